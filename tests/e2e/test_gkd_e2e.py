"""GKD (`rlhf --rlhf_type gkd`, rlhf/gkd.py) through the CLI on one process: a teacher equal to the student gives
no signal; padded and padding-free batches train alike, on-policy steps included; with LoRA and the run's own
model as teacher the teacher is the base with the adapter disabled; beta, top-k and --sft_alpha change the loss
as they should; validation logs eval_loss; a resume continues with the same branches and completions; completions
from a `swiftlite rollout` server (its transformers engine, the student's weights synced each sampled step) are
the in-process ones; and the refusals come all at once, one line each, exit 2."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

COMMON = ["rlhf", "--rlhf-type", "gkd", "--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--seed", "0",
          "--train-type", "full", "--logging-steps", "1", "--save-hf-model", "false", "--learning-rate", "1e-3",
          "--max-completion-length", "6", "--gradient-accumulation-steps", "2", "--per-device-train-batch-size", "2",
          "--parallelism", "single"]
WORDS = ["abcd", "bcda", "cdab", "dabc", "abdc", "badc", "cadb", "dcba"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("gkd")
    f = d / "d.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"reverse: {w}"},
                                                  {"role": "assistant", "content": w[::-1]}]}) + "\n" for w in WORDS))
    return f


def _steps(out):
    return [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines() if '"loss"' in x]


def _run(data, out, *extra, check=True):
    proc = run_cli([*COMMON, "--dataset", data, "--output-dir", out, *extra], check=check)
    return proc, (_steps(out) if check else None)


def test_a_teacher_equal_to_the_student_gives_no_signal(data, tmp_path):
    proc, steps = _run(data, tmp_path / "same", "--teacher-model", "tiny-llama-2l", "--lmbda", "0", "--max-steps", "1",
                       "--save-strategy", "no")
    assert "gkd (beta 0.5, lmbda 0, teacher: a frozen copy of tiny-llama-2l" in proc.stdout
    assert abs(steps[0]["loss"]) < 1e-7 and steps[0]["grad_norm"] < 1e-7 and steps[0]["on_policy"] == 0.0


def test_padding_free_trains_as_padded(data, tmp_path):
    runs = {}
    for pf in ("false", "true"):
        _, runs[pf] = _run(data, tmp_path / pf, "--teacher-model", "tiny-llama", "--lmbda", "0.5", "--max-steps", "2",
                           "--padding-free", pf, "--save-strategy", "no")
    assert [s["on_policy"] for s in runs["false"]] == [0.0, 1.0]      # seed 0: a dataset step, then a sampled one
    for a, b in zip(runs["false"], runs["true"]):
        assert a["jsd"] > 1e-3
        for k in ("loss", "grad_norm", "jsd"):
            assert b[k] == pytest.approx(a[k], rel=1e-5), (a["step"], k)
    assert runs["true"][1]["completions/mean_length"] == runs["false"][1]["completions/mean_length"]


def test_lora_teacher_is_the_base_with_the_adapter_disabled(data, tmp_path):
    proc, steps = _run(data, tmp_path / "lora", "--teacher-model", "tiny-llama-2l", "--train-type", "lora",
                       "--lmbda", "0", "--sft-alpha", "1", "--learning-rate", "5e-2", "--max-steps", "2",
                       "--save-strategy", "no")
    assert "teacher: the base model with the adapter disabled" in proc.stdout and "frozen copy" not in proc.stdout
    assert abs(steps[0]["jsd"]) < 1e-7          # LoRA starts at B = 0: the student is its base
    assert steps[0]["sft_loss"] > 0.1           # the cross-entropy moves the adapter away from the base
    assert steps[1]["jsd"] > 1e-7


def test_beta_topk_and_sft_alpha_change_the_loss(data, tmp_path):
    got = {}
    for name, extra in {"jsd": [], "fwd": ["--beta", "0"], "rev": ["--beta", "1"], "top": ["--gkd-logits-topk", "4"],
                        "sft": ["--sft-alpha", "0.5"]}.items():
        _, s = _run(data, tmp_path / name, "--teacher-model", "tiny-llama", "--lmbda", "0", "--max-steps", "1",
                    "--save-strategy", "no", *extra)
        got[name] = s[0]
    losses = [got[k]["loss"] for k in ("jsd", "fwd", "rev", "top")]
    assert all(v > 1e-3 for v in losses) and len({round(v, 7) for v in losses}) == 4
    # the JSD mixes toward the midpoint distribution m, so each of its KL terms is smaller than the plain KLs here
    assert got["fwd"]["loss"] > got["jsd"]["loss"] and got["rev"]["loss"] > got["jsd"]["loss"]
    s = got["sft"]
    assert s["jsd"] == pytest.approx(got["jsd"]["jsd"], rel=1e-6)      # the same batch, the same divergence
    assert s["loss"] == pytest.approx(s["jsd"] + 0.5 * s["sft_loss"], rel=1e-6) and s["sft_loss"] > 1.0


def test_validation_logs_eval_loss(data, tmp_path):
    _run(data, tmp_path / "val", "--teacher-model", "tiny-llama", "--lmbda", "0", "--max-steps", "2",
         "--split-dataset-ratio", "0.25", "--eval-steps", "2", "--save-strategy", "no")
    evals = [json.loads(x) for x in (tmp_path / "val" / "logging.jsonl").read_text().splitlines() if '"eval_loss"' in x]
    assert evals and evals[-1]["eval_loss"] == pytest.approx(evals[-1]["eval_jsd"], rel=1e-6)
    assert evals[-1]["eval_jsd"] > 1e-3


def test_validation_samples_with_the_steps_draw_as_msswift(data, tmp_path):
    """ms-swift's GKD validation draws its branch as a training step does: with --lmbda 1 the validation rows'
    responses are the student's completions, so eval_jsd differs from the dataset responses' (--lmbda 0; a
    learning rate of 1e-9 leaves both runs' weights where they started); prompt-only rows (OPSD's) are scored
    on their completions."""
    evals = {}
    for lmbda in ("0", "1"):
        _run(data, tmp_path / lmbda, "--teacher-model", "tiny-llama", "--lmbda", lmbda, "--max-steps", "1",
             "--learning-rate", "1e-9", "--split-dataset-ratio", "0.25", "--eval-steps", "1", "--save-strategy", "no")
        evals[lmbda] = [json.loads(x) for x in (tmp_path / lmbda / "logging.jsonl").read_text().splitlines()
                        if '"eval_loss"' in x][-1]
    assert evals["1"]["eval_jsd"] > 1e-3 and evals["0"]["eval_jsd"] > 1e-3
    assert evals["1"]["eval_jsd"] != pytest.approx(evals["0"]["eval_jsd"], rel=1e-3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"reverse: {w}"}]}) + "\n"
                               for w in WORDS))
    _run(prompts, tmp_path / "p", "--teacher-model", "tiny-llama", "--lmbda", "1", "--max-steps", "1",
         "--split-dataset-ratio", "0.25", "--eval-steps", "1", "--save-strategy", "no")
    got = [json.loads(x) for x in (tmp_path / "p" / "logging.jsonl").read_text().splitlines() if '"eval_loss"' in x]
    assert got and got[-1]["eval_jsd"] > 1e-3       # before: no targets, an eval_loss of 0


def test_a_resume_continues_with_the_same_branches_and_completions(data, tmp_path):
    args = ("--teacher-model", "tiny-llama", "--lmbda", "0.5", "--max-steps", "4", "--log-completions", "true")
    _, whole = _run(data, tmp_path / "whole", *args, "--save-strategy", "no")
    _run(data, tmp_path / "part", *args, "--save-steps", "2")
    ckpt = tmp_path / "part" / "checkpoint-2"
    _, resumed = _run(data, tmp_path / "resumed", *args, "--resume-from", ckpt, "--save-strategy", "no")
    assert [s["on_policy"] for s in whole] == [0.0, 1.0, 0.0, 1.0]
    tail = [s for s in resumed if s["step"] > 2]
    assert [s["step"] for s in tail] == [3, 4]
    for a, b in zip(whole[2:], tail):
        for k in ("loss", "grad_norm", "jsd"):
            assert b[k] == pytest.approx(a[k], rel=1e-5), (a["step"], k)
    comps = lambda out: [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]  # noqa: E731
    assert len([c for c in comps(tmp_path / "whole") if c["step"] == 4]) == 4
    assert [c["completion"] for c in comps(tmp_path / "resumed") if c["step"] == 4] == \
        [c["completion"] for c in comps(tmp_path / "whole") if c["step"] == 4]


def test_refusals_come_together(data, tmp_path):
    out = tmp_path / "bad"
    proc = run_cli([*COMMON, "--dataset", data, "--output-dir", out, "--seq-kd", "true", "--beta", "2",
                    "--use-vllm", "true"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 4, proc.stderr          # all at once, one line each
    for want in ("--rlhf-type gkd needs --teacher-model", "--beta 2: GKD's beta", "--seq-kd true",
                 "--use-vllm true needs --vllm-mode colocate or server"):
        assert any(want in x for x in lines), want
    assert not out.exists()
    proc = run_cli([*COMMON, "--dataset", data, "--output-dir", out, "--teacher-model", "tiny-llama", "--packing",
                    "true", "--lmbda", "0.5"], check=False)
    assert proc.returncode == 2 and "--packing with --lmbda 0.5" in proc.stderr and not out.exists()
    proc = run_cli([*COMMON, "--dataset", data, "--output-dir", out, "--teacher-model", "tiny-llama", "--beta", "2"],
                   check=False)
    assert proc.returncode == 2 and "--beta 2: GKD's beta interpolates" in proc.stderr
    proc = run_cli([*COMMON, "--dataset", data, "--output-dir", out, "--teacher-model", "tiny-llama", "--seq-kd",
                    "true"], check=False)
    assert proc.returncode == 2 and "--seq-kd true" in proc.stderr and "--lmbda 0" in proc.stderr


def test_dry_run_says_what_gkd_does(data, tmp_path):
    proc = run_cli([*COMMON, "--dataset", data, "--output-dir", tmp_path / "dry", "--teacher-model", "tiny-llama",
                    "--gkd-logits-topk", "8", "--dry-run"])
    assert ("gkd:            generalized JSD, beta 0.5 to tiny-llama at temperature 0.9 over its top 8 tokens, "
            "on-policy with probability 0.5 (completions of up to 6 tokens)") in proc.stdout


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.e2e.test_rollout_server import _server
    proc, srv = _server(tmp_path_factory)          # tiny-llama-2l with the weights of seed 0
    yield srv
    proc.terminate()
    assert proc.wait(timeout=30) == 0, srv["log"].read_text()


def test_a_rollout_server_samples_the_in_process_completions(data, server, tmp_path):
    """Two FSDP2 processes, every step sampled (--lmbda 1), seed 3 (so the server starts from other weights
    than the student's: only the sync makes them equal): the completions and losses of the run sampling
    in-process."""
    from tests.e2e.test_rollout_server import _port
    common = ["--teacher-model", "tiny-llama", "--lmbda", "1", "--seed", "3", "--max-steps", "2",
              "--log-completions", "true", "--save-strategy", "no", "--parallelism", "fsdp", "--nproc-per-node", "2",
              "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "1"]
    _, srv = _run(data, tmp_path / "srv", *common, "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host",
                  "127.0.0.1", "--vllm_server_port", str(server["port"]), "--vllm_server_group_port", str(_port()))
    _, local = _run(data, tmp_path / "local", *common)
    comps = lambda out: [(c["step"], c["completion"]) for c in  # noqa: E731
                         map(json.loads, (out / "completions.jsonl").read_text().splitlines())]
    assert len(comps(tmp_path / "local")) == 8 and comps(tmp_path / "srv") == comps(tmp_path / "local")
    assert [s["on_policy"] for s in srv] == [1.0, 1.0]
    assert [s["loss"] for s in srv] == pytest.approx([s["loss"] for s in local], rel=1e-6)
    assert [s["grad_norm"] for s in srv] == pytest.approx([s["grad_norm"] for s in local], rel=1e-5)
