"""DPO's frozen reference copy for a full fine-tune (or `--ref_model`): loaded like the policy (in the
backend's init context), every parameter frozen, in eval mode, and laid out by the run's backend
record (`Backend.frozen_copy`, parallel/base.py: a replica under single/DDP, FSDP2 on the policy's
mesh, FSDP1, DeepSpeed without optimizer; a record that names none, a plugin's, gets the layout of its
policy's torch engine, parallel/frozen_copy.py `like_policy`, and the run says which in one line). A
backend that cannot lay one out says so and points to --precompute-ref-log-probs, which needs no copy.
GRPO's teacher (--teacher_model, rlhf/teacher.py) is built here too, with the same layout, or on a
DeepSpeed run with --teacher_deepspeed by the teacher's own ZeRO config.
"""

from __future__ import annotations

import contextlib
from typing import Any

from swiftlite.parallel.base import FrozenModel


#: What `build_frozen` returns (the module to call and the context its forward runs in).
Frozen = FrozenModel


def _ref_config(cfg: Any, model: str | None = None) -> Any:
    """The run's config for loading the reference (or `model`, GRPO's teacher): its model (or
    --ref_model), full weights, no activation checkpointing (no backward) and no compile."""
    return cfg.with_values(model=model or cfg.rlhf.ref_model or cfg.model.model, train_type="full", quant_bits=None,
                           quant_method=None, gradient_checkpointing=False, compile=False)


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


def build_frozen(run: Any, model: str | None = None, teacher_deepspeed: str | None = None) -> Frozen:
    """Load the reference (the starting weights, or --ref_model; or `model`, GRPO's teacher) and lay it
    out like the policy, or (`teacher_deepspeed`, a DeepSpeed run's --teacher_deepspeed) by that ZeRO
    config: stage 3 partitions the copy, the other stages keep a replica."""
    from swiftlite.models.loading import model_config, prepare_model, resolve_model
    cfg = _ref_config(run.cfg, model)
    source = resolve_model(cfg.model.model)
    record = run.choice.record
    own: dict[str, Any] = {}
    if teacher_deepspeed is not None:
        from swiftlite.parallel.ds_teacher import partitioned_init, teacher_ds_config
        ds = teacher_ds_config(teacher_deepspeed, cfg, run.world, getattr(model_config(cfg, source), "hidden_size", None))
        own = {"own_config": ds} if ds is not None else {"replica": True}
        init = partitioned_init(ds, cfg, run.world) if ds is not None and source.kind != "preset" else None
    else:
        init = record.model_init_context(cfg, run.world, lambda: model_config(cfg, source), run.choice)
    with _built_whole() if source.kind == "preset" else contextlib.nullcontext():
        model = prepare_model(cfg, source, run.world, init_context=init)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    frozen = record.frozen(model, cfg, run.world, run.engine, run.choice, **own)
    if record.frozen_copy is None and run.world.is_main:
        print(f"reference copy: --parallelism {record.name} names no frozen_copy (Backend.frozen_copy); laid out "
              f"like its policy engine: {frozen.layout}", flush=True)
    return frozen


__all__ = ["Frozen", "build_frozen"]
