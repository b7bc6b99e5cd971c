"""--log_rollout_offpolicy_metrics (rlhf/offpolicy.py): the metrics are ms-swift's
`_compute_rollout_offpolicy_metrics` (its body copied below as the reference, one process), tokens
without a rollout log-prob are left out, the round merges micro-batches as ms-swift's logging does, and
the vLLM side asks for and reads the sampled tokens' processed log-probs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError
from swiftlite.rlhf.offpolicy import merge, offpolicy_metrics


def _msswift(per_token_logps, rollout_per_token_logps, completion_mask):
    SAFETY_BOUND = 20.0
    metrics = {}

    def masked_mean(x, mask, axis=None):
        if axis is None:
            return (x * mask).sum() / mask.sum().clamp(min=1.0)
        return (x * mask).sum(axis) / mask.sum(axis).clamp(min=1.0)
    mean_log_prob_training = masked_mean(per_token_logps, completion_mask, axis=-1)
    metrics['training_ppl'] = torch.exp(-mean_log_prob_training).mean().item()
    metrics['training_log_ppl'] = (-mean_log_prob_training).mean().item()
    log_ratio = per_token_logps - rollout_per_token_logps
    log_ratio *= completion_mask
    metrics['kl'] = masked_mean(-log_ratio, completion_mask).item()
    log_ratio_safe = torch.clamp(log_ratio, min=-20, max=20)
    k3_kl_matrix = torch.clamp(torch.exp(log_ratio_safe) - log_ratio_safe - 1, min=-10, max=10)
    metrics['k3_kl'] = masked_mean(k3_kl_matrix, completion_mask).item()
    mean_log_prob_rollout = masked_mean(rollout_per_token_logps, completion_mask, axis=-1)
    metrics['rollout_ppl'] = torch.exp(-mean_log_prob_rollout).mean().item()
    metrics['rollout_log_ppl'] = (-mean_log_prob_rollout).mean().item()
    log_ppl_diff = mean_log_prob_rollout - mean_log_prob_training
    metrics['log_ppl_diff'] = log_ppl_diff.mean().item()
    metrics['log_ppl_abs_diff'] = log_ppl_diff.abs().mean().item()
    metrics['log_ppl_diff_max'] = log_ppl_diff.max().item()
    metrics['log_ppl_diff_min'] = log_ppl_diff.min().item()
    metrics['ppl_ratio'] = torch.exp(log_ppl_diff).mean().item()
    log_ratio_safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    metrics['chi2_token'] = (masked_mean(torch.exp(log_ratio_safe).square(), completion_mask) - 1.0).item()
    log_ratio_mean = masked_mean(log_ratio, completion_mask, axis=-1)
    rho_geo = torch.exp(torch.clamp(log_ratio_mean, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    metrics['chi2_seq'] = (rho_geo.square().mean() - 1.0).item()
    return metrics


def _batch():
    g = torch.Generator().manual_seed(0)
    training = -torch.rand(3, 6, generator=g) * 4
    rollout = training + 0.3 * torch.randn(3, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.float32)
    return training, rollout, mask


def test_metrics_are_msswifts():
    training, rollout, mask = _batch()
    ours = offpolicy_metrics(training, rollout, mask)
    ref = _msswift(training, rollout.clone(), mask)
    assert set(ours) == set(ref)
    for k in ref:
        assert ours[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), k
    assert ours["kl"] != 0.0 and ours["chi2_token"] > 0


def test_tokens_without_a_rollout_log_prob_are_left_out():
    training, rollout, mask = _batch()
    holes = rollout.clone()
    holes[0, 5] = float("nan")                     # vLLM's stop token: no log-prob
    cut = mask.clone()
    cut[0, 5] = 0
    assert offpolicy_metrics(training, holes, mask) == pytest.approx(_msswift(training, rollout.clone(), cut))


def test_the_round_merges_micro_batches_as_msswift_logs_them():
    a = {"kl": 1.0, "log_ppl_diff_max": 0.5, "log_ppl_diff_min": -0.1}
    b = {"kl": 3.0, "log_ppl_diff_max": 0.2, "log_ppl_diff_min": -0.4}
    assert merge([a, b]) == {"rollout_correction/kl": 2.0, "rollout_correction/log_ppl_diff_max": 0.5,
                             "rollout_correction/log_ppl_diff_min": -0.4}


def test_vllm_is_asked_for_processed_log_probs_and_they_are_read():
    from swiftlite.rlhf.vllm_gen import engine_kwargs, output_logprobs, sampling_params

    class SP(SimpleNamespace):
        pass
    with_lp = sampling_params(SP, [1, 2], temperature=0.9, top_p=1.0, top_k=-1, max_tokens=4, eos_ids=[9],
                              logprobs=True)
    assert [p.logprobs for p in with_lp] == [0, 0]
    assert not hasattr(sampling_params(SP, [1], temperature=0.9, top_p=1.0, top_k=-1, max_tokens=4, eos_ids=[9])[0],
                       "logprobs")
    o = SimpleNamespace(vllm_tensor_parallel_size=1, vllm_gpu_memory_utilization=0.5, vllm_max_model_len=None,
                        vllm_max_num_seqs=None, vllm_enable_prefix_caching=True, vllm_enforce_eager=False,
                        sleep_level=0, log_rollout_offpolicy_metrics=True)
    assert engine_kwargs(o, model_dir="m", dtype="bfloat16", rank=0, per_device=2,
                         steps_per_generation=1)["logprobs_mode"] == "processed_logprobs"
    o.log_rollout_offpolicy_metrics = False
    assert "logprobs_mode" not in engine_kwargs(o, model_dir="m", dtype="bfloat16", rank=0, per_device=2,
                                                steps_per_generation=1)
    lp = lambda v: SimpleNamespace(logprob=v)   # noqa: E731
    out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5, 7], logprobs=[{5: lp(-0.5)}, {7: lp(-1.5), 3: lp(-2.0)}])])
    assert output_logprobs(out, 3)[:2] == [-0.5, -1.5] and output_logprobs(out, 3)[2] != output_logprobs(out, 3)[2]


def test_server_mode_is_refused():
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--rlhf_type", "grpo",
                                          "--reward_funcs", "format", "--use_vllm", "true", "--vllm_mode", "server",
                                          "--vllm_server_host", "127.0.0.1", "--log_rollout_offpolicy_metrics",
                                          "true"])
    with pytest.raises(UserError, match=r"--log-rollout-offpolicy-metrics with --vllm-mode server"):
        load_config(config_file, values, task="rlhf", validate_paths=False)
