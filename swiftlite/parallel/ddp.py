"""Single-process and DistributedDataParallel backends: a full replica on every rank."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from swiftlite.parallel.base import World, register_backend
from swiftlite.parallel.torch_engine import TorchEngine


@register_backend("single")
def single(model: torch.nn.Module, cfg: Any, world: World, total_steps: int) -> TorchEngine:
    """No wrapping: one process, one replica."""
    return TorchEngine(model.to(world.device), cfg, world, total_steps)


def apply_ddp(model: torch.nn.Module, world: World) -> DDP:
    """Replicate with gradient all-reduce (averaged over ranks)."""
    model = model.to(world.device)
    ids = [world.local_rank] if world.device.startswith("cuda") else None
    return DDP(model, device_ids=ids, find_unused_parameters=False, gradient_as_bucket_view=True,
               broadcast_buffers=False)


@register_backend("ddp")
def ddp(model: torch.nn.Module, cfg: Any, world: World, total_steps: int) -> TorchEngine:
    if not world.distributed:
        return single(model, cfg, world, total_steps)
    wrapped = apply_ddp(model, world)
    return TorchEngine(wrapped, cfg, world, total_steps, inner=model,
                       no_sync=lambda last: contextlib.nullcontext() if last else wrapped.no_sync())
