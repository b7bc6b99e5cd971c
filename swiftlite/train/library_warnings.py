"""Library warnings of a training process go to the run folder, not the console.

torch.distributed's deprecation notices (c10d_logger's FutureWarnings for the collectives DeepSpeed
calls), transformers' and DDP's renamed-argument notices and the like say nothing the user can act on
in their command, and each rank repeats them. A training process keeps them, with the file and line
that raised them, in `<run>/logs/warnings_rank<r>.log`; swiftlite's own messages are printed lines,
not warnings, and are unaffected. Warnings raised before the run folder exists (joining the process
group) are held and written once it does.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from swiftlite.checkpoint.layout import LOGS_DIR, rank_file


class WarningLog:
    """Replaces `warnings.showwarning` for this process; `open(run_dir, rank)` starts writing."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.path: Path | None = None
        self.count = 0
        self._previous = warnings.showwarning
        warnings.showwarning = self._show

    def _show(self, message: Any, category: type, filename: str, lineno: int, file: Any = None,
              line: str | None = None) -> None:
        text = warnings.formatwarning(message, category, filename, lineno, line)
        self.count += 1
        if self.path is None:
            self.held.append(text)
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(text)

    def open(self, run_dir: Path, rank: int) -> None:
        """Write to `<run_dir>/logs/warnings_rank<rank>.log` from now on (the held ones first)."""
        logs = Path(run_dir) / LOGS_DIR
        logs.mkdir(parents=True, exist_ok=True)
        self.path = logs / rank_file("warnings", rank)
        if self.held:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write("".join(self.held))
            self.held = []

    def close(self) -> None:
        """Give `warnings.showwarning` back; warnings of a run that never got its folder (it failed
        first) go to stderr, where its error is."""
        import sys
        warnings.showwarning = self._previous
        if self.path is None and self.held:
            sys.stderr.write("".join(self.held))
        self.held = []


def keep_library_warnings() -> WarningLog:
    """Start holding this process's warnings (call before the process group is joined)."""
    return WarningLog()
