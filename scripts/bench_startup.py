"""CLI start-up time: median wall time of `swiftlite --help` and each subcommand's help.

    python scripts/bench_startup.py [--repeat 10]

Reports each against a bare `python -c pass` measured in the same run (machines are noisy: the
ratio is the stable figure). Target: `swiftlite --help` under 0.5 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = [["--help"], ["sft", "--help"], ["export", "--help"], ["estimate", "--help"], ["infer", "--help"],
            ["bench", "--help"], ["models"]]


def timed(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    base = [sys.executable, "-c", "pass"]
    rows = []
    for cmd in COMMANDS:
        argv = [sys.executable, "-m", "swiftlite", *cmd]
        ts, bs = [], []
        for _ in range(args.repeat):  # alternate with the baseline: noise hits both alike
            bs.append(timed(base))
            ts.append(timed(argv))
        rows.append((" ".join(["swiftlite", *cmd]), statistics.median(ts), statistics.median(bs)))
    print(f"| command | median wall (s) | python -c pass (s) | extra over bare python (s) |")
    print("|---|---|---|---|")
    for name, t, b in rows:
        print(f"| `{name}` | {t:.3f} | {b:.3f} | {t - b:.3f} |")


if __name__ == "__main__":
    main()
