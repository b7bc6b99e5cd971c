"""Checkpoint on a signal: what SLURM (`--signal`), Kubernetes and spot instances send before they
kill a job.

On SIGTERM, SIGUSR1 or SIGINT every rank finishes the optimizer step it is in; after that step the
ranks agree (one all-reduce of a flag per step), save a checkpoint at that step (atomically, as any
other), write `<run>/preempted`, and end normally; the command then exits with PREEMPTED_EXIT (75,
EX_TEMPFAIL) so a batch script can requeue the job and start it again with `--resume auto`. A second
signal while the checkpoint is being written abandons that save: its temporary folder is left
unpublished (and removed by the next start) and the previous checkpoint stays `latest`.

The same signal often arrives twice at once (SLURM signals every process, and the launcher forwards
what it receives to its ranks): signals within DEBOUNCE_S of the first count as one.
`--save-on-signal false` leaves the signals' default behaviour alone.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from swiftlite.checkpoint import layout
from swiftlite.errors import UserError

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PREEMPTED_EXIT = 75
DEBOUNCE_S = 1.0


class SaveAbandoned(UserError):
    """A second signal arrived while the preemption checkpoint was being written."""


class Preemption:
    """The rank's signal handlers and the state they share with the loop."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.signum: int | None = None
        self.first_at = 0.0
        self.saving = False
        self._previous: dict[int, Any] = {}
        if enabled:
            import threading
            if threading.current_thread() is not threading.main_thread():
                self.enabled = False  # signal handlers can only be set from the main thread
                return
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            # A launched rank dumps its stack on SIGTERM (to name a hung rank): keep that dump first.
            from swiftlite.signals import rechain_stack_dump
            rechain_stack_dump()

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.first_at = signum, now
            return
        if now - self.first_at < DEBOUNCE_S or not self.saving:
            return
        raise SaveAbandoned(f"{signal.Signals(signum).name} again while saving the preemption checkpoint: "
                            "that save was abandoned; the previous checkpoint is still `latest`")

    def agreed(self) -> bool:
        """Whether any rank was signalled (every rank asks after each step, so all stop together)."""
        if not self.enabled:
            return False
        from swiftlite.distributed import all_reduce_sum
        return all_reduce_sum([0.0 if self.signum is None else 1.0])[0] > 0

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def write_marker(run_dir: Path, step: int, checkpoint: Path, signum: int | None) -> None:
    """<run>/preempted: which signal stopped the run, at which step, and the checkpoint it saved."""
    name = signal.Signals(signum).name if signum else "a signal on another rank"
    rec = {"step": step, "signal": name, "checkpoint": checkpoint.name, "time": round(time.time(), 3)}
    (run_dir / layout.PREEMPTED).write_text(json.dumps(rec) + "\n")


def read_marker(run_dir: Path, since: float) -> dict | None:
    """The marker a run left, if it was written after `since` (this command's start)."""
    p = run_dir / layout.PREEMPTED
    try:
        if p.stat().st_mtime < since:
            return None
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None
