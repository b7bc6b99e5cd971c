"""GRPO's rollout off-policy diagnostics (`--log_rollout_offpolicy_metrics`; ms-swift's
`_compute_rollout_offpolicy_metrics`, swift/rlhf_trainers/grpo_trainer.py): how far the log-probs the
completions were sampled with (vLLM's processed log-probs under --use_vllm colocate; transformers'
generate's otherwise: rlhf/generate.GumbelSampler's record) are from the training policy's on the same
tokens (the round's old log-probs, before any update).

Per micro-batch, with l the training log-probs, r the rollout ones, m the completion mask (tokens
without a rollout log-prob, vLLM's stop token, left out), log_ratio = (l - r) m:

    training_ppl      mean over completions of exp(-masked mean of l)     training_log_ppl  its log
    rollout_ppl       the same of r                                        rollout_log_ppl   its log
    kl                masked mean of -log_ratio (KL(rollout || training), the direct estimator)
    k3_kl             masked mean of exp(lr) - lr - 1, lr clamped to [-20, 20], the terms to [-10, 10]
    log_ppl_diff      mean over completions of (mean r - mean l); _abs_diff of its |.|, _max / _min
    ppl_ratio         mean over completions of exp(log_ppl_diff)
    chi2_token        masked mean of exp(2 lr) - 1;  chi2_seq  mean over completions of exp(2 mean lr) - 1

logged as `rollout_correction/<name>`: the mean over the round's micro-batches of every process (ms-swift
averages the gathered values; _max and _min take the extreme).
"""

from __future__ import annotations

import torch

SAFETY_BOUND = 20.0


def _mm(x: torch.Tensor, m: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1.0)


def offpolicy_metrics(training: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The metrics of one micro-batch (module docstring); [B, C] each, rollout nan where unknown."""
    m = (mask.bool() & torch.isfinite(rollout)).to(training.dtype)
    r = torch.nan_to_num(rollout.to(training.dtype), nan=0.0)
    mean_l = _mm(training, m, -1)
    mean_r = _mm(r, m, -1)
    out = {"training_ppl": float(torch.exp(-mean_l).mean()), "training_log_ppl": float((-mean_l).mean())}
    log_ratio = (training - r) * m
    out["kl"] = float(_mm(-log_ratio, m))
    safe = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    out["k3_kl"] = float(_mm(torch.clamp(torch.exp(safe) - safe - 1, -10, 10), m))
    out["rollout_ppl"] = float(torch.exp(-mean_r).mean())
    out["rollout_log_ppl"] = float((-mean_r).mean())
    diff = mean_r - mean_l
    out.update(log_ppl_diff=float(diff.mean()), log_ppl_abs_diff=float(diff.abs().mean()),
               log_ppl_diff_max=float(diff.max()), log_ppl_diff_min=float(diff.min()),
               ppl_ratio=float(torch.exp(diff).mean()))
    out["chi2_token"] = float(_mm(torch.exp(safe).square(), m) - 1.0)
    seq = torch.clamp(_mm(log_ratio, m, -1), -SAFETY_BOUND, SAFETY_BOUND)
    out["chi2_seq"] = float(torch.exp(seq).square().mean() - 1.0)
    return out


def merge(parts: list[dict[str, float]]) -> dict[str, float]:
    """The round's values from every micro-batch's (of every process): means, extremes for _max/_min."""
    if not parts:
        return {}
    out = {}
    for k in parts[0]:
        vals = [p[k] for p in parts]
        out[f"rollout_correction/{k}"] = (max(vals) if k.endswith("_max") else min(vals) if k.endswith("_min")
                                          else sum(vals) / len(vals))
    return out


__all__ = ["merge", "offpolicy_metrics"]
