"""FSDP1: legacy FullyShardedDataParallel with transformer auto-wrap (one unit per decoder layer)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from swiftlite.errors import UserError
from swiftlite.models.loading import decoder_layers
from swiftlite.parallel.base import World, register_backend
from swiftlite.parallel.fsdp2 import mixed_precision_dtypes
from swiftlite.parallel.torch_engine import TorchEngine


def check_uniform_dtype(model: torch.nn.Module) -> None:
    """FSDP1 flattens each unit into one tensor: every parameter must share a dtype."""
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) > 1:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
        raise UserError(f"--parallelism fsdp1 needs parameters of one dtype, found {names} "
                        "(use --parallelism fsdp, or cast the non-quantized parameters)")


def apply_fsdp1(model: torch.nn.Module, world: World, *, mp: tuple | None, reshard_after_forward: bool,
                cpu_offload: bool) -> FSDP:
    layer_cls = {type(layer) for layer in decoder_layers(model)}
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls)
    mixed = MixedPrecision(param_dtype=mp[0], reduce_dtype=mp[1], buffer_dtype=mp[0]) if mp else None
    strategy = ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
    device_id = torch.device(world.device)  # explicit "cpu" too: FSDP1 refuses to guess a CPU device
    return FSDP(model, auto_wrap_policy=policy, mixed_precision=mixed, sharding_strategy=strategy,
                cpu_offload=CPUOffload(offload_params=True) if cpu_offload else None,
                device_id=device_id, use_orig_params=True, sync_module_states=False)


@register_backend("fsdp1")
def fsdp1(model: torch.nn.Module, cfg: Any, world: World, total_steps: int) -> TorchEngine:
    check_uniform_dtype(model)
    if not cfg.parallel.cpu_offload:
        model = model.to(world.device)
    wrapped = apply_fsdp1(model, world, mp=mixed_precision_dtypes(cfg),
                          reshard_after_forward=cfg.parallel.reshard_after_forward,
                          cpu_offload=cfg.parallel.cpu_offload)
    return TorchEngine(wrapped, cfg, world, total_steps, clip=wrapped.clip_grad_norm_)
