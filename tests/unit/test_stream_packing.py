"""--streaming with --packing (ms-swift's IterablePackingDataset; its examples/train/pretrain/train.sh):
the rows of the stream packed as they are read, whole and in order, into packs of at most --max-length
tokens (data/collate.iter_packs, the function the non-streaming --packing runs), each pack a
padding-free row with position ids restarting per packed row; every rank its own packs of a step;
resume exact; the first step's loss that of the non-streaming packed run on the same rows."""

from __future__ import annotations

import json

import pytest
import torch

from swiftlite.config import load_config
from swiftlite.data.collate import collate, count_targets, pack_rows
from swiftlite.data.rows import DataStats
from swiftlite.data.stream import TokenStream
from swiftlite.data.tokenize import IGNORE
from swiftlite.launch.preflight import resolve_for_launch

LENGTHS = [3, 7, 4, 9, 5, 6, 8, 2, 5, 7, 3, 4, 12, 1, 11]
MAX = 12


def _file(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"i": i, "n": n}) + "\n" for i, n in enumerate(LENGTHS)))
    return f


def _row(i: int, n: int) -> dict:
    ids = [1000 * (i + 1) + j for j in range(n)]   # every token names its row and place
    return {"input_ids": ids, "labels": [IGNORE] + ids[1:]}


def _segments(pack: dict) -> list[tuple[list[int], list[int], list[int]]]:
    """A pack cut where its position ids restart: (ids, labels, positions) of each packed row."""
    starts = [j for j, p in enumerate(pack["position_ids"]) if p == 0] + [len(pack["input_ids"])]
    return [(pack["input_ids"][a:b], pack["labels"][a:b], pack["position_ids"][a:b])
            for a, b in zip(starts, starts[1:])]


def test_streamed_packs_hold_exactly_the_streamed_rows_whole_and_in_order(tmp_path):
    read: list[int] = []

    def encode(items):
        out = []
        for row, _where in items:
            read.append(row["i"])
            out.append(_row(row["i"], row["n"]))
        return out, DataStats(rows=len(items))

    stream = TokenStream([str(_file(tmp_path))], encode, False, pack_length=MAX)
    it = stream.rows()
    first = next(it)
    # bounded: the first pack is out after reading its rows and the one row that did not fit, no more
    assert len(read) == len(_segments(first)) + 1 < len(LENGTHS)
    rows = [_row(i, n) for i, n in enumerate(LENGTHS)]
    one_pass = pack_rows(rows, MAX)          # what the non-streaming --packing cuts from the same rows
    got = [first] + [next(it) for _ in range(2 * len(one_pass) - 1)]
    assert got == one_pass + one_pass        # each pass closes its last pack; the stream restarts
    assert len(one_pass) < len(rows)         # rows were really packed together
    for pack in got:
        assert len(pack["input_ids"]) == len(pack["labels"]) == len(pack["position_ids"]) <= MAX
    seen = [seg for pack in got for seg in _segments(pack)]
    assert [ids for ids, _, _ in seen] == [r["input_ids"] for r in rows] * 2   # none lost, none split
    for (ids, labels, pos), r in zip(seen, rows * 2):
        assert pos == list(range(len(ids)))                     # position ids restart at each row
        assert labels[0] == IGNORE and labels[1:] == r["labels"][1:]   # no row predicts the next one's start


def _cfg(tmp_path, data, name, **extra):
    values = {"model": "tiny-llama-2l", "train_type": "full", "dataset": [str(data)], "max_steps": 4,
              "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2, "logging_steps": 1,
              "output_dir": str(tmp_path / name), "save_steps": 100, "seed": 5, "max_length": 128,
              "packing": True, "streaming": True, "gradient_checkpointing": False, "dataloader_num_workers": 0}
    values.update(extra)
    return load_config(None, {k: v for k, v in values.items() if v is not None}, task="sft")


@pytest.fixture
def rows_file(tmp_path, demo_data):
    """12 demo rows (36-42 tokens: 3 to a 128-token pack) and one over --max-length (deleted)."""
    lines = demo_data[0].read_text().splitlines(True)[:12]
    long = json.dumps({"messages": [{"role": "user", "content": "reverse: " + "ab" * 100},
                                    {"role": "assistant", "content": "ba" * 100}]}) + "\n"
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(lines[:5] + [long] + lines[5:]))
    return f


def test_each_rank_takes_its_own_packs_of_the_step_and_resume_is_exact(tmp_path, rows_file):
    from swiftlite.data.pipeline import prepare_datasets, tokenize_specs
    from swiftlite.data.stream import StreamBatches
    from swiftlite.distributed import World
    from swiftlite.models.loading import batch_form, load_tokenizer, resolve_model
    cfg = _cfg(tmp_path, rows_file, "ranks")
    tok = load_tokenizer(cfg, resolve_model(cfg.model.model))
    packs = tokenize_specs([str(rows_file)], tok, task="sft", max_length=128, packing=True, skip_bad_rows=False,
                           use_cache=False).rows    # the non-streaming packs of the same rows, in file order
    assert len(packs) == 4 and all(len(p["input_ids"]) <= 128 for p in packs)
    train, _, plan = prepare_datasets(resolve_for_launch(cfg, 2).config, tok, 2)
    assert plan.global_batch == 4        # 1 per device x 2 ranks x accumulation 2: 4 packs a step
    form = batch_form(cfg)
    assert form.padding_free

    def batches(rank):
        return StreamBatches(train, plan, tok.pad_token_id, World(rank=rank, world_size=2), form, 0, False, None)
    ranks = [batches(0), batches(1)]
    steps = []
    for k in range(3):   # the stream wraps around: the 4 packs again each step
        got = [b.step_data(k) for b in ranks]
        steps.append(got)
        assert got[0].global_targets == got[1].global_targets == sum(count_targets(collate([p], 0)) for p in packs)
        for r in (0, 1):   # micro-batch m of rank r is pack m * world + r of the step
            want = [collate([packs[m * 2 + r]], tok.pad_token_id) for m in range(2)]
            assert all(set(g) == set(w) == {"input_ids", "labels", "position_ids"} for g, w in zip(got[r].micro, want))
            assert all(torch.equal(g[key], w[key]) for g, w in zip(got[r].micro, want) for key in w)
        assert not torch.equal(got[0].micro[0]["input_ids"], got[1].micro[0]["input_ids"])
    # the long row: dropped before packing, not split (counted once per reader of the stream's first pass:
    # here two ranks read it in one process)
    assert train.stream.stats.deleted == 2
    resumed = batches(1)                       # resume at step 2: a fresh read of the stream to its packs
    again = resumed.step_data(2)
    assert again.global_targets == steps[2][1].global_targets
    assert all(torch.equal(a[key], b[key]) for a, b in zip(again.micro, steps[2][1].micro) for key in a)
    for b in (*ranks, resumed):
        b.close()


def test_first_step_loss_equals_the_non_streaming_packed_run(tmp_path, rows_file):
    """The non-streaming plan permutes the packs (seeded); with one step holding all 4 packs both runs
    sum the same packs' losses over the same target count, so step 1's loss is the same."""
    from swiftlite.checkpoint import layout
    from swiftlite.train.loop import train
    streamed = train(_cfg(tmp_path, rows_file, "s", max_steps=1, gradient_accumulation_steps=4)).losses
    packed = train(_cfg(tmp_path, rows_file, "p", max_steps=1, gradient_accumulation_steps=4,
                        streaming=False)).losses
    assert len(streamed) == len(packed) == 1
    assert streamed[0] == pytest.approx(packed[0], rel=1e-5)
    args = json.loads((tmp_path / "s" / layout.ARGS).read_text())
    assert args["data"]["streaming"] is True and args["data"]["packing"] is True


def test_split_holds_out_rows_then_packs_each_side(tmp_path, demo_data):
    """--split_dataset_ratio with --packing: ms-swift holds out a share of the rows, then packs the train
    and validation sides apart. Packing first held out packs instead, and a --max-length that packs every
    row into one pack (sequence_parallel_512k.sh: 512000) could not be split at all."""
    from swiftlite.data.pipeline import prepare_datasets
    from swiftlite.models.loading import load_tokenizer, resolve_model
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(demo_data[0].read_text().splitlines(True)[:20]))
    cfg = _cfg(tmp_path, f, "split", streaming=False, max_length=4096, split_dataset_ratio=0.1,
               per_device_train_batch_size=1, gradient_accumulation_steps=1)
    tok = load_tokenizer(cfg, resolve_model(cfg.model.model))
    train, val, _ = prepare_datasets(resolve_for_launch(cfg, 1).config, tok, 1)

    def rows_in(packs):   # position ids restart at 0 for each packed row
        return sum(int((torch.tensor(p["position_ids"]) == 0).sum()) for p in packs)
    assert (len(train.rows), len(val.rows)) == (1, 1)      # every side fits one 4096-token pack
    assert (rows_in(train.rows), rows_in(val.rows)) == (18, 2)   # 10% of the 20 rows held out, not of the packs
