"""GRPO --loss_type real (REAL, ms-swift's): the loss and its gradient equal ms-swift's group formula
(swift/rlhf_trainers/grpo_trainer.py, written out below) when a group's completions are spread over
micro-batches, and the rules."""

from __future__ import annotations

import re

import pytest
import torch

from swiftlite.rlhf.grpo_loss import GrpoLoss, micro_batch_loss, real_terms, token_terms


def _msswift_real(logps, old, ref, adv, mask, G, tau, beta):
    """ms-swift's REAL loss of one micro-batch holding whole groups (its code, with per-token advantages
    constant over tokens)."""
    m = mask.float()
    log_ratio = logps - old
    global_scores = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    group_scores = global_scores.view(-1, G)
    group_rewards = adv.view(-1, G)
    pos_mask, neg_mask = group_rewards > 0, group_rewards <= 0
    valid = (pos_mask.sum(1) != 0) & (neg_mask.sum(1) != 0)
    if not valid.any():
        loss = 0.0 * global_scores.mean()
    else:
        scores = group_scores[valid] / tau
        zeros = torch.zeros(scores.size(0), 1)
        neg = torch.logsumexp(torch.cat([scores.masked_fill(~neg_mask[valid], float("-inf")), zeros], 1), 1)
        pos = torch.logsumexp(torch.cat([(-scores).masked_fill(~pos_mask[valid], float("-inf")), zeros], 1), 1)
        loss = (neg + pos).sum() / group_rewards.size(0)
    if beta:
        d = ref - logps
        kl = torch.exp(d) - d - 1
        loss = loss + beta * (kl * m).sum() / m.sum().clamp(min=1.0)
    return loss


def _inputs(n=12, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(n, T, generator=g) * 3).requires_grad_(True)
    ref = -torch.rand(n, T, generator=g) * 3
    mask = torch.ones(n, T)
    mask[1, 4:] = 0
    mask[7, 2:] = 0
    mask[10, 5:] = 0
    # three groups of 4: mixed signs, all positive (no signal), mixed with zeros (non-positive)
    adv = torch.tensor([1.0, -0.5, -0.5, 0.0, 0.3, 0.2, 0.1, 0.4, -1.0, 0.0, 2.0, 0.0])
    return logps, ref, mask, adv


@pytest.mark.parametrize("tau", [0.5, 2.0])
def test_split_micro_batches_give_msswifts_loss_and_gradient(tau):
    G = 4
    logps, ref, mask, adv = _inputs()
    want = _msswift_real(logps, logps.detach(), ref, adv, mask, G, tau, 0.0)
    (want_grad,) = torch.autograd.grad(want, logps)
    o = GrpoLoss("real", beta=0.0, real_tau=tau)
    coef, value = real_terms(adv, G, tau)
    total, grad = 0.0, torch.zeros_like(logps)
    per_device, ga = 3, 4          # micro-batches of 3 completions: groups straddle them
    for k in range(0, 12, per_device):
        sl = slice(k, k + per_device)
        lp = logps[sl].detach().requires_grad_(True)
        terms = token_terms(o, lp, None, None, coef[sl], mask[sl])
        part = micro_batch_loss(o, terms.per_token_loss, mask[sl], accumulation=ga,
                                real=(float(value[sl].sum()), per_device * ga / G, terms.kl))
        part.backward()
        total += float(part)
        grad[sl] = lp.grad
    assert total == pytest.approx(float(want), rel=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    # the all-positive group gives nothing
    assert torch.all(coef[4:8] == 0) and torch.all(value[4:8] == 0) and float(want) > 0


def test_kl_is_the_micro_batch_token_mean():
    G, beta, tau = 4, 0.04, 0.5
    logps, ref, mask, adv = _inputs(seed=1)
    want = _msswift_real(logps, logps.detach(), ref, adv, mask, G, tau, beta)
    (want_grad,) = torch.autograd.grad(want, logps)
    o = GrpoLoss("real", beta=beta, real_tau=tau)
    coef, value = real_terms(adv, G, tau)
    terms = token_terms(o, logps, None, ref, coef, mask)
    got = micro_batch_loss(o, terms.per_token_loss, mask, accumulation=1,
                           real=(float(value.sum()), 12 / G, terms.kl))
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    (grad,) = torch.autograd.grad(got, logps)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)


def test_no_valid_group_is_a_zero_loss():
    coef, value = real_terms(torch.tensor([1.0, 2.0, -1.0, -2.0]), 2, 0.5)
    assert torch.all(coef == 0) and torch.all(value == 0)


@pytest.mark.parametrize("argv,message", [
    (["--loss_type", "real", "--scale_rewards", "group"], "--scale-rewards group with --loss-type real"),
    (["--loss_type", "real", "--num_iterations", "2"], "--num-iterations 2 with --loss-type real"),
    (["--loss_type", "real", "--real_tau", "0"], "--real-tau 0: must be > 0"),
    (["--real_tau", "0.3"], "--real-tau applies to --loss-type real"),
    (["--loss_type", "real", "--teacher_model", "tiny-llama-2l"], "--loss-type real with --teacher-model"),
    (["--loss_type", "real", "--real_tau", "0.3"], None),
])
def test_rules(argv, message):
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.errors import UserError
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--rlhf_type", "grpo",
                                          "--reward_funcs", "format", *argv])
    if message is None:
        from swiftlite.rlhf.grpo import estimator_choices
        cfg = load_config(config_file, values, validate_paths=False, task="rlhf")
        assert cfg.rlhf.real_tau == 0.3 and estimator_choices(cfg.rlhf)[0] == "none"
        return
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(config_file, values, validate_paths=False, task="rlhf")
