"""GKD's divergence (rlhf/gkd_loss.jsd_sum) against the definitions computed from probabilities in float64,
the vocabulary alignment and top-k mode, and where a row's last response starts (rlhf/gkd.response_start)."""

from __future__ import annotations

import pytest
import torch

from swiftlite.rlhf.gkd import response_start
from swiftlite.rlhf.gkd_loss import align_vocab, jsd_sum

IGNORE = -100


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from probabilities."""
    return (p * (p.log() - q.log())).sum(-1)


def _reference(s: torch.Tensor, t: torch.Tensor, beta: float, temp: float) -> float:
    ps, pt = torch.softmax(s.double() / temp, -1), torch.softmax(t.double() / temp, -1)
    if beta == 0:
        return float(_kl(pt, ps).sum())
    if beta == 1:
        return float(_kl(ps, pt).sum())
    m = beta * pt + (1 - beta) * ps
    return float((beta * _kl(pt, m) + (1 - beta) * _kl(ps, m)).sum())


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_jsd_matches_the_definition(beta, temp):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(7, 11, generator=g) * 2, torch.randn(7, 11, generator=g) * 2
    got = float(jsd_sum(s, t, beta, temp))
    assert got == pytest.approx(_reference(s, t, beta, temp), rel=1e-5)
    assert got > 1e-3
    assert float(jsd_sum(t, t, beta, temp)) == pytest.approx(0.0, abs=1e-6)   # the teacher itself: no distance


def test_chunks_sum_to_the_whole(monkeypatch):
    import swiftlite.rlhf.gkd_loss as mod
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(9, 5, generator=g), torch.randn(9, 5, generator=g)
    whole = float(jsd_sum(s, t, 0.5, 1.0))
    monkeypatch.setattr(mod, "CHUNK", 2)
    assert float(jsd_sum(s, t, 0.5, 1.0)) == pytest.approx(whole, rel=1e-6)


def test_gradient_flows_to_the_student_only():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(3, 6, generator=g, requires_grad=True)
    t = torch.randn(3, 6, generator=g)
    jsd_sum(s, t, 0.5, 0.9).backward()
    assert s.grad is not None and float(s.grad.abs().sum()) > 0


def test_topk_is_the_divergence_over_the_teachers_top_tokens():
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g)
    k = 3
    vals, idx = torch.topk(t, k, dim=-1)
    want = _reference(s.gather(-1, idx), vals, 0.5, 1.0)
    assert float(jsd_sum(s, t, 0.5, 1.0, topk=k)) == pytest.approx(want, rel=1e-5)
    assert float(jsd_sum(s, t, 0.5, 1.0, topk=k)) != pytest.approx(float(jsd_sum(s, t, 0.5, 1.0)), rel=1e-3)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_teacher_given_by_its_top_k_alone_equals_the_dense_top_k(beta):
    """A teacher server's (log-probabilities, ids) [N, k]: the divergence and the student's gradient are the dense
    top-k mode's, on a teacher that is -inf off its top k (how the server's answer was laid out before)."""
    g = torch.Generator().manual_seed(5)
    s, t = torch.randn(6, 12, generator=g), torch.randn(6, 12, generator=g)
    k = 4
    vals, idx = torch.topk(torch.log_softmax(t, -1), k, dim=-1)
    dense = torch.full_like(t, float("-inf")).scatter(-1, idx, vals)
    a, b = s.clone().requires_grad_(), s.clone().requires_grad_()
    want, got = jsd_sum(a, dense, beta, 0.8, topk=k), jsd_sum(b, (vals, idx), beta, 0.8, topk=k)
    assert float(got) == pytest.approx(float(want), rel=1e-6) and float(got) > 0
    want.backward()
    got.backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7) and float(b.grad.abs().sum()) > 0


def test_a_larger_teacher_vocabulary_is_aligned():
    g = torch.Generator().manual_seed(4)
    s, t = torch.randn(2, 5, generator=g), torch.randn(2, 8, generator=g)
    a, b = align_vocab(s, t)
    assert a.shape == b.shape == (2, 8) and torch.equal(a[:, 5:], t[:, 5:]) and torch.equal(a[:, :5], s)
    # the teacher's extra ids take part as in the teacher's distribution, the student's logits given to them
    assert float(jsd_sum(s, t, 0.5, 1.0)) == pytest.approx(_reference(a, b, 0.5, 1.0), rel=1e-5)


def test_response_start_is_the_last_run_of_targets():
    assert response_start([IGNORE, IGNORE, 5, 6, IGNORE, IGNORE, 8, 9]) == 6
    assert response_start([IGNORE, 1, 2, IGNORE, 3, IGNORE]) == 4   # a trailing non-target after the response
    assert response_start([IGNORE, IGNORE]) == 2                    # no target: the completion follows the row
    assert response_start([4, 5]) == 0


def test_gkd_rows_train_the_last_response_by_default(tmp_path):
    """ms-swift's rlhf default --loss_scale is last_round: a GKD row's targets are the response after the last
    user turn (the one a sampled step replaces); --loss_scale default trains every assistant turn."""
    import json

    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.models.loading import load_tokenizer
    from swiftlite.train.tasks import task_of
    data = tmp_path / "mt.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "one"},
                                             {"role": "user", "content": "again"},
                                             {"role": "assistant", "content": "two"}]}) + "\n")
    extra_args = ["--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1"]
    runs = {}
    for extra in ([], ["--loss_scale", "default"]):
        config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", str(data), "--rlhf_type", "gkd",
                                              "--teacher_model", "tiny-llama", "--output_dir", str(tmp_path / "o"), "--max_length", "512",
                                              *extra_args, *extra])
        cfg = load_config(config_file, values, task="rlhf", validate_paths=False)
        tok = load_tokenizer(cfg)
        rows = task_of(cfg).prepare_data(cfg, tok, 1)[0].rows
        labels = list(rows[0]["labels"])
        runs[bool(extra)] = (labels, tok)
    last, tok = runs[False]
    every, _ = runs[True]
    runs_of = lambda lab: sum(1 for i, x in enumerate(lab) if x != IGNORE and (i == 0 or lab[i - 1] == IGNORE))  # noqa
    assert runs_of(last) == 1 and runs_of(every) == 2
    assert "two" in tok.decode([x for x in last if x != IGNORE]) and "one" not in tok.decode([x for x in last
                                                                                                 if x != IGNORE])
