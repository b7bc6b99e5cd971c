"""Cached datasets (ms-swift's `swift export --to_cached_dataset true`, then `--cached_dataset`): the export
writes exactly the rows the run would have tokenized (train and validation, sft and pt), the run reads
them instead of --dataset (with `#N`, --packing and its own --max-length), and a folder made for another
task or tokenizer, or not by this export at all, is refused in one line before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.test_msswift_scripts import in_process as main_in_process


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from swiftlite.models.presets import TINY_TOKENIZER, TINY_VOCAB
    d = tmp_path_factory.mktemp("cached")
    conf = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=TINY_VOCAB, max_position_embeddings=512,
                       eos_token_id=258, pad_token_id=259, bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(conf).save_pretrained(d / "model")
    AutoTokenizer.from_pretrained(TINY_TOKENIZER).save_pretrained(d / "model")
    rows = [{"messages": [{"role": "user", "content": f"question {i} " * (1 + i % 7)},
                          {"role": "assistant", "content": f"answer {i} " * (1 + i % 5)}]} for i in range(40)]
    (d / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "text.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * (5 + 3 * i)}) + "\n"
                                          for i in range(12)))
    return d


def _export(world: Path, out: Path, *extra: str) -> tuple[int, str]:
    return main_in_process(["export", "--model", str(world / "model"), "--to_cached_dataset", "true",
                            "--output_dir", str(out), *extra], world)


def _rows(world: Path, task: str, *args: str):
    """prepare_datasets of a run (the rows the ranks would train on) for these flags."""
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.data.pipeline import prepare_datasets
    from swiftlite.models.loading import load_tokenizer
    length = [] if "--max_length" in args else ["--max_length", "512"]   # what the run resolves it to (the model's)
    config_file, values = parse_run_args(["--model", str(world / "model"), "--per_device_train_batch_size", "1",
                                          "--gradient_accumulation_steps", "1", *length, *args])
    cfg = load_config(config_file, values, task=task)
    train, val, _ = prepare_datasets(cfg, load_tokenizer(cfg), 1)
    return train, val


@pytest.mark.parametrize("packing", [False, True])
def test_sft_rows_are_the_runs_rows(world, tmp_path, packing):
    """The same train and validation rows as the run tokenizing --dataset itself; packed as the run packs."""
    rc, err = _export(world, tmp_path / "c", "--dataset", str(world / "chat.jsonl"), "--split_dataset_ratio", "0.2",
                      "--max_length", "128", "--truncation_strategy", "right")
    assert rc == 0, err
    meta = json.loads((tmp_path / "c" / "train" / "swiftlite_cached.json").read_text())
    assert meta["task"] == "sft" and meta["max_length"] == 128
    pack = ["--packing", "true"] if packing else []
    want_t, want_v = _rows(world, "sft", "--dataset", str(world / "chat.jsonl"), "--split_dataset_ratio", "0.2",
                           "--max_length", "128", "--truncation_strategy", "right")
    if packing:   # the cached rows are packed after the split (ms-swift's order; --dataset packs, then holds out)
        from swiftlite.data.collate import pack_rows
        want_t.rows, want_v.rows = pack_rows(want_t.rows, 128), pack_rows(want_v.rows, 128)
    got_t, got_v = _rows(world, "sft", "--cached_dataset", str(tmp_path / "c" / "train"), "--cached_val_dataset",
                         str(tmp_path / "c" / "val"), "--max_length", "128", "--truncation_strategy", "right", *pack)
    assert got_t.rows == want_t.rows and got_v.rows == want_v.rows and len(got_v.rows) > 0
    assert any(len(r["input_ids"]) == 128 for r in got_t.rows)   # cut rows (or full packs)
    if packing:   # packs of several rows: position ids restart inside them
        assert any(r["position_ids"].count(0) > 1 for r in got_t.rows)


def test_delete_and_sampling(world, tmp_path):
    """Exported at the model's context (ms-swift's script gives no --max_length), read by runs with a shorter
    one: --truncation_strategy delete drops (and counts) the rows over it, right cuts them, as the run's own
    tokenization does; `DIR#N` draws N rows by --dataset's sampling rule."""
    rc, err = _export(world, tmp_path / "c", "--dataset", str(world / "chat.jsonl"))
    assert rc == 0, err
    assert json.loads((tmp_path / "c" / "train" / "swiftlite_cached.json").read_text())["max_length"] == 512
    assert not (tmp_path / "c" / "val").exists()
    want, _ = _rows(world, "sft", "--dataset", str(world / "chat.jsonl"), "--max_length", "64",
                    "--truncation_strategy", "right")
    got, _ = _rows(world, "sft", "--cached_dataset", str(tmp_path / "c" / "train"), "--max_length", "64",
                   "--truncation_strategy", "right")
    assert got.rows == want.rows and got.stats.truncated == want.stats.truncated > 0
    assert got.stats.no_target == want.stats.no_target > 0   # cut before their answer
    want, _ = _rows(world, "sft", "--dataset", str(world / "chat.jsonl"), "--max_length", "64")
    got, _ = _rows(world, "sft", "--cached_dataset", str(tmp_path / "c" / "train"), "--max_length", "64")
    assert got.rows == want.rows and got.stats.deleted == want.stats.deleted > 0
    some, _ = _rows(world, "sft", "--cached_dataset", f"{tmp_path / 'c' / 'train'}#7")
    every, _ = _rows(world, "sft", "--cached_dataset", str(tmp_path / "c" / "train"))
    assert len(some.rows) == 7 and all(r in every.rows for r in some.rows)
    both, _ = _rows(world, "sft", "--dataset", str(world / "chat.jsonl"), "--cached_dataset",
                    str(tmp_path / "c" / "train"))
    assert both.rows == every.rows + every.rows   # --dataset's rows, then the cached ones


def test_pt_split_pieces(world, tmp_path):
    """pretrained.sh: pt rows (--use_chat_template false), long documents cut into --max_length pieces; every
    token a target, and the pieces are the run's own."""
    rc, err = _export(world, tmp_path / "c", "--dataset", str(world / "text.jsonl"), "--use_chat_template", "false",
                      "--truncation_strategy", "split", "--max_length", "32", "--loss_scale", "all")
    assert rc == 0, err
    assert json.loads((tmp_path / "c" / "train" / "swiftlite_cached.json").read_text())["task"] == "pt"
    got, _ = _rows(world, "pt", "--cached_dataset", str(tmp_path / "c" / "train"), "--max_length", "32",
                   "--truncation_strategy", "split")
    want, _ = _rows(world, "pt", "--dataset", str(world / "text.jsonl"), "--max_length", "32",
                    "--truncation_strategy", "split")
    assert got.rows == want.rows and len(got.rows) > 12
    assert all(r["labels"] == r["input_ids"] and len(r["input_ids"]) <= 32 for r in got.rows)


def test_refusals_name_the_folder(world, tmp_path):
    """Each mismatch is one line naming the flag and the folder; nothing is written."""
    rc, err = _export(world, tmp_path / "c", "--dataset", str(world / "chat.jsonl"))
    assert rc == 0, err
    train = str(tmp_path / "c" / "train")
    from datasets import Dataset
    Dataset.from_dict({"messages": [[{"role": "user", "content": "x"}]], "length": [3]}).save_to_disk(
        str(tmp_path / "msswift"))
    cases = [
        (["pt", "--cached_dataset", train], "holds sft rows"),
        (["sft", "--cached_dataset", train, "--template", "default"], "another tokenizer or chat template"),
        (["sft", "--cached_dataset", str(tmp_path / "c")], "pass " + train),
        (["sft", "--cached_dataset", str(tmp_path / "msswift")], "ms-swift's cached dataset"),
        (["sft", "--cached_dataset", str(tmp_path / "nothere")], "no such folder"),
        (["sft", "--cached_dataset", train, "--streaming", "true", "--max_steps", "2"], "--streaming"),
        (["rlhf", "--rlhf_type", "dpo", "--cached_dataset", train], "sft or pt rows"),
    ]
    for argv, words in cases:
        out = tmp_path / "out"
        rc, err = main_in_process([argv[0], "--model", str(world / "model"), *argv[1:], "--output_dir", str(out)],
                                  world)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1 and words in lines[0] and "--cached_dataset" in lines[0], (argv, err)
        assert not out.exists()


def test_export_refusals_at_once(world, tmp_path):
    """The export takes the data's options: a training option, a missing --output_dir's replacement
    (an existing folder) and a bad value are all named in one run, nothing written."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    rc, err = main_in_process(["export", "--model", str(world / "model"), "--to_cached_dataset", "true",
                               "--dataset", str(world / "chat.jsonl"), "--learning_rate", "1e-4", "--packing", "true",
                               "--use_chat_template", "maybe", "--output_dir", str(tmp_path / "full")], world)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in err
    for words in ("--learning_rate: an option of the training run", "--packing: an option of the training run",
                  "--use_chat_template: expected true or false", "exists and is not empty"):
        assert any(words in ln for ln in lines), (words, err)
    rc, err = main_in_process(["export", "--model", str(world / "model"), "--to_cached_dataset", "true",
                               "--dataset", str(world / "chat.jsonl")], world)
    assert rc == 2 and "pass --output_dir" in err
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["x"]
