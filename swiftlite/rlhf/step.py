"""One preference optimizer step, with sft's contract (train/step.py, docs/design.md "Numerics").

A sample is a pair; each global batch is `per-device x world x accumulation` pairs, the same pairs in
the same step whatever the world size (data/loader.BatchPlan over pairs). A micro-batch of n pairs is
one batch of 2n sequences (the n chosen, then the n rejected: a pair never straddles two
micro-batches or ranks), padded, or with `--padding_free true` / `--packing` concatenated into one
sequence (rlhf/packing.py; under --packing a micro-batch is `per-device` packs of whole pairs and G
below is the number of pairs in the step's packs), one reference forward (no_grad) and one policy
forward + backward.

Normalisation: the objective is

    sum over the G pairs of the global batch of pair_loss / G
      + nll_weight x (sum of the chosen answers' token NLL) / (chosen target tokens of the global batch)

and each rank backpropagates its micro-batches' share scaled by world_size (the backends average
gradients over ranks), so the averaged gradient is the gradient of that global objective for any world
size or accumulation; the logged loss and metrics are all-reduced sums over the global batch divided by
G (TRL's names: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected; nll_loss where it is part of the loss; ORPO's log_odds_ratio and log_odds_chosen).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from swiftlite.data.loader import select
from swiftlite.distributed import all_reduce_sum
from swiftlite.rlhf.data import collate_pairs
from swiftlite.rlhf.loss import Method, method_of, pair_terms
from swiftlite.rlhf.reference import sequence_logps
from swiftlite.metrics import StepStats


@dataclass
class PairBatches:
    """The tokenized pairs, the step-indexed order over them, the method and (setup) the reference."""
    rows: list[dict]
    plan: Any                         # data.loader.BatchPlan over pairs
    pad_id: int
    world: Any
    method: Method
    chosen_targets: list[int] = field(default_factory=list)   # target tokens of each pair's chosen answer
    reference: Any = None             # rlhf/reference.py (None: ORPO, SimPO)
    form: Any = None                  # data.collate.BatchForm (rlhf/packing.pair_form); None = padded

    @property
    def padding_free(self) -> bool:
        return bool(self.form is not None and self.form.padding_free)

    def global_chosen_targets(self, step: int) -> int:
        return sum(self.chosen_targets[i] for mb in self.plan.all_micro_batches(step) for i in mb)

    def global_pairs(self, step: int) -> int:
        """Pairs in global batch `step`: the plan's global batch, or under --packing those of its packs."""
        return sum(len(mb) for mb in self.plan.all_micro_batches(step))


def pair_batches(cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> PairBatches:
    from swiftlite.rlhf.packing import pair_form
    return PairBatches(train.rows, plan, tokenizer.pad_token_id, world, method_of(cfg),
                       [train.targets(i) for i in range(len(train.rows))], form=pair_form(cfg))


def pair_forward(engine: Any, batches: Any, rows: list[dict], idx: list[int], split: str = "train"
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(per-pair loss terms, per-pair metrics, chosen answers' summed NLL) of one micro-batch."""
    world, m = batches.world, batches.method
    batch = {k: v.to(world.device) for k, v in collate_pairs(rows, batches.pad_id, batches.padding_free).items()}
    n = len(rows)
    ref = None
    if m.needs_reference:
        r = batches.reference.logps(batch, idx, split)   # before the policy forward (no_grad)
        ref = (r[:n], r[n:])
    logps, ntok = sequence_logps(engine, batch)
    terms, metrics = pair_terms(m, logps[:n], logps[n:], ntok[:n], ntok[n:], *(ref or (None, None)))
    return terms, metrics, -logps[:n].sum()


def preference_step(engine: Any, batches: PairBatches, step: int, *, data_step: int | None = None,
                    before_optimizer: Callable[[Any], None] | None = None) -> StepStats:
    """Optimizer step `step` (0-based) on the pairs of global batch `data_step` (default: `step`)."""
    world, m = batches.world, batches.method
    k = step if data_step is None else data_step
    pairs = batches.global_pairs(k)
    chosen_tokens = max(1, batches.global_chosen_targets(k)) if m.nll_weight else 1
    micro = batches.plan.micro_batches(k, world.rank)
    pair_sum, nll_sum, tokens = 0.0, 0.0, 0
    metric_sums: dict[str, float] = {}
    for i, mb in enumerate(micro):
        rows = select(batches.rows, mb)
        tokens += sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows)
        with engine.micro_batch(last=i == len(micro) - 1):
            terms, metrics, nll = pair_forward(engine, batches, rows, mb)
            objective = terms.sum() * (world.world_size / pairs)
            if m.nll_weight:
                objective = objective + nll * (m.nll_weight * world.world_size / chosen_tokens)
            engine.backward(objective)
        pair_sum += float(terms.detach().sum())
        nll_sum += float(nll.detach())
        for name, v in metrics.items():
            metric_sums[name] = metric_sums.get(name, 0.0) + float(v.sum())
    if before_optimizer is not None:
        before_optimizer(engine)
    grad_norm = engine.step()
    names = sorted(metric_sums)
    totals = all_reduce_sum([pair_sum, nll_sum, float(tokens), *[metric_sums[n] for n in names]])
    pair_total, nll_total, tokens_total = totals[:3]
    loss = pair_total / pairs + (m.nll_weight * nll_total / chosen_tokens if m.nll_weight else 0.0)
    out = {n: v / pairs for n, v in zip(names, totals[3:])}
    if m.nll_weight:
        out["nll_loss"] = nll_total / chosen_tokens
    return StepStats(step=step + 1, loss=loss, grad_norm=float(grad_norm), tokens=int(tokens_total),
                     target_tokens=pairs, metrics=out)


def evaluate_pairs(run: Any) -> dict[str, float]:
    """Validation: the pair-mean loss and metrics over every validation pair (each rank its share, every
    rank the same number of forwards; under --packing `per_device_eval_batch_size` packs a forward),
    logged as eval_loss, eval_rewards/accuracies, ..."""
    import math

    from swiftlite.rlhf.packing import units
    batches, world, val = run.batches, run.world, run.val_data
    m = batches.method
    bs = run.cfg.train.per_device_eval_batch_size
    groups = units(val)
    mine = list(range(world.rank, len(groups), world.world_size))
    rounds = math.ceil(math.ceil(len(groups) / world.world_size) / bs)
    pair_sum, nll_sum, chosen_tokens, count = 0.0, 0.0, 0, 0
    sums: dict[str, float] = {}
    run.engine.eval()
    with torch.no_grad():
        for b in range(rounds):
            idx = [p for u in mine[b * bs:(b + 1) * bs] for p in groups[u]]
            use = idx or [0]
            terms, metrics, nll = pair_forward(run.engine, batches, select(val.rows, use), use, "val")
            for name in metrics:
                sums.setdefault(name, 0.0)
            if not idx:
                continue                  # a rank that ran out joined the collectives only
            pair_sum += float(terms.sum())
            nll_sum += float(nll)
            chosen_tokens += sum(val.targets(i) for i in idx)
            count += len(idx)
            for name, v in metrics.items():
                sums[name] = sums.get(name, 0.0) + float(v.sum())
    run.engine.train()
    names = sorted(sums)
    totals = all_reduce_sum([pair_sum, nll_sum, float(chosen_tokens), float(count), *[sums.get(k, 0.0) for k in names]])
    pair_total, nll_total, tok_total, cnt = totals[:4]
    loss = pair_total / max(1.0, cnt) + (m.nll_weight * nll_total / max(1.0, tok_total) if m.nll_weight else 0.0)
    out = {"eval_loss": round(loss, 6)}
    out.update({f"eval_{k}": round(v / max(1.0, cnt), 6) for k, v in zip(names, totals[4:])})
    return out


__all__ = ["PairBatches", "evaluate_pairs", "pair_batches", "pair_forward", "preference_step"]
