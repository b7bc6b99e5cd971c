"""CHORD (--chord_sft_dataset, rlhf/chord.py) through the CLI: with mu 1 a GRPO step is `swiftlite sft`'s
step on the expert rows (the same loss and gradient norm, one process and two DDP processes); with
mu 0 it is plain GRPO's; CHORD-phi shrinks the expert loss by each token's p (1 - p)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli_env, run_cli

COMMON = ["--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--seed", "3", "--train-type", "full",
          "--logging-steps", "1", "--save-hf-model", "false", "--learning-rate", "1e-3"]
GRPO = ["--rlhf-type", "grpo", "--reward-funcs", "format", "--num-generations", "2", "--max-completion-length", "6",
        "--gradient-accumulation-steps", "1", "--beta", "0"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("chord")
    words = ["abcd", "bcda", "cdab", "dabc", "abdc", "badc", "cadb", "dcba"]
    (d / "prompts.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"reverse: {w}"}]}) + "\n" for w in words))
    (d / "expert.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"reverse: {w}"},
                                 {"role": "assistant", "content": w[::-1]}]}) + "\n" for w in words[:2]))
    return d


def _steps(run):
    return [json.loads(x) for x in (run / "logging.jsonl").read_text().splitlines() if '"loss"' in x]


def _chord(files, mu, phi="false"):
    return ["--chord-sft-dataset", files / "expert.jsonl", "--chord-sft-per-device-train-batch-size", "2",
            "--chord-mu-warmup-steps", "0", "--chord-mu-decay-steps", "0", "--chord-mu-peak", mu,
            "--chord-mu-valley", mu, "--chord-enable-phi-function", phi]


def _grpo(files, out, *extra, per_device="2", env=None):
    proc = run_cli(["rlhf", *COMMON, *GRPO, "--dataset", files / "prompts.jsonl", "--per-device-train-batch-size",
                    per_device, "--output-dir", out, "--max-steps", "2", *extra], env=env)
    return proc, _steps(out)


def test_mu_one_is_sft_on_the_expert_rows(files, tmp_path):
    run_cli(["sft", *COMMON, "--dataset", files / "expert.jsonl", "--per-device-train-batch-size", "2",
             "--gradient-accumulation-steps", "1", "--parallelism", "single", "--max-steps", "1",
             "--output-dir", tmp_path / "sft"])
    sft = _steps(tmp_path / "sft")[0]
    proc, steps = _grpo(files, tmp_path / "one", *_chord(files, "1"), "--parallelism", "single")
    assert "CHORD: 2 expert rows, 2 per micro-batch" in proc.stdout
    first = steps[0]
    assert first["chord_mu"] == 1.0
    assert first["loss"] == pytest.approx(sft["loss"], rel=1e-5)        # (1 - mu) x GRPO's is 0
    assert first["chord_sft_loss"] == pytest.approx(sft["loss"], rel=1e-5)
    assert first["grad_norm"] == pytest.approx(sft["grad_norm"], rel=1e-4)
    env = cli_env()
    env["NPROC_PER_NODE"] = "2"    # each process draws both rows: the same SFT gradient, averaged
    _, two = _grpo(files, tmp_path / "two", *_chord(files, "1"), "--parallelism", "ddp", per_device="1", env=env)
    for a, b in zip(two, steps):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_mu_zero_is_plain_grpo_and_phi_shrinks_the_expert_loss(files, tmp_path):
    _, plain = _grpo(files, tmp_path / "plain", "--parallelism", "single")
    _, zero = _grpo(files, tmp_path / "zero", *_chord(files, "0"), "--parallelism", "single")
    for a, b in zip(zero, plain):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-9)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
        assert a["chord_mu"] == 0.0 and a["chord_sft_loss"] == 0.0
    _, full = _grpo(files, tmp_path / "half", *_chord(files, "0.5"), "--parallelism", "single")
    _, phi = _grpo(files, tmp_path / "phi", *_chord(files, "0.5", "true"), "--parallelism", "single")
    assert 0 < phi[0]["chord_sft_loss"] < 0.25 * full[0]["chord_sft_loss"]   # p (1 - p) <= 1/4


def test_resume_continues_the_same_losses_with_a_teacher_and_chord(files, tmp_path):
    """A run stopped after checkpoint-2 and resumed gives the uninterrupted run's steps 3 and 4 bit for
    bit: the expert batches are a function of the step, the teacher is frozen, the round state is saved."""
    args = ["rlhf", *COMMON, *GRPO, "--dataset", files / "prompts.jsonl", "--per-device-train-batch-size", "2",
            "--parallelism", "single", "--teacher-model", "tiny-llama", "--save-steps", "2",
            "--lr-scheduler", "constant", "--num-iterations", "2",
            "--chord-sft-dataset", files / "expert.jsonl", "--chord-sft-per-device-train-batch-size", "1",
            "--chord-mu-warmup-steps", "1", "--chord-mu-decay-steps", "2", "--chord-mu-peak", "0.8",
            "--chord-mu-valley", "0.1"]
    run_cli([*args, "--max-steps", "4", "--output-dir", tmp_path / "whole"])
    run_cli([*args, "--max-steps", "2", "--output-dir", tmp_path / "cut"])
    proc = run_cli([*args, "--max-steps", "4", "--resume", "true", "--output-dir", tmp_path / "cut"])
    assert "resuming from checkpoint-2" in proc.stdout
    whole = _steps(tmp_path / "whole")
    cut = {s["step"]: s for s in _steps(tmp_path / "cut")}
    assert [s["chord_mu"] for s in whole] == pytest.approx([0.0, 0.8, 0.45, 0.1])
    for s in whole:
        for k in ("loss", "grad_norm", "teacher_kl", "chord_sft_loss"):
            assert cut[s["step"]][k] == s[k], (s["step"], k)
