"""rlhf/loss.py against the formulas written out by hand (TRL's definitions), and the preference step's
normalisation: the objective is the global pair mean, whatever the micro-batching."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from swiftlite.rlhf.loss import Method, pair_terms

PC = torch.tensor([-10.0, -4.0, -7.5])
PR = torch.tensor([-12.0, -3.0, -7.0])
NC = torch.tensor([5, 2, 3])
NR = torch.tensor([6, 2, 4])
RC = torch.tensor([-11.0, -4.5, -7.0])
RR = torch.tensor([-11.5, -3.5, -7.25])


def _sig(x):
    return 1 / (1 + math.exp(-x))


def test_dpo_sigmoid_matches_the_formula_and_equal_policy_and_reference_give_ln2():
    beta = 0.1
    loss, m = pair_terms(Method("dpo", beta), PC, PR, NC, NR, RC, RR)
    for i in range(3):
        d = (PC[i] - RC[i]) - (PR[i] - RR[i])
        assert loss[i].item() == pytest.approx(-math.log(_sig(beta * d.item())), abs=1e-6)
        assert m["rewards/chosen"][i].item() == pytest.approx(beta * (PC[i] - RC[i]).item(), abs=1e-6)
        assert m["rewards/margins"][i].item() == pytest.approx(beta * d.item(), abs=1e-6)
    assert m["rewards/accuracies"].tolist() == [1.0, 0.0, 0.0]
    assert m["logps/chosen"].tolist() == PC.tolist()
    same, m0 = pair_terms(Method("dpo", beta), PC, PR, NC, NR, PC, PR)
    assert torch.allclose(same, torch.full((3,), math.log(2)), atol=1e-7)
    assert float(m0["rewards/margins"].abs().max()) == 0.0


def test_dpo_label_smoothing_hinge_ipo():
    beta, ls = 0.5, 0.2
    d = (PC - RC) - (PR - RR)
    smooth, _ = pair_terms(Method("dpo", beta, label_smoothing=ls), PC, PR, NC, NR, RC, RR)
    want = -(1 - ls) * F.logsigmoid(beta * d) - ls * F.logsigmoid(-beta * d)
    assert torch.allclose(smooth, want, atol=1e-6)
    hinge, _ = pair_terms(Method("dpo", beta, "hinge"), PC, PR, NC, NR, RC, RR)
    assert torch.allclose(hinge, torch.relu(1 - beta * d), atol=1e-6)
    ipo, _ = pair_terms(Method("dpo", beta, "ipo"), PC, PR, NC, NR, RC, RR)
    want = ((PC - RC) / NC - (PR - RR) / NR - 1 / (2 * beta)) ** 2
    assert torch.allclose(ipo, want, atol=1e-6)


def test_orpo_and_simpo_on_mean_log_probs():
    ac, ar = PC / NC, PR / NR
    loss, m = pair_terms(Method("orpo", 0.1, nll_weight=1.0), PC, PR, NC, NR)
    log_odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
    assert torch.allclose(loss, -0.1 * F.logsigmoid(log_odds), atol=1e-6)
    assert torch.allclose(m["rewards/chosen"], 0.1 * ac, atol=1e-7)
    assert torch.allclose(m["logps/rejected"], ar, atol=1e-7)
    beta, gamma = 2.0, 0.5
    loss, m = pair_terms(Method("simpo", beta, nll_weight=1.0, simpo_gamma=gamma), PC, PR, NC, NR)
    assert torch.allclose(loss, -F.logsigmoid(beta * (ac - ar - gamma / beta)), atol=1e-6)
    assert torch.allclose(m["rewards/margins"], beta * (ac - ar), atol=1e-6)


def test_cpo_sigmoid_on_summed_log_probs_with_label_smoothing():
    """TRL CPOTrainer loss_type sigmoid: no reference, no length normalisation, rewards beta x summed logps."""
    beta, ls = 0.1, 0.15
    loss, m = pair_terms(Method("cpo", beta, label_smoothing=ls, nll_weight=1.0), PC, PR, NC, NR)
    for i in range(3):
        z = beta * (PC[i] - PR[i]).item()
        want = -(1 - ls) * math.log(_sig(z)) - ls * math.log(_sig(-z))
        assert loss[i].item() == pytest.approx(want, abs=1e-6)
        assert m["rewards/chosen"][i].item() == pytest.approx(beta * PC[i].item(), abs=1e-6)
        assert m["rewards/margins"][i].item() == pytest.approx(z, abs=1e-6)
    assert m["rewards/accuracies"].tolist() == [1.0, 0.0, 0.0]
    assert m["logps/chosen"].tolist() == PC.tolist()      # summed, as CPOTrainer logs them for sigmoid


def test_orpo_log1mexp_is_finite_near_zero():
    pc = torch.tensor([-1e-7, -0.69, -0.7, -30.0])
    loss, _ = pair_terms(Method("orpo", 0.1), pc, pc - 1, torch.ones(4), torch.ones(4))
    assert torch.isfinite(loss).all()


class _Plan:
    """A BatchPlan stand-in: `micro` lists each rank's micro-batches of pair indices."""

    def __init__(self, micro: dict[int, list[list[int]]]):
        self.micro = micro
        self.global_batch = sum(len(mb) for mbs in micro.values() for mb in mbs)

    def micro_batches(self, step, rank):
        return self.micro[rank]

    def all_micro_batches(self, step):
        return [mb for r in sorted(self.micro) for mb in self.micro[r]]


class _Engine:
    """A one-parameter 'policy': log p(row) = w x (a fixed per-row score); records the backward."""

    def __init__(self):
        self.w = torch.nn.Parameter(torch.tensor(0.3))
        self.grad = 0.0

    def micro_batch(self, last):
        import contextlib
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.grad = float(self.w.grad)
        self.w.grad = None
        return abs(self.grad)


@pytest.mark.parametrize("kind", ["dpo", "orpo", "simpo", "cpo"])
def test_step_objective_is_the_global_mean_whatever_the_micro_batching(monkeypatch, kind):
    """preference_step on one rank: 4 pairs as 1 micro-batch of 4, or 4 of 1, give the same loss,
    metrics and gradient (the pair mean and the chosen-token mean are over the global batch)."""
    import swiftlite.rlhf.step as step_mod
    from swiftlite.distributed import World
    scores = torch.tensor([[-3.0, -5.0], [-2.0, -1.0], [-6.0, -4.0], [-1.5, -2.5]])
    lengths = [(2, 3), (1, 1), (4, 2), (3, 3)]
    rows = [{"chosen_ids": [1] * (c + 1), "rejected_ids": [1] * (r + 1), "chosen_labels": [-100] + [1] * c,
             "rejected_labels": [-100] + [1] * r, "i": i} for i, (c, r) in enumerate(lengths)]
    engine = _Engine()

    def fake_forward(eng, batches, rs, idx, split="train"):
        idx_t = torch.tensor([r["i"] for r in rs])
        pc, pr = eng.w * scores[idx_t, 0], eng.w * scores[idx_t, 1]
        nc = torch.tensor([lengths[i][0] for i in idx_t.tolist()])
        nr = torch.tensor([lengths[i][1] for i in idx_t.tolist()])
        ref = (0.5 * scores[idx_t, 0], 0.5 * scores[idx_t, 1]) if batches.method.needs_reference else (None, None)
        terms, metrics = pair_terms(batches.method, pc, pr, nc, nr, *ref)
        return terms, metrics, -pc.sum()

    monkeypatch.setattr(step_mod, "pair_forward", fake_forward)
    method = {"dpo": Method("dpo", 0.5, nll_weight=0.3), "orpo": Method("orpo", 0.1, nll_weight=1.0),
              "simpo": Method("simpo", 2.0, nll_weight=1.0, simpo_gamma=0.5),
              "cpo": Method("cpo", 0.1, label_smoothing=0.1, nll_weight=1.0)}[kind]
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device="cpu")
    out = []
    for micro in ([[0, 1, 2, 3]], [[0], [1], [2], [3]], [[2, 0], [3, 1]]):
        b = step_mod.PairBatches(rows, _Plan({0: micro}), 0, world, method, [c for c, _ in lengths])
        stats = step_mod.preference_step(engine, b, 0)
        out.append((stats.loss, engine.grad, stats.metrics))
    for loss, grad, metrics in out[1:]:
        assert loss == pytest.approx(out[0][0], abs=1e-7)
        assert grad == pytest.approx(out[0][1], rel=1e-6)   # fp32 sums in another order
        for k, v in metrics.items():
            assert v == pytest.approx(out[0][2][k], abs=1e-7), k
    # and the loss is the plain global formula
    w = 0.3
    pc, pr = w * scores[:, 0], w * scores[:, 1]
    nc = torch.tensor([c for c, _ in lengths])
    nr = torch.tensor([r for _, r in lengths])
    ref = (0.5 * scores[:, 0], 0.5 * scores[:, 1]) if method.needs_reference else (None, None)
    terms, _ = pair_terms(method, pc, pr, nc, nr, *ref)
    want = float(terms.mean()) + method.nll_weight * float(-pc.sum()) / float(nc.sum())
    assert out[0][0] == pytest.approx(want, abs=1e-6)
