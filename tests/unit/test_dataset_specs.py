"""--dataset specs as ms-swift reads them: `path#N` sampling with the run's seed (and oversampling
beyond the size), several datasets mixed, hf:: / ms:: prefixes; TRL prompt/completion rows and
`conversations` in role/content form."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from swiftlite.data.formats import detect_format, to_messages
from swiftlite.data.pipeline import tokenize_specs
from swiftlite.data.sources import check_spec, load_rows, parse_source, sample_indices
from swiftlite.errors import UserError
from swiftlite.launch.preflight import resolve_for_launch

ROOT = Path(__file__).resolve().parents[2]


def numbered(path: Path, n: int) -> Path:
    """n chat rows whose answer is the row number (1-based, as the line)."""
    path.write_text("".join(json.dumps({"query": f"q{i}", "response": str(i)}) + "\n" for i in range(1, n + 1)))
    return path


def answers(rows) -> list[int]:
    return [int(r["response"]) for r in rows.rows]


# -- the sampling rule ----------------------------------------------------------------------------

def test_sample_below_the_size_is_a_seeded_sample_without_replacement():
    idx = sample_indices(100, 10, np.random.RandomState(42))
    assert len(idx) == len(set(idx)) == 10 and idx != list(range(10))
    # ms-swift's draw: the first N of numpy's RandomState(seed).permutation
    assert idx == np.random.RandomState(42).permutation(100)[:10].tolist()
    assert idx == sample_indices(100, 10, np.random.RandomState(42))
    assert idx != sample_indices(100, 10, np.random.RandomState(7))


def test_sample_at_and_beyond_the_size_repeats_every_row_then_samples_the_rest():
    assert sample_indices(5, 5, np.random.RandomState(0)) == [0, 1, 2, 3, 4]      # every row once, in order
    assert sample_indices(3, 9, np.random.RandomState(0)) == [0, 1, 2] * 3         # whole copies only
    idx = sample_indices(4, 11, np.random.RandomState(3))
    assert idx[:8] == [0, 1, 2, 3, 0, 1, 2, 3]
    rest = idx[8:]
    assert len(rest) == len(set(rest)) == 3 and rest == np.random.RandomState(3).permutation(4)[:3].tolist()
    assert sample_indices(0, 5, np.random.RandomState(0)) == []


# -- load_rows ------------------------------------------------------------------------------------

def test_hash_n_draws_seeded_rows_not_the_first_ones(tmp_path):
    f = numbered(tmp_path / "d.jsonl", 50)
    a = load_rows(f"{f}#10", seed=1)
    assert len(a.rows) == 10 and len(set(answers(a))) == 10 and answers(a) != list(range(1, 11))
    assert answers(a) == answers(load_rows(f"{f}#10", seed=1))
    assert answers(a) != answers(load_rows(f"{f}#10", seed=2))
    # where each row came from is its own line
    assert all(w.endswith(f"d.jsonl:{n}") for w, n in zip(a.where, answers(a)))
    assert answers(load_rows(str(f))) == list(range(1, 51))          # no #N: every row, in file order


def test_hash_n_beyond_the_size_oversamples_instead_of_capping(tmp_path):
    f = numbered(tmp_path / "d.jsonl", 20)
    rows = answers(load_rows(f"{f}#50", seed=42))
    assert len(rows) == 50                                          # was: 20, silently
    assert rows[:40] == list(range(1, 21)) * 2
    assert len(set(rows[40:])) == 10


def test_hash_n_on_csv_parquet_json_array_and_folders(tmp_path):
    import datasets
    ds = datasets.Dataset.from_list([{"query": f"q{i}", "response": str(i)} for i in range(1, 9)])
    ds.to_csv(str(tmp_path / "d.csv"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "files").mkdir()                                      # a downloaded repo: data files only
    numbered(tmp_path / "files" / "train.jsonl", 8)
    (tmp_path / "a.json").write_text(json.dumps([{"query": f"q{i}", "response": str(i)} for i in range(1, 9)]))
    want = (np.random.RandomState(5).permutation(8)[:3] + 1).tolist()
    for name in ("d.csv", "d.parquet", "saved", "files", "a.json"):
        got = answers(load_rows(f"{tmp_path / name}#3", seed=5))
        assert got == want, name
    assert load_rows(str(tmp_path / "d.csv")).where[0].endswith("d.csv: row 1")   # 1-based, as JSONL lines


def test_a_file_whose_name_has_a_hash_is_that_file(tmp_path):
    f = numbered(tmp_path / "odd#3.jsonl", 5)
    assert len(load_rows(str(f)).rows) == 5
    assert parse_source(str(f)).count is None


def test_parse_prefixes_and_counts():
    s = parse_source("hf::tatsu-lab/alpaca#500")
    assert (s.hub, s.path, s.count) == ("hf", "tatsu-lab/alpaca", 500)
    assert parse_source("HF::a/b").hub == "hf" and parse_source("MS::a/b").hub == "ms"
    assert parse_source("data/x.jsonl#7").hub is None
    for bad, msg in (("x.jsonl#0", "must be > 0"), ("x.jsonl#-2", "must be > 0"), ("x.jsonl#abc", "not a row count"),
                     ("hf::#5", "no dataset id after 'hf::'")):
        with pytest.raises(UserError, match=msg):
            parse_source(bad)


def test_modelscope_is_refused_with_what_to_do():
    for call in (lambda: check_spec("ms::AI-ModelScope/alpaca-gpt4-data-en#500"),
                 lambda: load_rows("ms::AI-ModelScope/alpaca-gpt4-data-en")):
        with pytest.raises(UserError) as e:
            call()
        msg = str(e.value)
        assert "ModelScope datasets are not supported" in msg and "download" in msg and "\n" not in msg
        assert "ms::AI-ModelScope/alpaca-gpt4-data-en" in msg
    check_spec("hf::tatsu-lab/alpaca#5")                               # accepted here; loaded at data time


def test_hf_prefix_goes_to_the_hub_and_offline_is_one_line(tmp_path):
    """The real path (datasets.load_dataset on the hub id) in a process with HF_HUB_OFFLINE=1."""
    code = ("from swiftlite.data.sources import load_rows\n"
            "from swiftlite.errors import UserError\n"
            "try:\n    load_rows('hf::tatsu-lab/alpaca#5')\n"
            "except UserError as e:\n    print(e)\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("--dataset hf::tatsu-lab/alpaca#5: the Hugging Face hub is unreachable"), line
    assert "tatsu-lab/alpaca is not in the local datasets cache" in line and "\n" not in line
    assert not out.stderr.strip(), out.stderr                        # no progress bars or retry warnings


# -- several datasets, the seed from the config ---------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    from swiftlite.config import build_config
    from swiftlite.models.loading import load_tokenizer, resolve_model
    cfg = build_config({"model": "tiny-llama"})
    return load_tokenizer(cfg, resolve_model(cfg.model.model))


def test_several_datasets_are_concatenated_in_order_each_sampled(tmp_path, tok):
    a = numbered(tmp_path / "a.jsonl", 30)
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "x"},
                                                  {"role": "assistant", "content": f"b{i}"}]}) + "\n"
                         for i in range(5)))
    out = tokenize_specs([f"{a}#4", f"{b}#7"], tok, task="sft", max_length=64, packing=False,
                         skip_bad_rows=False, use_cache=False, seed=3)
    assert len(out.rows) == 11
    texts = [tok.decode([t for t in r["labels"] if t >= 0]) for r in out.rows]
    assert all(not t.startswith("b") for t in texts[:4]) and all(t.startswith("b") for t in texts[4:])
    # one RandomState over the specs in order (as ms-swift): a's draw, then b's
    rng = np.random.RandomState(3)
    first = sample_indices(30, 4, rng)
    second = sample_indices(5, 7, rng)
    assert second[:5] == [0, 1, 2, 3, 4] and [t.strip()[:2] for t in texts[4:]] == [f"b{i}" for i in second]
    assert [int(t.split("<")[0].strip()) for t in texts[:4]] == [i + 1 for i in first]


def test_the_run_seed_reaches_the_sample_and_the_cache_key(tmp_path, tok, monkeypatch):
    from swiftlite.config import build_config
    from swiftlite.data.pipeline import prepare_datasets
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path / "cache"))
    f = numbered(tmp_path / "d.jsonl", 40)

    def rows(seed: int) -> list:
        cfg = build_config({"model": "tiny-llama", "dataset": [f"{f}#8"], "seed": seed,
                            "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1,
                            "load_from_cache_file": True})   # read the cache (ms-swift: off)
        train, _, _ = prepare_datasets(resolve_for_launch(cfg, 1).config, tok, 1)
        return [r["input_ids"] for r in train.rows]

    a, b, a2 = rows(1), rows(2), rows(1)                              # the 3rd is read from the cache
    assert len(a) == 8 and a != b and a == a2
    assert len(list((tmp_path / "cache" / "tokenized").glob("*.npz"))) == 2


# -- row formats ----------------------------------------------------------------------------------

CONV = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ho"}]


def test_trl_prompt_completion_rows():
    std = {"prompt": "hi", "completion": "ho"}
    assert detect_format(std) == "prompt_completion"
    assert to_messages(std, "r") == CONV[1:]
    assert to_messages({**std, "system": "be brief"}, "r") == CONV
    conv = {"prompt": CONV[:2], "completion": [CONV[2]]}
    assert to_messages(conv, "r") == CONV
    multi = {"prompt": CONV + [{"role": "user", "content": "again"}],
             "completion": [{"role": "assistant", "content": "ho ho"}]}
    assert [m["role"] for m in to_messages(multi, "r")] == ["system", "user", "assistant", "user", "assistant"]
    with pytest.raises(UserError, match=r"r: completion\[0\] needs 'role' and 'content'"):
        to_messages({"prompt": "hi", "completion": [{"text": "ho"}]}, "r")
    with pytest.raises(UserError, match="has no assistant turn"):
        to_messages({"prompt": CONV[:2], "completion": [{"role": "user", "content": "x"}]}, "r")


def test_conversations_with_role_and_content():
    row = {"conversations": CONV}
    assert detect_format(row) == "sharegpt"
    assert to_messages(row, "r") == CONV
    assert to_messages({"conversations": [{"from": "human", "value": "hi"}, {"role": "assistant", "content": "ho"}]},
                       "r") == CONV[1:]
    with pytest.raises(UserError, match=r"conversations\[0\] needs 'from' and 'value' \(or 'role' and 'content'\)"):
        to_messages({"conversations": [{"speaker": "x"}]}, "r")


def test_new_formats_tokenize_like_messages(tmp_path, tok):
    rows = [{"messages": CONV}, {"conversations": CONV}, {"prompt": CONV[:2], "completion": CONV[2:]},
            {"prompt": "hi", "completion": "ho", "system": "be brief"}]
    p = tmp_path / "mixed.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tokenize_specs([str(p)], tok, task="sft", max_length=64, packing=False, skip_bad_rows=False,
                         use_cache=False)
    assert len(out.rows) == 4 and all(r == out.rows[0] for r in out.rows)


def test_columns_renames_before_the_row_formats_read_them(tmp_path):
    """--columns (ms-swift's): '{"q": "query", "a": "response"}' makes a query/response source of rows
    that name them otherwise; applied to eager, streamed and GRPO rows alike, and part of the cache key."""
    from swiftlite.data.sources import load_rows
    from swiftlite.data.stream import _raw_rows
    f = tmp_path / "odd.jsonl"
    f.write_text("".join(json.dumps({"q": f"say {i}", "a": f"ok {i}", "keep": i}) + "\n" for i in range(3)))
    cols = {"q": "query", "a": "response"}
    rows = load_rows(str(f), columns=cols).rows
    assert rows[0] == {"query": "say 0", "response": "ok 0", "keep": 0}
    assert [r for r, _ in _raw_rows(str(f), False, [], cols)] == rows
    assert load_rows(str(f)).rows[0] == {"q": "say 0", "a": "ok 0", "keep": 0}   # without the flag: as written


def test_columns_flag_trains_and_bad_maps_are_refused(tmp_path):
    from swiftlite.config import build_config
    from swiftlite.data.pipeline import prepare_datasets
    from swiftlite.models.loading import load_tokenizer
    f = tmp_path / "odd.jsonl"
    f.write_text("".join(json.dumps({"q": f"say {i}", "a": f"ok {i}"}) + "\n" for i in range(8)))
    values = {"model": "tiny-llama", "dataset": [str(f)], "per_device_train_batch_size": 1,
              "gradient_accumulation_steps": 1, "columns": '{"q": "query", "a": "response"}'}
    cfg = build_config(values)
    assert cfg.data.columns == {"q": "query", "a": "response"}
    train, _, _ = prepare_datasets(resolve_for_launch(cfg, 1).config, load_tokenizer(cfg), 1)
    assert len(train.rows) == 8
    with pytest.raises(UserError, match="no usable rows|query|messages"):   # the same file without the map
        prepare_datasets(resolve_for_launch(build_config({**values, "columns": None}), 1).config,
                         load_tokenizer(cfg), 1)
    from swiftlite.config import load_config
    with pytest.raises(UserError, match="two columns renamed to the same name"):
        load_config(None, {**values, "columns": '{"q": "query", "a": "query"}'}, task="sft")
