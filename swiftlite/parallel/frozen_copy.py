"""What a record that names no frozen reference copy gets (`Backend.frozen_copy` None, parallel/base.py
`LIKE_POLICY`): a plugin's record, such as the toy of tests/e2e.

Every built-in record names its copy next to its engine factory, in its own module:

    single, ddp   ddp.frozen_replica      a replica on this rank's device (what DDP keeps too; the
                                          policy's autocast under fp32 master weights)
    fsdp          fsdp2.frozen_fsdp2      fully_shard per decoder layer and the root, on the policy's
    hsdp          hsdp.frozen_hsdp        own device mesh (1-D; hsdp's replicate x shard: fsdp2.frozen_on_mesh)
    fsdp1         fsdp1.frozen_fsdp1      FullyShardedDataParallel with the policy's wrap policy
    zero*         deepspeed.frozen_copy   deepspeed.initialize without optimizer

Each lays the copy out the way the backend laid out the policy, with the same public wrapping
functions, but with no optimizer, no gradients and no gradient all-reduce. The layouts live with their
backends (and this module imports them, never the reverse: tests/unit/test_import_graph.py).

`like_policy` reads the layout from the policy engine's root module and reuses those functions: FSDP2
on its mesh, FSDP1, else a replica. The run says in one line what a record naming none got
(rlhf/frozen.py), so a plugin's copy is never chosen silently.

torch is imported inside the function: the registry imports this module's name only.
"""

from __future__ import annotations

from typing import Any

from swiftlite.errors import UserError
from swiftlite.parallel.base import FrozenModel


def like_policy(model: Any, cfg: Any, world: Any, engine: Any, choice: Any) -> FrozenModel:
    """The copy of a record that names none: laid out as the policy engine's root module is, FSDP2 on
    its mesh, FSDP1, or a replica (DDP's wrapper or a plain module). A record that loads models in an
    init context of its own (a partitioned init) must say how its copy is laid out: a replica of a
    partitioned model would be wrong."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    root = engine.root()
    if isinstance(root, FSDPModule):
        from swiftlite.parallel.fsdp2 import frozen_fsdp2
        return frozen_fsdp2(model, cfg, world, engine, choice)
    if isinstance(root, FullyShardedDataParallel):
        from swiftlite.parallel.fsdp1 import frozen_fsdp1
        return frozen_fsdp1(model, cfg, world, engine, choice)
    if choice is not None and choice.record.init_context is not None:
        raise UserError(f"--parallelism {choice.name}: this backend builds models in its own init context and its "
                        "record names no frozen reference copy (Backend.frozen_copy); pass "
                        "--precompute-ref-log-probs (one pass with the starting weights, no copy)")
    from swiftlite.parallel.ddp import frozen_replica
    return frozen_replica(model, cfg, world)


__all__ = ["like_policy"]
