"""DPO's frozen reference copy for a full fine-tune (or `--ref_model`): loaded like the policy, every
parameter frozen, and laid out by the run's backend with the same public wrapping functions the
backend uses, but with no optimizer, no gradients and no DDP all-reduce:

    single, ddp     a replica on this rank's device (what DDP keeps too; autocast as the policy)
    fsdp, hsdp      fully_shard per decoder layer and the root, on the policy's mesh shape
    fsdp1           FullyShardedDataParallel with the policy's wrap policy
    DeepSpeed       deepspeed.initialize without optimizer: ZeRO-3 partitions it like the policy,
                    ZeRO-1/2 (which shard optimizer state only) keep a replica (stage 0)

A backend that is not in this table (an --external-plugins one) has no frozen copy: the run says to
use --precompute-ref-log-probs, which needs none.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable

from swiftlite.errors import UserError


@dataclass
class Frozen:
    module: Any                       # what to call
    autocast: Callable[[], Any]       # the context its forward runs in


def _ref_config(cfg: Any) -> Any:
    """The run's config for loading the reference: its model (or --ref_model), full weights, no
    activation checkpointing (no backward) and no compile."""
    ref = copy.deepcopy(cfg)
    if cfg.rlhf.ref_model:
        ref.model.model = cfg.rlhf.ref_model
    ref.train.train_type = "full"
    ref.quant.quant_bits = None
    ref.train.gradient_checkpointing = False
    ref.parallel.compile = False
    return ref


def _autocast_of(module: Any) -> Callable[[], Any]:
    import torch
    spec = module.__dict__.get("_swiftlite_autocast")
    if spec:
        return lambda: torch.autocast(device_type=spec[0], dtype=spec[1])
    return contextlib.nullcontext


def _replica(model: Any, cfg: Any, world: Any, run: Any) -> Frozen:
    from swiftlite.parallel.ddp import prepare_replica
    model = prepare_replica(model, cfg, world)
    return Frozen(model, _autocast_of(model))


def _fsdp2(model: Any, cfg: Any, world: Any, run: Any) -> Frozen:
    from torch.distributed.device_mesh import init_device_mesh

    from swiftlite.parallel.fsdp2 import apply_fsdp2, mixed_precision_dtypes
    device_type = "cuda" if world.device.startswith("cuda") else "cpu"
    if run.choice.key == "hsdp":
        from swiftlite.parallel.hsdp import mesh_shape
        mesh = init_device_mesh(device_type, mesh_shape(cfg, world.world_size, world.local_world_size),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device_type, (world.world_size,))
    if not cfg.parallel.cpu_offload:
        model = model.to(world.device)
    apply_fsdp2(model, mesh, mp=mixed_precision_dtypes(cfg), reshard_after_forward=True,
                cpu_offload=cfg.parallel.cpu_offload)
    return Frozen(model, contextlib.nullcontext)


def _fsdp1(model: Any, cfg: Any, world: Any, run: Any) -> Frozen:
    from swiftlite.parallel.fsdp1 import apply_fsdp1, check_uniform_dtype
    from swiftlite.parallel.fsdp2 import mixed_precision_dtypes
    check_uniform_dtype(model)
    if not cfg.parallel.cpu_offload:
        model = model.to(world.device)
    wrapped = apply_fsdp1(model, world, mp=mixed_precision_dtypes(cfg), reshard_after_forward=True,
                          cpu_offload=cfg.parallel.cpu_offload)
    return Frozen(wrapped, contextlib.nullcontext)


def _deepspeed(model: Any, cfg: Any, world: Any, run: Any) -> Frozen:
    import deepspeed
    conf = copy.deepcopy(run.engine.ds_config)
    for k in ("optimizer", "scheduler"):
        conf.pop(k, None)
    zero = dict(conf.get("zero_optimization") or {})
    if zero.get("stage", 0) != 3:
        zero = {"stage": 0}
    zero.pop("offload_optimizer", None)
    conf["zero_optimization"] = zero
    ds, *_ = deepspeed.initialize(model=model, config=conf, dist_init_required=None)
    ds.eval()
    return Frozen(ds, contextlib.nullcontext)


@contextlib.contextmanager
def _built_whole():
    """A built-in preset is built whole, as the policy was (models/loading.py), then partitioned by
    deepspeed.initialize. Once the policy's ZeRO-3 engine exists, transformers' from_config would build
    the copy under zero.Init instead, with other random draws: other weights than the policy's start
    (step 1 of a full zero3 run was not ln 2). So transformers' ZeRO-3 marker is off while it builds."""
    from transformers.integrations import deepspeed as hf_ds
    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


#: engine key (Backend.engine) -> how the frozen copy is laid out.
LAYOUTS = {"single": _replica, "ddp": _replica, "fsdp": _fsdp2, "hsdp": _fsdp2, "fsdp1": _fsdp1,
           "deepspeed": _deepspeed}


def build_frozen(run: Any) -> Frozen:
    """Load the reference (the starting weights, or --ref_model) and lay it out like the policy."""
    from swiftlite.models.loading import model_config, prepare_model, resolve_model
    layout = LAYOUTS.get(run.choice.key)
    if layout is None:
        raise UserError(f"--parallelism {run.choice.name}: no frozen reference copy for this backend; pass "
                        "--precompute-ref-log-probs (one pass with the starting weights, no copy)")
    cfg = _ref_config(run.cfg)
    source = resolve_model(cfg.model.model)
    init = run.choice.record.model_init_context(cfg, run.world, lambda: model_config(cfg, source), run.choice)
    with _built_whole() if source.kind == "preset" else contextlib.nullcontext():
        model = prepare_model(cfg, source, run.world, init_context=init)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return layout(model, cfg, run.world, run)


__all__ = ["Frozen", "LAYOUTS", "build_frozen"]
