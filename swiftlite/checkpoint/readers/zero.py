"""The fp32 master weights of a DeepSpeed ZeRO checkpoint (checkpoint-N/ds/), without a process group."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path
from typing import Any

import torch

from swiftlite import env
from swiftlite.checkpoint.layout import DS_LATEST, DS_TAG
from swiftlite.checkpoint.readers.base import TensorReader
from swiftlite.checkpoint.safety import safe_torch_load
from swiftlite.errors import UserError


class ZeroReader(TensorReader):
    """fp32 weights of a DeepSpeed ZeRO checkpoint (checkpoint-N/ds/), without a process group.

    DeepSpeed's zero_to_fp32 parses the files (through a weights_only torch.load: no arbitrary
    pickles) and builds ZeRO-3 parameters lazily; ZeRO-1/2 partitions are stitched here one parameter
    at a time instead of DeepSpeed's whole-model torch.cat. Optimizer files are memory-mapped."""

    def __init__(self, ckpt_dir: Path, *, exclude_frozen: bool):
        z = _zero_to_fp32()
        tag_file = ckpt_dir / DS_LATEST
        tag = tag_file.read_text().strip() if tag_file.is_file() else DS_TAG
        ds_dir = ckpt_dir / tag
        if not ds_dir.is_dir():
            raise UserError(f"{ckpt_dir}: no DeepSpeed checkpoint folder {tag}/")
        sink = io.StringIO()
        try:
            with safe_torch_load(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                states = z.parse_model_states(z.get_model_state_files(str(ds_dir)))
                stage, world, flat, paddings = z.parse_optim_states(z.get_optim_files(str(ds_dir)), str(ds_dir))
                sd: dict[str, Any] = dict(states[0].buffers)
                if not exclude_frozen and states[0].frozen_param_shapes:
                    if stage <= 2:
                        z._zero2_merge_frozen_params(sd, states)
                    else:
                        z._zero3_merge_frozen_params(sd, world, states)
                if stage <= 2:
                    _zero2_lazy(sd, world, flat, states[0].param_shapes, paddings)
                else:
                    z._zero3_merge_trainable_params(sd, world, flat, states)
                for alias, target in states[0].shared_params:
                    if target in sd:
                        sd[alias] = sd[target]
        except UserError:
            raise
        except (FileNotFoundError, ValueError, KeyError) as e:
            raise UserError(f"{ds_dir}: not a readable ZeRO checkpoint ({str(e).splitlines()[0]})") from None
        except Exception as e:
            if "weights_only" in str(e) or "Unsupported global" in str(e) or "UnpicklingError" in type(e).__name__:
                raise UserError(f"{ds_dir}: refused, the checkpoint holds objects outside the allow-list "
                                f"({str(e).splitlines()[0][:200]})") from None
            raise
        self.stage, self.world = int(getattr(stage, 'value', stage)), int(world)
        self.sd = sd
        self.info = {k: (torch.Size(v.shape), v.dtype) for k, v in sd.items()}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for n in names:
            v = self.sd[n]
            out[n] = v if isinstance(v, torch.Tensor) else v.contiguous()
        return out


class _Zero2Param:
    """One parameter of a ZeRO-1/2 checkpoint: a range of the (virtual) concatenation of every
    rank's fp32 partition of its group."""

    def __init__(self, parts: list[torch.Tensor], starts: list[int], offset: int, shape: torch.Size):
        self.parts, self.starts, self.offset, self.shape = parts, starts, offset, torch.Size(shape)
        self.dtype = parts[0].dtype

    def contiguous(self) -> torch.Tensor:
        n = self.shape.numel()
        lo, hi = self.offset, self.offset + n
        pieces = []
        for part, start in zip(self.parts, self.starts):
            a, b = max(lo, start), min(hi, start + part.numel())
            if a < b:
                pieces.append(part[a - start:b - start])
        flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return flat.reshape(self.shape).clone()


def _zero2_lazy(sd: dict, world: int, flat_groups: list, param_shapes: list, paddings: list | None) -> None:
    """DeepSpeed's _zero2_merge_trainable_params, without materialising the merged groups."""
    for g, shapes in enumerate(param_shapes):
        parts = [flat_groups[r][g] for r in range(world)]
        starts, pos = [], 0
        for p in parts:
            starts.append(pos)
            pos += p.numel()
        avail = pos
        pad = paddings[g] if paddings is not None else None
        if pad is not None and len(pad) != len(shapes):
            raise ValueError(f"group {g}: {len(pad)} alignment paddings for {len(shapes)} parameters")
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            sd[name] = _Zero2Param(parts, starts, offset, shape)
            offset += math.prod(shape)
            if pad is not None:
                offset += pad[i]
        align = 2 * world
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise ValueError(f"group {g}: consumed {offset} of {avail} elements (layout not understood)")


def _zero_to_fp32() -> Any:
    if not torch.cuda.is_available():
        env.set_default("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import deepspeed.utils.zero_to_fp32 as z
    except ImportError as e:
        raise UserError(f"this is a DeepSpeed checkpoint: install deepspeed to export it ({e})") from None
    return z
