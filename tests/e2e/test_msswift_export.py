"""An ms-swift user's LoRA command, then `swift export`'s spelling (issue 13, acceptance item 2, the
export half): underscore flags, `--dataset file#N`, `--target_modules all-linear`,
`--lr_scheduler_type cosine`, `--system`, `--report_to tensorboard` (events with HF's tag names); then
`swiftlite export --adapters <ckpt> --merge_lora true` writes `<ckpt>-merged`, which transformers
loads and whose logits match the training-side merged model (`--verify`, and checked here again).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import cli_env, run_cli

pytestmark = pytest.mark.slow

LOGIT_RTOL = 0.03


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    from swiftlite.demo import write_demo_data
    root = tmp_path_factory.mktemp("msswift")
    train, _ = write_demo_data(root / "data", n_train=100, n_val=8)
    out = root / "output"
    run_cli(["sft", "--model", "tiny-llama", "--train_type", "lora", "--dataset", f"{train}#48",
             "--target_modules", "all-linear", "--lr_scheduler_type", "cosine", "--learning_rate", "2e-2",
             "--lora_rank", "8", "--lora_alpha", "32", "--per_device_train_batch_size", "4",
             "--gradient_accumulation_steps", "1", "--gradient-checkpointing", "false", "--max_steps", "3", "--logging_steps", "1",
             "--max_length", "64", "--truncation_strategy", "right", "--system", "You reverse strings.",
             "--report_to", "tensorboard", "--output_dir", out],
            env=cli_env(SWIFTLITE_CACHE=str(root / "cache")))
    return out


def _export(*args) -> str:
    return run_cli(["export", *map(str, args)]).stdout


def test_the_run_trained_on_n_sampled_rows(lora_run):
    first = (lora_run / "logging.jsonl").read_text()
    assert (lora_run / "checkpoint-3" / "adapter" / "adapter_config.json").is_file()
    events = list((lora_run / "runs").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard events"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert {"train/loss", "train/learning_rate", "train/grad_norm"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
    assert json.loads((lora_run / "args.json").read_text())["data"]["dataset"][0].endswith("#48")
    assert "loss" in first


def test_export_adapters_merge_lora_true_writes_ckpt_merged(lora_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlite.export import load_reference
    ckpt = lora_run / "checkpoint-3"
    log = _export("--adapters", ckpt, "--merge_lora", "true", "--verify")
    merged = lora_run / "checkpoint-3-merged"
    assert f"output {merged} (no --output given: <checkpoint>-merged)" in log
    assert "verify: checks: passed" in log and merged.is_dir()
    names = {p.name for p in merged.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names and "adapter_config.json" not in names

    model = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    tok = AutoTokenizer.from_pretrained(str(merged))
    text = tok.apply_chat_template([{"role": "user", "content": "reverse: abcdef"}], tokenize=False,
                                   add_generation_prompt=True) + "fedcba"
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    ref = load_reference(str(ckpt), lambda _m: None)                  # base + the checkpoint's adapter (peft)
    with torch.no_grad():
        got, want = model(input_ids=ids).logits.float(), ref.model(input_ids=ids).logits.float()
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < LOGIT_RTOL, f"merged logits differ by {rel:.2%} of the logit scale"

    # the run folder still lists its checkpoints as before: the export is not one of them
    from swiftlite import checkpoint as ckpt_store
    assert [c.name for c in ckpt_store.list_checkpoints(lora_run)] == ["checkpoint-3"]


def test_adapter_folder_and_false_spellings(lora_run, tmp_path):
    # --adapters on the checkpoint's adapter/ folder means the checkpoint; --merge_lora false: the adapter alone
    log = _export("--adapters", lora_run / "checkpoint-3" / "adapter", "--merge_lora", "false")
    out = lora_run / "checkpoint-3-export"
    assert f"output {out}" in log and (out / "adapter_model.safetensors").is_file()
    assert "source " + str(lora_run / "checkpoint-3") + " (step 3, lora" in log
    # --merge-lora alone still works, and = spelling
    _export("--ckpt", lora_run, "--merge-lora", "-o", tmp_path / "a")
    _export("--ckpt", lora_run, "--merge_lora=true", "-o", tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").is_file() and (tmp_path / "b" / "model.safetensors").is_file()


@pytest.mark.long
def test_merge_lora_on_a_full_run_is_an_error(tmp_path):
    from swiftlite.demo import write_demo_data
    train, _ = write_demo_data(tmp_path / "data", n_train=16, n_val=4)
    run = tmp_path / "full"
    run_cli(["sft", "--model", "tiny-llama-2l", "--train_type", "full", "--dataset", train, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max_steps", "1",
             "--per_device_train_batch_size", "2", "--max_length", "32", "--truncation_strategy", "right", "--output_dir", run],
            env=cli_env(SWIFTLITE_CACHE=str(tmp_path / "cache")))
    r = run_cli(["export", "--adapters", run / "checkpoint-1", "--merge_lora", "true"], check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "is a full fine-tune" in r.stderr and "export it without --merge-lora" in r.stderr
    assert not (run / "checkpoint-1-merged").exists()
    # without --merge-lora it exports: <checkpoint>-export
    log = run_cli(["export", "--adapters", run / "checkpoint-1"]).stdout
    assert (run / "checkpoint-1-export" / "model.safetensors").is_file(), log
