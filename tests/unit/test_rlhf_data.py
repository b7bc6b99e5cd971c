"""Preference rows: ms-swift and TRL formats -> the same pair, prompt tokens masked, --max-length per
--truncation-strategy, bad rows as one-line errors or counted skips, and collation of a pair's two
sides into one micro-batch."""

from __future__ import annotations

import json

import pytest

from swiftlite.data.tokenize import IGNORE
from swiftlite.errors import UserError
from swiftlite.rlhf.data import collate_pairs, encode_pairs, to_pair


@pytest.fixture(scope="module")
def tok():
    from swiftlite.config import build_config
    from swiftlite.models.loading import load_tokenizer
    cfg = build_config({"model": "tiny-llama-2l", "dataset": ["x.jsonl"]}, task="rlhf")
    return load_tokenizer(cfg)


MS = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse: abc"},
                   {"role": "assistant", "content": "cba"}], "rejected_response": "abc"}
PROMPT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse: abc"}]
TRL_CONV = {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "cba"}],
            "rejected": [{"role": "assistant", "content": "abc"}]}
TRL_IMPLICIT = {"chosen": PROMPT + [{"role": "assistant", "content": "cba"}],
                "rejected": PROMPT + [{"role": "assistant", "content": "abc"}]}


def test_ms_swift_and_trl_forms_give_the_same_pair():
    pairs = [to_pair(r, "row") for r in (MS, TRL_CONV, TRL_IMPLICIT)]
    assert pairs[0] == pairs[1] == pairs[2]
    assert pairs[0].prompt == PROMPT
    assert pairs[0].chosen == [{"role": "assistant", "content": "cba"}]
    p = to_pair({"prompt": "reverse: abc", "chosen": "cba", "rejected": "abc"}, "row")
    assert p.prompt == [{"role": "user", "content": "reverse: abc"}] and p.rejected[0]["content"] == "abc"
    q = to_pair({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "row")
    assert q.prompt[0]["content"] == "The sky is" and q.chosen[0]["content"] == " blue."


def test_prompt_tokens_are_masked_and_the_answer_is_the_target(tok):
    rows, st = encode_pairs([(MS, "r:1")], tok, 512, "delete", False)
    assert st.rows == 1 and len(rows) == 1
    r = rows[0]
    for side, answer in (("chosen", "cba"), ("rejected", "abc")):
        ids, labels = r[f"{side}_ids"], r[f"{side}_labels"]
        targets = [t for t, lab in zip(ids, labels) if lab != IGNORE]
        assert tok.decode(targets).strip().startswith(answer)
        first = next(i for i, lab in enumerate(labels) if lab != IGNORE)
        assert "reverse: abc" in tok.decode(ids[:first])           # the prompt is all before the target
        assert all(lab == IGNORE for lab in labels[:first])
    # the two sides share the prompt tokens exactly
    first = next(i for i, lab in enumerate(r["chosen_labels"]) if lab != IGNORE)
    assert r["chosen_ids"][:first] == r["rejected_ids"][:first]


def test_multi_turn_history_is_context_only(tok):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                        {"role": "user", "content": "reverse: ab"}, {"role": "assistant", "content": "ba"}],
           "rejected_response": "ab"}
    (r,), _ = encode_pairs([(row, "r")], tok, 512, "delete", False)
    targets = tok.decode([t for t, lab in zip(r["chosen_ids"], r["chosen_labels"]) if lab != IGNORE])
    assert "hello" not in targets and "ba" in targets


def test_truncation_strategies(tok):
    long = {"prompt": "reverse: " + "abcdefgh" * 20, "chosen": "x", "rejected": "y"}
    ok = {"prompt": "reverse: ab", "chosen": "ba", "rejected": "ab"}
    full = len(encode_pairs([(ok, "r")], tok, 512, "delete", False)[0][0]["chosen_ids"])
    rows, st = encode_pairs([(long, "r:1"), (ok, "r:2")], tok, full + 2, "delete", False)
    assert len(rows) == 1 and st.deleted == 1 and st.rows == 2          # a prompt too long: deleted, counted
    rows, st = encode_pairs([(long, "r:1")], tok, full + 2, "left", False)
    assert len(rows) == 1 and st.truncated == 1                           # the end (the answers) kept
    assert len(rows[0]["chosen_ids"]) == full + 2
    rows, st = encode_pairs([(long, "r:1")], tok, full + 2, "right", False)
    assert rows == [] and st.no_target == 1                              # the answers cut away: dropped


@pytest.mark.parametrize("row,words", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "no rejected answer"),
    ({"prompt": "q", "chosen": "a"}, "no rejected answer"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "identical"),
    (dict(MS, rejected_response="cba"), "identical"),
    ({"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}, "both be strings"),
])
def test_bad_rows_are_one_line_errors_or_counted_skips(tok, row, words):
    with pytest.raises(UserError) as e:
        encode_pairs([(row, "data.jsonl:3")], tok, 512, "delete", False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data.jsonl:3:") and words in msg
    rows, st = encode_pairs([(row, "data.jsonl:3"), (MS, "data.jsonl:4")], tok, 512, "delete", True)
    assert len(rows) == 1 and len(st.skipped) == 1 and words in st.skipped[0]


def test_collate_puts_both_sides_of_each_pair_in_one_batch(tok):
    rows, _ = encode_pairs([(MS, "a"), ({"prompt": "reverse: abcdef", "chosen": "fedcba", "rejected": "abcdef"}, "b")],
                           tok, 512, "delete", False)
    b = collate_pairs(rows, tok.pad_token_id)
    assert b["input_ids"].shape[0] == 4
    for i, r in enumerate(rows):
        n = len(r["chosen_ids"])
        assert b["input_ids"][i, :n].tolist() == r["chosen_ids"]
        m = len(r["rejected_ids"])
        assert b["input_ids"][2 + i, :m].tolist() == r["rejected_ids"]
        assert int(b["attention_mask"][2 + i].sum()) == m


def test_rlhf_options_are_refused_elsewhere_and_per_method():
    from swiftlite.config import build_config, validate
    base = {"model": "tiny-llama-2l", "dataset": ["x.jsonl"]}
    with pytest.raises(UserError, match="--beta is an option of `swiftlite rlhf`"):
        cfg = build_config({**base, "beta": 0.2}, task="sft")
        cfg.explicit = frozenset({"beta", "model", "dataset"})
        validate(cfg, check_paths=False)
    for values, words in (({"rlhf_type": "orpo", "loss_type": "ipo"}, "--loss-type does not apply to --rlhf-type orpo"),
                          ({"rlhf_type": "dpo", "simpo_gamma": 0.5}, "--simpo-gamma does not apply"),
                          ({"label_smoothing": 0.6}, "--label-smoothing must be in [0, 0.5)"),
                          ({"loss_type": "hinge", "label_smoothing": 0.1}, "applies to the sigmoid loss"),
                          ({"rlhf_type": "kto", "packing": True}, "--packing with --rlhf-type kto: not available"),
                          ({"rlhf_type": "rm", "padding_free": True}, "--padding-free true with --rlhf-type rm:")):
        cfg = build_config({**base, **values}, task="rlhf")
        cfg.explicit = frozenset(values) | {"model", "dataset"}
        with pytest.raises(UserError, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                           .replace(")", r"\)")):
            validate(cfg, check_paths=False)


def test_the_demo_pairs_are_checkable(tmp_path):
    from swiftlite.rlhf.demo import write_preference_data
    train, val = write_preference_data(tmp_path, n_train=50, n_val=10)
    for line in train.read_text().splitlines():
        r = json.loads(line)
        s = r["messages"][0]["content"].removeprefix("reverse: ")
        assert r["messages"][1]["content"] == s[::-1] and r["rejected_response"] != s[::-1]
    assert len(val.read_text().splitlines()) == 10


def test_every_foreign_preference_option_is_named_in_one_line():
    """All at once: sft given three rlhf options names the three; dpo given two GRPO options names both."""
    from swiftlite.config import build_config, validate
    base = {"model": "tiny-llama-2l", "dataset": ["x.jsonl"]}
    for task, values, words in (
            ("sft", {"beta": 0.2, "temperature": 0.7, "num_iterations": 2},
             "--beta, --temperature, --num-iterations are options of `swiftlite rlhf`"),
            ("rlhf", {"rlhf_type": "dpo", "temperature": 0.7, "num_generations": 4},
             "--num-generations, --temperature do not apply to --rlhf-type dpo")):
        with pytest.raises(UserError, match=words):
            cfg = build_config({**base, **values}, task=task)
            cfg.explicit = frozenset({*values, "model", "dataset"})
            validate(cfg, check_paths=False)
