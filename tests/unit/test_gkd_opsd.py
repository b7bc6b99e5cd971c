"""OPSD's teacher view (data/teacher_view.py, rlhf/gkd.teacher_rows), GKD's prompt-only rows (data/pipeline.py
PROMPTS) and ms-swift's dataset registration (swift.dataset: msswift_api/dataset.py, data/registered.py)."""

from __future__ import annotations

import json

import pytest
import torch

from swiftlite.data.tokenize import IGNORE
from swiftlite.errors import UserError


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from swiftlite.models.presets import TINY_TOKENIZER
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


def _encode(tok, rows, keep):
    from swiftlite.data.pipeline import _encode_rows
    out, stats = _encode_rows([(r, f"d.jsonl:{i + 1}") for i, r in enumerate(rows)], tok, "rlhf", 512, False,
                              system="be brief", keep=keep)
    return out, stats


def test_the_teacher_reads_its_prompt_in_place_of_the_last_user_message(tok):
    from swiftlite.data.pipeline import PROMPTS
    from swiftlite.data.teacher_view import COLUMN
    rows = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
             COLUMN: "2+2? The reference says 4."},
            {"messages": [{"role": "user", "content": "3+3?"}], COLUMN: "3+3? The reference says 6."}]
    out, stats = _encode(tok, rows, (COLUMN, PROMPTS))
    assert len(out) == 2 and stats.no_target == 0
    want = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "2+2? The reference says 4."}], tokenize=False,
                                   add_generation_prompt=True)
    assert tok.decode(out[0]["teacher_prompt_ids"]) == want
    prompt = out[1]                                   # a prompt alone: its tokens up to the generation prompt
    assert set(prompt["labels"]) == {IGNORE} and tok.decode(prompt["input_ids"]).endswith("assistant\n")
    assert "The reference says 6." in tok.decode(prompt["teacher_prompt_ids"])


@pytest.mark.parametrize("truncation", ["delete", "left", "right"])
def test_the_teachers_view_is_not_held_to_max_length(tok, truncation):
    """The student's row fits, the teacher's longer prompt makes a longer view: kept whole under every
    --truncation_strategy, as ms-swift's GKD encodes a batch's views with the template's max_length unset."""
    from swiftlite.data.pipeline import _encode_rows
    from swiftlite.data.teacher_view import COLUMN
    row = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "four"}],
           COLUMN: "2+2? " + "The reference solution says four. " * 6}
    student, _ = _encode_rows([(dict(row), "d.jsonl:1")], tok, "rlhf", 512, False, truncation, keep=(COLUMN,))
    whole = student[0]["teacher_prompt_ids"]
    n, response = len(student[0]["input_ids"]), len(student[0]["input_ids"]) - _start(student[0]["labels"])
    limit = n + 10
    assert len(whole) + response > limit            # the student's row fits, the teacher's view does not
    out, stats = _encode_rows([(dict(row), "d.jsonl:1")], tok, "rlhf", limit, False, truncation, keep=(COLUMN,))
    assert len(out) == 1 and stats.deleted == 0 and stats.truncated == 0
    assert out[0]["teacher_prompt_ids"] == whole and out[0]["input_ids"] == student[0]["input_ids"]


def _start(labels):
    from swiftlite.data.tokenize import response_start
    return response_start(labels)


def test_prompt_rows_need_every_step_to_sample(tok):
    from swiftlite.data.teacher_view import COLUMN
    with pytest.raises(UserError, match="d.jsonl:1: the conversation has no assistant turn to learn from"):
        _encode(tok, [{"messages": [{"role": "user", "content": "x"}], COLUMN: "y"}], (COLUMN,))


def test_a_teacher_prompt_with_targets_before_the_response_is_refused(tok):
    from swiftlite.data.teacher_view import teacher_prompt_ids
    from swiftlite.data.tokenize import encode_messages
    from swiftlite.config.loss_scale import parse
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    enc = encode_messages(tok, msgs, 512, "r", loss_scale=parse("default"))
    with pytest.raises(UserError, match="has targets before it too .* use GKD's default --loss_scale last_round"):
        teacher_prompt_ids(tok, msgs, "c!", enc.input_ids, enc.labels, "r")
    with pytest.raises(UserError, match="'teacher_prompt' must be a non-empty string"):
        teacher_prompt_ids(tok, msgs, "", enc.input_ids, enc.labels, "r")


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_teachers_targets_are_the_students_in_order(padding_free):
    """The teacher's logits are taken where its labels are targets; they must be the student's targets,
    token for token and in order, for dataset rows and for sampled ones (whose response starts where the
    prompt ended, an insertion out of the loss inside it)."""
    from swiftlite.data.collate import collate
    from swiftlite.rlhf.gkd import teacher_rows
    rows = [{"input_ids": [1, 2, 3, 10, 11], "labels": [IGNORE] * 3 + [10, 11], "teacher_prompt_ids": [1, 7, 7, 7, 3]},
            {"input_ids": [4, 5, 12], "labels": [IGNORE, IGNORE, 12]},              # no teacher prompt: its own
            {"input_ids": [6, 20, 21, 22, 23], "labels": [IGNORE, 20, IGNORE, 22, 23], "response_from": 1,
             "teacher_prompt_ids": [6, 8]}]                                        # sampled, 21 inserted
    view = teacher_rows(rows)
    assert view[0]["input_ids"] == [1, 7, 7, 7, 3, 10, 11] and view[1]["input_ids"] == [4, 5, 12]
    assert view[2]["input_ids"] == [6, 8, 20, 21, 22, 23]
    s, t = collate(rows, 0, padding_free=padding_free), collate(view, 0, padding_free=padding_free)
    s_lab, t_lab = s["labels"][:, 1:], t["labels"][:, 1:]
    assert torch.equal(s_lab[s_lab != IGNORE], t_lab[t_lab != IGNORE])
    assert teacher_rows([{"input_ids": [1, 2], "labels": [IGNORE, 2]}]) is None   # no OPSD: the student's rows
    from swiftlite.data.collate import pack_rows
    with pytest.raises(UserError, match="--packing with a 'teacher_prompt' column"):   # (--lmbda 0 rows)
        pack_rows(rows[:2], 64)


PLUGIN = '''
from swift.dataset import DatasetMeta, ResponsePreprocessor, RowPreprocessor, register_dataset


class Keep(RowPreprocessor):
    def preprocess(self, row):
        if not row.get("correct", True):
            return None
        return {"messages": [{"role": "user", "content": row["problem"]}], "teacher_prompt": row["problem"] + "!"}


class Sts(ResponsePreprocessor):
    def preprocess(self, row):
        return super().preprocess({"query": row["text1"] + " / " + row["text2"], "response": f"{row['label']:.1f}"})


register_dataset(DatasetMeta(ms_dataset_id="org/keep", hf_dataset_id="org/keep-hf", dataset_path=r"{raw}",
                             preprocess_func=Keep()))
register_dataset(DatasetMeta(ms_dataset_id="swift/stsb", dataset_path=r"{sts}", preprocess_func=Sts()))
register_dataset(DatasetMeta(ms_dataset_id="swift/ms-only", preprocess_func=Keep()))
'''


def test_a_registered_dataset_is_read_through_its_preprocessor(tmp_path):
    from swiftlite.data.registered import DATASETS, fingerprint
    from swiftlite.data.sources import load_rows
    from swiftlite.parallel.base import load_plugins
    raw, sts = tmp_path / "raw.jsonl", tmp_path / "sts.jsonl"
    raw.write_text("".join(json.dumps({"problem": f"p{i}", "correct": i % 2 == 0}) + "\n" for i in range(6)))
    sts.write_text(json.dumps({"text1": "a", "text2": "b", "label": 3.25}) + "\n")
    p = tmp_path / "plug.py"
    p.write_text(PLUGIN.replace("{raw}", str(raw)).replace("{sts}", str(sts)))
    before = dict(DATASETS)
    try:
        load_plugins([str(p)])
        got = load_rows("org/keep-hf")                 # by any of its names; the rows the preprocessor keeps
        assert [r["messages"][0]["content"] for r in got.rows] == ["p0", "p2", "p4"]
        assert got.rows[1]["teacher_prompt"] == "p2!" and got.where[1] == f"{raw}:3"
        assert len(load_rows("org/keep#2").rows) == 2  # #N samples what the preprocessor kept
        assert load_rows("swift/stsb").rows[0]["messages"] == [{"role": "user", "content": "a / b"},
                                                               {"role": "assistant", "content": "3.2"}]
        with pytest.raises(UserError, match=r"swift/ms-only: its registered DatasetMeta names only a ModelScope id"):
            load_rows("swift/ms-only")
        assert fingerprint("org/keep") and fingerprint("org/keep") != fingerprint("swift/stsb")
        key = fingerprint("org/keep")          # the cache key follows the source file and the plugin file
        raw.write_text(raw.read_text() + json.dumps({"problem": "p6", "correct": True}) + "\n")
        assert fingerprint("org/keep") not in ("", key)
        key = fingerprint("org/keep")
        p.write_text(p.read_text() + "\nFLAG = 1\n")
        assert fingerprint("org/keep") != key
        with pytest.raises(UserError, match=r"plug\.py:\d+: ValueError: The `.*` has already been registered"):
            load_plugins([str(p)])
    finally:
        DATASETS.clear()
        DATASETS.update(before)
