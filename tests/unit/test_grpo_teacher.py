"""GRPO's teacher (on-policy distillation, rlhf/teacher.py): the per-token advantage and the teacher_kl
metric are ms-swift's formulas (swift/rl_core/advantage.py, copied below as the reference), the loss
takes [completions, tokens] advantages, the rules (rewards and groups optional with a teacher,
--teacher_deepspeed only on DeepSpeed), the vocabulary check and the planner's teacher bytes."""

from __future__ import annotations

import math

import pytest
import torch

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError
from swiftlite.rlhf.grpo_loss import GrpoLoss, advantages, clip_stats, token_terms
from swiftlite.rlhf.teacher import k3_sum, token_advantages

BASE = ["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--rlhf_type", "grpo", "--max_length", "64"]


def _cfg(*argv: str):
    config_file, values = parse_run_args([*BASE, *argv])
    return load_config(config_file, values, task="rlhf", validate_paths=False)


def _msswift_per_token(adv, mask, teacher, policy, coef):
    """ms-swift's expand_advantage_to_per_token with compute_teacher_logratio (rl_core/advantage.py)."""
    per_token = adv.unsqueeze(1).expand_as(mask).clone()
    signed = (teacher - policy).masked_fill(~mask.bool(), 0.0)
    return per_token + coef * signed


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 5
    teacher = -torch.rand(B, T, generator=g) * 3
    old = -torch.rand(B, T, generator=g) * 3
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([0.5, -1.0, 0.0])
    return adv, teacher, old, mask


@pytest.mark.parametrize("coef", [1.0, 0.3])
def test_token_advantages_are_msswifts_inside_the_completion(coef):
    adv, teacher, old, mask = _batch()
    ours = token_advantages(adv, teacher, old, mask, coef)
    ref = _msswift_per_token(adv, mask, teacher, old, coef)
    assert torch.allclose(ours * mask, ref * mask, atol=1e-7)
    assert torch.all(ours[mask == 0] == 0)     # outside the completion: masked (the loss masks it too)
    assert not torch.allclose(ours * mask, adv.unsqueeze(1) * mask)   # the teacher's signal is there


def test_teacher_kl_is_the_k3_token_mean():
    adv, teacher, old, mask = _batch(1)
    s, n = k3_sum(teacher, old, mask)
    d = (teacher - old)[mask.bool()]
    assert n == float(mask.sum())
    assert s / n == pytest.approx(float((torch.exp(d) - d - 1).mean()), rel=1e-6)
    assert k3_sum(old, old, mask)[0] == 0.0    # the teacher equal to the policy: no distance


def test_the_loss_takes_per_token_advantages():
    adv, teacher, old, mask = _batch(2)
    per_token = token_advantages(adv, teacher, old, mask, 1.0)
    logps = (old + 0.05).requires_grad_()
    o = GrpoLoss(beta=0.0)
    terms = token_terms(o, logps, old, None, per_token, mask)
    ratio = torch.exp(logps - old)
    expect = -torch.min(ratio * per_token, torch.clamp(ratio, 0.8, 1.2) * per_token)
    assert torch.allclose(terms.per_token_loss, expect)
    flat = token_terms(o, logps, old, None, adv, mask)        # a [B] advantage is broadcast as before
    assert torch.allclose(flat.per_token_loss, -torch.min(ratio * adv[:, None], torch.clamp(ratio, 0.8, 1.2) * adv[:, None]))
    cs = clip_stats(o, terms.ratio.detach(), per_token, mask)
    assert cs["tokens"].tolist() == mask.sum(-1).tolist()


def test_no_reward_function_gives_zero_rewards_and_advantages():
    adv, rewards, _ = advantages(torch.zeros(4, 0), torch.zeros(0), 1, "group")
    assert rewards.tolist() == [0.0] * 4 and adv.tolist() == [0.0] * 4
    adv, rewards, _ = advantages(torch.zeros(4, 0), torch.zeros(0), 2, "group")
    assert not torch.isnan(rewards).any() and adv.tolist() == [0.0] * 4


def test_rules_with_and_without_a_teacher():
    with pytest.raises(UserError, match=r"needs --reward-funcs .* or --teacher-model"):
        _cfg()
    with pytest.raises(UserError, match=r"--num-generations 1: .* 1 is for on-policy distillation"):
        _cfg("--reward_funcs", "format", "--num_generations", "1")
    cfg = _cfg("--teacher_model", "tiny-llama", "--num_generations", "1")
    assert cfg.rlhf.teacher_model == "tiny-llama" and cfg.rlhf.teacher_kl_coef == 1.0   # ms-swift's default
    with pytest.raises(UserError, match=r"--teacher-kl-coef applies to --teacher-model"):
        _cfg("--reward_funcs", "format", "--teacher_kl_coef", "0.5")
    with pytest.raises(UserError, match=r"--teacher-deepspeed zero3 applies to a DeepSpeed run"):
        _cfg("--teacher_model", "tiny-llama", "--teacher_deepspeed", "zero3", "--parallelism", "ddp")
    with pytest.raises(UserError, match=r"--teacher-deepspeed zero9: not one of zero0, zero1"):
        _cfg("--teacher_model", "tiny-llama", "--teacher_deepspeed", "zero9", "--deepspeed", "zero2")
    assert _cfg("--teacher_model", "tiny-llama", "--teacher_deepspeed", "zero3", "--deepspeed", "zero2") \
        .rlhf.teacher_deepspeed == "zero3"
    with pytest.raises(UserError, match=r"--teacher-model is an option of `swiftlite rlhf` .*not of sft"):
        config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl",
                                              "--teacher_model", "tiny-llama"])
        load_config(config_file, values, task="sft", validate_paths=False)


def test_a_teacher_with_a_smaller_vocabulary_is_refused_before_launch():
    from swiftlite.rlhf.teacher import check_teacher
    check_teacher(_cfg("--teacher_model", "tiny-llama", "--num_generations", "1"))        # the same tokenizer
    check_teacher(_cfg("--teacher_model", "qwen2.5-0.5b", "--num_generations", "1"))      # a larger vocabulary
    config_file, values = parse_run_args(["--model", "qwen2.5-0.5b", "--dataset", "d.jsonl", "--rlhf_type", "grpo",
                                          "--teacher_model", "tiny-llama", "--num_generations", "1"])
    cfg = load_config(config_file, values, task="rlhf", validate_paths=False)
    with pytest.raises(UserError, match=r"--teacher-model tiny-llama: its vocabulary has 260 tokens, the policy's 151936"):
        check_teacher(cfg)


def test_the_planner_counts_the_teacher():
    from swiftlite.planner.memory import reference_bytes
    from swiftlite.planner.recommend import workload_from_config
    from swiftlite.planner.shape import shape_from_model_arg
    shape = shape_from_model_arg("tiny-llama-2l")
    teacher = shape_from_model_arg("tiny-llama").n_params
    w = workload_from_config(_cfg("--teacher_model", "tiny-llama", "--num_generations", "1", "--beta", "0",
                                  "--torch-dtype", "bf16"), 4, None)
    assert w.teacher_params == teacher and w.reference == "none"
    assert reference_bytes(shape, w, "ddp") == teacher * 2                   # a bf16 replica
    assert reference_bytes(shape, w, "fsdp") == math.ceil(teacher * 2 / 4)   # sharded like the policy
    lora_same = workload_from_config(_cfg("--teacher_model", "tiny-llama-2l", "--num_generations", "1",
                                          "--train-type", "lora"), 4, None)
    assert lora_same.teacher_params == 0                                     # the base, adapter disabled
    z = workload_from_config(_cfg("--teacher_model", "tiny-llama", "--num_generations", "1", "--beta", "0",
                                  "--torch-dtype", "bf16", "--deepspeed", "zero2", "--teacher_deepspeed", "zero3"),
                             4, None)
    assert z.teacher_partitioned and reference_bytes(shape, z, "zero2") == math.ceil(teacher * 2 / 4)
