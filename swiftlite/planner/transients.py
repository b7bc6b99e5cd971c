"""Memory that exists only for part of a step, on top of the model states (docs/estimate.md,
"Transients"): DeepSpeed's optimizer-step gradient conversion under ZeRO-2/3, and autocast's 16-bit
weight copies under single/ddp with fp32 master weights. planner/memory.py places them in the
estimate: the step transient replaces the activations at the optimizer step (they are freed by
then), the autocast copies are a buffer of the forward.

`w` is a planner.memory.Workload (not imported: memory.py imports this module).
"""

from __future__ import annotations

from typing import Any

from swiftlite.planner.shape import ModelShape
from swiftlite.planner.states import _ceil_div, trainable_params

#: ZeRO-3 converts the gradients one optimizer sub-group at a time: `sub_group_size` elements
#: (1e9 in ds_configs/zero3*.json, DeepSpeed's default), deepspeed 0.19 stage3.py
#: `_prepare_fp32_grad_for_sub_group`.
ZERO3_SUB_GROUP_SIZE = 10**9

#: Families whose optimizer step runs on the GPU with DeepSpeed's gradient conversion. The offload
#: families step on the host (the fp32 gradient partition is already there: no GPU transient).
ZERO_GPU_STEP = ("zero2", "zero3", "zero3pp")


def step_transient_bytes(shape: ModelShape, w: Any, family: str) -> int:
    """Bytes DeepSpeed's `step()` adds per rank while it converts the gradients (0 elsewhere).

    ZeRO-2 (deepspeed 0.19 stage_1_and_2.py `step`): the rank's gradient partition is flattened
    into one 16-bit buffer (e bytes per trained parameter / N) and cast to the master weights' dtype
    (`.to(fp32)`: 4 more), both alive until the flat copy is deleted: 6 bytes per parameter / N for
    bf16/fp16 (measured on CPU: +6 bytes per parameter inside `engine.step()`, docs/estimate.md);
    fp32 runs flatten only (the cast is a no-op): 4. ZeRO-3 does the same per optimizer sub-group
    (stage3.py `_prepare_fp32_grad_for_sub_group`), at most ZERO3_SUB_GROUP_SIZE elements at once.
    DeepSpeed's own estimators count the fp32 copy as a resident 4 bytes (their 18 bytes per
    parameter / N); here it is a transient, because activations are freed by the time it exists.
    """
    if family not in ZERO_GPU_STEP:
        return 0
    n = _ceil_div(trainable_params(shape, w), w.world_size)
    if family != "zero2":
        n = min(n, ZERO3_SUB_GROUP_SIZE)
    master = w.elem if (w.pure_bf16 or not w.mixed) else 4
    return n * (w.elem + (master if master != w.elem else 0))


#: Bytes per trained parameter / N that ZeRO-2 with offload_optimizer adds inside `step()`, where its
#: optimizer runs on the host partitions: measured on CPU (the rise of the peak RSS inside
#: `engine.step()`: 101.4 MB for 50.7M parameters on 2 ranks; ZeRO-3's offload families add ~6 MB
#: there, counted as none). On a GPU machine it is counted in host memory; whether part of it sits
#: on the GPU (the copy of the updated fp32 partition into the 16-bit weights) was not measured.
ZERO2_OFFLOAD_STEP_BYTES = 4


def host_step_transient_bytes(shape: ModelShape, w: Any, family: str) -> int:
    """Bytes per rank an offload family's host-side optimizer step adds (ZERO2_OFFLOAD_STEP_BYTES)."""
    if family != "zero2_offload":
        return 0
    return ZERO2_OFFLOAD_STEP_BYTES * _ceil_div(trainable_params(shape, w), w.world_size)


#: Bytes of the fp32 residual stream and norm outputs, and of the per-op input casts, that autocast
#: adds per token and decoder layer over a 16-bit model's activations, in units of h: the review of
#: 2026-12-01 counted autograd's saved tensors of one Llama layer under `torch.autocast(bf16)` over
#: fp32 parameters at ~56 sbh against 49.6 sbh for bf16 parameters: +6 h bytes per token.
AUTOCAST_LAYER_EXTRA_H = 6


def autocast(w: Any, family: str) -> bool:
    """Whether the backend computes through `torch.autocast` over fp32 parameters: single and ddp
    with master weights (parallel/torch_engine.py); FSDP casts its gathered parameters instead."""
    return family in ("single", "ddp") and w.master_weights


def autocast_copy_bytes(shape: ModelShape, w: Any, family: str, grads: int) -> int:
    """autocast's cached 16-bit copies of the fp32 weights, alive until the forward ends.

    autocast casts each fp32 weight once per forward and keeps the copy in its cache until the
    autocast region exits (measured on CPU: 189 MB freed at the exit for 98.6M Linear weights, ~2
    bytes each; lm_head's copy is kept by the loss graph). A full fine-tune casts every linear weight
    and lm_head (the embedding too when tied, being the same tensor); LoRA casts only the fp32
    adapters (the frozen base is already 16-bit; a 4-bit base is dequantized per call, not cached).
    Under ddp the gradient buckets are allocated through the forward, so the copies add to the
    peak; under single the gradients do not exist yet in the forward (zero_grad(set_to_none)) and
    the copies only count where they exceed them (`grads`: the single rank's gradient bytes).
    """
    if not autocast(w, family):
        return 0
    if w.train_type == "full":
        copies = (shape.n_linear_params + shape.vocab * shape.hidden) * w.elem
    else:
        copies = w.adapter_params(shape) * w.elem
    # one process has no DDP buckets: a ddp-family record on one GPU counts like single
    return copies if family == "ddp" and w.world_size > 1 else max(0, copies - grads)


__all__ = ["AUTOCAST_LAYER_EXTRA_H", "ZERO2_OFFLOAD_STEP_BYTES", "ZERO3_SUB_GROUP_SIZE", "autocast",
           "autocast_copy_bytes", "host_step_transient_bytes", "step_transient_bytes"]
