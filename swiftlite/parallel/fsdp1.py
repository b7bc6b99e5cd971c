"""FSDP1: legacy FullyShardedDataParallel with transformer auto-wrap (one unit per decoder layer).

With --torch-dtype bf16 the flat parameters are fp32 (master weights: a full fine-tune's parameters
are upcast, a LoRA model is cast to fp32 whole, since a unit flattens one dtype) and
`MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)` computes in bf16 and reduces in fp32; buffers
(the rotary `inv_freq`) stay fp32, as under FSDP2, DDP's autocast and DeepSpeed 0.19. --pure-bf16
shards bf16 flat parameters (and casts buffers to bf16), as before master weights existed.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from swiftlite import dtypes
from swiftlite.errors import UserError
from swiftlite.parallel.base import Backend, FrozenModel, register_backend
from swiftlite.parallel.fsdp2 import (FSDP_OPTIONS, check_cpu_offload, check_one_process, check_precision,
                                      check_quantized_base, mixed_precision_dtypes, refuse_cpu_offload_without_gpu,
                                      reshard_after_forward)

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


def check_4bit_master(cfg: Any, world_size: int, choice: Any = None) -> str | None:
    """A 4-bit base under FSDP1 with master weights: a unit flattens one dtype, the packed weights are
    stored as --torch-dtype (bf16), so the adapters cannot be fp32 next to them, and a
    mixed-precision cast would scramble a fp32-stored base."""
    from swiftlite.optim import master_weights
    if cfg.quant_bits == 4 and master_weights(cfg):
        return (f"--parallelism fsdp1 with a 4-bit base and --torch-dtype {cfg.model.torch_dtype}: FSDP1 flattens "
                f"each unit into one dtype and the packed 4-bit weights are {cfg.model.torch_dtype}, so the LoRA "
                "weights cannot keep fp32 master weights; use --parallelism fsdp (fp32 adapters), or --pure-bf16 "
                "(bf16 adapters and AdamW state)")
    return None


def apply_fsdp1(model: "torch.nn.Module", world: "World", *, mp: tuple | None, reshard_after_forward: bool,
                cpu_offload: bool, buffer_dtype: "torch.dtype | None" = None,
                param_init_fn: Any = None, adapter_units: bool = False, own_units: bool = True) -> "FSDP":
    """Wrap `model` in FSDP1: one unit per decoder layer; with `own_units` the untied embeddings are a
    unit of their own (gathered only around their own forward, not for the whole forward as part of
    the root unit; lm_head stays in the root, where the loss finds it a plain Linear and fuses the
    chunked cross-entropy into it: an FSDP1 wrapper around it would not be); with `adapter_units`
    (LoRA) every trainable leaf (the adapter
    matrices) is a unit of its own, peft's recipe for FSDP1: a unit flattens its parameters into one
    FlatParameter whose gradient is as large as the whole flat parameter, so adapters flattened with
    the frozen base would give every rank a gradient buffer of 1/N of the *base* (measured: +0.25 of
    the model's bytes per rank at N = 4), where their own units hold gradients of the adapters only."""
    import torch
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy

    from swiftlite.models.loading import decoder_layers
    layer_cls = {type(layer) for layer in decoder_layers(model)}
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls)
    if adapter_units or own_units:
        policy = functools.partial(_or_policy, policies=[policy, functools.partial(
            lambda_auto_wrap_policy, lambda_fn=_unit_rule(model, adapter_units, own_units))])
    mixed = MixedPrecision(param_dtype=mp[0], reduce_dtype=mp[1], buffer_dtype=buffer_dtype) if mp else None
    strategy = ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
    device_id = torch.device(world.device)  # explicit "cpu" too: FSDP1 refuses to guess a CPU device
    ranks = {name: p.ndim for name, p in model.named_parameters()}
    wrapped = FSDP(model, auto_wrap_policy=policy, mixed_precision=mixed, sharding_strategy=strategy,
                   cpu_offload=CPUOffload(offload_params=True) if cpu_offload else None,
                   device_id=device_id, use_orig_params=True, sync_module_states=False,
                   param_init_fn=param_init_fn)
    from swiftlite.optim import remember_ranks
    # Its parameters are now 1-D views of their shards (and, loaded from a meta skeleton, new objects):
    # the weight decay reads the ranks they had, by name.
    remember_ranks(wrapped, ranks)
    return wrapped


def _unit_rule(model: "torch.nn.Module", adapter_units: bool, own_units: bool) -> Any:
    """The modules that get an FSDP1 unit besides the decoder layers (see apply_fsdp1)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = emb is None or head is None or getattr(emb, "weight", None) is getattr(head, "weight", None)
    own = {id(emb)} if own_units and not tied else set()

    def rule(module: "torch.nn.Module") -> bool:
        if id(module) in own:
            return True
        if not adapter_units or next(module.children(), None) is not None:
            return False
        weight = getattr(module, "weight", None)
        return weight is not None and weight.requires_grad
    return rule


def _check_reshard_bool(cfg: Any, world_size: int, choice: Any = None) -> str | None:
    """FSDP1 reshards all (FULL_SHARD) or nothing (SHARD_GRAD_OP): no partial resharding; on one
    process (run as single) no FSDP knob applies."""
    problem = check_one_process(cfg, world_size, backend="fsdp1")
    if problem:
        return problem
    n = reshard_after_forward(cfg)
    if not isinstance(n, bool):
        return (f"--reshard-after-forward {n}: partial resharding is FSDP2's (--parallelism fsdp or hsdp); "
                "fsdp1 takes true or false")
    return None


def fsdp1(model: "torch.nn.Module", cfg: Any, world: "World", total_steps: int, choice: Any = None) -> "TorchEngine":
    from swiftlite.models.sharded import finish, unit_initializer
    from swiftlite.optim import master_weights, trainable_dtype, upcast_trainable
    from swiftlite.parallel.torch_engine import TorchEngine
    refuse_cpu_offload_without_gpu(cfg, world)
    master = master_weights(cfg)
    if cfg.is_peft:
        # One dtype per unit: fp32 under master weights (the frozen base too: 4 bytes/param, sharded),
        # else the run's dtype.
        cast_to_uniform_dtype(model, dtypes.torch_dtype(trainable_dtype(cfg)))
    elif master:
        upcast_trainable(model)
    check_uniform_dtype(model)
    # Sharded loading (models/sharded.py): FSDP1 materializes and fills each unit as it wraps it.
    init = unit_initializer(model, "cpu" if cfg.parallel.cpu_offload else world.device)
    if not cfg.parallel.cpu_offload and init is None:
        model = model.to(world.device)
    mp = mixed_precision_dtypes(cfg)
    wrapped = apply_fsdp1(model, world, mp=mp,
                          reshard_after_forward=reshard_after_forward(cfg),
                          cpu_offload=cfg.parallel.cpu_offload,
                          buffer_dtype=None if master or mp is None else mp[0], param_init_fn=init,
                          adapter_units=cfg.is_peft)
    finish(model)
    return TorchEngine(wrapped, cfg, world, total_steps, clip=wrapped.clip_grad_norm_)


def frozen_fsdp1(model: "torch.nn.Module", cfg: Any, world: "World", engine: Any, choice: Any = None) -> FrozenModel:
    """DPO's frozen reference copy (`Backend.frozen_copy`): FullyShardedDataParallel with one unit per
    decoder layer, resharded after forward; no optimizer, no gradient sync. The copy is a full
    fine-tune's (every parameter frozen, of the loaded dtype): no adapter units, no master-weight cast."""
    import contextlib
    check_uniform_dtype(model)
    if not cfg.parallel.cpu_offload:
        model = model.to(world.device)
    wrapped = apply_fsdp1(model, world, mp=mixed_precision_dtypes(cfg), reshard_after_forward=True,
                          cpu_offload=cfg.parallel.cpu_offload)
    return FrozenModel(wrapped, contextlib.nullcontext, layout="FSDP1 units as the policy's")


register_backend(Backend(
    name="fsdp1", engine="fsdp1", factory=fsdp1, one_process="single", shards=(True, True, True),
    memory_family="fsdp1", options=FSDP_OPTIONS, loading="sharded", frozen_copy=frozen_fsdp1,
    checks=(check_quantized_base, check_precision, check_4bit_master, _check_reshard_bool, check_cpu_offload),
    summary="FSDP1 (FullyShardedDataParallel, one unit per decoder layer)"))
