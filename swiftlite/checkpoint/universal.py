"""DeepSpeed's universal checkpoint format: a ZeRO checkpoint converted once, next to itself, so it
resumes at another world size (or ZeRO stage), and read back as plain per-parameter tensors.

    checkpoint-20/
        ds/                 the ZeRO checkpoint as DeepSpeed wrote it (tied to its world size)
        ds_universal/       written by `ensure_universal` on the first resume that needs it:
            ds/             DeepSpeed's universal layout: zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt,
                            zero/optimizer_state.pt and the model-states files (LR schedule, steps)
            latest_universal
            manifest.json   every file with its sha256 (a folder that fails it is converted again)
        .tmp-ds_universal/  a conversion in progress (renamed to ds_universal/ when complete)

The conversion is DeepSpeed's own (`deepspeed.checkpoint.ds_to_universal.main`), run by rank 0 with
every torch.load inside it made weights-only (`safety.safe_torch_load`): nothing from the checkpoint
is unpickled beyond what DeepSpeed's own loader reads, and less freely. It writes into a temporary
folder that is fsynced and renamed: a kill at any moment leaves the original `ds/` untouched and at
most a `.tmp-` folder, which the next resume removes before converting again. Loading is the engine's
own (`Engine.load_universal`): DeepSpeed's universal loader (`checkpoint.load_universal`), which
re-partitions the fp32 masters and the AdamW moments for this run's world size
(parallel/deepspeed.py), or the per-parameter tensors read here (`UniversalState`) set through torch's
state-dict API (parallel/torch_engine.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import swiftlite.checkpoint.layout as layout
import swiftlite.checkpoint.universal_files as universal_files
from swiftlite.checkpoint.safety import one_line, safe_torch_load
from swiftlite.errors import UserError


@dataclass(frozen=True)
class ZeroLayout:
    """What the file names of a checkpoint's `ds/` folder say: ZeRO-3 or ZeRO-1/2, and how many
    data-parallel processes wrote it (one optimizer file each)."""
    stage3: bool
    world_size: int


def zero_layout(ckpt: Path) -> ZeroLayout | None:
    """The layout of `ckpt/ds/`, or None when the checkpoint holds no ZeRO optimizer files."""
    ds = Path(ckpt) / layout.DS_TAG
    optim = sorted(ds.glob("*zero_pp_rank_*_optim_states.pt")) if ds.is_dir() else []
    if not optim:
        return None
    stage3 = any(ds.glob("*zero_pp_rank_*_model_states.pt"))  # ZeRO-1/2 write one mp_rank_00 file
    return ZeroLayout(stage3=stage3, world_size=len(optim))


def universal_dir(ckpt: Path) -> Path:
    return Path(ckpt) / layout.DS_UNIVERSAL


def _tmp_dir(ckpt: Path) -> Path:
    return Path(ckpt) / f"{layout.TMP_PREFIX}{layout.DS_UNIVERSAL}"


def is_converted(ckpt: Path) -> bool:
    """A complete universal folder that still matches its manifest and holds only plain-data
    pickles (DeepSpeed's loader reads them with weights_only=False; check_checkpoint_safe leaves
    this folder to us). Anything else is converted again."""
    from swiftlite.checkpoint.safety import check_checkpoint_safe
    from swiftlite.checkpoint.store import verify_checkpoint
    folder = universal_dir(ckpt)
    if verify_checkpoint(folder) is not None:
        return False
    try:
        check_checkpoint_safe(folder)
    except UserError:
        return False
    return True


def convert(ckpt: Path, step: int) -> Path:
    """Convert `ckpt/ds/` (a ZeRO checkpoint, with DeepSpeed's own converter) or `ckpt/dcp/` (a torch
    backend's, universal_files.from_dcp) to `ckpt/ds_universal/`: temp folder, manifest with fsync,
    rename. Run by one process; returns the universal folder. An earlier interrupted or damaged
    conversion is removed first. Raises UserError with the reason when it cannot be converted."""
    from swiftlite import faults
    from swiftlite.checkpoint.store import replace_dir, write_manifest
    ckpt = Path(ckpt)
    final, tmp = universal_dir(ckpt), _tmp_dir(ckpt)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:
        raise UserError(f"--resume: {ckpt} must be converted to DeepSpeed's universal format next to itself, "
                        f"but the folder is not writable ({one_line(e)}); copy the checkpoint somewhere writable "
                        "and resume from the copy") from None
    zero = zero_layout(ckpt)
    src = ckpt / (layout.DS_TAG if zero is not None else layout.DCP_DIR)
    need = 2 * sum(f.stat().st_size for f in src.rglob("*") if f.is_file())  # its fragments, then the merged files
    free = shutil.disk_usage(ckpt).free
    if free < need:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"--resume: {ckpt}: converting it to DeepSpeed's universal format needs about {need:,} bytes "
                        f"next to it, {free:,} are free")
    out = tmp / layout.DS_TAG
    try:
        if zero is None:
            universal_files.from_dcp(ckpt, out)
        else:
            _deepspeed_convert(ckpt / layout.DS_TAG, out)
            universal_files.normalize(out, zero.stage3)
    except UserError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # noqa: BLE001 - DeepSpeed's converter asserts and raises many kinds
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"--resume: {ckpt}: could not convert this checkpoint to DeepSpeed's universal format "
                        f"({type(e).__name__}: {one_line(e)}); resume it with its own backend and world size") from None
    faults.maybe_inject(step, "convert")  # tests: a kill here leaves a full but unpublished temp folder
    write_manifest(tmp)                   # fsyncs every file and folder
    replace_dir(tmp, final, ckpt / f"{layout.DEL_PREFIX}{layout.DS_UNIVERSAL}")
    return final


def _deepspeed_convert(src: Path, out: Path) -> None:
    """DeepSpeed's ds_to_universal, in this process, every torch.load in it weights-only."""
    args = argparse.Namespace(input_folder=str(src), output_folder=str(out),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              # ZeRO-1/2: DeepSpeed asks for a Megatron-style `universal_checkpoint_info`
                              # client state that a plain engine never writes; its own flag supplies the
                              # default (version only: no tensor-parallel merge patterns, none needed)
                              inject_missing_state=True)
    sink = io.StringIO()  # DeepSpeed prints its progress bars and folder names
    from deepspeed.checkpoint import ds_to_universal
    with safe_torch_load(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        ds_to_universal.main(args)


def ensure_universal(ckpt: Path, world: Any, step: int, log=print) -> Path:
    """The universal folder of `ckpt`, converted by rank 0 if it is missing or fails its manifest;
    every rank returns together (one all-reduce of rank 0's outcome, so a failed conversion stops
    every rank with the same message rather than leaving the others waiting)."""
    from swiftlite.distributed import all_reduce_sum
    ckpt = Path(ckpt)
    error = ""
    if world.is_main:
        try:
            if is_converted(ckpt):
                log(f"notice: {ckpt.name}: using its universal conversion ({layout.DS_UNIVERSAL}/)")
            else:
                kind = "ZeRO" if zero_layout(ckpt) is not None else "DCP"
                log(f"notice: {ckpt.name}: converting the {kind} checkpoint to DeepSpeed's universal format "
                    f"({layout.DS_UNIVERSAL}/, once)")
                convert(ckpt, step)
        except (UserError, OSError) as e:  # OSError: the disk filled or failed while writing the conversion
            shutil.rmtree(_tmp_dir(ckpt), ignore_errors=True)
            error = str(e) if isinstance(e, UserError) else (
                f"--resume: {ckpt}: writing its universal conversion failed ({one_line(e)}); the checkpoint itself "
                "is unchanged")
    if all_reduce_sum([1.0 if error else 0.0])[0] > 0:
        raise UserError(error or f"--resume: {ckpt}: the universal conversion failed on rank 0 (see its log)")
    return universal_dir(ckpt)


def check_groups(folder: Path, saved: int, here: int) -> None:
    """Hyper-parameters and the LR schedule are restored group by group: the counts must agree."""
    if saved != here:
        raise UserError(f"--resume: {folder.parent.name} has {saved} optimizer parameter group(s) (decay, no decay), "
                        f"this run's optimizer {here}: fsdp1 flattens every parameter into one group, so its checkpoints "
                        "and ZeRO/DCP ones of the other backends do not resume into each other; use fsdp, ddp or single")


# --------------------------------------------------------------------------------------------------
# A universal folder read as plain tensors (a ZeRO checkpoint resumed under a torch backend)

def _model_states(folder: Path) -> dict:
    """DeepSpeed's model-states file of the conversion (LR schedule, step counters)."""
    files = sorted((folder / layout.DS_TAG).glob("*model_states.pt"))
    if not files:
        raise UserError(f"{folder}: no model-states file in the universal checkpoint")
    return universal_files.load(files[0])


class UniversalState:
    """Per-parameter fp32 weights and AdamW moments of a universal folder, read on demand."""

    def __init__(self, folder: Path):
        self.zero = Path(folder) / layout.DS_TAG / "zero"
        self.optim = universal_files.load(self.zero / "optimizer_state.pt")
        self.model_states = _model_states(Path(folder))
        inner = self.optim.get("optimizer_state_dict") or {}   # ZeRO-3's one step for every parameter
        self._step = (inner.get("state") or {}).get(0, {}).get("step")

    def has(self, name: str) -> bool:
        return (self.zero / name / "fp32.pt").is_file()

    def tensor(self, name: str, key: str, shape: Any) -> "Any":
        """`key` (fp32, exp_avg, exp_avg_sq) of parameter `name`: ZeRO-1/2 conversions store
        {"param": tensor}, ZeRO-3 ones a flat tensor; both are returned in `shape`."""
        v = universal_files.load(self.zero / name / f"{key}.pt")
        t = v["param"] if isinstance(v, dict) else v
        return t.reshape(shape).float()

    def step(self, name: str) -> Any:
        import torch
        f = self.zero / name / "step.pt"
        step = universal_files.load(f) if f.is_file() else self._step
        if step is None:
            raise UserError(f"{self.zero.parent.parent}: no optimizer step for {name}")
        return torch.as_tensor(step, dtype=torch.float32).clone()

    @property
    def param_groups(self) -> list[dict]:
        return list(self.optim.get("param_groups") or [])

    @property
    def scheduler(self) -> dict:
        return self.model_states["lr_scheduler"]
