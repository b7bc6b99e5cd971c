"""Reward modelling (`swiftlite rlhf --rlhf_type rm`), as TRL's RewardTrainer computes it.

The model is the causal LM's config with a one-output sequence-classification head (transformers'
AutoModelForSequenceClassification, num_labels 1: `score` instead of lm_head; models/loading.py,
config/tasks.reward_model). Its reward for a sequence is the head's output at the last token that is
not the pad token (transformers' pooling; the config's pad id is the tokenizer's, as TRL sets it).

Data are rlhf/data.py's pairs (ms-swift's messages + rejected_response, TRL's chosen/rejected) with an
optional numeric `margin` column; each side is the whole conversation (prompt + answer). A pair's
loss, from the rewards r_c, r_r of its chosen and rejected sides:

    -log sigmoid(r_c - r_r - margin)  [+ center_rewards_coefficient x (r_c + r_r)^2]

(margin 0 where a row has none; the centring term is TRL's `mean((r_c + r_r)^2)` per pair), and the
step's loss is the mean over the pairs of the global batch, every rank backpropagating its share
scaled by the world size (rlhf/step.py's normalisation). Logged, with TRL's names: `accuracy` (share
of pairs with r_c > r_r), `margin` (mean r_c - r_r), `mean_reward` (mean over both sides), and
`rewards/chosen`, `rewards/rejected` (means).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from swiftlite.data.loader import select
from swiftlite.distributed import all_reduce_sum
from swiftlite.metrics import StepStats
from swiftlite.rlhf.data import collate_pairs
from swiftlite.rlhf.reference import root_module


@dataclass(frozen=True)
class RmMethod:
    center_rewards_coefficient: float | None = None
    kind: str = "rm"
    needs_reference: bool = False
    nll_weight: float = 0.0


def rm_method(cfg: Any) -> RmMethod:
    return RmMethod(cfg.rlhf.center_rewards_coefficient)


def rm_terms(m: RmMethod, rc: torch.Tensor, rr: torch.Tensor, margin: torch.Tensor | None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses [n] (with autograd) and per-pair metrics [n] (detached), TRL's definitions."""
    rc, rr = rc.float(), rr.float()
    d = rc - rr
    loss = -F.logsigmoid(d - margin.float() if margin is not None else d)
    if m.center_rewards_coefficient is not None:
        loss = loss + m.center_rewards_coefficient * (rc + rr) ** 2
    rc, rr, d = rc.detach(), rr.detach(), d.detach()
    return loss, {"accuracy": (d > 0).float(), "margin": d, "mean_reward": (rc + rr) / 2,
                  "rewards/chosen": rc, "rewards/rejected": rr}


def rewards(engine_or_module: Any, batch: dict[str, torch.Tensor], *, module: bool = False) -> torch.Tensor:
    """The reward of each row of a padded batch [rows], through the backend's root module (or a module)."""
    if module:
        out = engine_or_module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    else:
        mod, ctx = root_module(engine_or_module)
        with ctx:
            out = mod(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.float().reshape(logits.shape[0], -1)[:, 0]


@dataclass
class RewardBatches:
    rows: list[dict]
    plan: Any
    pad_id: int
    world: Any
    method: RmMethod
    reference: Any = None
    form: Any = None


def reward_batches(cfg: Any, train: Any, plan: Any, tokenizer: Any, world: Any) -> RewardBatches:
    return RewardBatches(train.rows, plan, tokenizer.pad_token_id, world, rm_method(cfg))


def _forward(engine: Any, b: Any, rows: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = {k: v.to(b.world.device) for k, v in collate_pairs(rows, b.pad_id).items()}
    n = len(rows)
    r = rewards(engine, batch)
    margin = torch.tensor([row.get("margin", 0.0) for row in rows], dtype=torch.float32, device=r.device)
    return rm_terms(b.method, r[:n], r[n:], margin)


def rm_step(engine: Any, batches: RewardBatches, step: int, *, data_step: int | None = None,
            before_optimizer: Callable[[Any], None] | None = None) -> StepStats:
    """Optimizer step `step` (0-based) on the pairs of global batch `data_step` (default: `step`)."""
    b, world = batches, batches.world
    k = step if data_step is None else data_step
    pairs = b.plan.global_batch
    micro = b.plan.micro_batches(k, world.rank)
    loss_sum, tokens = 0.0, 0
    sums: dict[str, float] = {}
    for i, mb in enumerate(micro):
        rows = select(b.rows, mb)
        tokens += sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows)
        with engine.micro_batch(last=i == len(micro) - 1):
            terms, metrics = _forward(engine, b, rows)
            engine.backward(terms.sum() * (world.world_size / pairs))
        loss_sum += float(terms.detach().sum())
        for name, v in metrics.items():
            sums[name] = sums.get(name, 0.0) + float(v.sum())
    if before_optimizer is not None:
        before_optimizer(engine)
    grad_norm = engine.step()
    names = sorted(sums)
    totals = all_reduce_sum([loss_sum, float(tokens), *[sums[n] for n in names]])
    return StepStats(step=step + 1, loss=totals[0] / pairs, grad_norm=float(grad_norm), tokens=int(totals[1]),
                     target_tokens=pairs, metrics={n: v / pairs for n, v in zip(names, totals[2:])})


def evaluate_rewards(run: Any) -> dict[str, float]:
    """Validation: the pair-mean loss and metrics over every validation pair (eval_loss, eval_accuracy, ...)."""
    b, world, val = run.batches, run.world, run.val_data
    bs = run.cfg.train.per_device_eval_batch_size
    n = len(val.rows)
    mine = list(range(world.rank, n, world.world_size))
    rounds = math.ceil(math.ceil(n / world.world_size) / bs)
    loss_sum, count, sums = 0.0, 0, {}
    run.engine.eval()
    with torch.no_grad():
        for r in range(rounds):
            idx = mine[r * bs:(r + 1) * bs]
            terms, metrics = _forward(run.engine, b, select(val.rows, idx or [0]))
            for name in metrics:
                sums.setdefault(name, 0.0)
            if not idx:
                continue          # a rank that ran out joined the collectives only
            loss_sum += float(terms.sum())
            count += len(idx)
            for name, v in metrics.items():
                sums[name] += float(v.sum())
    run.engine.train()
    names = sorted(sums)
    totals = all_reduce_sum([loss_sum, float(count), *[sums[k] for k in names]])
    cnt = max(1.0, totals[1])
    out = {"eval_loss": round(totals[0] / cnt, 6)}
    out.update({f"eval_{k}": round(v / cnt, 6) for k, v in zip(names, totals[2:])})
    return out


__all__ = ["RewardBatches", "RmMethod", "evaluate_rewards", "reward_batches", "rewards", "rm_method", "rm_step",
           "rm_terms"]
