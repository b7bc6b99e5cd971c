"""The body of one rank (`run_rank`), and the torchrun / DeepSpeed launcher run as a child process
(`run_launched`) with its stderr passed through."""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
import time
from typing import IO, TYPE_CHECKING

from swiftlite import env
from swiftlite.config import RunConfig
from swiftlite.errors import UserError
from swiftlite.launch.diagnostics import (clear_rank_logs, explain_failure, finish_rank_diagnostics,
                                          install_rank_diagnostics, record_rank_failure, redact_argv)
from swiftlite.launch.plan import LaunchPlan

if TYPE_CHECKING:
    from swiftlite.job import Resolved

#: Lines of the launcher's stderr kept to read its failure summary.
TAIL_LINES = 200


def run_rank(cfg: RunConfig, facts: "Resolved | None" = None) -> None:
    """The body of one rank (or of a single-process run): train, and on failure leave the rank's
    error where the launcher looks for it. `facts`: the job's facts when this process resolved them
    (a single-process run); a launched rank reads them from its environment (swiftlite/job.py)."""
    install_rank_diagnostics(cfg)
    try:
        from swiftlite.train import train
        train(cfg, facts)
    except UserError as e:
        record_rank_failure(cfg, str(e), user_error=True)
        raise
    except BaseException as e:
        import traceback
        record_rank_failure(cfg, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", user_error=False)
        raise
    finally:
        from swiftlite import profiling
        profiling.finish()  # a forked rank ends in os._exit: atexit handlers would not run
        from swiftlite.distributed import teardown
        teardown()
        # last: a crash in native code while the process group is torn down still leaves its stack
        finish_rank_diagnostics()


def _pump(stream: IO[str], tail: list[str]) -> None:
    """Copy the launcher's stderr to ours line by line, keeping its last TAIL_LINES lines."""
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        tail.append(line)
        del tail[:-TAIL_LINES]


def run_launched(plan: LaunchPlan, cfg: RunConfig, facts: "Resolved | None" = None) -> int:
    """Run the launcher; on failure name the rank that caused it (see `explain_failure`)."""
    assert plan.command is not None
    print("launching: " + shlex.join(redact_argv(plan.command)), flush=True)
    logs = clear_rank_logs(cfg)
    extra = {env.PREFLIGHT_DONE: "1"}  # the ranks skip the checks this process just ran
    if facts is not None:
        extra[env.JOB_FACTS] = facts.to_json()   # ... and train with the facts it resolved
    if not env.has("OMP_NUM_THREADS"):
        extra["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    tail: list[str] = []
    forwarding = None
    try:
        proc = subprocess.Popen(plan.command, env=env.child_env(extra), stderr=subprocess.PIPE, text=True,
                                errors="replace")
        if cfg.checkpoint.save_on_signal:
            forwarding = _RankForwarding(proc.pid)
        assert proc.stderr is not None
        t = threading.Thread(target=_pump, args=(proc.stderr, tail), daemon=True)
        t.start()
        rc = proc.wait()
        t.join(10)
    except KeyboardInterrupt:
        return 130
    finally:
        if forwarding is not None:
            forwarding.restore()
    if rc == 0:
        return 0
    msg, code = explain_failure(logs, plan.world_size, "".join(tail), cfg.parallel.ddp_timeout,
                                time.monotonic() - t0)
    print(f"error: {msg}", file=sys.stderr)
    return code if code else (rc if rc > 0 else 1)


class _RankForwarding:
    """Preemption signals this process gets go to the ranks themselves (the launcher's descendants
    with LOCAL_RANK in their environment), not to torchrun or the DeepSpeed launcher in between:
    those would stop the ranks (torchrun) or die (SIGUSR1's default) instead of letting them save."""

    def __init__(self, launcher_pid: int):
        import signal

        from swiftlite.train.preempt import SIGNALS
        self.launcher_pid = launcher_pid
        self.previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        import psutil
        try:
            procs = psutil.Process(self.launcher_pid).children(recursive=True)
        except psutil.Error:
            return
        for p in procs:
            try:
                if "LOCAL_RANK" in p.environ():
                    p.send_signal(signum)
            except psutil.Error:
                pass

    def restore(self) -> None:
        import signal
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
