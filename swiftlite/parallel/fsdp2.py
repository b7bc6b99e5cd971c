"""FSDP2: `fully_shard` per decoder layer, then the root (torchtitan's order).

Parameters become DTensors sharded on dim 0, so each rank holds 1/N of parameters, gradients and
AdamW state. With --torch-dtype bf16 the sharded parameters, their gradients and the AdamW state are
fp32 (master weights: the trainable parameters are upcast before sharding) and `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)` all-gathers them in bf16 for compute and reduce-scatters gradients in fp32
(torchtitan's setup). --pure-bf16 shards the bf16 parameters themselves (docs/backends.md, "Precision").
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from swiftlite import dtypes
from swiftlite.errors import UserError
from swiftlite.parallel.base import Backend, register_backend

if TYPE_CHECKING:
    import torch

    from swiftlite.distributed import World
    from swiftlite.parallel.torch_engine import TorchEngine

FSDP_OPTIONS = frozenset({"mixed_precision", "cpu_offload"})


def compute_precision(cfg: Any) -> str:
    """FSDP's compute dtype: --mixed-precision, default the 16-bit --torch-dtype ("none" for fp32)."""
    mp = cfg.parallel.mixed_precision
    if mp is None:
        mp = cfg.model.torch_dtype if cfg.model.torch_dtype in dtypes.HALF else "none"
    return mp


def mixed_precision_dtypes(cfg: Any) -> "tuple[torch.dtype, torch.dtype] | None":
    """(param_dtype, reduce_dtype) for FSDP mixed precision, or None for none (compute in the
    parameters' own dtype)."""
    import torch
    mp = compute_precision(cfg)
    if mp == "none":
        return None
    return (dtypes.torch_dtype(mp), torch.float32)


def check_precision(cfg: Any, world_size: int, choice: Any = None) -> str | None:
    """--pure-bf16 needs bf16; --mixed-precision none next to fp32 master weights would compute in fp32."""
    from swiftlite.optim import master_weights, precision_problem
    problem = precision_problem(cfg)
    if problem:
        return problem
    if cfg.parallel.mixed_precision == "none" and master_weights(cfg):
        return (f"--mixed-precision none with --torch-dtype {cfg.model.torch_dtype}: the parameters are fp32 master "
                "weights, so FSDP would compute in fp32 too; use --torch-dtype fp32 for fp32 training, or add "
                "--pure-bf16 to train bf16 parameters with bf16 gradient reduction")
    return None


def refuse_cpu_offload_without_gpu(cfg: Any, world: "World") -> None:
    """Shared by fsdp and fsdp1: offload moves parameters off a GPU; on a CPU run it would be a no-op."""
    if cfg.parallel.cpu_offload and not world.device.startswith("cuda"):
        raise UserError("--cpu-offload moves parameters from the GPU to the CPU; this run has no GPU "
                        "(everything is on the CPU already): drop --cpu-offload")


def check_quantized_base(cfg: Any, world_size: int, choice: Any = None) -> str | None:
    """FSDP (both versions) and a bitsandbytes base."""
    bits = cfg.quant_bits
    shown = cfg.parallel.parallelism
    if bits == 8:
        return (f"--quant-bits 8 with --parallelism {shown}: FSDP re-wraps every parameter as a "
                "plain tensor and the 8-bit (LLM.int8) weights lose their scales (CB/SCB); use --qlora (4-bit) "
                "with FSDP, or 8-bit with zero2/zero3")
    mp = cfg.parallel.mixed_precision
    if bits == 4 and mp not in (None, "none") and mp != cfg.model.torch_dtype:
        return (f"--mixed-precision {mp} with a 4-bit base stored as {cfg.model.torch_dtype}: FSDP would cast the "
                f"packed 4-bit weights to {mp} and scramble them (their storage dtype follows --torch-dtype); "
                f"use --torch-dtype {mp} without --mixed-precision")
    return None


def apply_fsdp2(model: "torch.nn.Module", mesh: Any, *, mp: tuple | None, reshard_after_forward: bool,
                cpu_offload: bool) -> "torch.nn.Module":
    """Shard each decoder layer, then the root module (embeddings, norm, head)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from swiftlite.models.loading import decoder_layers
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp[0], reduce_dtype=mp[1])
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def fsdp2(model: "torch.nn.Module", cfg: Any, world: "World", total_steps: int, choice: Any = None) -> "TorchEngine":
    from torch.distributed.device_mesh import init_device_mesh

    from swiftlite.optim import master_weights, upcast_trainable
    from swiftlite.parallel.torch_engine import TorchEngine
    refuse_cpu_offload_without_gpu(cfg, world)
    if master_weights(cfg):
        upcast_trainable(model)  # fp32 shards of every trainable parameter (frozen ones keep their dtype)
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


register_backend(Backend(
    name="fsdp", engine="fsdp", factory=fsdp2, aliases=("fsdp2",), one_process="single",
    shards=(True, True, True), memory_family="fsdp", options=FSDP_OPTIONS,
    checks=(check_quantized_base, check_precision),
    summary="FSDP2 (fully_shard per decoder layer): params, grads and optimizer state sharded"))
