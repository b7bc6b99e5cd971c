"""ms-swift's data-loading flags: --dataloader_num_workers (batches built in DataLoader workers, the same
tensors in the same order, exact resume), --dataloader_prefetch_factor, --dataloader_pin_memory."""

from __future__ import annotations

import json

import pytest
import torch

from swiftlite.config import load_config
from swiftlite.data.loader import BatchPlan
from swiftlite.data.prefetch import Prefetcher, StepBatches
from swiftlite.data.tokenize import IGNORE
from swiftlite.errors import UserError
from swiftlite.launch.preflight import resolve_for_launch

ROWS = [{"input_ids": list(range(5, 5 + n)), "labels": [IGNORE] + list(range(6, 5 + n))} for n in
        (3, 7, 4, 9, 5, 6, 8, 2, 5, 7, 3, 4)]


def _targets(i: int) -> int:
    return sum(1 for x in ROWS[i]["labels"][1:] if x != IGNORE)


def _same(a, b) -> None:
    assert a.global_targets == b.global_targets and a.local_tokens == b.local_tokens
    assert len(a.micro) == len(b.micro)
    for x, y in zip(a.micro, b.micro):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("padding_free", [False, True])
def test_workers_build_the_same_steps_in_the_same_order(padding_free):
    plan = BatchPlan(len(ROWS), 2, 2, 2, seed=3)      # 2 ranks x accumulation 2: 8 rows a step
    steps = StepBatches(plan, 1, ROWS.__getitem__, _targets, 0, padding_free)
    pre = Prefetcher(steps, 1, 6, num_workers=2, prefetch_factor=2)   # resume at data step 1, epochs wrap
    try:
        assert pre._it is not None
        for k in range(1, 6):
            _same(pre.get(k), steps[k])
    finally:
        pre.close()
    assert pre._it is None


def test_starting_the_workers_draws_nothing_from_the_global_rng():
    """A DataLoader iterator without a generator of its own draws its workers' base seed from torch's
    global RNG: every dropout mask after it shifts, and differently on resume (the loader starts at
    another step), so a LoRA run with workers neither equalled the inline run nor resumed exactly."""
    plan = BatchPlan(len(ROWS), 1, 1, 2, seed=3)
    steps = StepBatches(plan, 0, ROWS.__getitem__, _targets, 0, False)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    pre = Prefetcher(steps, 0, 3, num_workers=1)
    try:
        _same(pre.get(0), steps[0])
    finally:
        pre.close()
    assert torch.equal(torch.get_rng_state(), before)


def _cfg(tmp_path, data, name, **extra):
    # LoRA with its default dropout: the masks come from the global RNG, which the loader must not touch
    values = {"model": "tiny-llama-2l", "train_type": "lora", "dataset": [f"{data}#48"], "max_steps": 4,
              "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "logging_steps": 1,
              "output_dir": str(tmp_path / name), "save_steps": 2, "seed": 5,
              "gradient_checkpointing": False}   # fast: these tests are about the data
    values.update(extra)
    return load_config(None, {k: v for k, v in values.items() if v is not None}, task="sft")


def test_training_losses_are_identical_with_0_and_2_workers_and_resume_is_exact(tmp_path, demo_data, monkeypatch):
    from swiftlite.data import prefetch
    from swiftlite.train.loop import train
    data = demo_data[0]
    started = []   # (workers, first data step, end) of each DataLoader the runs start
    real_init = prefetch.Prefetcher.__init__

    def spy(self, steps, first, end, **kw):
        real_init(self, steps, first, end, **kw)
        started.append((kw["num_workers"], first, end, self._it is not None))
    monkeypatch.setattr(prefetch.Prefetcher, "__init__", spy)
    inline = train(_cfg(tmp_path, data, "w0", dataloader_num_workers=0)).losses
    workers = train(_cfg(tmp_path, data, "w2", dataloader_num_workers=2, dataloader_prefetch_factor=3)).losses
    assert len(inline) == 4 and workers == inline           # bit for bit: same batches, same order
    assert started == [(2, 0, 4, True)]                     # 0 workers: no DataLoader at all
    # stop after step 2 (a checkpoint), resume with workers: steps 3-4 as in the uninterrupted run
    first = train(_cfg(tmp_path, data, "r", dataloader_num_workers=2, max_steps=4, save_steps=2,
                       )).losses
    assert first == inline
    import shutil
    from swiftlite.checkpoint import layout
    run = tmp_path / "r"
    shutil.rmtree(run / layout.checkpoint_name(4))
    (run / "latest").write_text(layout.checkpoint_name(2))
    resumed = train(_cfg(tmp_path, data, "r", dataloader_num_workers=2, resume="true")).losses
    assert resumed == inline[2:]
    assert started[-1] == (2, 2, 4, True)                   # the resumed loader starts at data step 2


def test_msswift_default_and_bad_values():
    cfg = load_config(None, {"dataset": ["d.jsonl"]}, task="sft", validate_paths=False)
    assert cfg.train.dataloader_num_workers == 1 and cfg.train.dataloader_pin_memory is True
    assert cfg.train.dataloader_prefetch_factor is None
    with pytest.raises(UserError, match=r"--dataloader-prefetch-factor needs --dataloader-num-workers > 0"):
        load_config(None, {"dataset": ["d.jsonl"], "dataloader_num_workers": 0, "dataloader_prefetch_factor": 2},
                    task="sft", validate_paths=False)
    with pytest.raises(UserError, match=r"--dataloader-num-workers must be >= 0, got -1"):
        load_config(None, {"dataset": ["d.jsonl"], "dataloader_num_workers": -1}, task="sft", validate_paths=False)


# -- --load_from_cache_file, --lazy_tokenize -----------------------------------------------------------

def _count_encodes(monkeypatch) -> list[int]:
    from swiftlite.data import pipeline
    calls: list[int] = []
    real = pipeline._encode_rows

    def counted(items, *a, **kw):
        items = list(items)
        calls.append(len(items))
        return real(items, *a, **kw)
    monkeypatch.setattr(pipeline, "_encode_rows", counted)
    return calls


def test_load_from_cache_file_false_tokenizes_again_true_reads_the_cache(tmp_path, demo_data, monkeypatch):
    from swiftlite import env
    from swiftlite.data.pipeline import tokenize_specs
    from swiftlite.models.loading import load_tokenizer, resolve_model
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(tmp_path, demo_data[0], "c")
    tok = load_tokenizer(cfg, resolve_model(cfg.model.model))
    calls = _count_encodes(monkeypatch)

    def run(load: bool):
        return tokenize_specs([f"{demo_data[0]}#40"], tok, task="sft", max_length=256, packing=False,
                              skip_bad_rows=False, load_from_cache_file=load)
    monkeypatch.setenv(env.DATA_SESSION, "job-1")
    first = run(False)
    assert sum(calls) == 40
    assert run(False).rows == first.rows and sum(calls) == 40     # same job (its ranks): the job's own entry
    monkeypatch.setenv(env.DATA_SESSION, "job-2")                  # a new run: ms-swift's default re-tokenizes
    assert run(False).rows == first.rows and sum(calls) == 80
    monkeypatch.setenv(env.DATA_SESSION, "job-3")
    assert run(True).rows == first.rows and sum(calls) == 80      # true: any earlier entry is read


def test_lazy_tokenize_tokenizes_at_batch_time_and_gives_the_eager_batches(tmp_path, demo_data, monkeypatch):
    from swiftlite.data.lazy import LazyRows
    from swiftlite.data.pipeline import prepare_datasets
    from swiftlite.models.loading import load_tokenizer, resolve_model
    from swiftlite.train.loop import train
    data = demo_data[0]
    cfg = _cfg(tmp_path, data, "lz", lazy_tokenize=True, split_dataset_ratio=0.1)
    tok = load_tokenizer(cfg, resolve_model(cfg.model.model))
    lazy, val, _ = prepare_datasets(resolve_for_launch(cfg, 1).config, tok, 1)
    assert isinstance(lazy.rows, LazyRows) and not lazy.rows.memo      # nothing tokenized before training
    eager, eval_eager, _ = prepare_datasets(resolve_for_launch(_cfg(tmp_path, data, "eg", split_dataset_ratio=0.1), 1).config,
                                            tok, 1)
    assert len(lazy.rows) == len(eager.rows) and val.rows == eval_eager.rows
    assert [lazy.rows[i] for i in range(len(eager.rows))] == eager.rows   # row for row the eager rows
    losses = train(_cfg(tmp_path, data, "e2", dataloader_num_workers=0)).losses
    assert train(_cfg(tmp_path, data, "l0", lazy_tokenize=True, dataloader_num_workers=0)).losses == losses
    assert train(_cfg(tmp_path, data, "l2", lazy_tokenize=True, dataloader_num_workers=2)).losses == losses


def test_lazy_tokenize_refusals():
    for extra, msg in (({"packing": True}, "--lazy-tokenize with --packing"),
                       ({"streaming": True, "max_steps": 2}, "--lazy-tokenize with --streaming")):
        with pytest.raises(UserError, match=msg):
            load_config(None, {"dataset": ["d.jsonl"], "lazy_tokenize": True, **extra}, task="sft",
                        validate_paths=False)


# -- --streaming -----------------------------------------------------------------------------------

def _stream_cfg(tmp_path, data, name, **extra):
    return _cfg(tmp_path, data, name, dataset=[str(data)], streaming=True, **extra)


def test_streaming_trains_in_file_order_and_resumes_exactly(tmp_path, demo_data, monkeypatch):
    import shutil

    from swiftlite.checkpoint import layout
    from swiftlite.data.pipeline import prepare_datasets, tokenize_specs
    from swiftlite.data.stream import StreamBatches, StreamData
    from swiftlite.distributed import World
    from swiftlite.models.loading import load_tokenizer, resolve_model
    from swiftlite.train.loop import train
    data = tmp_path / "six.jsonl"    # a 6-row file: the stream wraps around within 4 steps of 4 rows
    data.write_text("".join(demo_data[0].read_text().splitlines(True)[:6]))
    cfg = _stream_cfg(tmp_path, data, "s0", dataloader_num_workers=0)
    tok = load_tokenizer(cfg, resolve_model(cfg.model.model))
    calls = _count_encodes(monkeypatch)
    cfg = resolve_for_launch(cfg, 1).config   # the run's concrete config: the preset's context as max length
    train_data, _, plan = prepare_datasets(cfg, tok, 1)
    assert isinstance(train_data, StreamData) and sum(calls) == 1    # one row read before launch
    # step k is rows 4k..4k+3 of the file in order (global batch 2 x 1 x 2), wrapping around at the end
    eager = tokenize_specs([str(data)], tok, task="sft", max_length=cfg.data.max_length, packing=False,
                           skip_bad_rows=False).rows
    b = StreamBatches(train_data, plan, tok.pad_token_id, World(), None, 0, True, None)
    from swiftlite.data.collate import collate
    for k in range(4):
        rows = [eager[(4 * k + j) % 6] for j in range(4)]
        got = b.step_data(k).micro
        want = [collate(rows[2 * m:2 * m + 2], tok.pad_token_id) for m in range(2)]  # 2 micro-batches
        assert all(torch.equal(g[key], w[key]) for g, w in zip(got, want) for key in w)
    b.close()
    whole = train(cfg).losses
    assert train(_stream_cfg(tmp_path, data, "s2", dataloader_num_workers=2)).losses == whole
    run = tmp_path / "s0"
    shutil.rmtree(run / layout.checkpoint_name(4))
    (run / "latest").write_text(layout.checkpoint_name(2))
    assert train(_stream_cfg(tmp_path, data, "s0", dataloader_num_workers=0, resume="true")).losses == whole[2:]
    args = json.loads((run / layout.ARGS).read_text())
    assert args["data"]["streaming"] is True


@pytest.mark.parametrize("extra,msg", [
    ({"max_steps": -1}, "--streaming needs --max-steps"),
    ({"split_dataset_ratio": 0.1}, "--streaming with --split-dataset-ratio: a stream cannot hold rows out"),
    ({"save_strategy": "epoch"}, "--save-strategy epoch with --streaming"),
])
def test_streaming_refusals(extra, msg):
    values = {"dataset": ["d.jsonl"], "streaming": True, "max_steps": 10, **extra}
    with pytest.raises(UserError, match=msg.replace("(", r"\(")):
        load_config(None, values, task="sft", validate_paths=False)


def test_streaming_with_packing_is_accepted():
    """ms-swift packs a stream (IterablePackingDataset; tests/unit/test_stream_packing.py): not refused."""
    cfg = load_config(None, {"dataset": ["d.jsonl"], "streaming": True, "packing": True, "max_steps": 10},
                      task="sft", validate_paths=False)
    assert cfg.data.streaming and cfg.data.packing


def test_streaming_path_n_is_the_first_n_rows(tmp_path):
    """ms-swift's streaming `#N` (dataset_meta.post_process: `take(N)`): the file's first N rows in file order,
    not shuffled, and not repeated when the file is shorter."""
    from swiftlite.data.stream import _raw_rows
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(10)))
    assert [r["text"] for r, _ in _raw_rows(f"{f}#4", False, [])] == [f"row {i}" for i in range(4)]
    assert [r["text"] for r, _ in _raw_rows(f"{f}#25", False, [])] == [f"row {i}" for i in range(10)]
    assert len(list(_raw_rows(str(f), False, []))) == 10
    cfg = load_config(None, {"dataset": [f"{f}#4"], "streaming": True, "max_steps": 10}, task="sft",
                      validate_paths=False)
    assert cfg.data.dataset == [f"{f}#4"] and cfg.data.streaming


def test_rlhf_refuses_streaming_and_lazy_tokenize():
    for flag in ("streaming", "lazy_tokenize"):
        with pytest.raises(UserError, match=f"--{flag.replace('_', '-')} applies to sft and pt"):
            load_config(None, {"dataset": ["d.jsonl"], flag: True, "max_steps": 2}, task="rlhf", validate_paths=False)


def test_the_cache_keeps_any_row_fields_and_the_container_kind(tmp_path, monkeypatch):
    """rlhf's pairs go through the same cache (rlhf/data.prepare_pairs -> pipeline.cached)."""
    from swiftlite import env
    from swiftlite.data.pipeline import DataStats, cached
    from swiftlite.rlhf.data import PairData
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path))
    monkeypatch.setenv(env.DATA_SESSION, "a")
    pairs = [{"chosen_ids": [1, 2, 3], "chosen_labels": [IGNORE, 2, 3], "rejected_ids": [1, 4],
              "rejected_labels": [IGNORE, 4], "margin": 0.5},
             {"chosen_ids": [5], "chosen_labels": [5], "rejected_ids": [6, 7, 8], "rejected_labels": [6, 7, 8],
              "margin": None}]   # a scalar column (reward margins) is kept as it is
    built = []

    def build():
        built.append(1)
        return PairData([dict(p) for p in pairs], DataStats(rows=2, truncated=1))
    first = cached("k", build, kind=PairData, load_from_cache_file=True)
    again = cached("k", build, kind=PairData, load_from_cache_file=True)
    assert len(built) == 1 and isinstance(again, PairData) and again.rows == pairs == first.rows
    assert again.stats.truncated == 1 and again.targets(0) == 2
    monkeypatch.setenv(env.DATA_SESSION, "b")
    cached("k", build, kind=PairData, load_from_cache_file=False)
    assert len(built) == 2      # another job, ms-swift's default: built again
