"""GRPO's flags: ms-swift's defaults, every ms-swift GRPO option a flag or refused with its reason, and
the one-line refusals that need no data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swiftlite.cli import parse_run_args
from swiftlite.config import field_specs, load_config
from swiftlite.errors import UserError

NAMES = json.loads((Path(__file__).parent / "data" / "msswift_args_3602360a.json").read_text())
BASE = ["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--rlhf_type", "grpo", "--reward_funcs", "format"]


def _cfg(argv):
    config_file, values = parse_run_args([*BASE, *argv])
    return load_config(config_file, values, task="rlhf", validate_paths=False)


def test_defaults_are_msswifts():
    from swiftlite.rlhf.grpo import grpo_batches
    r = _cfg([]).rlhf
    assert (r.num_generations, r.max_completion_length, r.temperature, r.top_p, r.top_k, r.epsilon, r.num_iterations,
            r.log_completions, r.use_vllm) == (8, 512, 0.9, 1.0, -1, 0.2, 1, False, False)
    cfg = _cfg([])

    class Tok:
        pad_token_id = 0
    b = grpo_batches(cfg, type("T", (), {"rows": []})(), None, Tok(), None)
    assert (b.loss.loss_type, b.loss.beta, b.loss.epsilon_high) == ("grpo", 0.04, 0.2)   # beta 0.04: arXiv 2402.03300
    assert _cfg(["--beta", "0"]).rlhf.beta == 0.0 and _cfg(["--reward_weights", "1", "0.5", "--reward_funcs", "format",
                                                             "repetition"]).rlhf.reward_weights == [1.0, 0.5]


def test_every_msswift_grpo_option_is_a_flag_or_refused_with_its_reason():
    specs = field_specs()
    for name in NAMES["grpo_only"]:
        try:
            parse_run_args([f"--{name}", "1"])
        except UserError as e:
            assert "unknown option" not in str(e) and str(e).startswith(f"--{name}"), (name, str(e))
        else:
            assert name in specs, name


@pytest.mark.parametrize("argv,words", [
    (["--num_generations", "1"], "--num-generations 1: GRPO needs at least 2"),
    (["--reward_weights", "1", "2"], "--reward-weights has 2 values for 1 --reward-funcs"),
    (["--use_vllm", "true"], "--use-vllm true needs --vllm-mode colocate"),
    (["--use_vllm", "true", "--vllm_mode", "colocate"], "--use-vllm needs a CUDA GPU and the vllm package"),
    (["--use_vllm", "true", "--vllm_mode", "server"], "--vllm-mode server needs --vllm-server-host HOST"),
    (["--use_vllm", "true", "--vllm_mode", "colocate", "--sleep_level", "3"], "--sleep-level 3: out of range"),
    (["--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "1.5"],
     "--vllm-gpu-memory-utilization 1.5: out of range"),
    (["--use_vllm", "true", "--vllm_mode", "colocate", "--use_dora", "true"], "--use-vllm with --use-dora"),
    (["--use_vllm", "true", "--vllm_mode", "colocate", "--offload_model", "true", "--parallelism", "fsdp"],
     "--offload-model with --parallelism fsdp: FSDP's sharded parameters are not moved"),
    (["--vllm_mode", "colocate"], "--vllm-mode needs --use-vllm true"),
    (["--vllm_gpu_memory_utilization", "0.5"], "--vllm-gpu-memory-utilization applies to --use-vllm true"),
    (["--vllm_server_host", "127.0.0.1"], "--vllm-server-host applies to --use-vllm true"),
    (["--move_model_batches", "4"], "--move-model-batches applies to --use-vllm true"),
    (["--use_vllm", "true", "--vllm_mode", "colocate", "--move_model_batches", "4", "--parallelism", "fsdp"],
     "--move-model-batches with FSDP"),
    (["--loss_type", "sigmoid"], "--loss-type sigmoid does not apply to GRPO"),
    (["--steps_per_generation", "3", "--gradient_accumulation_steps", "2"], "is not a multiple of"),
    (["--reward_funcs", "soft_overlong"], "the soft_overlong reward needs --soft-cache-length"),
    (["--truncation_strategy", "right"], "--truncation-strategy right does not apply to GRPO"),
    (["--top_p", "0"], "--top-p 0.0: out of range"),
])
def test_refused_in_one_line(argv, words):
    with pytest.raises(UserError) as e:
        _cfg(argv)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_vllm_options_are_msswifts():
    d = _cfg([]).rlhf      # defaults (ms-swift's VllmArguments / RolloutTrainerArgumentsMixin)
    assert (d.vllm_gpu_memory_utilization, d.vllm_tensor_parallel_size, d.vllm_max_model_len, d.vllm_max_num_seqs,
            d.vllm_enable_prefix_caching, d.vllm_enforce_eager, d.vllm_enable_lora, d.sleep_level, d.offload_model,
            d.offload_optimizer) == (0.9, 1, None, None, True, False, False, 0, False, False)


def test_use_vllm_without_a_gpu_is_refused_before_launch(tmp_path):
    """The CLI on this machine (no CUDA GPU, no vllm): exit 2, one line, before anything starts."""
    from tests.conftest import run_cli
    (tmp_path / "d.jsonl").write_text('{"messages": [{"role": "user", "content": "1+1?"}], "solution": "2"}\n')
    p = run_cli(["rlhf", *BASE, "--dataset", str(tmp_path / "d.jsonl"), "--use_vllm", "true", "--vllm_mode",
                 "colocate", "--output_dir", str(tmp_path / "out")], check=False, cwd=tmp_path, timeout=300,
                own_process=True)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and "needs a CUDA GPU" in err[0], p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()


def test_grpo_options_are_refused_on_dpo_and_grpo_losses_too():
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--num_generations", "4"])
    with pytest.raises(UserError, match="--num-generations does not apply to --rlhf-type dpo"):
        load_config(config_file, values, task="rlhf", validate_paths=False)
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--loss_type", "dapo"])
    with pytest.raises(UserError, match="--loss-type dapo is a GRPO loss"):
        load_config(config_file, values, task="rlhf", validate_paths=False)


def test_the_planner_counts_grpos_sequences_and_reference():
    from swiftlite.planner.recommend import workload_from_config
    base = ["--max_length", "100", "--max_completion_length", "50", "--per_device_train_batch_size", "4"]
    lora, full, no_ref = (workload_from_config(_cfg([*base, *x]), 1, None)
                          for x in ([], ["--train_type", "full"], ["--train_type", "full", "--beta", "0"]))
    assert (lora.max_length, lora.micro_batch, lora.reference) == (150, 4, "none")   # adapter off: no copy
    assert full.reference == "copy" and no_ref.reference == "none"
