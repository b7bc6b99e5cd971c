"""DPO's frozen reference copy on the FSDP backends, and the default of every record
(`Backend.frozen_copy`, parallel/base.py; single and ddp name `ddp.frozen_replica`, DeepSpeed's
records `deepspeed.frozen_copy`).

The copy is laid out the way the backend laid out the policy, with the same public wrapping
functions, but with no optimizer, no gradients and no gradient all-reduce:

    single, ddp, a plain-module engine   a replica on this rank's device (what DDP keeps too; the
                                         policy's autocast under fp32 master weights)
    fsdp, hsdp                           fully_shard per decoder layer and the root, on the policy's
                                         own device mesh (1-D, or hsdp's replicate x shard)
    fsdp1                                FullyShardedDataParallel with the policy's wrap policy

`like_policy` is the default of every record that names no copy of its own: it reads the layout
from the policy engine's root module, so a backend that wraps with these functions (or not at
all, like the toy plugin of tests/e2e) gets its copy with no entry anywhere else.

torch is imported inside the functions: the registry imports this module's name only.
"""

from __future__ import annotations

from typing import Any

from swiftlite.errors import UserError
from swiftlite.parallel.base import FrozenModel


def fsdp2(model: Any, cfg: Any, world: Any, mesh: Any) -> FrozenModel:
    """fully_shard per decoder layer and the root on `mesh` (the policy's), resharded after forward."""
    import contextlib

    from swiftlite.parallel.fsdp2 import apply_fsdp2, mixed_precision_dtypes
    if not cfg.parallel.cpu_offload:
        model = model.to(world.device)
    apply_fsdp2(model, mesh, mp=mixed_precision_dtypes(cfg), reshard_after_forward=True,
                cpu_offload=cfg.parallel.cpu_offload)
    return FrozenModel(model, contextlib.nullcontext)


def fsdp1(model: Any, cfg: Any, world: Any) -> FrozenModel:
    """FullyShardedDataParallel units as the policy's (one per decoder layer), resharded after forward."""
    import contextlib

    from swiftlite.parallel.fsdp1 import apply_fsdp1, check_uniform_dtype
    from swiftlite.parallel.fsdp2 import mixed_precision_dtypes
    check_uniform_dtype(model)
    if not cfg.parallel.cpu_offload:
        model = model.to(world.device)
    wrapped = apply_fsdp1(model, world, mp=mixed_precision_dtypes(cfg), reshard_after_forward=True,
                          cpu_offload=cfg.parallel.cpu_offload)
    return FrozenModel(wrapped, contextlib.nullcontext)


def policy_mesh(root: Any) -> Any:
    """The device mesh FSDP2 sharded the policy on (every sharded parameter is a DTensor on it)."""
    for p in root.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return mesh
    raise UserError("rlhf: the policy is an FSDP2 module without sharded parameters (internal)")


def like_policy(model: Any, cfg: Any, world: Any, engine: Any, choice: Any) -> FrozenModel:
    """The copy laid out as the policy engine's root module is: FSDP2 on its mesh, FSDP1, or a replica
    (DDP's wrapper or a plain module). A record that loads models in an init context of its own (a
    partitioned init) must say how its copy is laid out: a replica of a partitioned model would be wrong."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    root = engine.root()
    if isinstance(root, FSDPModule):
        return fsdp2(model, cfg, world, policy_mesh(root))
    if isinstance(root, FullyShardedDataParallel):
        return fsdp1(model, cfg, world)
    if choice is not None and choice.record.init_context is not None:
        raise UserError(f"--parallelism {choice.name}: this backend builds models in its own init context and its "
                        "record names no frozen reference copy (Backend.frozen_copy); pass "
                        "--precompute-ref-log-probs (one pass with the starting weights, no copy)")
    from swiftlite.parallel.ddp import frozen_replica
    return frozen_replica(model, cfg, world)


__all__ = ["fsdp1", "fsdp2", "like_policy", "policy_mesh"]
