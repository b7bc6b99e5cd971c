"""`swiftlite bench`: the same training job under several backends, side by side.

Each backend runs as its own `swiftlite sft` in a subprocess, through the real CLI (so each gets its
own launcher and process group), with `--logging-steps 1` and two environment hooks read by
swiftlite/profiling.py: SWIFTLITE_BENCH_STATS=1 (per-rank step boundaries and peak memory) and
SWIFTLITE_PROFILE=K:N (a torch.profiler Chrome trace per rank over steps K..K+N-1). The figures are
read from the files each run writes (logging.jsonl, args.json, profile/, logs/), never from its output.

  spec.py     what to run: BackendSpec, parse_backends (names from the backend registry), BenchConfig
  device.py   peak FLOP/s (datasheet or measured in a subprocess) and machine facts
  trace.py    collective bytes and comm/compute overlap from the Chrome traces
  groups.py   bytes per process group, intra- vs inter-node, from the recorded collectives
  nodes.py    --nnodes: each column as local nodes (one `swiftlite sft --node-rank r` per node)
  runner.py   one `swiftlite sft` per backend in its own process group; collect; run_bench
  report.py   the rich table, bench.md, bench.png

Writes <output>/bench.json, bench.md, bench.png and prints a rich table. Run folders and logs stay
in <output>/runs/<backend>/ (with their traces under profile/). How each column is measured is told
next to its code: runner.py (step time, tokens/s, MFU, memory, first step), trace.py (comm, overlap),
device.py (the peak).
"""

from swiftlite.bench.device import DATASHEET_PEAKS, datasheet_peak, machine_info, probe_device
from swiftlite.bench.report import columns, render_markdown, render_table, write_chart
from swiftlite.bench.runner import (BackendResult, planner_family, collect, first_step_s, ran_as, run_backend,
                                    run_bench, sft_command)
from swiftlite.bench.spec import MODIFIERS, BackendSpec, BenchConfig, parse_backends
from swiftlite.bench.groups import link_bytes
from swiftlite.bench.nodes import node_commands, run_nodes
from swiftlite.bench.trace import analyze_trace, collective_bytes

__all__ = ["DATASHEET_PEAKS", "MODIFIERS", "BackendResult", "BackendSpec", "BenchConfig", "planner_family",
           "analyze_trace", "collect", "collective_bytes", "link_bytes", "node_commands", "run_nodes", "columns",
           "datasheet_peak", "first_step_s",
           "machine_info", "parse_backends", "probe_device", "ran_as", "render_markdown", "render_table",
           "run_backend", "run_bench", "sft_command", "write_chart"]
