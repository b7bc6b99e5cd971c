"""GRPO's entropy options, as ms-swift's GRPOTrainer has them (swift/rlhf_trainers/grpo_trainer.py
`_compute_loss_and_metrics`):

- --top_entropy_quantile q < 1 ("Beyond the 80/20 rule", arXiv 2506.01939: the high-entropy minority of tokens
  carries the learning signal): in each micro-batch, the threshold is the (1 - q) quantile of the entropies of
  its completion tokens (those the loss counts), and only tokens at or above it keep their policy term; the KL
  term and the loss's normalizer are left as they are (ms-swift multiplies the per-token policy loss by the mask
  before adding the KL). Logged: `entropy/threshold`, the mean over the step's micro-batches and processes.
- --log_entropy true: the per-completion mean entropies of the step's completions, summarised as ms-swift does
  (`entropy/mean`, `entropy/max`, `entropy/min`). The token-mean `entropy` is logged every step regardless.

The entropies are those of the training forward (the policy's distribution at --temperature), detached.
"""

from __future__ import annotations

from typing import Any

import torch


def top_entropy_mask(ent: torch.Tensor, mask: torch.Tensor, quantile: float) -> tuple[torch.Tensor | None, float]:
    """(which tokens keep their policy term, the threshold); (None, nan) when --top_entropy_quantile is 1."""
    if quantile >= 1.0:
        return None, float("nan")
    e = ent.detach().float().masked_fill(mask == 0, float("nan"))
    if bool(torch.isnan(e).all()):          # no token counted: nothing to keep (ms-swift's nan threshold)
        return torch.zeros_like(e, dtype=torch.bool), float("nan")
    thr = torch.nanquantile(e.flatten(), 1.0 - quantile)
    return e >= thr, float(thr)


class EntropyLog:
    """The step's entropy metrics of these options, gathered over the processes that score (one per
    sequence-parallel group)."""

    def __init__(self, quantile: float, per_completion: bool):
        self.quantile, self.per_completion = quantile, per_completion
        self.thresholds: list[float] = []
        self.means: list[float] = []

    def add(self, ent: torch.Tensor, mask: torch.Tensor, threshold: float) -> None:
        if self.quantile < 1.0:
            self.thresholds.append(threshold)
        if self.per_completion:
            m = mask.float()
            n = m.sum(-1)
            means = (ent.detach().float() * m).sum(-1) / n.clamp(min=1.0)
            self.means += [float(v) for v, k in zip(means, n) if k > 0]   # ms-swift's nanmean: empty rows drop

    def metrics(self, world_size: int, scores: bool) -> dict[str, float]:
        if self.quantile >= 1.0 and not self.per_completion:
            return {}
        from swiftlite.distributed import gather_objects
        parts = gather_objects((self.thresholds, self.means) if scores else ([], []), world_size)
        out: dict[str, float] = {}
        thr = [v for p in parts for v in p[0] if v == v]
        if self.quantile < 1.0:
            out["entropy/threshold"] = sum(thr) / len(thr) if thr else float("nan")
        means = [v for p in parts for v in p[1]]
        if self.per_completion and means:
            out.update({"entropy/mean": sum(means) / len(means), "entropy/max": max(means), "entropy/min": min(means)})
        self.thresholds, self.means = [], []
        return out


def entropy_log(o: Any) -> EntropyLog:
    return EntropyLog(float(getattr(o, "top_entropy_quantile", 1.0)), bool(getattr(o, "log_entropy", False)))


__all__ = ["EntropyLog", "entropy_log", "top_entropy_mask"]
