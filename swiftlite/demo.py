"""The built-in demo task: reverse a short string, in chat form.

Deterministic from a seed, learnable by the tiny model in a few minutes on a CPU, and scored by exact
match of the greedy answer, so "the model got better" is a number, not an impression.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ALPHABET = "abcdefgh"


def make_rows(n: int, seed: int, *, min_len: int = 3, max_len: int = 6) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(min_len, max_len)))
        rows.append({"messages": [{"role": "user", "content": f"reverse: {s}"},
                                  {"role": "assistant", "content": s[::-1]}]})
    return rows


def write_demo_data(out_dir: str | Path, *, n_train: int = 2000, n_val: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """train.jsonl and val.jsonl with disjoint seeds."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, s in (("train.jsonl", n_train, seed), ("val.jsonl", n_val, seed + 1)):
        p = out / name
        p.write_text("".join(json.dumps(r) + "\n" for r in make_rows(n, s)))
        paths.append(p)
    return paths[0], paths[1]
