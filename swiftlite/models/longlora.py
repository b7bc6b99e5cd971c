"""--train_type longlora: LongLoRA (Chen et al., 2023, "LongLoRA: Efficient Fine-tuning of Long-Context
Large Language Models"), as ms-swift trains it with its peft backend (swift/pipelines/train/tuner.py and
swift/tuners/longlora/llama.py, ms-swift 3602360a): peft's LoRA, built from the same options as
--train_type lora, and shifted sparse attention (S2-Attn) in training.

S2-Attn, while a module is in training mode: the sequence is cut into groups of G = 0.25 x its length
(ms-swift's fixed group_size_ratio) and each token attends causally within its group only; half of the
heads see the groups shifted by G/2 (their tokens rolled by -G/2 before, and back after), so information
flows between neighbouring groups. In eval mode (validation, inference, the exported model) attention is
the model's own, over the whole sequence: LongLoRA trains with S2-Attn and runs with full attention.

The sequence length that sets G is the run's --max-length, as ms-swift's, which pads every batch to it
(its collator's padding_to for longlora). Here the batch is not padded: the queries, keys and values are
padded with zeros up to --max-length inside the attention (a multiple of 4 above it when not one). The
tokens are the same and grouped the same; where ms-swift's batch carries pad tokens through the model,
this attention has zeros, which only the first G/2 tokens' shifted heads can see (the roll wraps them
behind the end of the sequence, as in ms-swift and the paper's code). Every key is repeated to the query
heads first (grouped-query attention), as ms-swift's implementation does.

ms-swift patches LLaMA's attention class only; here the function is registered with transformers'
AttentionInterface and selected for the model (model.set_attn_implementation), so any model whose
attention layers call transformers' attention functions takes it. Rows must be separate batch entries:
packing and padding-free batches are refused with longlora (models/loading.batch_form).
"""

from __future__ import annotations

from typing import Any

#: the attention function's name in transformers' AttentionInterface
NAME = "swiftlite_longlora_s2"
#: ms-swift's group_size_ratio (fixed at 0.25 by its prepare_adapter)
GROUP_RATIO = 0.25


def _padded_length(length: int, max_length: int) -> int:
    n = max(length, max_length)
    return n + (-n) % 4          # G = n / 4 must divide n (ms-swift raises when it does not)


def _shift(x: Any, by: int) -> Any:
    """The second half of the heads (dim 1) rolled by `by` along the sequence (dim 2)."""
    import torch
    half = x.shape[1] // 2
    return torch.cat([x[:, :half], x[:, half:].roll(by, dims=2)], dim=1)


def s2_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                 scaling: float | None = None, *, max_length: int, base: str, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention-function signature: query (batch, heads, seq, dim), key and value
    (batch, kv heads, seq, dim) -> (output (batch, seq, heads, dim), no weights)."""
    import torch.nn.functional as F
    if not module.training:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, **kwargs)
    b, h, n, d = query.shape
    if key.shape[1] != h:
        rep = h // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    p = _padded_length(n, max_length)
    g = int(p * GROUP_RATIO)
    q, k, v = (F.pad(t, (0, 0, 0, p - n)) if p > n else t for t in (query, key, value))
    q, k, v = (_shift(t, -(g // 2)).reshape(b, h, p // g, g, d).transpose(1, 2).reshape(b * (p // g), h, g, d)
               for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout)
    out = out.reshape(b, p // g, h, g, d).transpose(1, 2).reshape(b, h, p, d)
    out = _shift(out, g // 2)[:, :, :n]
    return out.transpose(1, 2).contiguous(), None


def install(model: Any, max_length: int) -> str:
    """S2-Attn for `model`'s attention layers in training mode; returns the attention they use
    otherwise (the model's own: sdpa, eager, flash_attention_2, ...), whose mask the model keeps
    building (eager needs its causal mask; sdpa's lets padded rows be skipped)."""
    from functools import partial

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from swiftlite.errors import UserError
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model   # peft: the CausalLM
    base = inner.config._attn_implementation or "sdpa"
    if base == NAME:    # a model object set up before keeps its first setting
        return AttentionInterface._global_mapping[NAME].keywords["base"]
    AttentionInterface.register(NAME, partial(s2_attention, max_length=max_length, base=base))
    if base in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS[base])
    inner.set_attn_implementation(NAME)
    if inner.config._attn_implementation != NAME:
        raise UserError(f"--train_type longlora: {type(inner).__name__}'s attention does not go through transformers' "
                        "attention functions, so S2-Attn cannot replace it; use --train_type lora")
    return base


def batch_form(cfg: Any) -> Any:
    """Padded batches: S2-Attn groups the positions of one row, which packed rows would share."""
    from swiftlite.data.collate import BatchForm
    from swiftlite.errors import UserError
    d = cfg.data
    if d.packing or d.padding_free:
        flag = "--packing" if d.packing else "--padding_free true"
        raise UserError(f"{flag} with --train_type longlora: S2-Attn groups the positions of one row, and packed "
                        "rows would share groups; train without it (padded batches, as ms-swift's)")
    return BatchForm(False, "--train_type longlora: S2-Attn groups each row's positions", cfg.model.attn_impl)


__all__ = ["GROUP_RATIO", "NAME", "batch_form", "install", "s2_attention"]
