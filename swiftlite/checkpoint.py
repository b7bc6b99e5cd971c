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


def _sha256(path: Path, *, fsync: bool = False) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
        if fsync:  # the manifest vouches for these bytes: make sure they are on disk first
            os.fsync(fh.fileno())
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
            files[str(p.relative_to(ckpt))] = {"size": p.stat().st_size, "sha256": _sha256(p, fsync=True)}
    tmp = ckpt / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"version": 1, "files": files}, indent=1) + "\n")
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, ckpt / MANIFEST)
    for d in {p.parent for p in ckpt.rglob("*")} | {ckpt}:
        _fsync_dir(d)


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
    trash = path.parent / f".del-{path.name}"
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(path, trash)
    except OSError:
        return
    _fsync_dir(path.parent)
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


def publish(tmp: Path, final: Path, run_dir: Path) -> None:
    """Move a finished `.tmp-checkpoint-N` (manifest written) into place as `checkpoint-N`, then
    point `latest` at it. Re-saving an existing step swaps the old folder out by rename, so at every
    moment `checkpoint-N` is either the old complete folder, absent, or the new complete one."""
    if final.exists():
        trash = run_dir / f".del-{final.name}"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(tmp, final)
        _fsync_dir(run_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
        _fsync_dir(run_dir)
    write_latest(run_dir, final.name)


def clean_partial(run_dir: Path) -> None:
    """Remove `.tmp-checkpoint-*` (interrupted saves) and `.del-checkpoint-*` (interrupted deletes)."""
    if run_dir.is_dir():
        for p in run_dir.iterdir():
            if p.name.startswith((".tmp-" + PREFIX, ".del-" + PREFIX)):
                shutil.rmtree(p, ignore_errors=True)


# -- safety: never unpickle untrusted code ---------------------------------------------------------
#
# Three kinds of pickle live in a checkpoint, and each is checked before anything loads it:
#   dcp/.metadata      read by DCP with plain `pickle.load`  -> _SafeUnpickler (exact allow-list)
#   dcp/*.distcp       non-tensor items ("bytes" entries: optimizer hyper-parameters) are read by
#                      DCP's planner with `torch.load(weights_only=False)` -> each is loaded here first
#                      with weights_only=True
#   *.pt / *.bin ...   DeepSpeed's own files (torch.load(weights_only=False) inside DeepSpeed), RNG
#                      states -> the pickle's globals must all be on torch's weights-only list or
#                      DeepSpeed's few plain data classes below
# Anything else refuses the checkpoint with a one-line UserError; nothing from it has run.

# Plain-data globals outside the DCP modules that a DCP .metadata holds.
_ALLOWED_PICKLE = {
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "slice"), ("torch", "Size"), ("torch", "device"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint.storage",
                "torch.distributed.checkpoint._extension")
# Globals in DeepSpeed checkpoint files besides torch's weights-only list: data classes and enums.
DEEPSPEED_SAFE_GLOBALS = frozenset({
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
})
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list (as opposed to a file that is merely not a pickle)."""


class _SafeUnpickler(pickle.Unpickler):
    """Plain pickle restricted to an exact list: DCP's own data classes and enums, a few builtins."""

    def find_class(self, module: str, name: str) -> Any:
        import dataclasses
        import enum
        if "." in name or name.startswith("__"):  # `mod`, "os.system" would reach os through mod
            raise _Refused(f"refusing to load {module}.{name}")
        if (module, name) in _ALLOWED_PICKLE:
            return super().find_class(module, name)
        if module == "torch":
            import torch
            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if (isinstance(obj, type) and getattr(obj, "__module__", None) == module
                    and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))):
                return obj
        raise _Refused(f"refusing to load {module}.{name}")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def load_dcp_metadata(dcp_dir: Path) -> Any:
    """The DCP `.metadata` object, read with the allow-list unpickler (UserError if refused)."""
    meta = Path(dcp_dir) / ".metadata"
    if not meta.is_file():
        raise UserError(f"{dcp_dir}: not a DCP checkpoint (no .metadata)")
    try:
        with meta.open("rb") as fh:
            md = _SafeUnpickler(fh).load()
    except _Refused as e:
        raise UserError(f"{meta}: refused, unsafe pickle content ({_one_line(e)})") from None
    except Exception as e:  # truncated or garbage
        raise UserError(f"{meta}: unreadable checkpoint metadata ({type(e).__name__})") from None
    from torch.distributed.checkpoint.metadata import Metadata
    if not isinstance(md, Metadata):
        raise UserError(f"{meta}: refused, not DCP metadata (holds a {type(md).__name__})")
    return md


def check_dcp_metadata(dcp_dir: Path) -> None:
    """Check a DCP folder before `dcp.load` reads it: `.metadata` through the allow-list unpickler,
    and every non-tensor item of the .distcp files (which DCP unpickles with weights_only=False)
    through torch's weights-only loader. A crafted checkpoint is refused before any of it runs."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    dcp_dir = Path(dcp_dir)
    md = load_dcp_metadata(dcp_dir)
    root = dcp_dir.resolve()
    byte_keys = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for index, info in (md.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str):
            raise UserError(f"{dcp_dir}/.metadata: refused, storage entry without a file name")
        path = (dcp_dir / rel).resolve()
        if root not in path.parents:
            raise UserError(f"{dcp_dir}/.metadata: refused, storage file {rel!r} is outside the checkpoint")
        if getattr(index, "fqn", None) not in byte_keys:
            continue  # tensors: DCP itself loads them with weights_only=True
        if getattr(info, "transform_descriptors", None):
            raise UserError(f"{dcp_dir}: refused, item {index.fqn} uses storage transforms "
                            f"({info.transform_descriptors}) that swiftlite does not check")
        try:
            with path.open("rb") as fh:
                fh.seek(int(info.offset))
                blob = fh.read(int(info.length))
            torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
        except OSError as e:
            raise UserError(f"{path}: unreadable ({_one_line(e)})") from None
        except Exception as e:
            raise UserError(f"{path}: refused, item {index.fqn} is not plain data ({_one_line(e)})") from None


def check_torch_file(path: Path, extra_safe: frozenset[str] = DEEPSPEED_SAFE_GLOBALS) -> None:
    """A torch.save file must hold only weights-only-safe globals (plus `extra_safe`) before any
    code (ours or DeepSpeed's) unpickles it with weights_only=False. Reads only its pickle part."""
    import torch
    try:
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except ValueError:
        # legacy (non-zip) format or TorchScript: accept only what the weights-only loader reads
        try:
            torch.load(str(path), weights_only=True, map_location="cpu")
        except Exception as e:
            raise UserError(f"{path}: refused, not a plain-data torch file ({_one_line(e)})") from None
        return
    except Exception as e:  # unsupported pickle opcodes, truncated zip, garbage
        raise UserError(f"{path}: refused, unsafe or unreadable pickle ({_one_line(e)})") from None
    bad = sorted(unsafe - set(extra_safe))
    if bad:
        raise UserError(f"{path}: refused, unsafe pickle content (would call {bad[0]})")


def check_checkpoint_safe(ckpt: Path) -> None:
    """Every pickle in a checkpoint folder is plain data; raises a one-line UserError otherwise.
    Call it before loading anything from a checkpoint that came from elsewhere (resume, export)."""
    ckpt = Path(ckpt)
    for p in sorted(ckpt.rglob("*")):
        if not p.is_file():
            continue
        if p.name == ".metadata":
            check_dcp_metadata(p.parent)
        elif p.suffix.lower() in PICKLE_SUFFIXES:
            check_torch_file(p)


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
    try:
        state = torch.load(f, weights_only=True)
        torch.set_rng_state(state["torch"])
    except Exception as e:
        raise UserError(f"{f}: refused, not a plain RNG state ({_one_line(e)})") from None
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
