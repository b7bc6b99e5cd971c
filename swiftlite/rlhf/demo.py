"""The built-in preference task: the reverse-string demo (swiftlite/demo.py) as pairs, in ms-swift's
form (`messages` + `rejected_response`). The chosen answer is the string reversed; the rejected one is
a checkable mistake: the string itself (not reversed), or the reversal with two neighbouring
characters swapped, or with one character dropped. Preference accuracy on held-out pairs is then a
number, not an impression.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from swiftlite.demo import ALPHABET


def wrong_answer(s: str, rng: random.Random) -> str:
    """A wrong reversal of `s` (never the right one)."""
    right = s[::-1]
    for _ in range(100):
        kind = rng.randrange(3)
        if kind == 0:
            cand = s
        elif kind == 1:
            i = rng.randrange(len(right) - 1)
            cand = right[:i] + right[i + 1] + right[i] + right[i + 2:]
        else:
            i = rng.randrange(len(right))
            cand = right[:i] + right[i + 1:]
        if cand != right and cand:
            return cand
    return right + rng.choice(ALPHABET)


def make_pairs(n: int, seed: int, *, min_len: int = 3, max_len: int = 6) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(min_len, max_len)))
        rows.append({"messages": [{"role": "user", "content": f"reverse: {s}"},
                                  {"role": "assistant", "content": s[::-1]}],
                     "rejected_response": wrong_answer(s, rng)})
    return rows


def write_preference_data(out_dir: str | Path, *, n_train: int = 1000, n_val: int = 200, seed: int = 10
                          ) -> tuple[Path, Path]:
    """pref_train.jsonl and pref_val.jsonl (disjoint seeds, and not the sft demo's seeds)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, s in (("pref_train.jsonl", n_train, seed), ("pref_val.jsonl", n_val, seed + 1)):
        p = out / name
        p.write_text("".join(json.dumps(r) + "\n" for r in make_pairs(n, s)))
        paths.append(p)
    return paths[0], paths[1]


__all__ = ["make_pairs", "wrong_answer", "write_preference_data"]
