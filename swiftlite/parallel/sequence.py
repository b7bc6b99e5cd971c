"""--sequence_parallel_size N: Ulysses sequence parallelism (Jacobs et al., 2023, "DeepSpeed Ulysses"),
ms-swift's `--sequence_parallel_size` for sft and pt (swift/sequence_parallel/ulysses.py, 3602360a).

The world is cut into groups of N consecutive ranks. The ranks of one group train on the same rows (the
data is sharded over world / N data-parallel ranks: data rank = rank // N), and each holds 1/N of every
sequence: the micro-batch is padded to a multiple of N tokens and rank i of the group keeps the i-th
slice of the positions. Everything but attention is per token, so it runs on the slice as it is; the
rotary embedding gets the slice's true positions (its position_ids). In each attention layer, one
all-to-all turns (all heads, 1/N of the positions) into (1/N of the heads, all positions), attention runs
on the whole sequence for those heads, and a second all-to-all turns it back. Both all-to-alls are
differentiable (torch.distributed.nn.functional.all_to_all_single), so backward sends each position's
gradient back to the rank that holds it, and recomputation under gradient checkpointing repeats them.

Attention over the whole sequence needs the whole sequence's mask, which no slice has: the step hands
it over (`SequenceParallel.shard` keeps the full position_ids of a padding-free batch, the full
attention mask of a padded one) and the attention function reads it while the micro-batch runs
(`active`). Within it: flash-attention (--attn_impl flash_attn) gets the full position_ids (packed rows
as varlen sequences) or the full 2-D mask through transformers' own function; every other
implementation runs torch's scaled_dot_product_attention with the boolean mask built here (causal, and
within a row: a padding-free batch's rows restart their position_ids at 0).

The loss: next-token targets are shifted on the whole sequence before it is cut (a slice's last position
predicts the next slice's first token), so each slice carries `shift_labels` aligned with its positions
(parallel/loss.py reads them unshifted). Each target is in exactly one slice. Every rank's summed loss
is scaled by world_size / the global batch's targets, as without sequence parallelism (train/step.py):
the backends average gradients over all world_size ranks, and the gradients of one group's ranks add up
to the gradient of its rows' loss, so the averaged gradient is that of the global token-mean loss.

Outside a sharded micro-batch (validation, generation) the attention function is the model's own
implementation on the whole sequence: each rank evaluates its share of the validation rows whole.
Import-light: torch is imported inside the functions.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from swiftlite.data.tokenize import IGNORE
from swiftlite.errors import UserError

#: the attention function's name in transformers' AttentionInterface
NAME = "swiftlite_ulysses"
#: the micro-batch being run: (SequenceParallel, full position_ids or None, full attention mask or None,
#: the sdpa mask once built: every layer, and its recomputation, shares one tensor)
_ACTIVE: list[tuple[Any, Any, Any, dict]] = []


def data_world(rank: int, world_size: int, size: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of `rank` with groups of `size` consecutive ranks."""
    size = max(1, int(size or 1))
    return rank // size, max(1, world_size // size)


def problem(size: int, world_size: int | None, model_config: Any = None) -> str | None:
    """Why --sequence_parallel_size `size` cannot run on `world_size` processes with this model, or None."""
    if size <= 1:
        return None
    if world_size is not None and world_size % size:
        return (f"--sequence_parallel_size {size} does not divide the {world_size} processes: each group of {size} "
                "ranks shares its rows; use a divisor of the world size")
    if model_config is not None:
        heads = getattr(model_config, "num_attention_heads", None)
        if heads and heads % size:
            return (f"--sequence_parallel_size {size}: the model's {heads} attention heads are not divisible by {size} "
                    "(each rank of a group attends with 1/N of the heads); use a divisor of the head count")
    return None


@dataclass
class SequenceParallel:
    size: int
    rank: int          # within the group
    group: Any         # the torch.distributed group of this rank's N ranks
    pad_id: int = 0

    def shard(self, batch: dict) -> tuple[dict, Any, Any]:
        """(this rank's slice of a micro-batch, the full position_ids, the full attention mask)."""
        import torch
        import torch.nn.functional as F
        ids = batch["input_ids"]
        b, n = ids.shape
        pad = (-n) % self.size
        labels = batch["labels"]
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
        mask = batch.get("attention_mask")
        pos = batch.get("position_ids")
        if pos is None:   # a padded batch (right padding): positions 0.. of each row
            pos = torch.arange(n, device=ids.device).unsqueeze(0).expand(b, n)
        full = {"input_ids": F.pad(ids, (0, pad), value=self.pad_id), "shift_labels": F.pad(shifted, (0, pad), value=IGNORE),
                # a pad position at 0 is a row of its own: it sees itself only (padding-free form)
                "position_ids": F.pad(pos, (0, pad), value=0)}
        if "loss_scale" in batch:
            w = batch["loss_scale"]
            full["loss_scale"] = F.pad(torch.cat([w[:, 1:], torch.zeros_like(w[:, :1])], dim=1), (0, pad))
        if mask is not None:
            mask = F.pad(mask, (0, pad), value=0)
        k = (n + pad) // self.size
        local = {key: v[:, self.rank * k:(self.rank + 1) * k].contiguous() for key, v in full.items()}
        return local, (None if mask is not None else full["position_ids"]), mask

    @contextmanager
    def active(self, position_ids: Any, attention_mask: Any):
        """The micro-batch's forward and backward (recomputation included) run inside this."""
        _ACTIVE.append((self, position_ids, attention_mask, {}))   # {}: the mask, built once for all layers
        try:
            yield
        finally:
            _ACTIVE.pop()


def build(world: Any, size: int, pad_id: int = 0) -> SequenceParallel | None:
    """This rank's SequenceParallel (every rank creates every group, as torch.distributed requires)."""
    if size <= 1:
        return None
    why = problem(size, world.world_size)
    if why:
        raise UserError(why)
    import torch.distributed as dist
    mine = None
    for g in range(world.world_size // size):
        ranks = list(range(g * size, (g + 1) * size))
        group = dist.new_group(ranks)
        if world.rank in ranks:
            mine = group
    return SequenceParallel(size, world.rank % size, mine, pad_id if pad_id is not None else 0)


def _to_heads(x: Any, sp: SequenceParallel) -> Any:
    """(batch, heads, n/N, dim) on each rank -> (batch, heads/N, n, dim): rank i gets the i-th head group."""
    import torch
    from torch.distributed.nn.functional import all_to_all_single
    b, h, s, d = x.shape
    n = sp.size
    send = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous()
    got = all_to_all_single(torch.empty_like(send), send, group=sp.group)      # [source rank = slice, b, h/N, s, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _to_positions(x: Any, sp: SequenceParallel) -> Any:
    """The inverse: (batch, heads/N, n, dim) -> (batch, heads, n/N, dim)."""
    import torch
    from torch.distributed.nn.functional import all_to_all_single
    b, h, s, d = x.shape
    n = sp.size
    send = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()   # [slice, b, h/N, s/N, d]
    got = all_to_all_single(torch.empty_like(send), send, group=sp.group)      # [source rank = head group, ...]
    return got.permute(1, 0, 2, 3, 4).reshape(b, h * n, s // n, d)


def gather_positions(x: Any, sp: SequenceParallel) -> Any:
    """(batch, n/N, ...) slices of the group's ranks -> the whole (batch, n, ...) on every rank, differentiable:
    the backward sums the group's gradients of the whole and hands each rank its slice's (torch's own
    differentiable all_gather emulates that with gloo scatters addressed by group rank as if global,
    which fails for every group but the first)."""
    return _gather_function().apply(x, sp.group, sp.size, sp.rank)


@lru_cache(maxsize=None)
def _gather_function() -> Any:
    """The autograd Function, made on first use (this module imports no torch at import time)."""
    import torch
    import torch.distributed as dist

    class GatherPositions(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, group: Any, size: int, rank: int) -> Any:
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x.contiguous(), group=group)
            ctx.group, ctx.size, ctx.rank = group, size, rank
            return torch.cat(parts, dim=1)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
            k = grad.shape[1] // ctx.size
            return grad[:, ctx.rank * k:(ctx.rank + 1) * k], None, None, None
    return GatherPositions


def full_mask(position_ids: Any, attention_mask: Any) -> Any:
    """The boolean (batch or 1, 1, n, n) mask of the whole sequence: causal, within a row (rows of a
    padding-free batch restart their positions at 0), and only at real tokens of a padded one. None
    when that is the plain causal mask (one unpadded row per sequence): sdpa's is_causal needs no n x n
    tensor."""
    import torch
    if attention_mask is not None and bool(attention_mask.bool().all()):
        attention_mask = None
        if position_ids is None:
            return None
    if position_ids is not None and attention_mask is None and not bool((position_ids[:, 1:] == 0).any()):
        return None
    if attention_mask is not None:
        n = attention_mask.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=attention_mask.device).tril()
        return (causal[None] & attention_mask.bool()[:, None, :])[:, None]
    n = position_ids.shape[1]
    row = (position_ids == 0).cumsum(dim=1)                                      # [b, n] row index
    causal = torch.ones(n, n, dtype=torch.bool, device=position_ids.device).tril()
    return (causal[None] & (row[:, :, None] == row[:, None, :]))[:, None]


def ulysses_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                      scaling: float | None = None, *, base: str, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention-function signature: query (batch, heads, n/N, dim), key and value
    (batch, kv heads, n/N, dim) -> (output (batch, n/N, heads, dim), no weights)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if not _ACTIVE:   # validation, generation: the model's own attention on the whole sequence
        return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, **kwargs)
    import torch.nn.functional as F
    sp, position_ids, mask2d, built = _ACTIVE[-1]
    if getattr(module, "sliding_window", None):
        raise UserError("--sequence_parallel_size with a sliding-window attention layer: not supported; train "
                        "without sequence parallelism")
    h, kv = query.shape[1], key.shape[1]
    if kv % sp.size:   # fewer key/value heads than ranks: each rank gets its query heads' copies
        key, value = key.repeat_interleave(h // kv, dim=1), value.repeat_interleave(h // kv, dim=1)
    q, k, v = (_to_heads(t, sp) for t in (query, key, value))
    p = dropout if module.training else 0.0
    if base.startswith("flash"):
        kwargs.pop("position_ids", None)
        out, _ = ALL_ATTENTION_FUNCTIONS[base](module, q, k, v, mask2d, dropout=p, scaling=scaling,
                                               **({"position_ids": position_ids} if position_ids is not None else {}),
                                               **kwargs)
        out = out.transpose(1, 2)                                                 # back to (b, h/N, n, d)
    else:
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if "mask" not in built:   # one additive mask for every layer (sdpa keeps its mask for backward)
            import torch
            keep = full_mask(position_ids, mask2d)
            built["mask"] = None if keep is None else torch.zeros(keep.shape, dtype=q.dtype, device=q.device) \
                .masked_fill_(~keep, torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=built["mask"], is_causal=built["mask"] is None,
                                             dropout_p=p, scale=scaling)
    return _to_positions(out.contiguous(), sp).transpose(1, 2).contiguous(), None


def _mask(*args: Any, base: Any, **kwargs: Any) -> Any:
    """The model's own mask outside a sharded micro-batch; inside one, none (a slice's mask would be
    wrong, and the attention builds the whole sequence's)."""
    return None if _ACTIVE else base(*args, **kwargs)


def install(model: Any) -> str:
    """Ulysses attention for `model`'s attention layers; returns the implementation it wraps (the
    model's own: sdpa, eager, flash_attention_2, ...), whose mask the model keeps building for the
    passes outside a sharded micro-batch."""
    from functools import partial

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model   # peft: the CausalLM
    base = inner.config._attn_implementation or "sdpa"
    if base == NAME:
        return AttentionInterface._global_mapping[NAME].keywords["base"]
    if base.startswith("swiftlite_"):
        raise UserError("--sequence_parallel_size with --train_type longlora: S2-Attn groups whole rows; use one")
    AttentionInterface.register(NAME, partial(ulysses_attention, base=base))
    if base in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(NAME, partial(_mask, base=ALL_MASK_ATTENTION_FUNCTIONS[base]))
    inner.set_attn_implementation(NAME)
    if inner.config._attn_implementation != NAME:
        raise UserError(f"--sequence_parallel_size: {type(inner).__name__}'s attention does not go through "
                        "transformers' attention functions, so it cannot be split by heads")
    return base


__all__ = ["NAME", "SequenceParallel", "build", "data_world", "full_mask", "gather_positions", "install", "problem",
           "ulysses_attention"]
