"""Single-process and DistributedDataParallel backends: a full replica on every rank.

With --torch-dtype bf16 the replica's trainable parameters, gradients and AdamW state are fp32
(master weights) and the forward runs under `torch.autocast(bf16)`; DDP all-reduces the fp32
gradients. --pure-bf16 trains the bf16 parameters (docs/backends.md, "Precision").

torch is imported inside the functions: the registry imports this module to read its records, and
that must stay fast for `--help` and `--dry-run`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from swiftlite.parallel.base import Backend, FrozenModel, register_backend

if TYPE_CHECKING:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from swiftlite.distributed import World
    from swiftlite.parallel.torch_engine import TorchEngine


def check_precision(cfg: Any, world_size: int, choice: Any = None) -> str | None:
    from swiftlite.optim import precision_problem
    return precision_problem(cfg)


def prepare_replica(model: "torch.nn.Module", cfg: Any, world: "World") -> "torch.nn.Module":
    """The replica on this rank's device: fp32 trainable parameters and autocast under master weights."""
    from swiftlite.optim import master_weights, upcast_trainable
    from swiftlite.parallel.torch_engine import autocast_forward
    if master_weights(cfg):
        upcast_trainable(model)
    model = model.to(world.device)
    autocast_forward(model, cfg, world)
    return model


def frozen_replica(model: "torch.nn.Module", cfg: Any, world: "World", engine: Any = None,
                   choice: Any = None) -> FrozenModel:
    """DPO's frozen reference copy (`Backend.frozen_copy`): a replica on this rank's device, under the
    autocast the policy's forward uses; no optimizer, no DDP wrapper (nothing to all-reduce)."""
    from swiftlite.parallel.torch_engine import autocast_context
    model = prepare_replica(model, cfg, world)
    return FrozenModel(model, lambda: autocast_context(model), layout=f"a replica on {world.device}")


def single(model: "torch.nn.Module", cfg: Any, world: "World", total_steps: int, choice: Any = None) -> "TorchEngine":
    """No wrapping: one process, one replica."""
    from swiftlite.parallel.torch_engine import TorchEngine
    return TorchEngine(prepare_replica(model, cfg, world), cfg, world, total_steps)


def apply_ddp(model: "torch.nn.Module", world: "World") -> "DistributedDataParallel":
    """Replicate with gradient all-reduce (averaged over ranks). gradient_as_bucket_view: the
    gradients are DDP's buckets (no second copy); buffers are never changed in training, so they are
    not broadcast each forward."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = model.to(world.device)
    ids = [world.local_rank] if world.device_type == "cuda" else None
    return DDP(model, device_ids=ids, find_unused_parameters=False, gradient_as_bucket_view=True,
               broadcast_buffers=False)


def ddp(model: "torch.nn.Module", cfg: Any, world: "World", total_steps: int, choice: Any = None) -> "TorchEngine":
    from swiftlite.parallel.torch_engine import TorchEngine
    if not world.distributed:
        return single(model, cfg, world, total_steps)
    model = prepare_replica(model, cfg, world)
    wrapped = apply_ddp(model, world)
    return TorchEngine(wrapped, cfg, world, total_steps, inner=model,
                       no_sync=lambda last: contextlib.nullcontext() if last else wrapped.no_sync())


register_backend(Backend(
    name="single", engine="single", factory=single, max_processes=1, memory_family="single",
    checks=(check_precision,), frozen_copy=frozen_replica, summary="one process, no wrapping"))
register_backend(Backend(
    name="ddp", engine="ddp", factory=ddp, one_process="single", memory_family="ddp", checks=(check_precision,),
    frozen_copy=frozen_replica, reentrant_checkpointing=False, summary="DistributedDataParallel: a full replica per process, gradients all-reduced"))
