"""FSDP2: `fully_shard` per decoder layer, then the root (torchtitan's order).

Parameters become DTensors sharded on dim 0, so each rank holds 1/N of parameters, gradients and
AdamW state. Mixed precision computes in bf16 and reduces gradients in fp32.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from swiftlite.errors import UserError
from swiftlite.models.loading import decoder_layers
from swiftlite.parallel.base import World, register_backend
from swiftlite.parallel.torch_engine import TorchEngine


def mixed_precision_dtypes(cfg: Any) -> tuple[torch.dtype, torch.dtype] | None:
    """(param_dtype, reduce_dtype) for FSDP mixed precision, or None for none."""
    mp = cfg.parallel.mixed_precision
    if mp is None:
        mp = "bf16" if cfg.model.torch_dtype == "bf16" else "none"
    if mp == "none":
        return None
    return ({"bf16": torch.bfloat16, "fp16": torch.float16}[mp], torch.float32)


def apply_fsdp2(model: torch.nn.Module, mesh: Any, *, mp: tuple | None, reshard_after_forward: bool,
                cpu_offload: bool) -> torch.nn.Module:
    """Shard each decoder layer, then the root module (embeddings, norm, head)."""
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp[0], reduce_dtype=mp[1])
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


@register_backend("fsdp")
def fsdp2(model: torch.nn.Module, cfg: Any, world: World, total_steps: int) -> TorchEngine:
    if cfg.parallel.cpu_offload and not world.device.startswith("cuda"):
        raise UserError("--cpu-offload moves parameters from the GPU to the CPU; this run has no GPU "
                        "(everything is on the CPU already): drop --cpu-offload")
    device_type = "cuda" if world.device.startswith("cuda") else "cpu"
    if not cfg.parallel.cpu_offload:
        model = model.to(world.device)
    mesh = init_device_mesh(device_type, (world.world_size,))
    apply_fsdp2(model, mesh, mp=mixed_precision_dtypes(cfg),
                reshard_after_forward=cfg.parallel.reshard_after_forward,
                cpu_offload=cfg.parallel.cpu_offload)
    def sync(last: bool):
        # Reduce-scatter only at the end of an accumulation window (grads accumulate unsharded
        # in between, as with DDP's no_sync).
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return TorchEngine(model, cfg, world, total_steps, no_sync=sync)
