"""GRPO's advantages, loss per --loss_type and the built-in rewards against values written out here
from TRL's GRPOTrainer and ms-swift's swift/rewards/orm.py (scripts/compare_grpo_trl.py runs TRL's own
_compute_loss on a batch like this one)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from swiftlite.errors import UserError
from swiftlite.rlhf.grpo_loss import GrpoLoss, advantages, aggregate, micro_batch_loss, token_terms

LENGTHS = [4, 2, 3, 1]          # 2 prompts x G = 2


def _batch():
    g = torch.Generator().manual_seed(5)
    logps = -torch.rand(4, 4, generator=g) * 2
    old = logps + (torch.rand(4, 4, generator=g) - 0.5) * 0.8
    ref = logps + (torch.rand(4, 4, generator=g) - 0.5) * 0.4
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(4)] for n in LENGTHS])
    return logps, old, ref, mask


def _reference_loss(loss_type, logps, old, ref, adv, mask, beta, lo, hi, max_len, dapo_tokens, level="token"):
    """TRL's formulas, element by element in plain Python floats (any number of completions); `level`
    sequence: ms-swift's GSPO ratio, exp of the completion's mean token log-ratio."""
    B = len(mask)
    per = [[0.0] * 4 for _ in range(B)]
    for i in range(B):
        seq = sum((logps[i][t] - old[i][t]) * mask[i][t] for t in range(4)) / max(1.0, sum(mask[i]))
        for t in range(4):
            r = math.exp(logps[i][t] - old[i][t]) if level == "token" else math.exp(seq)
            c = min(max(r, 1 - lo), 1 + hi)
            v = -min(r * adv[i], c * adv[i])
            if beta:
                d = ref[i][t] - logps[i][t]
                v += beta * (math.exp(d) - d - 1)
            per[i][t] = v * mask[i][t]
    if loss_type == "grpo":
        return sum(sum(per[i]) / sum(mask[i]) for i in range(B)) / B
    if loss_type == "bnpo":
        return sum(map(sum, per)) / sum(map(sum, mask))
    if loss_type == "dr_grpo":
        return sum(map(sum, per)) / (B * max_len)
    return sum(map(sum, per)) / dapo_tokens


def test_group_advantages_scale_and_unscorable():
    rpf = torch.tensor([[1.0, 0.0], [0.0, float("nan")], [0.5, 0.5], [0.5, 0.5], [float("nan"), float("nan")],
                        [1.0, 1.0]])
    adv, rewards, zero = advantages(rpf, torch.tensor([1.0, 2.0]), 2, "group")
    # group 1: rewards 1, 0 -> mean 0.5, Bessel std 0.7071; group 2: 1.5, 1.5 -> std 0; group 3: nan, 3
    s = math.sqrt(0.5)
    assert adv[:2].tolist() == pytest.approx([0.5 / (s + 1e-4), -0.5 / (s + 1e-4)], abs=1e-6)
    assert adv[2:4].tolist() == [0.0, 0.0] and zero[2:4].all() and not zero[0]
    assert adv[4] == 0.0 and math.isnan(rewards[4])            # every reward None: no signal
    assert adv[5] == 0.0                                        # alone in its group: std nan -> 0
    none, _, _ = advantages(rpf[:4], torch.tensor([1.0, 2.0]), 2, "none")
    assert none.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    batch, _, _ = advantages(rpf[:4], torch.tensor([1.0, 2.0]), 2, "batch")
    std = torch.tensor([1.0, 0.0, 1.5, 1.5]).std().item()      # Bessel, over the whole batch
    assert batch[0].item() == pytest.approx(0.5 / (std + 1e-4), abs=1e-6)


def _msswift_advantages(rewards_per_func, weights, K, estimator, scale, kl=None, beta=0.0):
    """ms-swift's compute_advantages (swift/rl_core/advantage.py, grpo/rloo/reinforce_plus_plus with
    group/batch/none), written out with plain torch on rewards that are all scored."""
    r = (rewards_per_func * weights).sum(1)
    if kl is not None:
        r = r - beta * kl
    g = r.view(-1, K)
    gm = g.mean(1).repeat_interleave(K)
    a = r * K / (K - 1) - gm * K / (K - 1) if estimator == "rloo" else r - gm
    std = None
    if estimator == "reinforce_plus_plus":
        std = {"batch": a.std().expand_as(a), "group": a.view(-1, K).std(1).repeat_interleave(K)}.get(scale)
    else:
        std = {"batch": r.std().expand_as(r), "group": g.std(1).repeat_interleave(K)}.get(scale)
    return a / (std + 1e-4) if std is not None and scale != "none" else a


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("with_kl", [False, True])
def test_advantage_estimators_match_msswift(estimator, scale, with_kl):
    g = torch.Generator().manual_seed(5)
    rpf = torch.rand(12, 2, generator=g)
    w = torch.tensor([1.0, 0.5])
    kl = torch.rand(12, generator=g) * 3 if with_kl else None
    got, rewards, _ = advantages(rpf, w, 4, scale, estimator, kl, 0.1)
    want = _msswift_advantages(rpf, w, 4, estimator, scale, kl, 0.1)
    assert torch.allclose(got, want, atol=1e-6), (got, want)
    assert torch.allclose(rewards, (rpf * w).sum(1) - (0.1 * kl if with_kl else 0.0), atol=1e-6)
    # they differ from plain GRPO's (reinforce++ divides by the advantages' std, which is the rewards'
    # std within a group: only its batch scale differs)
    if estimator == "rloo" or with_kl or (estimator == "reinforce_plus_plus" and scale == "batch"):
        assert not torch.allclose(got, advantages(rpf, w, 4, scale)[0], atol=1e-4)


def test_kl_in_reward_takes_the_kl_out_of_the_loss():
    logps, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    adv = torch.tensor([0.3])
    on = token_terms(GrpoLoss(beta=0.1, kl_in_reward=True), logps, None, ref, adv)
    off = token_terms(GrpoLoss(beta=0.1), logps, None, ref, adv)
    assert on.kl is None and off.kl is not None
    assert torch.allclose(off.per_token_loss - on.per_token_loss, 0.1 * off.kl)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta,with_old", [(0.04, True), (0.0, False), (0.1, False)])
def test_loss_types_match_trl_formulas(loss_type, beta, with_old):
    logps, old, ref, mask = _batch()
    adv = torch.tensor([0.9, -0.9, 0.3, -0.3])
    o = GrpoLoss(loss_type, beta, 0.2, 0.28, 6)
    lp = logps.clone().requires_grad_(True)
    terms = token_terms(o, lp, old if with_old else None, ref if beta else None, adv)
    got = aggregate(o, terms.per_token_loss, mask, dapo_tokens=7.5)
    want = _reference_loss(loss_type, logps.tolist(), (old if with_old else logps).tolist(), ref.tolist(),
                           adv.tolist(), mask.tolist(), beta, 0.2, 0.28, 6, 7.5)
    assert float(got.detach()) == pytest.approx(want, abs=1e-6)
    got.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[mask == 0] == 0).all()
    if not with_old and not beta:   # on-policy, no KL: the gradient is -A_i / norm on each kept token
        norm = {"grpo": None, "bnpo": 10.0, "dr_grpo": 24.0, "dapo": 7.5}[loss_type]
        for i, n in enumerate(LENGTHS):
            d = 4 * n if norm is None else norm
            assert lp.grad[i, :n].tolist() == pytest.approx([-adv[i].item() / d] * n, abs=1e-6)

    # More than one micro-batch: the 4 completions (10 tokens) are one generation round cut into
    # micro-batches [0, 1] (6 tokens) and [2, 3] (4 tokens). What each backpropagates is TRL's
    # _compute_loss: grpo/bnpo/dr_grpo their formula / GA; dapo its token sum over num_items_in_batch
    # (the round's tokens on all processes) / processes x GA / steps_per_generation. bnpo's normaliser
    # (the micro-batch's tokens x GA) would give 12 and 8 where dapo's is 10 (layout a), 5 (b, c).
    total = float(mask.sum())
    layouts = {"a: GA 2, S 2, 1 process": (2, 2, 1), "b: GA 1, S 1, 2 processes (one micro-batch each)": (1, 1, 2),
               "c: GA 1, S 2, 1 process (a round serves 2 steps)": (1, 2, 1)}
    for name, (ga, spg, procs) in layouts.items():
        for rows in ([0, 1], [2, 3]):
            idx = torch.tensor(rows)
            lp = logps[idx].clone().requires_grad_(True)
            terms = token_terms(o, lp, old[idx] if with_old else None, ref[idx] if beta else None, adv[idx])
            got = micro_batch_loss(o, terms.per_token_loss, mask[idx], accumulation=ga, round_tokens=total,
                                   steps_per_generation=spg, world_size=procs)
            norm_dapo = total / procs * ga / spg
            want = _reference_loss(loss_type, logps[idx].tolist(), (old if with_old else logps)[idx].tolist(),
                                   ref[idx].tolist(), adv[idx].tolist(), mask[idx].tolist(), beta, 0.2, 0.28, 6,
                                   norm_dapo)
            if loss_type != "dapo":
                want /= ga
            assert float(got.detach()) == pytest.approx(want, abs=1e-7), (name, rows)
            got.backward()
            if not with_old and not beta:   # on-policy, no KL: -A_i / (what TRL divides the token sum by)
                n_mb = float(mask[idx].sum())
                for k, i in enumerate(rows):
                    n = LENGTHS[i]
                    d = {"grpo": 2 * n * ga, "bnpo": n_mb * ga, "dr_grpo": 2 * 6 * ga, "dapo": norm_dapo}[loss_type]
                    assert lp.grad[k, :n].tolist() == pytest.approx([-adv[i].item() / d] * n, abs=1e-7), (name, rows)


def test_builtin_rewards_as_ms_swift():
    from swiftlite.plugin import build_rewards
    args = SimpleNamespace(repetition_n_grams=2, repetition_max_penalty=-1.0, soft_max_length=10,
                           soft_cache_length=4, max_completion_length=10)
    fmt, rep, soft = build_rewards(["format", "repetition", "soft_overlong"], args)
    assert fmt(["<think>a</think> <answer>1</answer>", "<answer>1</answer>", "<think>a</think><answer>1</answer>x"]) \
        == [1.0, 0.0, 0.0]
    # "a b a b": bigrams ab, ba, ab -> 2 distinct of 3
    assert rep(["a b a b", "a", ""]) == pytest.approx([-(1 - 2 / 3), 0.0, 0.0])
    # L_max 10, L_cache 4: no penalty up to 6 tokens, then -(len - 6)/4
    assert soft(["x"] * 3, response_token_ids=[[0] * 5, [0] * 8, [0] * 10]) == [0, -0.5, -1.0]
    assert fmt.name == "Format" and fmt.needs == ()


def test_accuracy_reward_verifies_the_answer_with_math_verify():
    """ms-swift's `accuracy`: the <answer> part (or the whole completion) parsed and verified against
    the solution with math_verify (the `grpo` extra); equal values in other forms score 1."""
    from swiftlite.plugin import build_rewards
    (acc,) = build_rewards(["accuracy"], None)
    assert acc.needs == ("solution",)
    got = acc(["<answer>\\frac{1}{2}</answer>", "The answer is $0.5$", "no idea", "<answer>3</answer>"],
              solution=["$\\frac{1}{2}$", "$\\frac{1}{2}$", "$2$", "<answer>$4$</answer>"])
    assert got == [1.0, 1.0, 0.0, 0.0]


def test_unknown_reward_and_required_columns():
    from swiftlite.plugin import ORM, build_rewards, check_reward_funcs, orms
    with pytest.raises(UserError, match="--reward_funcs nope: unknown reward function"):
        build_rewards(["nope"], None)
    with pytest.raises(UserError, match="--reward_funcs nope: unknown reward function"):
        check_reward_funcs(["format", "nope"])      # what preflight and --dry-run run, building nothing

    class NeedsPackage(ORM):
        requires = ("swiftlite_no_such_package", "--reward_funcs needs_pkg needs swiftlite_no_such_package")
    orms["needs_pkg"] = NeedsPackage
    try:
        with pytest.raises(UserError, match="needs swiftlite_no_such_package"):
            check_reward_funcs(["needs_pkg"])
    finally:
        del orms["needs_pkg"]
    check_reward_funcs(["format", "accuracy"])      # math_verify is installed (the dev extra)

    def exact(completions, solution, hint=None, **kwargs):
        return [float(c == s) for c, s in zip(completions, solution)]
    orms["exact_test"] = exact
    try:
        (r,) = build_rewards(["exact_test"], None)
        assert r.needs == ("solution",) and r.name == "exact" and r(["a", "b"], solution=["a", "c"]) == [1.0, 0.0]
    finally:
        del orms["exact_test"]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_sequence_importance_levels_match_msswift_formulas(loss_type, beta):
    """GSPO (--importance_sampling_level sequence): one ratio per completion, exp of its mean token
    log-ratio; sequence_token has the same value with each token's own gradient."""
    logps, old, ref, mask = _batch()
    adv = torch.tensor([0.9, -0.9, 0.3, -0.3])
    got = {}
    for level in ("sequence", "sequence_token"):
        o = GrpoLoss(loss_type, beta, 0.2, 0.28, 6, level)
        lp = logps.clone().requires_grad_(True)
        terms = token_terms(o, lp, old, ref if beta else None, adv, mask)
        loss = aggregate(o, terms.per_token_loss, mask, dapo_tokens=7.5)
        loss.backward()
        got[level] = (float(loss.detach()), lp.grad.clone(), terms.ratio.detach())
    want = _reference_loss(loss_type, logps.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), beta,
                           0.2, 0.28, 6, 7.5, level="sequence")
    assert got["sequence"][0] == pytest.approx(want, abs=1e-6)
    assert got["sequence_token"][0] == pytest.approx(want, abs=1e-6)
    ratio = got["sequence"][2]
    assert ratio.shape == (4, 1)
    seq = ((logps - old) * mask).sum(-1) / mask.sum(-1)
    assert ratio[:, 0].tolist() == pytest.approx(torch.exp(seq).tolist(), abs=1e-6)
    # with one advantage per completion (GRPO's), GSPO-token's gradient is GSPO's (the GSPO paper, 4.3)
    g_seq, g_tok = got["sequence"][1], got["sequence_token"][1]
    assert (g_seq[mask == 0] == 0).all() and torch.allclose(g_seq, g_tok, atol=1e-7)
    if not beta:   # no KL: every kept token of a completion gets the same gradient
        assert torch.allclose(g_seq[0, :4], g_seq[0, 0].expand(4))
    # the clip metrics count completions, not tokens
    from swiftlite.rlhf.grpo_loss import clip_stats
    cs = clip_stats(GrpoLoss(loss_type, beta, 0.2, 0.28, 6, "sequence"), ratio, adv, mask)
    assert cs["tokens"].tolist() == [1.0] * 4 and set(cs["region"].tolist()) <= {0.0, 1.0}


def test_token_level_is_unchanged_by_the_mask_argument():
    logps, old, ref, mask = _batch()
    adv = torch.tensor([0.9, -0.9, 0.3, -0.3])
    o = GrpoLoss("grpo", 0.04, 0.2, 0.28, 6)
    a = token_terms(o, logps, old, ref, adv).per_token_loss
    b = token_terms(o, logps, old, ref, adv, mask).per_token_loss
    assert torch.equal(a, b)


def test_padding_free_log_probs_are_the_padded_ones_from_real_tokens_only():
    """rlhf/generate.token_logps(padding_free=True): one sequence of the rows' real tokens (left-padded
    prompts, completions cut at their mask), positions restarting per row, no attention mask; the log-probs
    and entropies the padded forward gives, 0 past each completion's mask, with gradients."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from swiftlite.rlhf.generate import token_logps
    torch.manual_seed(0)
    conf = AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, num_attention_heads=8,
                                num_key_value_heads=2, num_hidden_layers=2, vocab_size=300, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa").eval()
    pid, cid = torch.randint(0, 300, (3, 6)), torch.randint(0, 300, (3, 5))
    pm, cm = torch.ones(3, 6, dtype=torch.long), torch.ones(3, 5, dtype=torch.long)
    pm[0, :2] = pm[2, :4] = 0
    cm[1, 3:] = cm[2, 1:] = 0
    seen = []
    model.model.register_forward_hook(lambda m, args, kw, out: seen.append(kw), with_kwargs=True)
    padded, ent_p = token_logps(model, pid, pm, cid, cm, 0.7, entropy=True)
    free, ent_f = token_logps(model, pid, pm, cid, cm, 0.7, entropy=True, padding_free=True)
    assert seen[1]["input_ids"].shape == (1, int(pm.sum() + cm.sum())) and seen[1].get("attention_mask") is None
    assert seen[1]["position_ids"][0].tolist() == [*range(4 + 5), *range(6 + 3), *range(2 + 1)]
    assert torch.allclose(padded * cm, free, atol=2e-6) and torch.allclose(ent_p * cm, ent_f, atol=2e-6)
    assert free[cm == 0].abs().max() == 0 and free.requires_grad
