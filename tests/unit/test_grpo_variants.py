"""GRPO's variants (rlhf/grpo_loss.py, rlhf/dynamic_sample.py): FIPO's influence weights equal their
definition computed term by term in float64; --delta caps only the unclipped term; FIPO is dapo while the
policy is the sampling one; dynamic sampling keeps the groups with a reward signal in ms-swift's order,
falls back to the round where too few have one, and lays a chosen completion out exactly as it was sampled."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from swiftlite.rlhf.dynamic_sample import dynamic_round, resample_prompts, signal_groups
from swiftlite.rlhf.grpo_loss import GrpoLoss, aggregate, fipo_weight, token_terms


def _fipo_reference(o: GrpoLoss, log_ratio, ratio, adv, mask):
    """Term by term: F_t = sum_{s >= t} gamma^(s - t) d_s, then the clamp and the safety cap."""
    B, T = log_ratio.shape
    gamma = 2.0 ** (-1.0 / o.fipo_decay_rate)
    w = torch.ones(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            f = 0.0
            for s in range(t, T):
                if mask[b, s] and not (o.delta is not None and ratio[b, s] > o.delta):
                    f += gamma ** (s - t) * float(log_ratio[b, s])
            v = math.exp(f)
            if o.fipo_clip_range:
                lo = 1.0 if o.fipo_clip_high_only else 1.0 - o.fipo_clip_range
                v = min(max(v, lo), 1.0 + o.fipo_clip_range)
            if o.fipo_safety_threshold is not None and adv[b] < 0 and ratio[b, t] > o.fipo_safety_threshold:
                v = min(max(v, 0.8), 1.0)
            w[b, t] = v
    return w


@pytest.mark.parametrize("high_only,delta,safety", [(True, None, 4.0), (False, 1.5, 1.2), (False, None, None)])
def test_fipo_weight_matches_its_definition(high_only, delta, safety):
    g = torch.Generator().manual_seed(0)
    B, T = 3, 300                      # T > the 128-position blocks: the blocks must join up
    log_ratio = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    ratio = torch.exp(log_ratio)
    mask = torch.ones(B, T)
    mask[1, 200:] = 0                  # a shorter completion
    adv = torch.tensor([0.7, -1.2, -0.3], dtype=torch.float64).unsqueeze(1)
    o = GrpoLoss("fipo", fipo_decay_rate=8.0, fipo_clip_range=0.2, fipo_clip_high_only=high_only, delta=delta,
                 fipo_safety_threshold=safety)
    got = fipo_weight(o, log_ratio, ratio, adv, mask)
    want = _fipo_reference(o, log_ratio, ratio, adv.squeeze(1), mask)
    m = mask.bool()
    assert torch.allclose(got["influence_weight"][m], want[m], rtol=1e-9, atol=1e-12)
    assert got["influence_weight"].min() < 1.0 if not high_only else got["influence_weight"].min() >= 1.0
    assert not got["influence_weight"].requires_grad
    if safety == 1.2:   # some negative-advantage tokens above the threshold are capped
        assert (~got["safety"][m]).any()


def test_fipo_is_dapo_at_the_sampling_policy_and_weights_tokens_after():
    g = torch.Generator().manual_seed(1)
    logps = (torch.randn(2, 40, generator=g) * 0.3 - 2.0).requires_grad_()
    mask = torch.ones(2, 40)
    adv = torch.tensor([1.0, -1.0])
    dapo, fipo = GrpoLoss("dapo", beta=0.0), GrpoLoss("fipo", beta=0.0)
    a = aggregate(dapo, token_terms(dapo, logps, None, None, adv, mask).per_token_loss, mask)
    b = aggregate(fipo, token_terms(fipo, logps, None, None, adv, mask).per_token_loss, mask)
    assert float(a.detach()) == pytest.approx(float(b.detach()), abs=1e-7)   # l_old = l: every weight is 1
    old = logps.detach() - 0.05                             # the policy moved: ratio e^0.05 everywhere
    t = token_terms(fipo, logps, old, None, adv, mask)
    w = t.fipo["influence_weight"]
    assert float(w[0, 0]) == pytest.approx(1.2) and float(w[0, -1]) == pytest.approx(math.exp(0.05))
    plain = token_terms(dapo, logps, old, None, adv, mask).per_token_loss
    assert torch.allclose(t.per_token_loss, plain * w)


def test_delta_caps_only_the_unclipped_term():
    logps = torch.zeros(2, 1)
    old = torch.full((2, 1), -math.log(5.0))               # ratio 5
    adv = torch.tensor([-1.0, 1.0])
    plain = token_terms(GrpoLoss("bnpo", beta=0.0), logps, old, None, adv).per_token_loss
    capped = token_terms(GrpoLoss("bnpo", beta=0.0, delta=2.0), logps, old, None, adv).per_token_loss
    assert plain[:, 0].tolist() == pytest.approx([5.0, -1.2])   # -min(5 x -1, 1.2 x -1), -min(5, 1.2)
    assert capped[:, 0].tolist() == pytest.approx([2.0, -1.2])  # the negative advantage's loss is bounded


def test_signal_groups_and_resample_prompts():
    table = [1, 0, 1, 0, 2, 2, 2, 2, 0, 0, 0, 1]            # 3 groups of 4, 1 reward function
    assert signal_groups([float(v) for v in table], [1.0], 4) == [0, 2]
    two = [1.0, 0.0, 0.0, 1.0]                               # 2 completions x 2 functions whose sums tie
    assert signal_groups(two, [1.0, 1.0], 2) == [] and signal_groups(two, [1.0, 2.0], 2) == [0]
    plan = SimpleNamespace(seed=3, n_samples=5, round_prompts=7)
    a1, a2 = resample_prompts(plan, 0, 1), resample_prompts(plan, 0, 2)
    assert a1 == resample_prompts(plan, 0, 1) and a1 != a2 and len(a1) == 7
    assert sorted(a1[:5]) == list(range(5)) and a1[5:] == a1[:2]   # without replacement, then repeated


def _sampled(rows):
    """A micro-batch as generate.sample lays it out, from (prompt, completion, rollout log-probs) rows."""
    width = max(len(p) for p, _, _ in rows)
    n = max(len(c) for _, c, _ in rows)
    t = {"prompt_ids": torch.zeros(len(rows), width, dtype=torch.long),
         "prompt_mask": torch.zeros(len(rows), width, dtype=torch.long),
         "completion_ids": torch.zeros(len(rows), n, dtype=torch.long),
         "completion_mask": torch.zeros(len(rows), n, dtype=torch.long),
         "rollout_logps": torch.full((len(rows), n), float("nan"))}
    for i, (p, c, lp) in enumerate(rows):
        t["prompt_ids"][i, width - len(p):] = torch.tensor(p)
        t["prompt_mask"][i, width - len(p):] = 1
        t["completion_ids"][i, :len(c)] = torch.tensor(c)
        t["completion_mask"][i, :len(c)] = 1
        t["rollout_logps"][i, :len(c)] = torch.tensor(lp)
    return t


def _batches(n_prompts, max_resample_times=3):
    rows = [{"input_ids": [100 + i] * (1 + i % 3)} for i in range(n_prompts)]
    plan = SimpleNamespace(num_generations=2, round_prompts=2, seed=0, n_samples=n_prompts)
    return SimpleNamespace(plan=plan, options=SimpleNamespace(reward_weights=None,
                                                              max_resample_times=max_resample_times),
                           rewards=[object()], rows=rows, pad_id=0, world=SimpleNamespace(world_size=1, device="cpu"))


def _round(b, prompts, salt):
    """A sampled round of 2 groups x 2 completions in micro-batches [0, 1] and [2, 3]: completion c of prompt
    p is [p, salt, c] (+ one more token for odd c)."""
    comp = {c: [prompts[c // 2], salt, c] + ([7] if c % 2 else []) for c in range(4)}
    micro = {(0, 1): _sampled([(b.rows[prompts[0]]["input_ids"], comp[c], [-0.5] * len(comp[c])) for c in (0, 1)]),
             (2, 3): _sampled([(b.rows[prompts[1]]["input_ids"], comp[c], [-0.25] * len(comp[c])) for c in (2, 3)])}
    return (micro, {}, {}, {})


def test_dynamic_round_takes_signal_groups_in_order_and_lays_them_out():
    b = _batches(6)
    mine = [[0, 1], [2, 3]]
    calls = []

    def attempt(p, a):
        calls.append(a)
        return _round(b, p, 50 + a), ([1.0, 0.0, 3.0, 3.0] if a == 1 else [2.0, 2.0, 5.0, 4.0])
    # the round's group 1 has a signal, group 0 none; attempt 1 gives one more (its group 0)
    prompts, sampled, table, metrics = dynamic_round(b, 0, [0, 1], _round(b, [0, 1], 50), [4.0, 4.0, 0.0, 1.0], mine,
                                                     attempt)
    first = resample_prompts(b.plan, 0, 1)
    assert calls == [1] and metrics == {"dynamic_sample/resamples": 1.0, "dynamic_sample/kept_original": 0.0}
    assert prompts == [1, first[0]] and table == [0.0, 1.0, 1.0, 0.0]
    want = _round(b, [1, first[0]], 0)[0]
    got0, got1 = sampled
    # the round's group 1 moved to the first micro-batch, attempt 1's group 0 to the second, token for token
    assert got0["completion_ids"].tolist() == [[1, 50, 2, 0], [1, 50, 3, 7]]
    assert got1["completion_ids"].tolist() == [[first[0], 51, 0, 0], [first[0], 51, 1, 7]]
    assert got0["completion_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert torch.equal(got0["prompt_ids"], want[(0, 1)]["prompt_ids"])
    assert torch.equal(got1["prompt_mask"], want[(2, 3)]["prompt_mask"])
    assert got0["rollout_logps"][0].tolist()[:3] == [-0.25] * 3 and math.isnan(got0["rollout_logps"][0, 3])


def test_dynamic_round_keeps_the_round_when_too_few_groups_have_a_signal():
    b = _batches(4, max_resample_times=2)
    calls = []

    def attempt(p, a):
        calls.append(a)
        return _round(b, p, 60 + a), [1.0, 1.0, 2.0, 2.0]
    got = _round(b, [0, 1], 50)
    prompts, sampled, table, metrics = dynamic_round(b, 0, [0, 1], got, [0.0, 0.0, 0.0, 1.0], [[0, 1], [2, 3]],
                                                     attempt)
    assert calls == [1, 2] and sampled is None and prompts == [0, 1] and table == [0.0, 0.0, 0.0, 1.0]
    assert metrics == {"dynamic_sample/resamples": 2.0, "dynamic_sample/kept_original": 1.0}
    # every group with a signal already: no resampling, the round as sampled
    prompts, sampled, _, metrics = dynamic_round(b, 0, [0, 1], got, [0.0, 1.0, 0.0, 1.0], [[0, 1], [2, 3]], attempt)
    assert calls == [1, 2] and sampled is None and metrics["dynamic_sample/resamples"] == 0.0


def test_dynamic_samplings_relayout_keeps_per_completion_values():
    """A chosen completion moves to its new micro-batch with its token-wise tensors and its per-completion ones
    (--use_gym_env's reward): a [rows] tensor is carried as one value per completion."""
    from swiftlite.rlhf.dynamic_sample import _layout, _record
    t = {"prompt_ids": torch.tensor([[9, 9], [0, 8]]), "prompt_mask": torch.tensor([[1, 1], [0, 1]]),
         "completion_ids": torch.tensor([[5, 6, 7], [4, 2, 2]]), "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
         "loss_mask": torch.tensor([[1, 0, 1], [1, 0, 0]]), "gym_reward": torch.tensor([0.5, -1.0]),
         "truncated": torch.tensor([0.0, 1.0])}
    out = _layout([[8], [9, 9]], [_record(t, 1), _record(t, 0)], 2, "cpu")
    assert out["completion_ids"].tolist() == [[4, 2, 2], [5, 6, 7]]
    assert out["completion_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert out["loss_mask"].tolist() == [[1, 0, 0], [1, 0, 1]]
    assert out["gym_reward"].tolist() == [-1.0, 0.5] and "truncated" not in out
