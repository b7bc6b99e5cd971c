"""--log_rollout_offpolicy_metrics through the CLI (transformers' generate): in fp32 the log-probs
recorded while sampling equal the training policy's on the same tokens (kl 0, ppl ratio 1: the record
is read at the right tokens), and with --top_k they are the processed distribution's (vLLM's
processed_logprobs), higher than the unfiltered training log-probs. And --save_only_model through the
rlhf engines, which ms-swift's distillation scripts carry."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

COMMON = ["rlhf", "--rlhf-type", "grpo", "--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--seed", "3",
          "--reward-funcs", "format", "--num-generations", "2", "--per-device-train-batch-size", "2",
          "--gradient-accumulation-steps", "2", "--max-completion-length", "6", "--logging-steps", "1",
          "--save-hf-model", "false", "--parallelism", "single", "--max-steps", "2",
          "--log-rollout-offpolicy-metrics", "true"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("offpolicy") / "data.jsonl"
    d.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"reverse: {w}"}]}) + "\n"
                         for w in ["abcd", "bcda", "cdab", "dabc"]))
    return d


def _steps(run):
    return [json.loads(x) for x in (run / "logging.jsonl").read_text().splitlines() if '"loss"' in x]


def test_sampling_log_probs_equal_the_training_ones_in_fp32(data, tmp_path):
    run_cli([*COMMON, "--dataset", data, "--output-dir", tmp_path / "a", "--learning-rate", "1e-2"])
    for s in _steps(tmp_path / "a"):
        assert s["rollout_correction/training_ppl"] > 10                     # a random model: uncertain
        assert abs(s["rollout_correction/kl"]) < 1e-5
        assert s["rollout_correction/ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
        assert s["rollout_correction/rollout_ppl"] == pytest.approx(s["rollout_correction/training_ppl"], rel=1e-5)
        assert abs(s["rollout_correction/chi2_token"]) < 1e-4


def test_top_k_samples_from_the_processed_distribution(data, tmp_path):
    run_cli([*COMMON, "--dataset", data, "--output-dir", tmp_path / "k", "--top-k", "5"])
    s = _steps(tmp_path / "k")[0]
    # renormalised over 5 tokens: each sampled token's rollout log-prob is above its full-vocabulary one
    assert s["rollout_correction/log_ppl_diff_min"] > 0
    assert s["rollout_correction/rollout_ppl"] < s["rollout_correction/training_ppl"]


def test_grpo_and_dpo_write_weights_only_checkpoints(data, tmp_path):
    """--save_only_model through the rlhf engines (GRPO's round, DPO's precomputed reference table): the
    checkpoint holds the weights and no optimizer state (ms-swift's opd_rl.sh and on_policy_distillation.sh
    carry the flag)."""
    from torch.distributed.checkpoint import FileSystemReader
    run_cli([*COMMON, "--dataset", data, "--output-dir", tmp_path / "g", "--save-only-model", "true",
             "--save-steps", "2", "--steps-per-generation", "4", "--gradient-accumulation-steps", "1"])
    ck = tmp_path / "g" / "checkpoint-2"
    keys = set(FileSystemReader(str(ck / "dcp")).read_metadata().state_dict_metadata)
    assert keys and all(k.startswith("model") for k in keys)
    assert not list(ck.glob("grpo_round*"))        # mid-round state: a full checkpoint's only
    again = run_cli([*COMMON, "--dataset", data, "--output-dir", tmp_path / "g", "--save-only-model", "true",
                     "--save-steps", "2", "--steps-per-generation", "4", "--gradient-accumulation-steps", "1",
                     "--max-steps", "4", "--resume", "true"], check=False)
    assert again.returncode == 2 and "needs that round's completions, which a --save_only_model checkpoint does " \
        "not keep" in again.stderr
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}) + "\n"
                             for i in range(8)))
    run_cli(["rlhf", "--rlhf-type", "dpo", "--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--dataset", pairs,
             "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "1", "--max-steps", "2",
             "--save-steps", "2", "--save-only-model",
             "true", "--precompute-ref-log-probs", "true", "--parallelism", "single", "--save-hf-model", "false",
             "--output-dir", tmp_path / "d"])
    d = tmp_path / "d" / "checkpoint-2"
    assert all(k.startswith("model") for k in FileSystemReader(str(d / "dcp")).read_metadata().state_dict_metadata)
