"""FSDP1: legacy FullyShardedDataParallel with transformer auto-wrap (one unit per decoder layer)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from swiftlite import dtypes
from swiftlite.errors import UserError
from swiftlite.parallel.base import Backend, register_backend
from swiftlite.parallel.fsdp2 import (FSDP_OPTIONS, check_quantized_base, mixed_precision_dtypes,
                                      refuse_cpu_offload_without_gpu)

if TYPE_CHECKING:
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from swiftlite.distributed import World
    from swiftlite.parallel.torch_engine import TorchEngine


def _is_quantized(p: "torch.Tensor") -> bool:
    return type(p).__name__ in ("Params4bit", "Int8Params")


def cast_to_uniform_dtype(model: "torch.nn.Module", dtype: "torch.dtype") -> list[str]:
    """FSDP1 flattens each unit's parameters into one tensor of one dtype ("Must flatten tensors
    with uniform dtype"). A LoRA/QLoRA model mixes dtypes: peft keeps adapters in fp32 next to a
    bf16 base, and bitsandbytes' 4-bit weights are stored as `bnb_4bit_quant_storage` (= --torch-dtype,
    see quant.bnb_config). Cast every non-quantized floating parameter (norms, embeddings, lm_head,
    LoRA) to `dtype`; packed 4-bit weights are never cast (that would scramble them). Returns the
    names of the parameters cast."""
    cast = []
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != dtype and not _is_quantized(p):
            p.data = p.data.to(dtype)
            cast.append(name)
    return cast


def check_uniform_dtype(model: "torch.nn.Module") -> None:
    """FSDP1 flattens each unit into one tensor: every parameter must share a dtype."""
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) > 1:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
        raise UserError(f"--parallelism fsdp1 needs parameters of one dtype, found {names} "
                        "(use --parallelism fsdp, or cast the non-quantized parameters)")


def apply_fsdp1(model: "torch.nn.Module", world: "World", *, mp: tuple | None, reshard_after_forward: bool,
                cpu_offload: bool) -> "FSDP":
    import torch
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from swiftlite.models.loading import decoder_layers
    layer_cls = {type(layer) for layer in decoder_layers(model)}
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls)
    mixed = MixedPrecision(param_dtype=mp[0], reduce_dtype=mp[1], buffer_dtype=mp[0]) if mp else None
    strategy = ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
    device_id = torch.device(world.device)  # explicit "cpu" too: FSDP1 refuses to guess a CPU device
    return FSDP(model, auto_wrap_policy=policy, mixed_precision=mixed, sharding_strategy=strategy,
                cpu_offload=CPUOffload(offload_params=True) if cpu_offload else None,
                device_id=device_id, use_orig_params=True, sync_module_states=False)


def fsdp1(model: "torch.nn.Module", cfg: Any, world: "World", total_steps: int, choice: Any = None) -> "TorchEngine":
    from swiftlite.parallel.torch_engine import TorchEngine
    refuse_cpu_offload_without_gpu(cfg, world)
    if cfg.is_peft:
        cast_to_uniform_dtype(model, dtypes.torch_dtype(cfg.model.torch_dtype))
    check_uniform_dtype(model)
    if not cfg.parallel.cpu_offload:
        model = model.to(world.device)
    wrapped = apply_fsdp1(model, world, mp=mixed_precision_dtypes(cfg),
                          reshard_after_forward=cfg.parallel.reshard_after_forward,
                          cpu_offload=cfg.parallel.cpu_offload)
    return TorchEngine(wrapped, cfg, world, total_steps, clip=wrapped.clip_grad_norm_)


register_backend(Backend(
    name="fsdp1", engine="fsdp1", factory=fsdp1, one_process="single", shards=(True, True, True),
    memory_family="fsdp1", options=FSDP_OPTIONS, checks=(check_quantized_base,),
    summary="FSDP1 (FullyShardedDataParallel, one unit per decoder layer)"))
