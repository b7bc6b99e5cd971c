"""How long the training process waits for each step's batches with 0 and N DataLoader workers
(--dataloader_num_workers). The model's step is replaced by a sleep of --step-ms (a GPU step leaves
the host CPU idle like this); the batches are the real ones (data/prefetch.StepBatches: collate of
every micro-batch, global target count). Prints one line per worker count.

    python scripts/dataloader_bench.py --rows 4000 --length 1024 --batch 8 --accumulation 4 --steps 40
"""

from __future__ import annotations

import argparse
import time

from swiftlite.data.loader import BatchPlan
from swiftlite.data.prefetch import Prefetcher, StepBatches
from swiftlite.data.tokenize import IGNORE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--length", type=int, default=1024, help="longest row (rows are 1/4..1 of it)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accumulation", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--padding-free", action="store_true")
    a = ap.parse_args()
    import random
    rnd = random.Random(0)
    rows = []
    for _ in range(a.rows):
        n = rnd.randint(a.length // 4, a.length)
        ids = [rnd.randrange(32000) for _ in range(n)]
        rows.append({"input_ids": ids, "labels": [IGNORE] * (n // 2) + ids[n // 2:]})
    targets = [sum(1 for x in r["labels"][1:] if x != IGNORE) for r in rows]
    plan = BatchPlan(len(rows), a.batch, 1, a.accumulation, 42)
    steps = StepBatches(plan, 0, rows.__getitem__, targets.__getitem__, 0, a.padding_free)
    tokens = sum(len(rows[i]["input_ids"]) for k in range(a.steps) for mb in plan.micro_batches(k, 0) for i in mb)
    for w in a.workers:
        pre = Prefetcher(steps, 0, a.steps, num_workers=w)
        wait, first = 0.0, 0.0
        t0 = time.perf_counter()
        for k in range(a.steps):
            t = time.perf_counter()
            pre.get(k)
            if k == 0:
                first = time.perf_counter() - t   # the workers' start (fork) is paid here
            else:
                wait += time.perf_counter() - t
            time.sleep(a.step_ms / 1000)
        total = time.perf_counter() - t0
        pre.close()
        print(f"workers {w}: first step {1000 * first:.0f} ms, then batch wait {1000 * wait / (a.steps - 1):.2f} "
              f"ms/step, {tokens / total:,.0f} tokens/s "
              f"({a.steps} steps of {a.batch}x{a.accumulation} rows, step {a.step_ms:g} ms)", flush=True)


if __name__ == "__main__":
    main()
