"""GKD (rlhf/gkd.py) on 2 CPU processes (gloo) against one process, through the CLI: FSDP2 and ZeRO-3, full
fine-tune of the 2-layer tiny-llama distilling the 4-layer one (a frozen teacher laid out by the backend:
FSDP2 on the policy's mesh, a ZeRO-3 partition). --lmbda 0.5 with --seed 0 makes step 1 train on the
dataset's responses and step 2 on completions the student samples (the draw is (seed + step)'s, the
completion seeds (seed, step, row)'s: the same completions on any number of processes). Asserted per step:
the branch, loss, jsd and gradient norm (1e-5 relative) equal the one-process run's, and the completions
logged are the same texts. With LoRA whose teacher is the run's own model (the base with the adapter
disabled inside the sharded student), FSDP2 and FSDP1 x 2 give one process's steps too."""

from __future__ import annotations

import json
import random

import pytest

from tests.conftest import cli_env, run_cli

SEED = 0


def _write_rows(path):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"reverse: {w}"},
                                                     {"role": "assistant", "content": w[::-1]}]}) + "\n"
                            for w in ["abcd", "bcda", "cdab", "dabc", "abdc", "badc", "cadb", "dcba"]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("gkd_dist")
    _write_rows(d / "d.jsonl")
    common = ["rlhf", "--rlhf-type", "gkd", "--model", "tiny-llama-2l", "--teacher-model", "tiny-llama",
              "--torch-dtype", "fp32", "--seed", str(SEED), "--train-type", "full", "--logging-steps", "1",
              "--save-hf-model", "false", "--save-strategy", "no", "--learning-rate", "1e-3", "--lmbda", "0.5",
              "--max-completion-length", "6", "--gradient-accumulation-steps", "1", "--dataset", d / "d.jsonl",
              "--max-steps", "2", "--log-completions", "true", "--sft-alpha", "0.1",
              "--split-dataset-ratio", "0.25", "--eval-steps", "1"]
    run_cli([*common, "--per-device-train-batch-size", "4", "--parallelism", "single", "--output-dir", d / "one"])
    env = cli_env()
    env["NPROC_PER_NODE"] = "2"
    names = ["one", "fsdp"]
    run_cli([*common, "--per-device-train-batch-size", "2", "--parallelism", "fsdp", "--output-dir", d / "fsdp"], env=env)
    try:
        import deepspeed  # noqa: F401
        run_cli([*common, "--per-device-train-batch-size", "2", "--deepspeed", "zero3", "--output-dir", d / "zero3"],
                env=env)
        names.append("zero3")
    except ImportError:
        pass
    out = {}
    for name in names:
        lines = (d / name / "logging.jsonl").read_text().splitlines()
        steps = [json.loads(x) for x in lines if '"loss"' in x]
        comps = [json.loads(x) for x in (d / name / "completions.jsonl").read_text().splitlines()]
        out[name] = (steps, comps)
        out[name + "/eval"] = [json.loads(x) for x in lines if '"eval_loss"' in x]
    return out


def test_the_branches_are_those_of_the_seed(runs):
    steps, comps = runs["one"]
    want = [float(random.Random(SEED + s).random() <= 0.5) for s in range(2)]
    assert [s["on_policy"] for s in steps] == want == [0.0, 1.0]
    assert {c["step"] for c in comps} == {2} and len(comps) == 4      # step 2's four rows, sampled
    assert "sft_loss" in steps[0] and "sft_loss" not in steps[1]     # --sft-alpha on dataset steps only
    assert steps[0]["loss"] == pytest.approx(steps[0]["jsd"] + 0.1 * steps[0]["sft_loss"], rel=1e-6)


@pytest.mark.parametrize("backend", ["fsdp", "zero3"])
def test_two_processes_match_one(runs, backend):
    if backend not in runs:
        pytest.skip("deepspeed is not installed")
    (one, c1), (two, c2) = runs["one"], runs[backend]
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a["jsd"] > 1e-3 and a["on_policy"] == b["on_policy"]
        for k in ("loss", "grad_norm", "jsd"):
            assert b[k] == pytest.approx(a[k], rel=1e-5), (backend, a["step"], k)
    assert sorted(c["completion"] for c in c2) == sorted(c["completion"] for c in c1)


@pytest.mark.parametrize("backend", ["fsdp", "zero3"])
def test_validation_samples_alike_on_two_processes(runs, backend):
    """Validation after step 1 draws step 1's branch (sampled, seed 0) and after step 2 step 2's: each
    validation row's completion is seeded by the row, so two processes score what one does."""
    if backend not in runs:
        pytest.skip("deepspeed is not installed")
    one, two = runs["one/eval"], runs[backend + "/eval"]
    assert [e["step"] for e in one] == [e["step"] for e in two] == [1, 2]
    for a, b in zip(one, two):
        assert a["eval_jsd"] > 1e-3
        for k in ("eval_loss", "eval_jsd"):
            assert b[k] == pytest.approx(a[k], rel=1e-5), (backend, a["step"], k)


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """LoRA (dropout 0: the same masks on any world size) whose teacher is the run's own model, i.e. its base
    with the adapter disabled inside the sharded student (FSDP2's DTensors, FSDP1's flat parameters);
    --sft_alpha moves the adapter on the dataset step, so the sampled step has a distance to close."""
    d = tmp_path_factory.mktemp("gkd_lora")
    _write_rows(d / "d.jsonl")
    common = ["rlhf", "--rlhf-type", "gkd", "--model", "tiny-llama-2l", "--teacher-model", "tiny-llama-2l",
              "--torch-dtype", "fp32", "--seed", str(SEED), "--train-type", "lora", "--lora-dropout", "0",
              "--logging-steps", "1", "--save-strategy", "no", "--learning-rate", "1e-2", "--lmbda", "0.5",
              "--max-completion-length", "6", "--gradient-accumulation-steps", "1", "--dataset", d / "d.jsonl",
              "--max-steps", "2", "--sft-alpha", "0.5"]
    run_cli([*common, "--per-device-train-batch-size", "4", "--parallelism", "single", "--output-dir", d / "one"])
    env = cli_env()
    env["NPROC_PER_NODE"] = "2"
    for backend in ("fsdp", "fsdp1"):
        run_cli([*common, "--per-device-train-batch-size", "2", "--parallelism", backend, "--output-dir", d / backend],
                env=env)
    return {n: [json.loads(x) for x in (d / n / "logging.jsonl").read_text().splitlines() if '"loss"' in x]
            for n in ("one", "fsdp", "fsdp1")}


@pytest.mark.parametrize("backend", ["fsdp", "fsdp1"])
def test_lora_base_teacher_on_two_processes_matches_one(lora_runs, backend):
    one, two = lora_runs["one"], lora_runs[backend]
    assert [s["on_policy"] for s in one] == [s["on_policy"] for s in two] == [0.0, 1.0]
    assert abs(one[0]["jsd"]) < 1e-7 and one[1]["jsd"] > 1e-4      # B = 0 at the start; then the adapter moved
    for a, b in zip(one, two):
        for k in ("loss", "grad_norm", "jsd"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-9), (backend, a["step"], k)


@pytest.fixture(scope="module")
def turn_runs(tmp_path_factory):
    """--multi_turn_scheduler math_tip_trick (GRPO's rollouts, whose turns every process joins while any has a
    completion left): the student makes EOS likely (tests/e2e/test_grpo_multi_turn_e2e.py), so its completions
    end early and get the tip."""
    from tests.e2e.test_gkd_multi_turn_e2e import build_eos_prone, write_math_rows
    d = tmp_path_factory.mktemp("gkd_turns")
    build_eos_prone(d / "model")
    write_math_rows(d / "d.jsonl")
    common = ["rlhf", "--rlhf-type", "gkd", "--model", d / "model", "--teacher-model", "tiny-llama",
              "--torch-dtype", "fp32", "--seed", str(SEED), "--train-type", "full", "--logging-steps", "1",
              "--save-hf-model", "false", "--save-strategy", "no", "--learning-rate", "1e-3", "--lmbda", "1",
              "--multi-turn-scheduler", "math_tip_trick", "--max-completion-length", "12",
              "--gradient-accumulation-steps", "1", "--dataset", d / "d.jsonl", "--max-steps", "2",
              "--log-completions", "true"]
    run_cli([*common, "--per-device-train-batch-size", "4", "--parallelism", "single", "--output-dir", d / "one"])
    env = cli_env()
    env["NPROC_PER_NODE"] = "2"
    run_cli([*common, "--per-device-train-batch-size", "2", "--parallelism", "fsdp", "--output-dir", d / "fsdp"],
            env=env)
    return {n: ([json.loads(x) for x in (d / n / "logging.jsonl").read_text().splitlines() if '"loss"' in x],
                [json.loads(x) for x in (d / n / "completions.jsonl").read_text().splitlines()]) for n in ("one", "fsdp")}


def test_multi_turn_on_two_processes_matches_one(turn_runs):
    (one, c1), (two, c2) = turn_runs["one"], turn_runs["fsdp"]
    assert sum("But wait... It seems I made a mistake," in c["completion"] for c in c1) >= 2
    assert sorted(c["completion"] for c in c2) == sorted(c["completion"] for c in c1)
    for a, b in zip(one, two):
        for k in ("loss", "grad_norm", "jsd", "completions/mean_length"):
            assert b[k] == pytest.approx(a[k], rel=1e-5), (a["step"], k)
