"""GRPO's training forward under --sequence_parallel_size N (Ulysses, parallel/sequence.py).

The ranks of a group hold the same micro-batches (the data is split over world / N ranks). The group
samples them once: each rank samples every N-th completion of each micro-batch and the group gathers
them (`split_sampling`), which gives what one process sampling them all would, since a completion's draw
depends on (seed, round, index) only (rlhf/generate.py); with --multi_turn_scheduler each rank runs the
turns of its own share. For the policy's log-probs each rank feeds 1/N of every sequence's
positions (`SequenceParallel.shard`: the next-token targets taken on the whole sequence first), gets
its slice's log-probs at the targets, and an all-gather over the group gives every rank the whole
[B, C] completion log-probs; the GRPO loss is then formed as without sequence parallelism.

Gradients: the all-gather's backward sums the group's gradients of each slice (sequence.gather_positions),
so each rank's slice gets N times the loss's gradient, and the backend's average over all world ranks
(N per group) makes it the data-parallel mean over groups, as a run of world / N processes would
have. The old and reference log-probs of a round are taken on whole sequences (no slice), outside the
sharded micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Pick:
    """Where the completion tokens' log-probs sit among the whole sequence's next-token positions."""
    length: int                     # the whole sequence's length before the group's padding
    start: int | None = None        # padded rows: position prompt_len - 1 predicts completion token 0
    index: Any = None               # padding-free: the positions predicting each row's completion tokens
    lengths: list[int] | None = None  # padding-free: each row's completion tokens


def shard(sp: Any, t: dict, padding_free: bool) -> tuple[dict, Any, Any, Pick]:
    """(this rank's slice, the whole position ids (padding-free) or None, the whole attention mask
    (padded) or None, where to pick the completion log-probs) of a round's micro-batch `t`."""
    p_ids, p_mask, c_ids, c_mask = t["prompt_ids"], t["prompt_mask"], t["completion_ids"], t["completion_mask"]
    if padding_free:
        from swiftlite.rlhf.generate import packed_layout
        ids, pos, keep, lengths = packed_layout(p_ids, p_mask, c_ids, c_mask)
        batch = {"input_ids": ids, "labels": ids, "position_ids": pos}
        pick = Pick(ids.shape[1], index=keep, lengths=lengths)
    else:
        ids = torch.cat([p_ids, c_ids], dim=1)
        attn = torch.cat([p_mask, c_mask], dim=1)
        batch = {"input_ids": ids, "labels": ids, "attention_mask": attn,
                 "position_ids": (attn.cumsum(-1) - 1).clamp(min=0)}   # as `generate` placed the tokens
        pick = Pick(ids.shape[1], start=p_ids.shape[1] - 1)
    local, positions, mask = sp.shard(batch)
    return local, positions, mask, pick


def sharded_logps(module: Any, sp: Any, local: dict, pick: Pick, completion_ids: torch.Tensor, temperature: float,
                  ctx: Any = None, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The completion tokens' log-probs [B, C] (and entropies) of `local`'s micro-batch, whole on every rank
    of the group: this rank's slice computed here, the others' gathered. Run inside `sp.active`."""
    import contextlib

    from swiftlite.parallel.sequence import gather_positions
    with ctx if ctx is not None else contextlib.nullcontext():
        out = module(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
    logits = (out.logits if hasattr(out, "logits") else out[0]).float() / temperature   # [B, s, V]
    targets = local["shift_labels"].clamp(min=0)                  # IGNORE (past the end, padding): any id
    rows, ents = [], []
    for b in range(logits.shape[0]):    # one row's [s, V] fp32 log-softmax alive at a time
        lse = torch.logsumexp(logits[b], dim=-1)
        rows.append(logits[b].gather(-1, targets[b].unsqueeze(-1)).squeeze(-1) - lse)
        if entropy:
            with torch.no_grad():
                ents.append(lse - (torch.softmax(logits[b], dim=-1) * logits[b]).sum(-1))
    whole = gather_positions(torch.stack(rows), sp)[:, :pick.length]
    ent = None
    if entropy:
        with torch.no_grad():
            ent = gather_positions(torch.stack(ents), sp)[:, :pick.length]
    return _completion(whole, pick, completion_ids), (None if ent is None else _completion(ent, pick, completion_ids))


def _completion(values: torch.Tensor, pick: Pick, completion_ids: torch.Tensor) -> torch.Tensor:
    """[B, C] of the whole sequence's per-position values at the positions predicting completion tokens
    (0 past a padding-free row's completion, as rlhf/generate.token_logps)."""
    from swiftlite.rlhf.generate import spread
    C = completion_ids.shape[1]
    if pick.index is None:
        return values[:, pick.start:pick.start + C]
    return spread(values[0, pick.index], pick.lengths, C)


def split_sampling(sp: Any, sample: Any, ids: list[list[list[int]]], seeds: list[list[int]], rows: list[list[dict]],
                   *, pad_id: int, device: Any) -> list[dict[str, torch.Tensor]]:
    """A round's micro-batches sampled once across the group, not N times: rank r of the group samples
    every N-th completion of each micro-batch from the r-th (`sample(ids, seeds, rows)`, the micro-batches
    it has a share of; every rank calls it, with an empty list where it has none, so the generators'
    collectives match), and the group all-gathers the token lists and lays every micro-batch out whole,
    as one process sampling it would (a completion's draw depends on its seed only)."""
    import torch.distributed as dist

    from swiftlite.rlhf.vllm_gen import completion_layout
    n, r = sp.size, sp.rank
    picks = [list(range(r, len(mb), n)) for mb in ids]
    keep = [m for m, p in enumerate(picks) if p]
    outs = sample([[ids[m][j] for j in picks[m]] for m in keep], [[seeds[m][j] for j in picks[m]] for m in keep],
                  [[rows[m][j] for j in picks[m]] for m in keep])
    mine = {}
    for m, t in zip(keep, outs):
        for k, j in enumerate(picks[m]):
            c = int(t["completion_mask"][k].sum())
            # the prompt as sampled (a gym scheduler's environment writes its own) and its environment reward
            mine[(m, j)] = (*(t[x][k, :c].tolist() if x in t else None
                              for x in ("completion_ids", "loss_mask", "rollout_logps")),
                            t["prompt_ids"][k][t["prompt_mask"][k].bool()].tolist(),
                            float(t["gym_reward"][k]) if "gym_reward" in t else None)
    parts: list[Any] = [None] * n
    dist.all_gather_object(parts, mine, group=sp.group)
    got = {k: v for part in parts for k, v in part.items()}
    result = []
    for m, mb in enumerate(ids):
        comps = [got[(m, j)] for j in range(len(mb))]
        # each completion whole, as its sampler's mask kept it: a multi-turn one holds end-of-turn tokens inside
        p_ids, p_mask, c_ids, c_mask = completion_layout([c[3] for c in comps], [c[0] for c in comps], pad_id=pad_id,
                                                         eos_ids=[], device=device)
        t = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": c_ids, "completion_mask": c_mask}
        width = c_ids.shape[1]
        for x, i, fill, dtype in (("loss_mask", 1, 0, torch.long), ("rollout_logps", 2, float("nan"), torch.float32)):
            if comps[0][i] is not None:
                t[x] = torch.tensor([c[i] + [fill] * (width - len(c[i])) for c in comps], dtype=dtype, device=device)
        if comps[0][4] is not None:
            t["gym_reward"] = torch.tensor([c[4] for c in comps], dtype=torch.float32, device=device)
        result.append(t)
    return result


__all__ = ["Pick", "shard", "sharded_logps", "split_sampling"]
