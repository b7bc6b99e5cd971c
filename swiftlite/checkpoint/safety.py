"""Never unpickle untrusted code: allow-list unpicklers for everything a checkpoint holds.

Used before anything loads a checkpoint that came from elsewhere (resume, export, infer): the DCP
metadata reader, the torch-file check, and `safe_torch_load` for DeepSpeed's own readers. There is
one DeepSpeed allow-list (`DEEPSPEED_SAFE_GLOBALS`) for all of them.
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path
from typing import Any, Iterator

from swiftlite.checkpoint.layout import DCP_METADATA, DS_UNIVERSAL, TMP_PREFIX
from swiftlite.errors import UserError

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


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def load_dcp_metadata(dcp_dir: Path) -> Any:
    """The DCP `.metadata` object, read with the allow-list unpickler (UserError if refused)."""
    meta = Path(dcp_dir) / DCP_METADATA
    if not meta.is_file():
        raise UserError(f"{dcp_dir}: not a DCP checkpoint (no .metadata)")
    try:
        with meta.open("rb") as fh:
            md = _SafeUnpickler(fh).load()
    except _Refused as e:
        raise UserError(f"{meta}: refused, unsafe pickle content ({one_line(e)})") from None
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
            raise UserError(f"{path}: unreadable ({one_line(e)})") from None
        except Exception as e:
            raise UserError(f"{path}: refused, item {index.fqn} is not plain data ({one_line(e)})") from None


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
            raise UserError(f"{path}: refused, not a plain-data torch file ({one_line(e)})") from None
        return
    except Exception as e:  # unsupported pickle opcodes, truncated zip, garbage
        raise UserError(f"{path}: refused, unsafe or unreadable pickle ({one_line(e)})") from None
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
        first = p.relative_to(ckpt).parts[0]
        if first == DS_UNIVERSAL or first.startswith(TMP_PREFIX):
            continue  # derived from the checkpoint; checked before use by checkpoint/universal.py, or never read
        if p.name == DCP_METADATA:
            check_dcp_metadata(p.parent)
        elif p.suffix.lower() in PICKLE_SUFFIXES:
            check_torch_file(p)


@contextlib.contextmanager
def safe_torch_load(allowed: frozenset[str] = DEEPSPEED_SAFE_GLOBALS) -> Iterator[None]:
    """Make every torch.load in the block (such as DeepSpeed's zero_to_fp32 helpers, which load
    with weights_only=False) weights_only with `allowed` as extra globals, and memory-mapped."""
    import importlib

    import torch
    objs = []
    for dotted in sorted(allowed):
        mod, _, name = dotted.rpartition(".")
        try:
            objs.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            continue
    orig = torch.load

    def safe_load(f: Any, *a: Any, **kw: Any) -> Any:
        kw["weights_only"] = True
        kw.setdefault("mmap", True)
        with torch.serialization.safe_globals(objs):
            return orig(f, *a, **kw)

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = orig
