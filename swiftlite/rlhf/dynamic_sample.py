"""DAPO's dynamic sampling for GRPO (--dynamic_sample, arXiv 2503.14476; ms-swift's `_dynamic_sampling` in
swift/rlhf_trainers/grpo_trainer.py).

A group whose completions all get the same reward (std 0) has advantage 0 everywhere: it costs a round's
share of compute and gives no gradient. After a round is sampled and scored (rlhf/grpo.py), its groups with
a reward signal (the weighted reward's std > 0, ms-swift's test) are kept in order; while fewer than the
round's groups have one, up to --max_resample_times resampling attempts each draw as many prompts again
from the training set and sample and score a group for each; their groups with a signal follow. The round
is the first (round's groups) of those, in that order. When the attempts run out with fewer, the round
keeps its own groups, as ms-swift does (`dynamic_sample/kept_original` is then 1).

Every rank holds the whole round's reward table, so every rank makes the same choice with no further
communication; the chosen completions then move to the ranks whose micro-batches hold their new places
(one all-gather of their token lists, only when the choice is not the round itself). Each attempt's
prompts and completions depend on (--seed, round, attempt) alone (`resample_prompts`; the completions'
seeds: grpo.ATTEMPT_SEED_STRIDE), so a resumed run and any process count resample the same.

One difference from ms-swift: its loop checks the original round and its first max_resample_times - 1
attempts, and samples one more attempt that it never reads; here every attempt made is read.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from swiftlite.distributed import gather_objects

#: Keys of a sampled micro-batch rebuilt from the prompt (left-padded) or the completion's length.
_REBUILT = ("prompt_ids", "prompt_mask", "completion_mask", "truncated")


def resample_prompts(plan: Any, rnd: int, attempt: int) -> list[int]:
    """The prompts of resampling `attempt` (1, 2, ...) of round `rnd`: the round's number of prompts drawn
    without replacement from a permutation of the training set seeded by (seed, round, attempt) (ms-swift
    draws them from a second shuffled pass over the set); the permutation repeats where the round holds
    more prompts than the set."""
    g = torch.Generator().manual_seed((plan.seed * 1_000_003 + rnd * 104_729 + attempt * 7_919 + 17) % (2 ** 63 - 1))
    perm = torch.randperm(plan.n_samples, generator=g).tolist()
    k = plan.round_prompts
    return (perm * (k // len(perm) + 1))[:k]


def signal_groups(table: list[float], weights: list[float], num_generations: int) -> list[int]:
    """The groups (prompt positions in the round) whose weighted rewards are not all equal: ms-swift's
    nan-summed weighted reward, its Bessel std over the group > 0."""
    F = len(weights)
    rpf = torch.tensor(table, dtype=torch.float64).view(-1, F)
    rewards = (rpf * torch.tensor(weights, dtype=torch.float64)).nansum(dim=1).view(-1, num_generations)
    if num_generations < 2:
        return []
    return [g for g, ok in enumerate((rewards.std(dim=1) > 0).tolist()) if ok]


def dynamic_round(b: Any, rnd: int, prompts: list[int], got: tuple, table: list[float], mine: list[list[int]],
                  attempt: Callable[[list[int], int], tuple[tuple, list[float]]]
                  ) -> tuple[list[int], list[dict[str, torch.Tensor]] | None, list[float], dict[str, float]]:
    """(prompts, sampled micro-batches or None where the round stays as sampled, the reward table, metrics)
    of round `rnd` after dynamic sampling (module docstring). `got`: grpo._collect of the round; `table`:
    its rewards (grpo._rewards); `attempt(prompts, a)`: the same two for resampling a."""
    plan, o = b.plan, b.options
    G, n_groups, F = plan.num_generations, plan.round_prompts, len(b.rewards)
    weights = list(o.reward_weights or [1.0] * F)
    attempts = [(prompts, got, table)]
    chosen = [(0, g) for g in signal_groups(table, weights, G)]
    a = 0
    while len(chosen) < n_groups and a < o.max_resample_times:
        a += 1
        p = resample_prompts(plan, rnd, a)
        again, t = attempt(p, a)
        attempts.append((p, again, t))
        chosen += [(a, g) for g in signal_groups(t, weights, G)]
    metrics = {"dynamic_sample/resamples": float(a), "dynamic_sample/kept_original": 0.0}
    if len(chosen) < n_groups:
        metrics["dynamic_sample/kept_original"] = 1.0
        return prompts, None, table, metrics
    chosen = chosen[:n_groups]
    if chosen == [(0, g) for g in range(n_groups)]:
        return prompts, None, table, metrics
    new_prompts = [attempts[a][0][g] for a, g in chosen]
    new_table = [v for a, g in chosen for v in attempts[a][2][g * G * F:(g + 1) * G * F]]
    wanted = {(a, g) for a, g in chosen}
    records: dict[tuple[int, int], dict[str, tuple[list, torch.dtype, int]]] = {}
    for a, (_, (micro, *_), _) in enumerate(attempts):
        for key, t in micro.items():
            for j, c in enumerate(key):
                if (a, c // G) in wanted:
                    records[(a, c)] = _record(t, j)
    if b.world.world_size > 1:   # a chosen completion's new place may be on another rank
        records = {k: v for part in gather_objects(records, b.world.world_size) for k, v in part.items()}
    sampled = []
    for mb in mine:
        rows = []
        for c in mb:
            a, g = chosen[c // G]
            rows.append(records[(a, g * G + c % G)])
        sampled.append(_layout([b.rows[new_prompts[c // G]]["input_ids"] for c in mb], rows, b.pad_id,
                               b.world.device))
    return new_prompts, sampled, new_table, metrics


def _record(t: dict[str, torch.Tensor], j: int) -> dict[str, tuple[list, torch.dtype, int]]:
    """Row j of a sampled micro-batch as lists: its completion-wide tensors up to the completion's length, and
    its per-completion values (a [rows] tensor: --use_gym_env's reward, the turns taken) as one-item lists."""
    n = int(t["completion_mask"][j].sum())
    return {k: ((v[j, :n] if v.dim() > 1 else v[j:j + 1]).tolist(), v.dtype, v.dim())
            for k, v in t.items() if k not in _REBUILT}


def _layout(prompts: list[list[int]], rows: list[dict], pad_id: int, device: Any) -> dict[str, torch.Tensor]:
    """A sampled micro-batch from prompt token lists and `_record`s, laid out as generate.sample lays one
    out: prompts left-padded, completions right-padded (ids with pad_id, float values with nan, the rest 0)
    with the mask 1 over each completion's length."""
    from swiftlite.rlhf.generate import left_padded
    out = dict(zip(("prompt_ids", "prompt_mask"), left_padded(prompts, pad_id)))
    n = max(1, max(len(r["completion_ids"][0]) for r in rows))
    out["completion_mask"] = torch.zeros((len(rows), n), dtype=torch.long)
    for k, (_, dtype, dim) in rows[0].items():
        if dim == 1:     # one value per completion
            out[k] = torch.tensor([r[k][0][0] for r in rows], dtype=dtype)
            continue
        fill = pad_id if k == "completion_ids" else (float("nan") if dtype.is_floating_point else 0)
        out[k] = torch.full((len(rows), n), fill, dtype=dtype)
        for i, r in enumerate(rows):
            vals = r[k][0]
            out[k][i, :len(vals)] = torch.tensor(vals, dtype=dtype)
    for i, r in enumerate(rows):
        out["completion_mask"][i, :len(r["completion_ids"][0])] = 1
    return {k: v.to(device) for k, v in out.items()}


__all__ = ["dynamic_round", "resample_prompts", "signal_groups"]
