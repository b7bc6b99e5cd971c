"""Atomic storage of checkpoints in a run folder: manifest, publish, `latest`, prune, resume.

A checkpoint is written into `.tmp-checkpoint-20/` and renamed once complete, then `latest` is
replaced atomically. A crash at any moment leaves either the previous state or the new one. At resume
the manifest is verified; a corrupt checkpoint is reported and the newest good one is used. The names
are in `layout.py`; what may be unpickled is decided in `safety.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from swiftlite.checkpoint.layout import DEL_PREFIX, LATEST, MANIFEST, PREFIX, TMP_PREFIX, step_of
from swiftlite.checkpoint.safety import check_checkpoint_safe
from swiftlite.errors import UserError


def _sha256(path: Path, *, fsync: bool = False) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
        if fsync:  # the manifest vouches for these bytes: make sure they are on disk first
            os.fsync(fh.fileno())
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (best effort where the folder cannot be opened)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(ckpt: Path) -> None:
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(ckpt))] = {"size": p.stat().st_size, "sha256": _sha256(p, fsync=True)}
    tmp = ckpt / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"version": 1, "files": files}, indent=1) + "\n")
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, ckpt / MANIFEST)
    for d in {p.parent for p in ckpt.rglob("*")} | {ckpt}:
        fsync_dir(d)


def verify_checkpoint(ckpt: Path, *, deep: bool = True) -> str | None:
    """None when `ckpt` is complete and intact, else the reason it is not."""
    if not ckpt.is_dir():
        return "not a folder"
    mf = ckpt / MANIFEST
    if not mf.is_file():
        return f"no {MANIFEST} (not a swiftlite checkpoint, or its write did not finish)"
    try:
        files = json.loads(mf.read_text())["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError
        for meta in files.values():
            int(meta["size"]), str(meta["sha256"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"{MANIFEST} is unreadable"
    root = ckpt.resolve()
    for rel, meta in files.items():
        p = ckpt / rel
        if root not in p.resolve().parents:
            return f"{MANIFEST} names a file outside the checkpoint ({rel!r})"
        if not p.is_file():
            return f"missing file {rel}"
        if p.stat().st_size != meta["size"]:
            return f"{rel} has {p.stat().st_size} bytes, manifest says {meta['size']}"
        if deep and _sha256(p) != meta["sha256"]:
            return f"{rel} checksum mismatch"
    return None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Completed checkpoint folders (by name), oldest first."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and step_of(p) >= 0]
    return sorted(found, key=step_of)


def write_latest(run_dir: Path, ckpt_name: str) -> None:
    tmp = run_dir / (LATEST + ".tmp")
    tmp.write_text(ckpt_name + "\n")
    os.replace(tmp, run_dir / LATEST)
    fsync_dir(run_dir)


def read_latest(run_dir: Path) -> str | None:
    try:
        name = (run_dir / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if name.startswith(PREFIX) and "/" not in name and os.sep not in name else None


def find_resume(run_dir: Path, log=print, *, check_safe: bool = True) -> Path | None:
    """The newest intact checkpoint of a run (`latest` first, then older ones); None if none.

    A checkpoint whose files do not match its manifest (truncated, corrupted, half-deleted) is
    reported through `log` and skipped, so the previous good one is used. A checkpoint holding
    unsafe pickle content is refused outright (UserError): it was tampered with, not damaged."""
    candidates = list(reversed(list_checkpoints(run_dir)))
    name = read_latest(run_dir)
    if name:
        candidates.sort(key=lambda p: (p.name != name, -step_of(p)))
    for c in candidates:
        why = verify_checkpoint(c)
        if why is None:
            if check_safe:
                check_checkpoint_safe(c)
            return c
        log(f"warning: skipping {c}: {why}")
    return None


def resolve_resume_arg(path: str, log=print) -> Path:
    """--resume-from PATH: a checkpoint folder, or a run folder (its latest good checkpoint)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"--resume-from {path}: no such folder")
    if not p.is_dir():
        raise UserError(f"--resume-from {path}: is a file, not a checkpoint folder")
    if (p / MANIFEST).is_file() or p.name.startswith(PREFIX):
        why = verify_checkpoint(p)
        if why:
            raise UserError(f"--resume-from {path}: not a usable checkpoint ({why})")
        check_checkpoint_safe(p)
        return p
    found = find_resume(p, log=log)
    if found is None:
        raise UserError(f"--resume-from {path}: not a checkpoint (no {MANIFEST}) and holds no checkpoint")
    return found


def _discard(path: Path) -> None:
    """Delete a checkpoint folder without ever leaving a half-deleted `checkpoint-N`: rename it out
    of the checkpoint namespace first (atomic), then remove it. A crash in between leaves only a
    `.del-*` folder, which `clean_partial` removes at the next start."""
    trash = path.parent / f"{DEL_PREFIX}{path.name}"
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(path, trash)
    except OSError:
        return
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def prune(run_dir: Path, limit: int | None, keep: Path) -> None:
    """Keep the newest `limit` checkpoints. Never deletes `keep` (the one just written, the last
    good one), nor the newest checkpoint that verifies; a folder is renamed away before removal, so
    a crash mid-prune never leaves a half-deleted checkpoint."""
    if not limit:
        return
    ckpts = list_checkpoints(run_dir)
    protected = {keep}
    for c in reversed(ckpts):
        if verify_checkpoint(c, deep=False) is None:
            protected.add(c)
            break
    excess = len(ckpts) - limit
    for old in ckpts:
        if excess <= 0:
            break
        if old in protected:
            continue
        _discard(old)
        excess -= 1


def replace_dir(tmp: Path, final: Path, trash: Path) -> None:
    """Rename the finished folder `tmp` to `final`. An existing `final` is first renamed to `trash`
    (removed afterwards), so at every moment `final` is the old complete folder, absent, or the new
    complete one; the parent folder is fsynced so the rename survives a crash. Used for checkpoints
    and for export outputs alike."""
    shutil.rmtree(trash, ignore_errors=True)
    had_old = final.exists()
    if had_old:
        os.replace(final, trash)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if had_old:
        shutil.rmtree(trash, ignore_errors=True)


def publish(tmp: Path, final: Path, run_dir: Path) -> None:
    """Move a finished `.tmp-checkpoint-N` (manifest written) into place as `checkpoint-N`, then
    point `latest` at it. Re-saving an existing step swaps the old folder out by rename, so at every
    moment `checkpoint-N` is either the old complete folder, absent, or the new complete one."""
    replace_dir(tmp, final, run_dir / f"{DEL_PREFIX}{final.name}")
    write_latest(run_dir, final.name)


def clean_partial(run_dir: Path) -> None:
    """Remove `.tmp-checkpoint-*` (interrupted saves) and `.del-checkpoint-*` (interrupted deletes)."""
    if run_dir.is_dir():
        for p in run_dir.iterdir():
            if p.name.startswith((TMP_PREFIX + PREFIX, DEL_PREFIX + PREFIX)):
                shutil.rmtree(p, ignore_errors=True)
