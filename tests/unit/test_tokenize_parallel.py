"""--dataset-num-proc: forked tokenization gives exactly the rows, stats and errors of one process."""

from __future__ import annotations

import json

import pytest

from swiftlite.data import pipeline
from swiftlite.errors import UserError


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from swiftlite.models.presets import TINY_TOKENIZER
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


def _write(path, n, bad_at=None):
    from swiftlite.demo import make_rows
    rows = make_rows(n, seed=3)
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({"unrelated": 1} if i == bad_at else r) + "\n")
    return str(path)


def _tok(spec, tokenizer, n, skip=False):
    return pipeline.tokenize_specs([spec], tokenizer, task="sft", max_length=64, packing=False,
                                   skip_bad_rows=skip, use_cache=False, num_proc=n)


def test_parallel_equals_serial(tmp_path, tokenizer):
    spec = _write(tmp_path / "d.jsonl", pipeline.PARALLEL_MIN_ROWS + 37)
    one, two = _tok(spec, tokenizer, 1), _tok(spec, tokenizer, 2)
    assert one.rows == two.rows and len(one.rows) == pipeline.PARALLEL_MIN_ROWS + 37
    assert one.stats == two.stats


def test_parallel_errors_and_skips_match(tmp_path, tokenizer):
    spec = _write(tmp_path / "bad.jsonl", pipeline.PARALLEL_MIN_ROWS + 10, bad_at=1500)
    with pytest.raises(UserError) as e1:
        _tok(spec, tokenizer, 1)
    with pytest.raises(UserError) as e2:
        _tok(spec, tokenizer, 2)
    assert str(e1.value) == str(e2.value) and ":1501" in str(e1.value)
    a, b = _tok(spec, tokenizer, 1, skip=True), _tok(spec, tokenizer, 2, skip=True)
    assert a.rows == b.rows and a.stats == b.stats and len(a.stats.skipped) == 1
