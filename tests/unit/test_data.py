"""Data formats, chat-template masking, packing and the global batch plan."""

from __future__ import annotations

import json

import pytest

from swiftlite.data.collate import collate, count_targets, pack_rows
from swiftlite.data.formats import detect_format, to_messages
from swiftlite.data.loader import BatchPlan
from swiftlite.data.pipeline import tokenize_specs
from swiftlite.data.tokenize import IGNORE, encode_messages
from swiftlite.errors import UserError
from swiftlite.models.presets import TINY_TOKENIZER

CONV = [{"role": "system", "content": "You reverse strings."},
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "reverse: abc"}, {"role": "assistant", "content": "cba"}]

ROWS = {
    "messages": {"messages": CONV},
    "sharegpt": {"system": "You reverse strings.", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "reverse: abc"}, {"from": "gpt", "value": "cba"}]},
    "alpaca": {"system": "You reverse strings.", "instruction": "reverse:", "input": "abc", "output": "cba",
               "history": [["hi", "hello"]]},
    "query_response": {"system": "You reverse strings.", "query": "reverse: abc", "response": "cba",
                       "history": [["hi", "hello"]]},
}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))


@pytest.mark.parametrize("fmt", list(ROWS))
def test_every_format_detected(fmt):
    assert detect_format(ROWS[fmt]) == fmt


def test_alpaca_joins_instruction_and_input():
    msgs = to_messages(ROWS["alpaca"], "x")
    assert msgs[-2] == {"role": "user", "content": "reverse:\nabc"}


@pytest.mark.parametrize("fmt", ["sharegpt", "query_response"])
def test_formats_give_identical_tokens_and_labels(tok, fmt):
    ref = encode_messages(tok, to_messages(ROWS["messages"], "x"), 512)
    got = encode_messages(tok, to_messages(ROWS[fmt], "x"), 512)
    assert got.input_ids == ref.input_ids
    assert got.labels == ref.labels


def test_labels_only_on_assistant_turns(tok):
    enc = encode_messages(tok, CONV, 512)
    target_text = tok.decode([t for t, lab in zip(enc.input_ids, enc.labels) if lab != IGNORE])
    # both assistant answers, each with its end-of-turn marker, and nothing else
    assert target_text == "hello<|im_end|>\ncba<|im_end|>\n"
    for t, lab in zip(enc.input_ids, enc.labels):
        assert lab in (IGNORE, t)


def test_truncation_is_reported(tok):
    enc = encode_messages(tok, CONV, 10)
    assert enc.truncated and len(enc.input_ids) == 10


def test_row_with_unknown_keys_names_them():
    with pytest.raises(UserError, match=r"f\.jsonl:3: row matches no known format \(found keys: answer, question"):
        to_messages({"question": "q", "answer": "a"}, "f.jsonl:3")


def test_bad_jsonl_line_names_file_and_line(tmp_path, tok):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(ROWS["messages"]) + "\n{not json\n")
    with pytest.raises(UserError, match=r"d\.jsonl:2: not valid JSON"):
        tokenize_specs([str(p)], tok, task="sft", max_length=64, packing=False, skip_bad_rows=False,
                       use_cache=False)


def test_skip_bad_rows_counts(tmp_path, tok):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(ROWS["messages"]) + "\n{not json\n" + json.dumps({"foo": 1}) + "\n")
    out = tokenize_specs([str(p)], tok, task="sft", max_length=64, packing=False, skip_bad_rows=True,
                         use_cache=False)
    assert len(out.rows) == 1 and len(out.stats.skipped) == 2


def test_row_limit_and_formats_from_csv_and_parquet(tmp_path, tok):
    import datasets
    ds = datasets.Dataset.from_list([{"query": f"reverse: {c}", "response": c} for c in ("ab", "cd", "ef")])
    ds.to_csv(str(tmp_path / "d.csv"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    for spec in ("d.csv#2", "d.parquet#2", "folder#2"):
        out = tokenize_specs([str(tmp_path / spec)], tok, task="sft", max_length=64, packing=False,
                             skip_bad_rows=False, use_cache=False)
        assert len(out.rows) == 2, spec


def test_cache_returns_identical_rows(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path / "cache"))
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(ROWS[f]) + "\n" for f in ROWS))
    a = tokenize_specs([str(p)], tok, task="sft", max_length=64, packing=False, skip_bad_rows=False)
    assert list((tmp_path / "cache" / "tokenized").glob("*.npz"))
    b = tokenize_specs([str(p)], tok, task="sft", max_length=64, packing=False, skip_bad_rows=False)
    assert a.rows == b.rows


def test_packing_keeps_rows_whole_and_masks_boundaries(tok):
    rows = [{"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]},
            {"input_ids": [6, 7, 8, 9], "labels": [6, 7, 8, 9]}]
    packs = pack_rows(rows, 6)
    assert [p["input_ids"] for p in packs] == [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert packs[0]["labels"] == [IGNORE, 2, 3, IGNORE, 5]
    assert packs[0]["position_ids"] == [0, 1, 2, 0, 1]


def test_collate_pads_and_counts_targets():
    batch = collate([{"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3]}, {"input_ids": [4], "labels": [4]}], 0)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 2, 3], [4, IGNORE, IGNORE]]
    assert count_targets(batch) == 2


def test_global_batches_do_not_depend_on_world_size():
    one = BatchPlan(40, per_device=4, world_size=1, accumulation=1, seed=3)
    two = BatchPlan(40, per_device=1, world_size=2, accumulation=2, seed=3)
    for step in range(25):  # crosses epochs
        a = sorted(i for mb in one.all_micro_batches(step) for i in mb)
        b = sorted(i for mb in two.all_micro_batches(step) for i in mb)
        assert a == b
    ranks = [set(i for mb in two.micro_batches(0, r) for i in mb) for r in (0, 1)]
    assert not ranks[0] & ranks[1]
