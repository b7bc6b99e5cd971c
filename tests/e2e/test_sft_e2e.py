"""The CLI end to end on one process: the run folder, a falling loss, a reloadable model, a local HF
folder as --model, pre-training on text, and --dry-run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import read_losses, run_cli


@pytest.fixture(scope="module")
def run(demo_data, tmp_path_factory):
    train, val = demo_data
    out = tmp_path_factory.mktemp("e2e") / "run"
    proc = run_cli(["sft", "--model", "tiny-llama-2l", "--train-type", "full", "--dataset", train, "--val-dataset", val,
                    "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", 30, "--per-device-train-batch-size", 8, "--learning-rate", "3e-3",
                    "--logging-steps", 5, "--save-steps", 15, "--save-total-limit", 1, "--output-dir", out,
                    "--report-to", "tensorboard"])
    return out, proc


def test_run_folder(run):
    out, proc = run
    assert json.loads((out / "args.json").read_text())["train"]["max_steps"] == 30
    for f in ("logging.jsonl", "images/train_loss.png", "images/learning_rate.png", "latest"):
        assert (out / f).is_file(), f
    assert list((out / "runs").glob("events.out.tfevents*")), "TensorBoard events"
    assert (out / "latest").read_text().strip() == "checkpoint-30"
    # --save-total-limit 1 kept only the newest checkpoint
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-30"]
    ck = out / "checkpoint-30"
    for f in ("manifest.json", "trainer_state.json", "scheduler.json", "dcp/.metadata", "rng/rank0.pt",
              "model/config.json", "model/model.safetensors", "model/tokenizer.json"):
        assert (ck / f).is_file(), f
    assert "first step done" in proc.stdout


def test_loss_falls_and_eval_is_logged(run):
    out, _ = run
    losses = read_losses(out)
    assert losses[30] < 0.6 * losses[1], losses
    evals = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert [e["step"] for e in evals] == [15, 30]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] + 0.05


def test_checkpoint_model_reloads_with_transformers(run, demo_data):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, _ = run
    folder = out / "checkpoint-30" / "model"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": "reverse: abc"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    from safetensors.torch import load_file
    sd = load_file(folder / "model.safetensors")
    assert set(sd) == set(model.state_dict()), "every weight of the architecture is in the file"


def test_local_hf_folder_as_model(run, demo_data, tmp_path):
    """The from_pretrained path users take with hub ids, exercised on a local folder."""
    train, _ = demo_data
    out, _ = run
    run2 = tmp_path / "from_folder"
    run_cli(["sft", "--model", out / "checkpoint-30" / "model", "--train-type", "full", "--dataset", f"{train}#64",
             "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", 2,
             "--per-device-train-batch-size", 8, "--output-dir", run2, "--logging-steps", 1])
    first = read_losses(run2)[1]
    assert first < read_losses(out)[1] - 0.5, "starts from the trained weights, not from scratch"


def test_pretraining_on_text(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"text": "abcdefgh" * (i % 5 + 1)}) + "\n" for i in range(64)))
    out = tmp_path / "pt"
    run_cli(["pt", "--model", "tiny-llama-2l", "--train-type", "full", "--dataset", data, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", 15,
             "--learning-rate", "3e-3",
             "--per-device-train-batch-size", 8, "--output-dir", out, "--logging-steps", 1, "--packing",
             "--max-length", 64])
    losses = read_losses(out)
    assert losses[15] < losses[1] - 1.0


def test_dry_run_prints_plan_and_creates_nothing(tmp_path):
    out = tmp_path / "never"
    data = tmp_path / "x.jsonl"
    data.write_text(json.dumps({"query": "q", "response": "r"}) + "\n")
    proc = run_cli(["sft", "--model", "llama-70b", "--dataset", data, "--parallelism", "fsdp",
                    "--nproc-per-node", 8, "--nnodes", 2, "--node-rank", 1, "--master-addr", "10.1.2.3",
                    "--master-port", 29400, "--per-device-train-batch-size", 2,
                    "--gradient-accumulation-steps", 4, "--output-dir", out, "--dry-run"])
    assert "world:          2 node(s) x 8 process(es) = 16" in proc.stdout
    assert "global 128" in proc.stdout
    assert "--nnodes=2" in proc.stdout and "--node-rank=1" in proc.stdout and "--master-addr=10.1.2.3" in proc.stdout
    assert not out.exists()
