"""Atomic save and resume of the whole training state.

Layout of a run folder:

    output_dir/args.json, logging.jsonl, latest            ("checkpoint-20", moved last)
    output_dir/checkpoint-20/
        dcp/ or ds/            the backend's sharded model + optimizer state
        scheduler.json         LR schedule state
        trainer_state.json     global step, backend, world size, train type
        rng/rank<r>.pt         RNG states per rank (tensors only, loaded with weights_only=True)
        model/ | adapter/      an HF model folder (full) or a peft adapter, for use without swiftlite
        manifest.json          every file with its size and sha256, written last

A checkpoint is written into `.tmp-checkpoint-20/` and renamed once complete, then `latest` is
replaced atomically. A crash at any moment leaves either the previous state or the new one. At resume
the manifest is verified; a corrupt checkpoint is reported and the newest good one is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

from swiftlite.errors import UserError

MANIFEST = "manifest.json"
LATEST = "latest"
PREFIX = "checkpoint-"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
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
            files[str(p.relative_to(ckpt))] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    tmp = ckpt / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"version": 1, "files": files}, indent=1) + "\n")
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, ckpt / MANIFEST)


def verify_checkpoint(ckpt: Path, *, deep: bool = True) -> str | None:
    """None when `ckpt` is complete and intact, else the reason it is not."""
    if not ckpt.is_dir():
        return "not a folder"
    mf = ckpt / MANIFEST
    if not mf.is_file():
        return f"no {MANIFEST} (not a swiftlite checkpoint, or its write did not finish)"
    try:
        files = json.loads(mf.read_text())["files"]
    except (ValueError, KeyError):
        return f"{MANIFEST} is unreadable"
    for rel, meta in files.items():
        p = ckpt / rel
        if not p.is_file():
            return f"missing file {rel}"
        if p.stat().st_size != meta["size"]:
            return f"{rel} has {p.stat().st_size} bytes, manifest says {meta['size']}"
        if deep and _sha256(p) != meta["sha256"]:
            return f"{rel} checksum mismatch"
    return None


def step_of(path: Path) -> int:
    try:
        return int(path.name[len(PREFIX):])
    except ValueError:
        return -1


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
    _fsync_dir(run_dir)


def find_resume(run_dir: Path, log=print) -> Path | None:
    """The newest intact checkpoint of a run (`latest` first, then older ones); None if none."""
    candidates = list(reversed(list_checkpoints(run_dir)))
    latest = run_dir / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        candidates.sort(key=lambda p: (p.name != name, -step_of(p)))
    for c in candidates:
        why = verify_checkpoint(c)
        if why is None:
            return c
        log(f"warning: skipping {c}: {why}")
    return None


def resolve_resume_arg(path: str) -> Path:
    """--resume-from PATH: a checkpoint folder, or a run folder (its latest good checkpoint)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"--resume-from {path}: no such folder")
    if (p / MANIFEST).is_file() or p.name.startswith(PREFIX):
        why = verify_checkpoint(p)
        if why:
            raise UserError(f"--resume-from {path}: not a usable checkpoint ({why})")
        return p
    found = find_resume(p)
    if found is None:
        raise UserError(f"--resume-from {path}: not a checkpoint (no {MANIFEST}) and holds no checkpoint")
    return found


def prune(run_dir: Path, limit: int | None, keep: Path) -> None:
    """Keep the newest `limit` checkpoints; never delete `keep` (the one just written)."""
    if not limit:
        return
    ckpts = list_checkpoints(run_dir)
    for old in ckpts[:-limit]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def clean_partial(run_dir: Path) -> None:
    """Remove `.tmp-checkpoint-*` folders left by an interrupted save."""
    if run_dir.is_dir():
        for p in run_dir.iterdir():
            if p.name.startswith(".tmp-" + PREFIX):
                shutil.rmtree(p, ignore_errors=True)


# -- safety ----------------------------------------------------------------------------------------

_ALLOWED_PICKLE = {
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "slice"), ("torch", "Size"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.serialization", "_get_layout"), ("torch", "device"),
}
_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch
        if module.startswith(_ALLOWED_MODULE_PREFIXES) or (module, name) in _ALLOWED_PICKLE:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def check_dcp_metadata(dcp_dir: Path) -> None:
    """DCP reads its `.metadata` with plain pickle; check it with an allow-list unpickler first so a
    crafted checkpoint cannot run code (issue: never unpickle untrusted files)."""
    meta = Path(dcp_dir) / ".metadata"
    if not meta.is_file():
        raise UserError(f"{dcp_dir}: not a DCP checkpoint (no .metadata)")
    try:
        with meta.open("rb") as fh:
            _SafeUnpickler(fh).load()
    except pickle.UnpicklingError as e:
        raise UserError(f"{meta}: refused, unsafe pickle content ({e})") from None
    except Exception as e:  # truncated or garbage
        raise UserError(f"{meta}: unreadable checkpoint metadata ({type(e).__name__})") from None


def save_rng(path: Path, rank: int) -> None:
    """Torch RNG states (dropout draws); training uses no Python/NumPy randomness."""
    import torch
    path.mkdir(parents=True, exist_ok=True)
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    torch.save(state, path / f"rank{rank}.pt")


def load_rng(path: Path, rank: int) -> None:
    import torch
    f = path / f"rank{rank}.pt"
    if not f.is_file():
        return  # another world size: RNG restarts from the seed, which changes only dropout draws
    state = torch.load(f, weights_only=True)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
