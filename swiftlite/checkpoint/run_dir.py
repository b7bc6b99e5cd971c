"""The run folder (--output-dir): one check, shared by the preflight (before any process starts) and
the trainer (which then creates and cleans it), and the lock that keeps two runs out of one folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from swiftlite.checkpoint.layout import LATEST, LOCK, LOGGING, PREEMPTED
from swiftlite.checkpoint.store import clean_partial, find_resume, list_checkpoints, resolve_resume_arg
from swiftlite.errors import UserError

if TYPE_CHECKING:
    from swiftlite.config import RunConfig


def _resuming(cfg: "RunConfig") -> bool:
    return cfg.checkpoint.resume != "false" or bool(cfg.checkpoint.resume_from)


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
        RunLock(run_dir).check()
        return run_dir
    parent = run_dir.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"--output-dir {raw}: cannot be created ({parent} is not a folder)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--output-dir {raw}: cannot be created ({parent} is not writable)")
    return run_dir


def resume_point(cfg: "RunConfig", run_dir: Path, log=print) -> Path | None:
    """The checkpoint this run resumes from: --resume-from's, or with --resume the newest good one in
    the run folder. `--resume true` with none is an error (HF does the same); `--resume auto` then
    starts fresh (a requeued job's first start)."""
    if cfg.checkpoint.resume_from:
        return resolve_resume_arg(cfg.checkpoint.resume_from, log=log)
    if cfg.checkpoint.resume == "false":
        return None
    found = find_resume(run_dir, log=log) if run_dir.is_dir() else None
    if found is None and cfg.checkpoint.resume == "true":
        raise UserError(f"--resume: no checkpoint in --output-dir {cfg.train.output_dir} "
                        "(--resume auto starts fresh when there is none)")
    return found


def prepare_run_dir(cfg: "RunConfig", world_is_main: bool) -> Path:
    """Create the run folder (rank 0; the others only resolve its path): checked as the preflight
    checks it, emptied of an old run's checkpoints with --overwrite-output-dir, interrupted saves and
    deletes removed."""
    # --add_version's vN-<time> folder is already in cfg.train.output_dir (config/load.apply_add_version)
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
        (run_dir / PREEMPTED).unlink(missing_ok=True)  # an earlier stop's marker: this run starts anew
    return run_dir


#: lock files this process holds (RunLock.acquire): a forked child closes its copies at once
_HELD: list = []


def _close_held_in_child() -> None:
    """In a process forked from the lock's holder (a DataLoader worker, ...): close the inherited
    descriptors of the lock file. flock belongs to the open file, which a fork shares, so a worker left
    alive for a moment after its parent was killed would hold the folder and refuse the next run."""
    for fh in _HELD:
        try:
            fh.close()
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


class RunLock:
    """An advisory lock (fcntl.flock) on <run>/.lock, held by rank 0 for the run's life, so a second
    run started on the same folder (a re-submitted job) stops at once instead of interleaving its
    checkpoints with the first one's. The kernel drops the lock when its process dies (and no process
    forked from it keeps a copy: `_close_held_in_child`), so a folder whose run was killed is taken
    over, with a notice naming the run that left it."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self._fh = None

    def holder(self) -> str:
        try:
            info = self.path.read_text().split()
        except OSError:
            return "another process"
        return f"pid {info[0]} on {info[1]}" if len(info) >= 2 else "another process"

    def acquire(self, log=print) -> "RunLock":
        import fcntl
        import socket
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise UserError(f"--output-dir {self.path.parent}: another swiftlite run is using it "
                            f"({self.holder()}); wait for it, or pick another --output-dir") from None
        fh.seek(0)
        previous = fh.read().split()
        if len(previous) >= 2:
            log(f"notice: taking over {self.path} from a run that is gone (pid {previous[0]} on {previous[1]})")
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()} {socket.gethostname()}\n")
        fh.flush()
        self._fh = fh
        _HELD.append(fh)
        return self

    def check(self) -> None:
        """Preflight: refuse now if a live run holds the folder (the lock is taken and let go). Only
        the launching process and rank 0 look: another rank may come here after rank 0 took the lock
        for this very run."""
        from swiftlite import env
        if env.world_vars().rank != 0 or not self.path.parent.is_dir():
            return
        import fcntl
        try:
            fh = open(self.path, "r", encoding="utf-8")
        except FileNotFoundError:
            return
        with fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UserError(f"--output-dir {self.path.parent}: another swiftlite run is using it "
                                f"({self.holder()}); wait for it, or pick another --output-dir") from None
            fcntl.flock(fh, fcntl.LOCK_UN)

    def release(self) -> None:
        """Let go at the end of a run: the holder line is cleared, so the next run takes over quietly."""
        if self._fh is not None:
            import fcntl
            self._fh.seek(0)
            self._fh.truncate()
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            if self._fh in _HELD:
                _HELD.remove(self._fh)
            self._fh = None
