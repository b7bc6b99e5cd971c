"""Start a run: check it, then train here, fork the ranks from here, or re-run under a launcher.

- `plan.py`: `plan_launch` -> `LaunchPlan` (this process, forked ranks, torchrun or the DeepSpeed
  launcher; the rendezvous port).
- `preflight.py`: `preflight`, every check before a process starts; `resolve_for_launch`.
- `fork.py`: `run_forked`, the ranks of one node forked from this process (`warm_imports` first).
- `run.py`: `run_rank`, the body of a rank; `run_launched`, the launcher as a child process.
- `diagnostics.py`: rank error and stack files, `explain_failure` (one line naming the rank that
  failed), `redact_argv`.
- `torchrun.py`: torchrun without its traceback (run as `python -m swiftlite.torchrun`).

Import-light (no torch at import time): the CLI imports this package before any run starts.
"""

from swiftlite.launch.diagnostics import (clear_rank_logs, explain_failure, finish_rank_diagnostics,
                                          install_rank_diagnostics, record_rank_failure, redact_argv)
from swiftlite.launch.fork import run_forked, warm_imports
from swiftlite.launch.plan import LaunchPlan, gpu_torch_build, plan_launch, port_in_use
from swiftlite.launch.preflight import preflight, resolve_for_launch
from swiftlite.launch.run import run_launched, run_rank

__all__ = [
    "LaunchPlan", "clear_rank_logs", "explain_failure", "finish_rank_diagnostics", "gpu_torch_build",
    "install_rank_diagnostics", "plan_launch", "port_in_use", "preflight", "record_rank_failure",
    "redact_argv", "resolve_for_launch", "run_forked", "run_launched", "run_rank", "warm_imports",
]
