"""GRPO's --dynamic_sample with --loss_type fipo and --delta (ms-swift's fipo.sh, which runs them under
--sequence_parallel_size 2) on 2 forked CPU processes: FSDP2 data parallel (a resampled group's completions
move to the ranks whose micro-batches hold their new places) and one sequence-parallel group, each against
one process with the same seed and global batch (tiny 2-layer Llama, LoRA, fp32, 4 steps of 2 passes over
each round: FIPO's weights move on every second step). The completions table is the same byte for byte;
losses, gradient norms and FIPO's metrics agree to 1e-5 (relative)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import LazyRuns, run_cli
from tests.e2e.test_grpo_e2e import write_reverse_rows

REL = 1e-5
PLUGIN = '''from swiftlite.plugin import orms
orms["picky"] = lambda completions, solution, **kw: [float(len(c)) if s[0] in "ab" else 0.0
                                                     for c, s in zip(completions, solution)]
'''
ARGS = ["--rlhf-type", "grpo", "--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--seed", "7",
        "--lora-dropout", "0", "--reward-funcs", "picky", "--num-generations", "4", "--max-completion-length", "6",
        "--per-device-train-batch-size", "2", "--max-steps", "4", "--logging-steps", "1", "--save-hf-model", "false",
        "--log-completions", "true", "--learning-rate", "5e-2", "--lr-scheduler", "constant",
        "--dynamic_sample", "true", "--loss_type", "fipo", "--delta", "10", "--num_iterations", "2",
        "--epsilon_high", "0.28", "--fipo_clip_high_only", "false", "--fipo_decay_rate", "4"]
KEYS = ("loss", "grad_norm", "reward", "reward_std", "dynamic_sample/resamples", "fipo/future_kl_mean",
        "fipo/influence_weight_mean", "fipo/safety_keep_ratio")
RUNS = {
    "one": ["--parallelism", "single", "--gradient-accumulation-steps", "4"],
    "fsdp2": ["--parallelism", "fsdp", "--nproc-per-node", "2", "--gradient-accumulation-steps", "2"],
    "sp2": ["--parallelism", "fsdp", "--nproc-per-node", "2", "--sequence_parallel_size", "2",
            "--gradient-accumulation-steps", "4"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo_dynamic")
    write_reverse_rows(d / "data.jsonl")
    (d / "plugin.py").write_text(PLUGIN)

    def one(name):
        run_cli(["rlhf", *ARGS, "--dataset", d / "data.jsonl", "--external-plugins", d / "plugin.py", *RUNS[name],
                 "--output-dir", d / name])
        return d / name
    return LazyRuns(one)


def _steps(out):
    return {r["step"]: r for r in map(json.loads, (out / "logging.jsonl").read_text().splitlines()) if "loss" in r}


@pytest.mark.parametrize("name", ["fsdp2", "sp2"])
def test_dynamic_sample_and_fipo_match_one_process(runs, name):
    one, two = runs["one"], runs[name]
    assert (two / "completions.jsonl").read_text() == (one / "completions.jsonl").read_text()
    a, b = _steps(one), _steps(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert sum(a[s]["dynamic_sample/resamples"] for s in a) >= 1      # the resampling path ran
    assert any(a[s]["fipo/future_kl_mean"] != 0.0 for s in a)           # and FIPO's weights moved
    for s in a:
        assert b[s]["frac_reward_zero_std"] == 0.0
        for k in KEYS:
            assert b[s][k] == pytest.approx(a[s][k], rel=REL, abs=1e-7), (s, k, a[s][k], b[s][k])
