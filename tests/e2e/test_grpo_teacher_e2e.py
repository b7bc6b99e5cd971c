"""GRPO with a teacher (on-policy distillation, rlhf/teacher.py) through the CLI: a teacher equal to the
policy gives no signal (teacher_kl 0, loss 0, no gradient), --teacher_kl_coef scales the signal of a
different teacher, with LoRA the run's own model is the base with the adapter disabled, and a
ZeRO-3-partitioned teacher under a ZeRO-2 policy on 2 processes scores as one process does."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli_env, run_cli

COMMON = ["--rlhf-type", "grpo", "--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--seed", "3",
          "--gradient-accumulation-steps", "1", "--max-completion-length", "6", "--logging-steps", "1",
          "--save-hf-model", "false", "--beta", "0"]
PLUGIN = '''from swiftlite.plugin import orms
orms["length"] = lambda completions, **kwargs: [len(c) / 10 for c in completions]
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("opd")
    words = ["abcd", "bcda", "cdab", "dabc", "abdc", "badc", "cadb", "dcba"]
    (d / "data.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"reverse: {w}"}]}) + "\n" for w in words))
    (d / "plugin.py").write_text(PLUGIN)
    return d


def _steps(run):
    return [json.loads(x) for x in (run / "logging.jsonl").read_text().splitlines() if '"loss"' in x]


def _run(files, out, *extra, env=None):
    proc = run_cli(["rlhf", *COMMON, "--dataset", files / "data.jsonl", "--output-dir", out, *extra], env=env)
    return proc, _steps(out)


def test_a_teacher_equal_to_the_policy_gives_no_signal(files, tmp_path):
    proc, steps = _run(files, tmp_path / "a", "--teacher-model", "tiny-llama-2l", "--train-type", "full",
                       "--num-generations", "1",
                       "--per-device-train-batch-size", "4", "--parallelism", "single", "--max-steps", "1")
    assert "teacher: a frozen copy of tiny-llama-2l" in proc.stdout and "rewards none" in proc.stdout
    s = steps[0]
    assert abs(s["teacher_kl"]) < 1e-6 and abs(s["loss"]) < 1e-7 and s["grad_norm"] < 1e-7
    assert s["reward"] == 0.0


def test_teacher_kl_coef_scales_a_teachers_signal(files, tmp_path):
    runs = {}
    for coef in ("1", "2"):
        _, steps = _run(files, tmp_path / coef, "--teacher-model", "tiny-llama", "--teacher-kl-coef", coef,
                        "--num-generations", "1", "--per-device-train-batch-size", "4", "--parallelism", "single",
                        "--max-steps", "1")
        runs[coef] = steps[0]
    assert runs["1"]["teacher_kl"] > 1e-3                         # another model: a distance
    assert runs["2"]["teacher_kl"] == pytest.approx(runs["1"]["teacher_kl"], rel=1e-6)   # the same completions
    assert abs(runs["1"]["loss"]) > 1e-4
    assert runs["2"]["loss"] == pytest.approx(2 * runs["1"]["loss"], rel=1e-5)
    assert runs["2"]["grad_norm"] == pytest.approx(2 * runs["1"]["grad_norm"], rel=1e-4)


def test_lora_teacher_is_the_base_with_the_adapter_disabled(files, tmp_path):
    proc, steps = _run(files, tmp_path / "l", "--teacher-model", "tiny-llama-2l", "--train-type", "lora",
                       "--external-plugins", files / "plugin.py", "--reward-funcs", "length",
                       "--num-generations", "2", "--per-device-train-batch-size", "4", "--learning-rate", "5e-2",
                       "--parallelism", "single", "--max-steps", "2")
    assert "teacher: the base model with the adapter disabled" in proc.stdout
    assert "frozen copy" not in proc.stdout
    assert abs(steps[0]["teacher_kl"]) < 1e-7        # LoRA starts at B = 0: the policy is its base
    assert steps[1]["teacher_kl"] > 1e-6             # the reward moved the adapter away from the base


def test_zero3_teacher_under_a_zero2_policy_matches_one_process(files, tmp_path):
    pytest.importorskip("deepspeed")
    args = ("--teacher-model", "tiny-llama", "--num-generations", "1", "--max-steps", "1")
    _, one = _run(files, tmp_path / "one", *args, "--per-device-train-batch-size", "4", "--parallelism", "single")
    env = cli_env()
    env["NPROC_PER_NODE"] = "2"
    proc, two = _run(files, tmp_path / "two", *args, "--per-device-train-batch-size", "2", "--deepspeed", "zero2",
                     "--teacher-deepspeed", "zero3", env=env)
    assert "(ZeRO-3 partitions)" in proc.stdout
    assert two[0]["teacher_kl"] == pytest.approx(one[0]["teacher_kl"], rel=1e-4)
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-3, abs=1e-6)
