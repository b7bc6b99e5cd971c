"""GRPO's advantages and loss, as TRL's GRPOTrainer computes them (trl/trainer/grpo_trainer.py,
`_generate_and_score_completions` and `_compute_loss`). Torch only: scripts/compare_grpo_trl.py
imports this module in TRL's own environment and checks it against TRL's code on the same inputs.

Advantages (per completion; rewards r = sum_k w_k r_k over the reward functions, nan-aware):
    A = r - mean(r over its group of G completions of one prompt), divided by (std + 1e-4) where
    --scale_rewards is group (the group's std) or batch (the whole generation batch's std); none: not
    divided. std is Bessel-corrected (TRL's nanstd). A completion all of whose rewards are None gets A = 0.

Per token t of completion i (log-probs of the policy l, of the policy that generated l_old, of the
reference l_ref; logits divided by --temperature before the log-softmax, as TRL):
    ratio = exp(l - l_old);  clipped = clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss_it = -min(ratio A_i, clipped A_i) + beta (exp(l_ref - l) - (l_ref - l) - 1)    (k3 KL)
l_old is l itself, detached, when each round is used by one optimizer step (ratio 1, TRL's shortcut).
--importance_sampling_level (ms-swift's and TRL's, GSPO, arXiv 2507.18071) sets what `ratio` is:
    token           exp(l_t - l_old_t), per token (the above)
    sequence        exp(mean_t m (l - l_old)), one ratio per completion, the same for all its tokens
    sequence_token  GSPO-token: exp(l_t - sg(l_t) + sg(mean_t m (l - l_old))), the sequence ratio's value
                    with each token's own gradient
and the clip metrics are token means for token, completion means for the sequence levels (ms-swift's
masked_batch_mean).

Aggregation over one micro-batch (mask m: completion tokens up to and including the first EOS), as TRL:
    grpo     mean over completions of (sum_t m loss / sum_t m)
    bnpo     sum m loss / sum m                       (the micro-batch's tokens)
    dr_grpo  sum m loss / (completions x --max_completion_length)
    dapo     sum m loss / (tokens of the generation round x GA / steps_per_generation / processes)
and the optimizer step's loss is the mean of its micro-batches' (TRL divides by the accumulation
steps and the backends average over ranks).

--delta (two-sided clipping, INTELLECT-2, ms-swift's and TRL's) caps the unclipped term's ratio:
    loss_it = -min(min(ratio, delta) A_i, clipped A_i)
so that a token with a negative advantage and a large ratio has a bounded loss.

FIPO (--loss_type fipo, ms-swift's `_compute_fipo_influence`) is dapo's loss with each token's term
(before the KL) times an influence weight w_t (`fipo_weight`): exp of the decayed sum of the log-ratios
from t to the end of the completion, clamped by --fipo_clip_range and capped for negative-advantage tokens
above --fipo_safety_threshold. w is detached, and 1 while the policy is the sampling one (l_old = l), so
FIPO differs from dapo only on a round's later optimizer steps (--num_iterations > 1 or
--steps_per_generation > GA).

REAL (--loss_type real, ms-swift's, arXiv 2602.05630) is no per-token loss: each completion's score is
its mean token log-ratio s_i = mean_t m (l - l_old), and each group whose advantages hold both a positive
and a non-positive one (a valid group) gives
    log(1 + sum_{neg} exp(s_j / tau)) + log(1 + sum_{pos} exp(-s_j / tau))           (tau: --real_tau)
summed over the valid groups and divided by the number of groups, plus beta x the token-mean k3 KL.
Here each round trains one optimizer step (the rules refuse more), so l_old is l detached and every s_i
is 0 at the step: the loss is log(1 + n_neg) + log(1 + n_pos) per valid group and its gradient
sum_i c_i ds_i, c_i = 1 / (tau (n_neg + 1)) for a non-positive completion, -1 / (tau (n_pos + 1)) for a
positive one (`real_terms`). That linear form lets a group's completions sit in different micro-batches
and processes, with the same value and gradient as ms-swift's group-by-group formula. `micro_batch_loss` is each micro-batch's share, what is
backpropagated (TRL's `_compute_loss` return value): grpo, bnpo and dr_grpo the above / GA; dapo its
token sum over (the round's completion tokens on all processes / processes x GA / steps_per_generation),
which already holds the accumulation, so that a step's GA micro-batches, averaged over the processes,
make a token mean over the step's completions when every micro-batch holds as many tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "real", "fipo")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")
#: ms-swift's defaults tied to --advantage_estimator: (--scale_rewards, --kl_in_reward).
ESTIMATOR_DEFAULTS = {"grpo": ("group", False), "rloo": ("none", True), "reinforce_plus_plus": ("batch", True)}
IMPORTANCE_LEVELS = ("token", "sequence", "sequence_token")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected std ignoring nan (TRL's trainer.utils.nanstd); nan for fewer than 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    corr = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = torch.sqrt(var * corr)
    return std.squeeze(dim) if dim is not None else std.reshape(())


def advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int, scale: str,
               estimator: str = "grpo", kl: torch.Tensor | None = None, beta: float = 0.0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages [N], rewards [N] (nan where every function returned None), std-is-zero [N]) of a
    generation batch of N = prompts x G completions, laid out prompt by prompt (TRL's
    sum_then_normalize). `estimator` and `kl` are ms-swift's (swift/rl_core/advantage.py):
    grpo      A = r - mean(group), divided by the reward std (`scale`);
    rloo      A = (r - mean(group)) x G / (G - 1): r minus the mean of the other G - 1 completions;
    reinforce_plus_plus  A = r - mean(group), divided by the std of A itself (over the group or batch);
    `kl` ([N], --kl_in_reward): beta x each completion's KL to the reference is subtracted from its
    reward first. frac_reward_zero_std always reads the group's reward std."""
    # no reward function (on-policy distillation alone, rlhf/teacher.py): every reward is 0, as ms-swift's
    unscorable = torch.isnan(rewards_per_func).all(dim=1) & (rewards_per_func.shape[1] > 0)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = float("nan")
    if kl is not None and beta != 0.0:
        rewards = rewards - beta * kl
    G = num_generations
    grouped = rewards.view(-1, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(G)
    group_std = nanstd(grouped, dim=1).repeat_interleave(G)
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards {scale!r}")
    adv = rewards - mean
    if estimator == "rloo" and G > 1:
        adv = adv * G / (G - 1)
    base = adv if estimator == "reinforce_plus_plus" else rewards   # whose std divides
    if scale == "group":
        std = group_std if base is rewards else nanstd(base.view(-1, G), dim=1).repeat_interleave(G)
    else:
        std = nanstd(base).expand_as(base) if base.numel() > 1 else torch.zeros_like(base)
    if scale != "none":
        adv = adv / (std + 1e-4)
    std_zero = torch.isclose(group_std if scale != "batch" else std, torch.zeros_like(std))
    return torch.nan_to_num(adv, nan=0.0), rewards, std_zero


@dataclass(frozen=True)
class GrpoLoss:
    """The loss options (--loss_type, --beta, --epsilon, --epsilon_high, --max_completion_length)."""
    loss_type: str = "grpo"
    beta: float = 0.04
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    max_completion_length: int = 512
    importance_sampling_level: str = "token"
    kl_in_reward: bool = False         # beta's KL is in the rewards (advantages), not in the loss
    real_tau: float = 0.5              # --real_tau (REAL's temperature)
    delta: float | None = None         # --delta: the unclipped ratio's cap (two-sided clipping)
    fipo_decay_rate: float = 32.0      # --fipo_* (FIPO, below)
    fipo_clip_range: float | None = 0.2
    fipo_clip_high_only: bool = True
    fipo_safety_threshold: float | None = 4.0


def real_terms(adv: torch.Tensor, num_generations: int, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(c [N], v [N]) of REAL (module docstring) for a generation batch's advantages [N], laid out group
    by group: c_i the gradient coefficient of completion i's score, v_i its group's loss / G (a share, so
    that summing v over any set of whole or split groups adds up). Positive: advantage > 0 (ms-swift's)."""
    groups = adv.view(-1, num_generations)
    pos = groups > 0
    n_pos = pos.sum(dim=1, keepdim=True).to(adv.dtype)
    n_neg = (~pos).sum(dim=1, keepdim=True).to(adv.dtype)
    valid = ((n_pos > 0) & (n_neg > 0)).to(adv.dtype)
    coef = torch.where(pos, -1.0 / (tau * (n_pos + 1)), 1.0 / (tau * (n_neg + 1))) * valid
    value = (torch.log1p(n_neg) + torch.log1p(n_pos)) * valid / num_generations
    return coef.reshape(-1), value.expand_as(groups).reshape(-1)


@dataclass
class TokenTerms:
    per_token_loss: torch.Tensor     # [B, T] before masking
    ratio: torch.Tensor              # [B, T] exp(l - l_old)
    kl: torch.Tensor | None          # [B, T] k3 estimate, None when beta == 0
    fipo: dict[str, torch.Tensor] | None = None   # [B, T] future_kl, influence_weight, safety (--loss_type fipo)


#: Target positions per block of FIPO's decay matrix: a [block, T] matrix alive at a time, not [T, T].
FIPO_BLOCK = 128


def fipo_weight(o: GrpoLoss, log_ratio: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
                ) -> dict[str, torch.Tensor]:
    """FIPO's token influence weights (module docstring), detached: the future KL F_t = sum over s >= t of
    gamma^(s - t) d_s, d = the masked token log-ratio (0 where the ratio exceeds --delta), gamma =
    2^(-1 / --fipo_decay_rate); w = exp(F) clamped to [1 - r, 1 + r] ([1, 1 + r] with --fipo_clip_high_only,
    r = --fipo_clip_range, no clamp when r is 0 or None); tokens with a negative advantage and a ratio above
    --fipo_safety_threshold keep w within [0.8, 1] (ms-swift's constants)."""
    with torch.no_grad():
        m = mask.bool()
        d = log_ratio.masked_fill(~m, 0.0)
        if o.delta is not None:
            d = torch.where(ratio.expand_as(d) > o.delta, torch.zeros_like(d), d)
        T = d.shape[1]
        gamma = 2.0 ** (-1.0 / o.fipo_decay_rate)
        s = torch.arange(T, device=d.device, dtype=d.dtype)
        future = torch.empty_like(d)
        for lo in range(0, T, FIPO_BLOCK):
            t = s[lo:lo + FIPO_BLOCK].unsqueeze(1)             # [block, 1] target positions
            dist = s.unsqueeze(0) - t                          # [block, T]: s - t
            decay = torch.where(dist >= 0, gamma ** dist.clamp(min=0), torch.zeros_like(dist))
            future[:, lo:lo + FIPO_BLOCK] = d @ decay.t()
        future = future.masked_fill(~m, 0.0)
        w = torch.exp(future)
        if o.fipo_clip_range:
            w = w.clamp(min=1.0 if o.fipo_clip_high_only else 1.0 - o.fipo_clip_range, max=1.0 + o.fipo_clip_range)
        safe = torch.ones_like(m)
        if o.fipo_safety_threshold is not None:
            safe = ~((adv < 0) & (ratio > o.fipo_safety_threshold)).expand_as(m)
            w = torch.where(safe, w, w.clamp(min=0.8, max=1.0))
    return {"future_kl": future, "influence_weight": w, "safety": safe}


def token_terms(o: GrpoLoss, logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                adv: torch.Tensor, mask: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> TokenTerms:
    """Per-token clipped surrogate plus beta x k3 KL ([B, T] each; adv is [B], or [B, T] per token: a
    teacher's, rlhf/teacher.py). `mask` (the completion tokens) is needed by the sequence importance
    levels; their `ratio` is [B, 1]. `keep` ([B, T] bool, --top_entropy_quantile: rlhf/entropy.py): the tokens
    whose surrogate term stays, the others keeping only their KL term (ms-swift's entropy mask)."""
    old = logps.detach() if old_logps is None else old_logps
    a = adv if adv.dim() == 2 else adv.unsqueeze(1)
    log_ratio = logps - old
    if o.loss_type == "real":
        # `adv` holds REAL's coefficients c_i (real_terms): c_i x s_i, spread over the tokens
        m = mask.to(log_ratio.dtype)
        loss = a * log_ratio * m / m.sum(-1, keepdim=True).clamp(min=1.0)
        kl = None
        if o.beta != 0.0 and not o.kl_in_reward:
            d = ref_logps - logps
            kl = torch.exp(d) - d - 1   # token-mean over the micro-batch, added in aggregate (ms-swift's)
        return TokenTerms(loss, torch.exp(log_ratio), kl)
    if o.importance_sampling_level == "token":
        ratio = torch.exp(log_ratio)
    elif o.importance_sampling_level in ("sequence", "sequence_token"):
        m = mask.to(log_ratio.dtype)
        seq = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        ratio = torch.exp(seq) if o.importance_sampling_level == "sequence" else \
            torch.exp(logps - logps.detach() + seq.detach())
    else:
        raise ValueError(f"importance_sampling_level {o.importance_sampling_level!r}")
    clipped = torch.clamp(ratio, 1 - o.epsilon, 1 + o.epsilon_high)
    unclipped = ratio if o.delta is None else torch.clamp(ratio, max=o.delta)   # --delta: two-sided
    loss = -torch.min(unclipped * a, clipped * a)
    fipo = None
    if o.loss_type == "fipo":
        fipo = fipo_weight(o, log_ratio, ratio.detach(), a, torch.ones_like(logps) if mask is None else mask)
        loss = loss * fipo["influence_weight"]
    if keep is not None:
        loss = loss * keep.to(loss.dtype)
    kl = None
    if o.beta != 0.0 and not o.kl_in_reward:
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        loss = loss + o.beta * kl
    return TokenTerms(loss.expand_as(logps) if loss.shape != logps.shape else loss, ratio, kl, fipo)


def aggregate(o: GrpoLoss, per_token_loss: torch.Tensor, mask: torch.Tensor, dapo_tokens: float | None = None,
              real: tuple[float, float, torch.Tensor | None] | None = None) -> torch.Tensor:
    """One micro-batch's loss per --loss_type (module docstring). `dapo_tokens`: dapo's normalizer,
    the generation round's tokens x GA / steps_per_generation / processes (TRL's)."""
    m = mask.to(per_token_loss.dtype)
    s = per_token_loss * m
    if o.loss_type == "grpo":
        return (s.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if o.loss_type == "bnpo":
        return s.sum() / m.sum().clamp(min=1.0)
    if o.loss_type == "dr_grpo":
        return s.sum() / (per_token_loss.size(0) * o.max_completion_length)
    if o.loss_type in ("dapo", "fipo"):
        return s.sum() / max(1.0, float(dapo_tokens if dapo_tokens is not None else m.sum()))
    if o.loss_type == "real":   # real = (sum of the completions' value shares, groups, k3 KL or None)
        value, groups, kl = real
        out = (s.sum() + value) / groups
        return out if kl is None else out + o.beta * (kl * m).sum() / m.sum().clamp(min=1.0)
    raise ValueError(f"loss_type {o.loss_type!r}")


def micro_batch_loss(o: GrpoLoss, per_token_loss: torch.Tensor, mask: torch.Tensor, *, accumulation: int = 1,
                     round_tokens: float | None = None, steps_per_generation: int | None = None,
                     world_size: int = 1, real: tuple[float, float, torch.Tensor | None] | None = None
                     ) -> torch.Tensor:
    """What one micro-batch backpropagates (TRL's `_compute_loss` in training): `aggregate` / GA for
    grpo, bnpo and dr_grpo; for dapo the token sum over round_tokens x GA / steps_per_generation /
    world_size, `round_tokens` being the completion tokens of the whole generation round summed over
    all processes (TRL's num_items_in_batch). Without round_tokens (one micro-batch is the round on one
    process) dapo's normaliser is the micro-batch's own tokens. `real`: (the micro-batch's completions'
    value shares, the groups per optimizer step and process, the k3 KL or None): REAL's sum over its
    groups / the step's groups on this process, its KL token mean / GA (ms-swift's per micro-batch)."""
    if o.loss_type == "real":
        value, groups, kl = real
        part = aggregate(o, per_token_loss, mask, real=(value, groups, None))
        if kl is not None:
            m = mask.to(per_token_loss.dtype)
            part = part + o.beta * (kl * m).sum() / m.sum().clamp(min=1.0) / accumulation
        return part
    if o.loss_type in ("dapo", "fipo"):
        if round_tokens is None:
            return aggregate(o, per_token_loss, mask)
        spg = accumulation if steps_per_generation is None else steps_per_generation
        return aggregate(o, per_token_loss, mask, dapo_tokens=float(round_tokens) * accumulation / spg / world_size)
    return aggregate(o, per_token_loss, mask) / accumulation


def clip_stats(o: GrpoLoss, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masked sums of TRL's clip indicators ([B, T] -> per-completion sums of low/high/region), and the
    per-completion token counts, so that means over any set of micro-batches can be formed. `adv`: [B]
    or [B, T] (token_terms)."""
    a = adv if adv.dim() == 2 else adv.unsqueeze(1)
    low = ((ratio < 1 - o.epsilon) & (a < 0)).to(ratio.dtype)
    high = ((ratio > 1 + o.epsilon_high) & (a > 0)).to(ratio.dtype)
    region = ((low + high) > 0).to(ratio.dtype)
    if ratio.shape[-1] == 1:   # a sequence-level ratio: each completion counts once
        return {"low": low[:, 0], "high": high[:, 0], "region": region[:, 0], "tokens": torch.ones_like(low[:, 0])}
    m = mask.to(ratio.dtype)
    return {"low": (low * m).sum(-1), "high": (high * m).sum(-1), "region": (region * m).sum(-1),
            "tokens": m.sum(-1)}


__all__ = ["ADVANTAGE_ESTIMATORS", "ESTIMATOR_DEFAULTS", "GrpoLoss", "IMPORTANCE_LEVELS", "LOSS_TYPES", "TokenTerms", "advantages", "aggregate", "clip_stats", "fipo_weight", "micro_batch_loss",
           "nanstd", "real_terms", "token_terms"]
