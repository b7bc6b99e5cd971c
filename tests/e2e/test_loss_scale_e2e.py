"""Weighted loss scales end to end (ms-swift's examples/train/agent/loss_scale/train.sh: --loss_scale hermes
--agent_template hermes): the first step's logged loss is the sum of weight x cross-entropy over the
targets of the step's rows / their number, computed here with the model's own forward; 2 DDP processes log
the same; a cached dataset written with the scale keeps the weights (the same loss from the folder); and
the messages' own "loss" / "loss_scale" fields act (ms-swift's data format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import read_losses, run_cli

TOOL = {"name": "reverse", "description": "Reverse a word",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}
WORDS = ["alpha", "bravo", "charlie", "delta"]


def _agent_row(w: str) -> dict:
    return {"tools": [json.dumps(TOOL)], "messages": [
        {"role": "user", "content": f"Please reverse {w}."},
        {"role": "tool_call", "content": json.dumps({"name": "reverse", "arguments": {"word": w}})},
        {"role": "tool_response", "content": w[::-1]},
        {"role": "assistant", "content": f"The reverse of {w} is {w[::-1]}."}]}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from swiftlite.models.presets import TINY_TOKENIZER, TINY_VOCAB
    d = tmp_path_factory.mktemp("loss_scale")
    conf = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=TINY_VOCAB, max_position_embeddings=1024,
                       eos_token_id=258, pad_token_id=259, bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(conf).save_pretrained(d / "model")
    AutoTokenizer.from_pretrained(TINY_TOKENIZER).save_pretrained(d / "model")
    (d / "agent.jsonl").write_text("".join(json.dumps(_agent_row(w)) + "\n" for w in WORDS))
    fields = [{"messages": [{"role": "user", "content": f"hi {i}"},
                            {"role": "assistant", "content": f"first answer {i}", "loss_scale": 3.0},
                            {"role": "user", "content": "and?"},
                            {"role": "assistant", "content": f"second answer {i}", "loss": False}]}
              for i in range(4)]
    (d / "fields.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fields))
    return d


def _args(world: Path, data: str | None, out: Path, *extra: str) -> list[str]:
    # one step over the 4 rows: 2 per micro-batch x 2 accumulation steps
    return ["sft", "--model", world / "model", *(["--dataset", world / data] if data else []),
            "--output_dir", out, "--torch_dtype", "fp32",
            "--train_type", "full", "--max_steps", "1", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--logging_steps", "1", "--max_length", "1024", *extra]


def _expected(world: Path, data: str, scale: str, binary: bool | None = None) -> float:
    """sum over the rows' targets of weight x cross-entropy / the number of targets, with the model's own
    forward and logits (the rows tokenized as the run tokenizes them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlite.config.loss_scale import parse
    from swiftlite.data.pipeline import tokenize_specs
    from swiftlite.data.agent import Agent
    tok = AutoTokenizer.from_pretrained(world / "model")
    model = AutoModelForCausalLM.from_pretrained(world / "model", torch_dtype=torch.float32)
    rows = tokenize_specs([str(world / data)], tok, task="sft", max_length=1024, packing=False, skip_bad_rows=False,
                          use_cache=False, loss_scale=parse(scale, binary=binary), agent=Agent("hermes")).rows
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["input_ids"]])
            labels = torch.tensor(r["labels"][1:])
            w = torch.tensor(r.get("loss_scale", [1.0] * len(r["labels"]))[1:])
            logits = model(input_ids=ids).logits[0, :-1].float()
            ce = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
            total += float((ce * w).sum())
            count += int((labels != -100).sum())
    return total / count


def test_hermes_step_loss_is_the_weighted_mean(world, tmp_path):
    run_cli(_args(world, "agent.jsonl", tmp_path / "h", "--loss_scale", "hermes", "--agent_template", "hermes"))
    expected = _expected(world, "agent.jsonl", "hermes")
    assert read_losses(tmp_path / "h")[1] == pytest.approx(expected, rel=1e-5)
    assert json.loads((tmp_path / "h" / "args.json").read_text())["data"]["loss_scale"] == "hermes"
    # the weights act: the binary scale's mean is another number
    assert abs(expected - _expected(world, "agent.jsonl", "default")) > 0.05 * expected

    # 2 processes, DDP and ZeRO-3 (the weights through DeepSpeed's engine forward): the same step (the
    # weighted sum over all ranks / all targets)
    for backend in ("ddp", "zero3"):
        run_cli(_args(world, "agent.jsonl", tmp_path / backend, "--loss_scale", "hermes", "--agent_template", "hermes",
                      "--nproc_per_node", "2", "--parallelism", backend, "--gradient_accumulation_steps", "1"))
        assert read_losses(tmp_path / backend)[1] == pytest.approx(expected, rel=1e-5), backend

    # a cached dataset written under the scale holds the weights (ms-swift's loss_scale column)
    run_cli(["export", "--model", world / "model", "--to_cached_dataset", "true", "--output_dir", tmp_path / "c",
             "--dataset", world / "agent.jsonl", "--loss_scale", "hermes", "--agent_template", "hermes",
             "--max_length", "1024"])
    run_cli(_args(world, None, tmp_path / "cached", "--cached_dataset", tmp_path / "c" / "train"))
    assert read_losses(tmp_path / "cached")[1] == pytest.approx(expected, rel=1e-5)


def test_message_fields_loss_and_loss_scale(world, tmp_path):
    """"loss": false takes the second answer out; "loss_scale": 3 weighs the first 3 with
    --is_binary_loss_scale false, and only marks it a target without (ms-swift's rule)."""
    run_cli(_args(world, "fields.jsonl", tmp_path / "w", "--is_binary_loss_scale", "false"))
    weighted = _expected(world, "fields.jsonl", "default", binary=False)
    assert read_losses(tmp_path / "w")[1] == pytest.approx(weighted, rel=1e-5)
    run_cli(_args(world, "fields.jsonl", tmp_path / "b"))
    plain = _expected(world, "fields.jsonl", "default")
    assert read_losses(tmp_path / "b")[1] == pytest.approx(plain, rel=1e-5)
    # the weight 3 on every target of the first answer: 3 x its mean (the end of turn keeps weight 1)
    assert 2.0 * plain < weighted < 3.0 * plain
