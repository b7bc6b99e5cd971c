"""CHORD (rlhf/chord.py): mu's schedule is ms-swift's (mu_schedule_function, copied below as the
reference), the expert batches are a function of (seed, process, batch index) that walks every row once
per pass, CHORD-phi weights each token by p (1 - p), and the options' rules."""

from __future__ import annotations

import math

import pytest
import torch

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError
from swiftlite.rlhf.chord import ChordData, mu_schedule, sft_loss

BASE = ["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--rlhf_type", "grpo", "--reward_funcs", "format"]
CHORD = ["--chord_sft_dataset", "e.jsonl", "--chord_sft_per_device_train_batch_size", "1",
         "--chord_mu_warmup_steps", "2", "--chord_mu_decay_steps", "4", "--chord_mu_peak", "0.9",
         "--chord_mu_valley", "0.05"]


def _cfg(*argv: str):
    config_file, values = parse_run_args([*BASE, *argv])
    return load_config(config_file, values, task="rlhf", validate_paths=False)


def _msswift_mu(global_step, mu_warmup_steps, mu_decay_steps, mu_peak, mu_valley):
    if global_step < mu_warmup_steps:
        return (global_step / mu_warmup_steps) * mu_peak
    if global_step >= (mu_warmup_steps + mu_decay_steps):
        return mu_valley
    adjusted_step = global_step - mu_warmup_steps
    cosine_decay = 0.5 * (1 + math.cos(math.pi * adjusted_step / mu_decay_steps))
    return (mu_peak - mu_valley) * cosine_decay + mu_valley


@pytest.mark.parametrize("warmup,decay", [(0, 200), (2, 4), (3, 0), (0, 0)])
def test_mu_is_msswifts_schedule(warmup, decay):
    for step in range(12):
        assert mu_schedule(step, warmup, decay, 0.9, 0.05) == pytest.approx(_msswift_mu(step, warmup, decay, 0.9, 0.05))
    assert mu_schedule(0, 0, 200, 0.9, 0.05) == pytest.approx(0.9)      # chord.sh: the peak at once
    assert mu_schedule(100, 0, 200, 0.9, 0.05) == pytest.approx(0.475)   # halfway down the cosine


def test_expert_batches_walk_every_row_once_per_pass_per_process():
    rows = [{"id": i} for i in range(5)]
    a = ChordData(rows, 2, seed=7, rank=0, pad_id=0)
    drawn = [r["id"] for k in range(5) for r in a.batch_rows(k)]        # 10 draws: two passes
    assert sorted(drawn[:5]) == list(range(5)) and sorted(drawn[5:]) == list(range(5))
    assert drawn[:5] != drawn[5:]                                         # a new permutation each pass
    assert [r["id"] for r in a.batch_rows(3)] == [r["id"] for r in ChordData(rows, 2, 7, 0, 0).batch_rows(3)]
    other = [r["id"] for k in range(5) for r in ChordData(rows, 2, seed=7, rank=1, pad_id=0).batch_rows(k)]
    assert other != drawn                                                # each process its own order


class _Logits(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return type("Out", (), {"logits": self.logits})()


def test_sft_loss_is_the_target_mean_and_phi_weights_by_p_one_minus_p():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 6, generator=g)
    labels = torch.tensor([[-100, 1, 2, -100], [-100, -100, 3, 4]])
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": labels}
    plain, n = sft_loss(_Logits(logits), batch, None, phi=False)
    lp = torch.log_softmax(logits[:, :-1], -1)
    tgt = labels[:, 1:]
    keep = tgt != -100
    ce = -lp[keep].gather(-1, tgt[keep].unsqueeze(-1)).squeeze(-1)
    assert n == 4 and plain.item() == pytest.approx(ce.mean().item(), rel=1e-6)
    weighted, _ = sft_loss(_Logits(logits), batch, None, phi=True)
    p = torch.exp(-ce)
    assert weighted.item() == pytest.approx((ce * p * (1 - p)).mean().item(), rel=1e-6)


def test_rules():
    r = _cfg(*CHORD).rlhf
    assert r.chord_sft_dataset == ["e.jsonl"] and r.chord_mu_peak == 0.9 and r.chord_enable_phi_function is False
    with pytest.raises(UserError, match=r"--chord-sft-dataset needs --chord-mu-peak, --chord-mu-valley"):
        _cfg(*CHORD[:-4])
    with pytest.raises(UserError, match=r"--chord-mu-peak 1.5: out of range"):
        _cfg(*CHORD[:-3], "1.5", *CHORD[-2:])
    with pytest.raises(UserError, match=r"--chord-mu-peak applies to CHORD \(--chord-sft-dataset\)"):
        _cfg("--chord_mu_peak", "0.5")


def test_the_run_facts_record_chord_and_the_teacher():
    """A resume with another expert dataset, schedule or teacher is another run (checkpoint/state.run_facts)."""
    from types import SimpleNamespace

    from swiftlite.checkpoint.state import compare_run_facts, run_facts
    data = SimpleNamespace(rows=[{"input_ids": [1, 2], "labels": [-100, 2]}])
    a = run_facts(_cfg(*CHORD, "--max_length", "64"), data, 4)
    b = run_facts(_cfg(*CHORD[:-1], "0.1", "--max_length", "64"), data, 4)
    assert compare_run_facts(a, b) == ["shape.chord_mu_valley (0.05 -> 0.1)"]
    plain = run_facts(_cfg("--max_length", "64"), data, 4)
    assert "chord_sft_dataset" not in plain["shape"] and "teacher_model" not in plain["shape"]
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--rlhf_type", "grpo",
                                          "--teacher_model", "tiny-llama", "--num_generations", "1"])
    t = run_facts(load_config(config_file, values, task="rlhf", validate_paths=False), data, 4)
    assert t["shape"]["teacher_model"] == "tiny-llama" and t["shape"]["teacher_kl_coef"] == 1.0


def test_the_planner_counts_the_expert_micro_batch_when_it_is_the_larger():
    """CHORD's expert rows run a forward/backward of their own after the policy's (rlhf/grpo_step.py):
    the activation peak is the larger micro-batch's; a small expert batch changes nothing."""
    from swiftlite.planner.memory import activation_bytes, estimate
    from swiftlite.planner.recommend import workload_from_config
    from swiftlite.planner.shape import shape_from_model_arg
    shape = shape_from_model_arg("qwen2.5-0.5b")
    kw = ("--max_length", "512", "--max_completion_length", "64", "--per_device_train_batch_size", "1")
    plain = workload_from_config(_cfg(*kw), 1, 80 * 2**30)
    small = workload_from_config(_cfg(*kw, *CHORD), 1, 80 * 2**30)
    big_cfg = list(CHORD)
    big_cfg[big_cfg.index("--chord_sft_per_device_train_batch_size") + 1] = "8"
    big = workload_from_config(_cfg(*kw, *big_cfg), 1, 80 * 2**30)
    assert plain.side_batch == (0, 0) and small.side_batch == (1, 512) and big.side_batch == (8, 512)
    assert estimate(shape, small, "ddp").peak == estimate(shape, plain, "ddp").peak
    import dataclasses
    expert = activation_bytes(shape, dataclasses.replace(plain, micro_batch=8, max_length=512))
    assert expert > activation_bytes(shape, plain)
    assert estimate(shape, big, "ddp").peak - estimate(shape, plain, "ddp").peak == \
        expert - activation_bytes(shape, plain)
