"""Preference objectives from per-sequence summed log-probs (fp32), as TRL computes them.

For a pair with policy log-probs pc, pr (summed over the answer tokens), their token counts nc, nr and
(DPO) the reference's rc, rr:

- DPO (TRL DPOTrainer; ms-swift `--rlhf_type dpo`): d = (pc - rc) - (pr - rr);
  sigmoid: -(1 - ls) log sigmoid(beta d) - ls log sigmoid(-beta d) (conservative DPO; ls = 0: DPO);
  hinge: relu(1 - beta d);
  ipo: ((pc - rc)/nc - (pr - rr)/nr - 1/(2 beta))^2 (TRL's per-token mean log-ratios).
  rewards = beta (pc - rc), beta (pr - rr); `--rpo_alpha` adds alpha x the chosen answers' NLL.
- ORPO (TRL ORPOTrainer): on mean log-probs ac = pc/nc, ar = pr/nr,
  log_odds = (ac - ar) - (log(1 - e^ac) - log(1 - e^ar)); pair loss -beta log sigmoid(log_odds), plus
  the chosen answers' NLL (weight 1); rewards = beta ac, beta ar.
- SimPO (TRL CPOTrainer, loss_type simpo): z = ac - ar - gamma/beta;
  -(1 - ls) log sigmoid(beta z) - ls log sigmoid(-beta z), plus cpo_alpha x the chosen NLL;
  rewards = beta ac, beta ar.
- CPO (TRL CPOTrainer, loss_type sigmoid; ms-swift `--rlhf_type cpo`): SimPO's sibling on the summed
  log-probs, no reference: -(1 - ls) log sigmoid(beta (pc - pr)) - ls log sigmoid(-beta (pc - pr)),
  plus cpo_alpha x the chosen NLL; rewards = beta pc, beta pr.

Normalisation (docs/design.md, Numerics, applied by rlhf/step.py): the pair terms are a mean over the
pairs of the global batch, the NLL term a mean over the chosen answers' target tokens of the global
batch (TRL's token-mean cross-entropy of the chosen half). This module returns the per-pair terms and
the NLL weight; it does no reduction over pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

#: The metrics every step logs (TRL's names), each a mean over the pairs of the global batch.
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class Method:
    """What --rlhf_type and its options resolve to (defaults as ms-swift's)."""
    kind: str                 # dpo | orpo | simpo | cpo
    beta: float
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    nll_weight: float = 0.0   # rpo_alpha (dpo), 1 (orpo), cpo_alpha (simpo, cpo)
    simpo_gamma: float = 1.0

    @property
    def needs_reference(self) -> bool:
        return self.kind == "dpo"


def method_of(cfg: Any) -> Method:
    r = cfg.rlhf
    if r.rlhf_type == "dpo":
        return Method("dpo", 0.1 if r.beta is None else r.beta, r.loss_type or "sigmoid", r.label_smoothing,
                      r.rpo_alpha or 0.0)
    if r.rlhf_type == "orpo":
        return Method("orpo", 0.1 if r.beta is None else r.beta, nll_weight=1.0)
    if r.rlhf_type == "cpo":
        return Method("cpo", 0.1 if r.beta is None else r.beta, label_smoothing=r.label_smoothing,
                      nll_weight=r.cpo_alpha)
    return Method("simpo", 2.0 if r.beta is None else r.beta, label_smoothing=r.label_smoothing,
                  nll_weight=r.cpo_alpha, simpo_gamma=r.simpo_gamma)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, stable on both sides of -ln 2 (TRL's log1mexp)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _smoothed_sigmoid(z: torch.Tensor, beta: float, ls: float) -> torch.Tensor:
    return -F.logsigmoid(beta * z) * (1 - ls) - F.logsigmoid(-beta * z) * ls


def pair_terms(m: Method, pc: torch.Tensor, pr: torch.Tensor, nc: torch.Tensor, nr: torch.Tensor,
               rc: torch.Tensor | None = None, rr: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair loss terms [n] (with autograd) and per-pair metrics [n] (detached), TRL's definitions."""
    pc, pr = pc.float(), pr.float()
    nc, nr = nc.float().clamp(min=1), nr.float().clamp(min=1)
    extra: dict[str, torch.Tensor] = {}
    if m.kind == "dpo":
        cl, rl = pc - rc.float(), pr - rr.float()
        d = cl - rl
        if m.loss_type == "sigmoid":
            loss = _smoothed_sigmoid(d, m.beta, m.label_smoothing)
        elif m.loss_type == "hinge":
            loss = torch.relu(1 - m.beta * d)
        elif m.loss_type == "ipo":
            loss = (cl / nc - rl / nr - 1 / (2 * m.beta)) ** 2
        else:
            raise ValueError(f"unknown DPO loss type {m.loss_type!r}")
        rew_c, rew_r = m.beta * cl, m.beta * rl
        shown_c, shown_r = pc, pr
    elif m.kind == "cpo":     # summed log-probs (TRL's CPOTrainer averages only for ipo/simpo)
        loss = _smoothed_sigmoid(pc - pr, m.beta, m.label_smoothing)
        rew_c, rew_r = m.beta * pc, m.beta * pr
        shown_c, shown_r = pc, pr
    else:
        ac, ar = pc / nc, pr / nr
        if m.kind == "orpo":
            log_odds = (ac - ar) - (_log1mexp(ac) - _log1mexp(ar))
            ratio = F.logsigmoid(log_odds)
            loss = -m.beta * ratio
            extra = {"log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()}
        elif m.kind == "simpo":
            loss = _smoothed_sigmoid(ac - ar - m.simpo_gamma / m.beta, m.beta, m.label_smoothing)
        else:
            raise ValueError(f"unknown preference method {m.kind!r}")
        rew_c, rew_r = m.beta * ac, m.beta * ar
        shown_c, shown_r = ac, ar
    rew_c, rew_r = rew_c.detach(), rew_r.detach()
    metrics = {"rewards/chosen": rew_c, "rewards/rejected": rew_r,
               "rewards/accuracies": (rew_c > rew_r).float(), "rewards/margins": rew_c - rew_r,
               "logps/chosen": shown_c.detach(), "logps/rejected": shown_r.detach(), **extra}
    return loss, metrics


__all__ = ["Method", "PAIR_METRICS", "method_of", "pair_terms"]
