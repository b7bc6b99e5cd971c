"""The run folder (--output-dir): one check, shared by the preflight (before any process starts) and
the trainer (which then creates and cleans it)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from swiftlite.checkpoint.layout import LATEST, LOGGING
from swiftlite.checkpoint.store import clean_partial, list_checkpoints
from swiftlite.errors import UserError

if TYPE_CHECKING:
    from swiftlite.config import RunConfig


def _resuming(cfg: "RunConfig") -> bool:
    return bool(cfg.checkpoint.resume or cfg.checkpoint.resume_from)


def check_output_dir(cfg: "RunConfig") -> Path:
    """The resolved --output-dir, checked without creating anything: not a file, not an old run's
    checkpoints (unless --resume / --overwrite-output-dir), and creatable (nearest existing parent is
    a writable folder)."""
    raw = cfg.train.output_dir
    if not str(raw).strip():
        raise UserError("--output-dir is empty")
    run_dir = Path(raw).expanduser().resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--output-dir {raw}: exists and is not a folder")
    if run_dir.is_dir():
        if list_checkpoints(run_dir) and not _resuming(cfg) and not cfg.train.overwrite_output_dir:
            raise UserError(f"--output-dir {raw}: already holds checkpoints; "
                            "pass --resume to continue or --overwrite-output-dir to start over")
        if not os.access(run_dir, os.W_OK | os.X_OK):
            raise UserError(f"--output-dir {raw}: folder is not writable")
        return run_dir
    parent = run_dir.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"--output-dir {raw}: cannot be created ({parent} is not a folder)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--output-dir {raw}: cannot be created ({parent} is not writable)")
    return run_dir


def prepare_run_dir(cfg: "RunConfig", world_is_main: bool) -> Path:
    """Create the run folder (rank 0; the others only resolve its path): checked as the preflight
    checks it, emptied of an old run's checkpoints with --overwrite-output-dir, interrupted saves and
    deletes removed."""
    run_dir = Path(cfg.train.output_dir).expanduser().resolve()
    if world_is_main:
        check_output_dir(cfg)
        if cfg.train.overwrite_output_dir and not _resuming(cfg) and run_dir.is_dir():
            for p in list_checkpoints(run_dir):
                shutil.rmtree(p)
            for name in (LOGGING, LATEST):
                (run_dir / name).unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        clean_partial(run_dir)
    return run_dir
