"""GRPO's entropy options (rlhf/entropy.py): --top_entropy_quantile keeps the policy term of the tokens at or
above the quantile of the counted tokens' entropies only (the KL term of every token stays), --log_entropy's
per-completion summaries; and through the CLI, the options change the loss and log ms-swift's metrics."""

from __future__ import annotations

import json

import pytest
import torch

from swiftlite.rlhf.entropy import EntropyLog, top_entropy_mask
from swiftlite.rlhf.grpo_loss import GrpoLoss, token_terms


def test_the_threshold_is_the_quantile_of_the_counted_tokens_only():
    ent = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 5.0, 6.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])          # 99 is padding: it must not move the threshold
    keep, thr = top_entropy_mask(ent, mask, 0.5)
    assert thr == pytest.approx(torch.quantile(torch.tensor([1.0, 2, 3, 4, 5, 6, 7]), 0.5).item())
    assert keep.tolist() == [[False, False, False, False], [True, True, True, True]]
    keep, thr = top_entropy_mask(ent, mask, 1.0)
    assert keep is None
    keep, _ = top_entropy_mask(ent, torch.zeros_like(mask), 0.2)
    assert not keep.any()


def test_a_dropped_token_keeps_its_kl_term_and_loses_its_surrogate_gradient():
    torch.manual_seed(0)
    o = GrpoLoss(beta=0.1)
    logps = torch.randn(2, 5, requires_grad=True)
    ref = torch.randn(2, 5)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.ones(2, 5)
    keep = torch.tensor([[True, False, True, False, True], [False, True, True, True, False]])
    full = token_terms(o, logps, None, ref, adv, mask)
    part = token_terms(o, logps, None, ref, adv, mask, keep)
    kl_only = (o.beta * full.kl).detach()
    assert torch.allclose(part.per_token_loss[~keep], kl_only[~keep])
    assert torch.allclose(part.per_token_loss[keep], full.per_token_loss[keep])
    g_full, = torch.autograd.grad(full.per_token_loss.sum(), logps, retain_graph=True)
    g_part, = torch.autograd.grad(part.per_token_loss.sum(), logps)
    g_kl, = torch.autograd.grad((o.beta * token_terms(GrpoLoss(beta=0.1), logps, None, ref, torch.zeros(2), mask).kl).sum(),
                                logps)
    assert torch.allclose(g_part[~keep], g_kl[~keep]) and torch.allclose(g_part[keep], g_full[keep])
    assert not torch.allclose(g_part, g_full)


def test_the_logged_summaries_are_per_completion_means():
    log = EntropyLog(0.2, True)
    ent = torch.tensor([[1.0, 3.0, 50.0], [2.0, 2.0, 2.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])     # an empty row drops out (ms-swift's nanmean)
    log.add(ent, mask, 1.5)
    log.add(ent[:1], mask[:1], 2.5)
    m = log.metrics(1, True)
    assert m == {"entropy/threshold": pytest.approx(2.0), "entropy/mean": pytest.approx((2.0 + 2.0 + 2.0) / 3),
                 "entropy/max": pytest.approx(2.0), "entropy/min": pytest.approx(2.0)}
    assert EntropyLog(1.0, False).metrics(1, True) == {}


def test_through_the_cli_the_quantile_changes_the_loss_and_the_metrics_are_logged(tmp_path):
    from tests.conftest import cli_env, run_cli
    from tests.e2e.test_grpo_multi_turn_e2e import COMMON, build_eos_prone
    build_eos_prone(tmp_path / "model")
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(4)))
    (tmp_path / "r.py").write_text("from swiftlite.plugin import orms\n"
                                   "orms['n'] = lambda completions, completion_ids, **kw: "
                                   "[float(len(c)) for c in completion_ids]\n")

    def run(name, *extra):
        out = tmp_path / name
        run_cli(["rlhf", *COMMON, "--model", tmp_path / "model", "--dataset", tmp_path / "data.jsonl", "--max-steps",
                 "1", "--external-plugins", tmp_path / "r.py", "--reward_funcs", "n", "--beta", "0.1", *extra,
                 "--output-dir", out], env=cli_env())
        return [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines() if '"loss"' in x][0]
    base = run("all")
    top = run("top", "--top_entropy_quantile", "0.2", "--log_entropy", "true")
    assert "entropy/threshold" not in base and "entropy/mean" not in base
    assert top["entropy/min"] <= top["entropy/mean"] <= top["entropy/max"]
    assert top["entropy/threshold"] > top["entropy/min"]
    assert top["entropy"] == pytest.approx(base["entropy"], rel=1e-5)     # the same completions, the same forward
    assert top["kl"] == pytest.approx(base["kl"], rel=1e-5, abs=1e-9)
    assert top["loss"] != pytest.approx(base["loss"], rel=1e-3)
