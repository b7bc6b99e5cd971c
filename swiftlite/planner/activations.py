"""Activation memory per GPU: the decoder layers' saved tensors and the loss's logits, by
`--loss-impl` (docs/estimate.md, "Activations" and "Logits"). Split from memory.py (model states,
buffers, communication), which adds these to each backend's estimate."""

from __future__ import annotations

import math
from typing import Any

from swiftlite.parallel.loss import chunk_tokens_for
from swiftlite.planner.shape import ModelShape
from swiftlite.planner.transients import AUTOCAST_LAYER_EXTRA_H

# `w` below is a planner.memory.Workload (not imported: memory.py imports this module).

#: Logits memory of `--loss-impl plain`, bytes per (token x vocab entry). The loss upcasts logits to
#: fp32; cross-entropy saves its fp32 log-probabilities (4 bytes), and at the start of backward the
#: gradient arriving from the loss and the gradient of the logits exist next to them (4 + 4): the peak
#: is 12 bytes. (The steady state between forward and backward is 4; a run OOMs at the peak.)
LOGIT_BYTES = 12
#: GKD (rlhf/gkd.py): the student's logits and the teacher's (the compute dtype, <= 4 bytes each), the
#: tensors rlhf/gkd_loss.jsd_sum keeps for backward (32 bytes per entry, counted with autograd's
#: saved-tensor hooks on a [256, 4096] JSD at beta 0.5) and the backward's two fp32 gradients (4 + 4).
GKD_LOGIT_BYTES = 48
#: `--loss-impl chunked` (parallel/chunked_ce.py) holds one chunk's fp32 logits, turned in place into
#: their gradient: 4 bytes per (chunk row x vocab entry), + the 16-bit matmul output / gradient copy
#: (e bytes) when the compute dtype is 16-bit. Rows per chunk: parallel/loss.py `chunk_tokens_for`.
CHUNK_LOGIT_BYTES = 4



def activation_bytes(shape: ModelShape, w: Any, autocast: bool = False) -> int:
    """Activation memory per GPU at the peak of one micro-batch (see docs/estimate.md).

    Per token and decoder layer, a Llama-style block keeps (in the compute dtype): both norm inputs
    and outputs (4h), q and the attention output (2 * heads * head_dim), k and v (2 * kv * head_dim),
    and the SwiGLU gate, up, act and product (4i): Korthikanti et al.'s 34sbh adapted to RMSNorm,
    GQA, SwiGLU and no dropout. 16-bit RMSNorm upcasts its input to fp32 (+2 * 4h bytes).
    Eager attention adds the softmax matrix (heads * s^2, fp32 + a 16-bit copy); SDPA/flash keeps
    only its fp32 logsumexp (heads * s). LoRA dropout keeps a dropped-out copy of each adapted input
    plus its mask (1 byte on CUDA; on CPU, torch's dropout multiplies by a noise tensor of the
    input's dtype and keeps that). A Houlsby adapter (--train_type adapter) keeps the MLP's output and its
    bottleneck's input and output (h + 2 * --adapter_length). With checkpointing, each layer keeps only its input (s * b * h) and one
    layer is recomputed at a time. The loss adds `logit_bytes` (its --loss-impl). Under
    --sequence_parallel_size N every per-token term counts a rank's 1/N of the tokens (`rank_tokens`), and
    k and v repeated to the query heads where N does not divide the kv heads add their copies.
    `autocast` (single/ddp over fp32 master weights, planner/transients.py): the residual stream
    stays fp32, so each checkpointed layer input is 4 bytes per element, the per-op input casts add
    AUTOCAST_LAYER_EXTRA_H * h bytes per token and layer, and the loss gathers fp32 hidden states.
    """
    e = w.elem
    s, b = w.max_length, w.micro_batch
    tokens = rank_tokens(w)
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_token = (4 * shape.hidden + 2 * q_dim + 2 * kv_dim + 4 * shape.intermediate) * e
    sp = getattr(w, "sequence_parallel", 1)
    if sp > 1 and shape.kv_heads % sp:   # Ulysses repeats k and v to the query heads before the all-to-all
        per_token += 2 * (shape.heads - shape.kv_heads) * shape.head_dim * e
    if e < 4:
        per_token += 2 * 4 * shape.hidden
    if autocast:
        per_token += AUTOCAST_LAYER_EXTRA_H * shape.hidden
    if w.peft and w.lora_dropout > 0:
        per_token += shape.lora_input_features(w.lora_targets) * (e + (e if w.cpu else 1))
    if w.train_type == "adapter":   # the MLP's output (linear1's input), linear1's output (act's input), act's
        per_token += (shape.hidden + 2 * w.adapter_length) * e   # output (linear2's input); the sum saves none
    layer = tokens * per_token
    if w.flash_attention:
        layer += shape.heads * tokens * 4
    else:   # (Ulysses: heads / sp of the whole sequence's matrix per rank)
        layer += shape.heads * s * s * b * (4 + e) // sp
    if w.gradient_checkpointing:
        layers = shape.layers * tokens * shape.hidden * (4 if autocast else e) + layer
    else:
        layers = shape.layers * layer
    return layers + logit_bytes(shape, w, hidden_elem=4 if autocast else None)


def rank_tokens(w: Any) -> int:
    """The tokens of one micro-batch a rank computes: padding-free batches their real tokens, else the
    padded bound (max_length x micro_batch); under --sequence_parallel_size N, 1/N of them (rounded up),
    which is where Ulysses saves memory: every activation but attention's inner all-to-all is per token."""
    tokens = w.tokens_per_micro_batch or w.max_length * w.micro_batch
    sp = getattr(w, "sequence_parallel", 1)
    return -(-tokens // sp)


def logit_bytes(shape: ModelShape, w: Any, hidden_elem: int | None = None) -> int:
    """Memory of the loss at its peak, per micro-batch, by --loss-impl (docs/estimate.md, "Logits").

    plain:   every token's logits, LOGIT_BYTES per (token x vocab entry).
    chunked: one chunk of rows at a time (CHUNK_LOGIT_BYTES + e for 16-bit per entry), the hidden
             states gathered at the target positions and their gradient (2 * tokens * h * e; every
             token counted as a target: an upper bound), and for a 16-bit full fine-tune the fp32
             accumulator of lm_head's gradient (4 * vocab * h, beside the 16-bit gradient the states
             count; in fp32 the accumulator becomes that gradient).
    liger:   Liger's chunks of next_pow2(tokens / ceil(vocab / h)) rows in the compute dtype, with the
             same gathered hidden states and gradient.
    cce:     logits stay in on-chip blocks: the gathered hidden states and their gradient only.
    `hidden_elem`: bytes per hidden-state element when not the compute dtype's (fp32 under autocast).
    """
    e = w.elem
    tokens = rank_tokens(w)
    v, h = shape.vocab, shape.hidden
    if w.loss_impl == "plain":
        return tokens * v * (w.plain_logit_bytes or LOGIT_BYTES)
    hidden = 2 * tokens * h * (hidden_elem or e)
    if w.loss_impl == "cce":
        return hidden
    if w.loss_impl == "liger":
        rows = min(tokens, 1 << max(0, math.ceil(tokens / math.ceil(v / h)) - 1).bit_length())
        return hidden + rows * v * e
    rows = min(tokens, chunk_tokens_for(v, w.loss_chunk_tokens))
    chunk = rows * v * (CHUNK_LOGIT_BYTES + (e if e < 4 else 0))
    accumulator = 4 * v * h if (w.train_type == "full" and e < 4) else 0
    return hidden + chunk + accumulator
