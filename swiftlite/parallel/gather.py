"""The weights of a sharded engine, gathered for GRPO's generation round (rlhf/generate.py): once per
round where the backend allows it, not once per token.

FSDP2 (fsdp, hsdp) unshards every FSDPModule and keeps them unsharded until the round ends (their
reshard-after-forward is switched off for the round, then restored and resharded). ZeRO-3 gathers
every parameter with deepspeed.zero.GatheredParameters and takes its module hooks off for the round
(TRL's unwrap_model_for_generation), so no all-gather runs while it generates. FSDP1 holds its root
unit (embeddings, lm_head) whole with summon_full_params(recurse=False), as TRL does; its
decoder-layer units still all-gather at each token (their hooks do so even inside a recursive
summon: 18 all-gathers for a 6-token call either way). Other engines hold whole weights already.
Here, in parallel/, because it reaches into the backends' own state.
"""

from __future__ import annotations

import contextlib
from typing import Any


@contextlib.contextmanager
def gathered(model: Any):
    """The generation round's gather (module docstring) for `model`, the engine's root (`Engine.root()`:
    the FSDP1 root unit and the DeepSpeed engine wrap the model): a no-op for unsharded engines."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if units:
        # The outermost unit is the root: FSDP2 initialises every unit's state from the root's first
        # forward, and a unit unsharded before that would initialise on its own (an error later).
        units[0]._get_fsdp_state()._lazy_init()
        saved = []
        for m in units:
            group = m._get_fsdp_state()._fsdp_param_group
            # reshard-after-forward per unit as FSDP2 keeps it (None: kept unsharded after forward)
            saved.append(None if group is None else group.post_forward_mesh_info)
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            yield
        finally:
            for m, info in zip(units, saved):
                group = m._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    group.post_forward_mesh_info = info
                m.reshard()
        return
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    if isinstance(model, FSDP1):
        with FSDP1.summon_full_params(model, writeback=False, recurse=False):
            yield
        return
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if params:
        import deepspeed
        with deepspeed.zero.GatheredParameters(params):
            off = _zero3_offload(model)
            if off is None:
                yield
                return
            # ZeRO-3's per-module hooks would release and fetch every layer again at each token; they
            # are taken off for the round and put back after it (as TRL's unwrap_model_for_generation)
            from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
            for prm in iter_params(off.module, recurse=True):
                prm.ds_active_sub_modules.clear()
            for hook in [*off.forward_hooks, *off.backward_hooks]:
                hook.remove()
            off.forward_hooks, off.backward_hooks = [], []
            try:
                yield
            finally:
                coord = getattr(off, "param_coordinator", None)
                if coord is not None and not coord.is_invalid_trace():
                    coord._invalidate_trace()
                off._register_deepspeed_module(off.module)
        return
    yield


def lockstep(model: Any) -> bool:
    """Whether a forward of `model` inside `gathered` still runs collectives (FSDP1's decoder-layer units
    all-gather at each token): then every process must make the same generate calls, each with
    transformers' synced_gpus (a process that finishes first keeps stepping until all have). Elsewhere
    generation is local to each process and may differ between them (a multi-turn round's later turns,
    a sequence-parallel group's shares)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    return any(isinstance(m, FSDP1) for m in model.modules())


def _zero3_offload(engine: Any) -> Any:
    """The DeepSpeed engine's ZeRO-3 parameter offload (which holds the module hooks), or None."""
    opt = getattr(engine, "optimizer", None)
    off = getattr(opt, "parameter_offload", None) if opt is not None else None
    return off if off is not None and hasattr(off, "forward_hooks") else None



__all__ = ["gathered"]
