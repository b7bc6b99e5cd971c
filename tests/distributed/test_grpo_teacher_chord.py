"""GRPO with a teacher (rlhf/teacher.py) and CHORD (rlhf/chord.py) together, full fine-tune, on FSDP2 and
DDP with 2 CPU processes (gloo) against one process, through the CLI.

The teacher (the 4-layer tiny-llama against the 2-layer policy) is a frozen copy laid out by the backend
(FSDP2 on the policy's mesh, a DDP replica); CHORD's expert batch is a micro-batch of its own after each
GRPO micro-batch (mu 0.5), whose backward carries the gradient sync on the last. Two expert rows and an
expert batch of 2, so that every process draws both rows in every step (the per-process draws then meet
the one-process run's). Asserted per step: loss and gradient norm (1e-5 relative), teacher_kl and
chord_sft_loss (1e-5 relative) equal the one-process run's; measured 2026-12-03: within 2e-7."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli_env, run_cli

WORDS = ["abcd", "bcda", "cdab", "dabc", "abdc", "badc", "cadb", "dcba"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("teacher_chord")
    (d / "p.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"reverse: {w}"}]}) + "\n" for w in WORDS))
    (d / "e.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"reverse: {w}"},
                                 {"role": "assistant", "content": w[::-1]}]}) + "\n" for w in WORDS[:2]))
    common = ["rlhf", "--rlhf-type", "grpo", "--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--seed", "3",
              "--train-type", "full", "--logging-steps", "1", "--save-hf-model", "false", "--learning-rate", "1e-3",
              "--num-generations", "2", "--max-completion-length", "6", "--gradient-accumulation-steps", "1",
              "--beta", "0", "--dataset", d / "p.jsonl", "--max-steps", "2", "--teacher-model", "tiny-llama",
              "--chord-sft-dataset", d / "e.jsonl", "--chord-sft-per-device-train-batch-size", "2",
              "--chord-mu-warmup-steps", "0", "--chord-mu-decay-steps", "0", "--chord-mu-peak", "0.5",
              "--chord-mu-valley", "0.5"]
    out = {}
    run_cli([*common, "--per-device-train-batch-size", "4", "--parallelism", "single", "--output-dir", d / "one"])
    env = cli_env()
    env["NPROC_PER_NODE"] = "2"
    for backend in ("fsdp", "ddp"):
        run_cli([*common, "--per-device-train-batch-size", "2", "--parallelism", backend, "--output-dir", d / backend],
                env=env)
    for name in ("one", "fsdp", "ddp"):
        out[name] = [json.loads(x) for x in (d / name / "logging.jsonl").read_text().splitlines() if '"loss"' in x]
    return out


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_two_processes_match_one(runs, backend):
    one, two = runs["one"], runs[backend]
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a["teacher_kl"] > 1e-3 and a["chord_mu"] == b["chord_mu"] == 0.5
        for k in ("loss", "grad_norm", "teacher_kl", "chord_sft_loss"):
            assert b[k] == pytest.approx(a[k], rel=1e-5), (backend, a["step"], k)
