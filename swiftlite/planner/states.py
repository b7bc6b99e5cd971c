"""Bytes per parameter: what each memory family holds per trained weight, a quantized base's
storage, and the trainable count (docs/estimate.md, "Model states"). Leaf arithmetic shared by
planner/memory.py (the states, buffers and the estimate) and planner/load.py (the load phase);
`w` is a planner.memory.Workload (not imported: memory.py imports this module).
"""

from __future__ import annotations

import math
from typing import Any

from swiftlite.planner.shape import ModelShape


def _ceil_div(a: int, b: int) -> int:
    """a / b rounded up, in integers (byte counts of 405B models exceed float precision margins)."""
    return -(-a // b)


def quantized_bytes(n_weights: int, w: Any, out_rows: int = 0) -> int:
    """Storage of `n_weights` linear weights quantized with bitsandbytes.

    nf4: 4 bits per weight plus one absmax per 64-weight block: fp32 (32/64 = 0.5 bit) or, with double
    quantization, 8-bit absmax plus an fp32 constant per 256 blocks (8/64 + 32/16384 = 0.127 bit).
    LLM.int8: 1 byte per weight plus an fp32 scale per output row.
    HQQ (`w.quant_method == "hqq"`, models/hqq.py): the packed weights plus a scale and a zero point per
    group of 64 weights in the compute dtype; 3-bit ones are packed 10 groups to an int32 (3.2 bits a
    weight, plus up to 9 groups' padding per layer, which only tiny layers notice).
    """
    if getattr(w, "quant_method", "bnb") == "hqq":
        bits = 3.2 if w.quant_bits == 3 else w.quant_bits
        return int(math.ceil(n_weights * bits / 8 + 2 * w.elem * n_weights / 64))
    if w.quant_bits == 4:
        absmax = n_weights / 64 + 4 * n_weights / (64 * 256) if w.double_quant else 4 * n_weights / 64
        return int(math.ceil(n_weights / 2 + absmax))
    if w.quant_bits == 8:
        return n_weights + 4 * out_rows
    raise ValueError(f"quant_bits {w.quant_bits}")


def _base_bytes(w: Any, n_linear: int, n_other: int, out_rows: int, elem: int | None = None) -> int:
    """Bytes of frozen/gathered base weights: quantized linears (if any) + the rest in `elem` bytes
    (default: the compute dtype's)."""
    e = w.elem if elem is None else elem
    if w.quant_bits is None:
        return (n_linear + n_other) * e
    return quantized_bytes(n_linear, w, out_rows) + n_other * e


def _frozen_elem(w: Any, family: str) -> int:
    """Bytes per frozen (non-quantized) base weight as stored: --torch-dtype, except fsdp1 with master
    weights, which casts the whole LoRA model to fp32 (one dtype per flattened unit)."""
    return 4 if family == "fsdp1" and w.master_weights else w.elem


def trainable_params(shape: ModelShape, w: Any) -> int:
    """Parameters the optimizer updates: all of them (full) or the adapter's (Workload.adapter_params;
    llamapro: its inserted layers)."""
    return shape.n_params if w.train_type == "full" else w.adapter_params(shape)


def tuner_params(shape: ModelShape, w: Any) -> int:
    """Trainable parameters of a tuner on a frozen base. LoRA: r (in + out) per adapted linear. AdaLoRA: its
    starting rank's A, B and E (init_r (in + out + 1); pruning zeroes entries of E but keeps the tensors, so
    the count is the same at every step). BOFT: its blocks and scales (ModelShape.boft_params).
    Bone (peft's MiSS): r x out per adapted linear (ModelShape.miss_params). Houlsby adapters
    (models/adapter.py): per decoder layer linear1 (hidden x length + length) and linear2 (length x hidden
    + hidden), not part of `shape`.
    Approximated: BOFT's forward (and Bone's with --init_weights bat) also holds each adapted layer's
    rotated or updated weight (out x in) until the backward; the activation formulas count LoRA's
    input copies instead."""
    if w.train_type == "llamapro":   # whole new decoder layers, already in `shape` (ModelShape.expanded)
        return w.llamapro_blocks * shape.n_layer_params
    if w.train_type == "adapter":   # the run's own count (models/adapter.py: import-light)
        from swiftlite.models.adapter import adapter_params
        return adapter_params(shape.layers, shape.hidden, w.adapter_length)
    if w.train_type == "boft":
        return shape.boft_params(*w.boft_block, targets=w.lora_targets)
    if w.train_type == "bone":
        return shape.miss_params(w.bone_rank, w.lora_targets)
    if w.train_type == "adalora":
        return (shape.lora_params(w.adalora_init_r, w.lora_targets)
                + sum(w.adalora_init_r * lin.count for lin in shape.linears
                      if "all-linear" in w.lora_targets or lin.name in w.lora_targets))
    return shape.lora_params(w.lora_rank, w.lora_targets)


def _state_bytes_per_param(w: Any, family: str) -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes per *trainable* parameter under a memory family: what the
    backend holds (measured from the tensors: TorchEngine/DeepSpeedEngine.state_bytes)."""
    zero = family.startswith("zero")
    if not w.mixed:
        if zero:
            # DeepSpeed's ZeRO optimizer keeps its own fp32 flat partition of the weights even when
            # they are fp32 already (measured: 4 + 8 bytes per trainable param, sharded).
            return 4, 4, 12
        return 4, 4, 8                     # fp32 weights, fp32 grads, AdamW exp_avg + exp_avg_sq
    e = w.elem
    if zero:
        # DeepSpeed casts the module to 16-bit and keeps the master partition in its optimizer: fp32
        # master + m + v (ZeRO paper, 12), or with --pure-bf16 (bf16_master_weights_and_grads,
        # bf16_optimizer_states) a bf16 "master" + bf16 m + v (measured: 6 bytes).
        return (e, e, 3 * e) if w.pure_bf16 else (e, e, 12)
    if w.master_weights or (w.peft and family != "fsdp1"):
        # The torch backends' fp32 master weights: the trainable parameters themselves are fp32, FSDP
        # reduce-scatters their gradients in fp32 (reduce_dtype) and keeps them fp32, DDP's autocast
        # leaves fp32 gradients; AdamW's m and v follow the parameter. peft keeps adapters fp32 under a
        # 16-bit base (autocast_adapter_dtype) under --pure-bf16 too, except fsdp1 (one dtype per unit).
        return 4, 4, 8
    return e, e, 2 * e                     # --pure-bf16: bf16 params, grads, m and v


__all__ = ["quantized_bytes", "trainable_params"]
