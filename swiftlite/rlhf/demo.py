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


def preference_accuracy(model_dir: str, data: str, limit: int | None = None, batch: int = 16) -> tuple[float, int]:
    """(share of pairs whose chosen answer the model finds more likely than the rejected one, pairs):
    summed log-probs of each answer's tokens, the same tokens training scores (rlhf/data.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlite.data.sources import load_rows
    from swiftlite.rlhf.data import collate_pairs, encode_pairs
    from swiftlite.rlhf.reference import module_logps
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()   # docs/design.md trap 1: score in train mode under no_grad (dropout is 0 here)
    src = load_rows(data)
    rows, _ = encode_pairs(list(zip(src.rows, src.where))[:limit], tok, 100000, "delete", False)
    right = 0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            part = rows[i:i + batch]
            lp, _ = module_logps(model, collate_pairs(part, tok.pad_token_id))
            right += int((lp[:len(part)] > lp[len(part):]).sum())
    return right / max(1, len(rows)), len(rows)


def main(argv: list[str] | None = None) -> int:
    """python -m swiftlite.rlhf.demo data DIR | accuracy MODEL_DIR PAIRS.jsonl [LIMIT]"""
    import sys
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) >= 2 and args[0] == "data":
        for p in write_preference_data(args[1]):
            print(p)
        return 0
    if len(args) >= 3 and args[0] == "accuracy":
        acc, n = preference_accuracy(args[1], args[2], int(args[3]) if len(args) > 3 else None)
        print(f"preference accuracy: {acc:.3f} on {n} held-out pairs (chosen answer more likely than rejected)")
        return 0
    print(main.__doc__)
    return 2


__all__ = ["main", "make_pairs", "preference_accuracy", "wrong_answer", "write_preference_data"]


if __name__ == "__main__":
    raise SystemExit(main())
