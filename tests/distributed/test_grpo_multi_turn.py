"""Multi-turn GRPO (`--multi_turn_scheduler math_tip_trick`, rlhf/multi_turn.py) on 2 forked CPU processes:
FSDP2, ZeRO-3, FSDP1 (in lockstep) and a sequence-parallel group of 2 sample the same completions, every
turn, as one process with the same seed and global batch (each process continues its own share; a process
whose completions are all finished still takes part in the turns of the others), and take the same steps
(loss within 1e-5, grad norm within a relative 1e-4). The model is the e2e test's, whose completions mostly
end before the limit and are continued."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli_env, run_cli
from tests.e2e.test_grpo_multi_turn_e2e import build_eos_prone

STEPS = 2
ARGS = ["--rlhf-type", "grpo", "--torch-dtype", "fp32", "--seed", "5", "--lora-dropout", "0", "--loss-type", "dapo",
        "--learning-rate", "1e-2", "--beta", "0.5", "--reward-funcs", "length", "--num-generations", "4",
        "--max-completion-length", "8", "--per-device-train-batch-size", "2", "--max-steps", str(STEPS),
        "--logging-steps", "1", "--save-hf-model", "false", "--log-completions", "true",
        "--multi-turn-scheduler", "math_tip_trick"]
PLUGIN = 'from swiftlite.plugin import orms\norms["length"] = lambda completions, **kw: [len(c) / 10 for c in completions]\n'


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo_mt")
    build_eos_prone(d / "model")
    (d / "data.jsonl").write_text("".join(json.dumps({"prompt": f"what is {i} + 1?", "solution": f"${i + 1}$"}) + "\n"
                                          for i in range(4)))
    (d / "plugin.py").write_text(PLUGIN)
    run_cli(["rlhf", *ARGS, "--model", d / "model", "--dataset", d / "data.jsonl", "--external-plugins",
             d / "plugin.py", "--parallelism", "single", "--gradient-accumulation-steps", "2", "--output-dir",
             d / "single"])
    return d


def _steps(path):
    return {s["step"]: s for s in map(json.loads, path.read_text().splitlines()) if "loss" in s}


@pytest.mark.parametrize("backend", ["fsdp", "zero3", "fsdp1", "sp2"])
def test_two_processes_continue_the_same_completions_as_one(single, backend):
    """sp2: one sequence-parallel group of 2 (rlhf/grpo_sp.py), each rank sampling its share; fsdp1: the
    processes generate in lockstep (parallel/gather.py), a finished micro-batch still asked for."""
    d = single
    shape = (["--parallelism", "fsdp", "--sequence_parallel_size", "2", "--gradient-accumulation-steps", "2"]
             if backend == "sp2" else ["--parallelism", backend, "--gradient-accumulation-steps", "1"])
    run_cli(["rlhf", *ARGS, "--model", d / "model", "--dataset", d / "data.jsonl", "--external-plugins",
             d / "plugin.py", *shape, "--nproc-per-node", "2", "--output-dir", d / backend],
            env=cli_env(DS_ACCELERATOR="cpu"))
    text = (d / "single" / "completions.jsonl").read_text()
    assert "But wait... It seems I made a mistake," in text          # some completions took a second turn
    assert (d / backend / "completions.jsonl").read_text() == text
    one, two = (_steps(d / r / "logging.jsonl") for r in ("single", backend))
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    for s in one:
        assert two[s]["loss"] == pytest.approx(one[s]["loss"], abs=1e-5), (s, one[s]["loss"], two[s]["loss"])
        assert two[s]["grad_norm"] == pytest.approx(one[s]["grad_norm"], rel=1e-4)
        assert two[s]["completions/mean_length"] == pytest.approx(one[s]["completions/mean_length"])
