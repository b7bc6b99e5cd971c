"""The GRPO demo (scripts/quickstart_grpo.sh): the reverse-string task (swiftlite/demo.py) as prompts
with a `solution` column, and the exact-match reward (scripts/grpo_exact_reward.py registers it with
`--external_plugins`, as an ms-swift plugin would). Held-out accuracy is measured by `swiftlite infer
--metric exact_match` (greedy) on the SFT demo's val.jsonl, before and after GRPO.

The prompts use a seed of their own (not the SFT data's, nor the held-out rows'), and no held-out string.
"""

from __future__ import annotations

import json
from pathlib import Path

from swiftlite.demo import make_rows


#: write_demo_data's held-out rows (val.jsonl: 200 rows, seed 1), which the GRPO prompts leave out.
HELD_OUT = (200, 1)


def make_prompts(n: int, seed: int) -> list[dict]:
    """GRPO rows: the user turn of the demo task and the right answer as `solution`; a string of the
    held-out rows is left out (short strings repeat: 8^3 of length 3), so fewer than n may come back."""
    held = {r["messages"][0]["content"] for r in make_rows(*HELD_OUT)}
    return [{"messages": r["messages"][:1], "solution": r["messages"][1]["content"]} for r in make_rows(n, seed)
            if r["messages"][0]["content"] not in held]


def write_grpo_data(out_dir: str | Path, *, n: int = 1000, seed: int = 20) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    p = out / "grpo_train.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in make_prompts(n, seed)))
    return p


def exact_match(completions: list[str], solution: list[str]) -> list[float]:
    """1.0 when the stripped completion is the solution, else 0.0 (what `swiftlite infer --metric
    exact_match` counts on the greedy answer)."""
    return [float(c.strip() == s.strip()) for c, s in zip(completions, solution)]


def main(argv: list[str] | None = None) -> int:
    """python -m swiftlite.rlhf.grpo_demo data DIR [N]"""
    import sys
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) >= 2 and args[0] == "data":
        print(write_grpo_data(args[1], **({"n": int(args[2])} if len(args) > 2 else {})))
        return 0
    print(main.__doc__)
    return 2


__all__ = ["HELD_OUT", "exact_match", "main", "make_prompts", "write_grpo_data"]


if __name__ == "__main__":
    raise SystemExit(main())
