"""--loss-scale and --template default: the targets of a chat row under each of ms-swift's binary loss
scales, ms-swift's `default` template rendered and labelled as ms-swift does, and the refusals."""

from __future__ import annotations

import json

import pytest

from swiftlite.data import pipeline
from swiftlite.config.loss_scale import LossScale, parse
from swiftlite.data.templates import BUILTIN
from swiftlite.data.tokenize import IGNORE, encode_messages

THINK = "<think>\n\n</think>\n\n"
CONV = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": THINK + "hello"},
        {"role": "user", "content": "again"}, {"role": "assistant", "content": THINK + "yes there"}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from swiftlite.models.presets import TINY_TOKENIZER
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


def _targets(tok, enc) -> list[str]:
    """The labelled text, one string per run of consecutive targets."""
    runs, cur = [], []
    for i, lab in zip(enc.input_ids, enc.labels):
        if lab != IGNORE:
            assert lab == i
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def _enc(tok, value, messages=CONV):
    return encode_messages(tok, messages, 512, loss_scale=parse(value) if value else None)


def test_default_is_every_assistant_turn(tokenizer):
    assert _targets(tokenizer, _enc(tokenizer, None)) == _targets(tokenizer, _enc(tokenizer, "default"))
    assert _targets(tokenizer, _enc(tokenizer, None)) == [THINK + "hello<|im_end|>\n", THINK + "yes there<|im_end|>\n"]


def test_last_round_is_the_answer_after_the_last_user_turn(tokenizer):
    assert _targets(tokenizer, _enc(tokenizer, "last_round")) == [THINK + "yes there<|im_end|>\n"]


def test_all_is_every_token(tokenizer):
    enc = _enc(tokenizer, "all")
    assert all(lab == i for i, lab in zip(enc.input_ids, enc.labels))


def test_ignore_empty_think_drops_the_empty_block_only(tokenizer):
    assert _targets(tokenizer, _enc(tokenizer, "ignore_empty_think")) == ["hello<|im_end|>\n", "yes there<|im_end|>\n"]
    assert _targets(tokenizer, _enc(tokenizer, "last_round+ignore_empty_think")) == ["yes there<|im_end|>\n"]
    # a thinking block with content is trained on
    full = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nwhy\n</think>\n\nA"}]
    assert _targets(tokenizer, _enc(tokenizer, "ignore_empty_think", full)) == ["<think>\nwhy\n</think>\n\nA<|im_end|>\n"]
    # under `all`, the empty block is cut out of the otherwise whole row
    enc = _enc(tokenizer, "all+ignore_empty_think")
    runs = _targets(tokenizer, enc)
    assert len(runs) == 3 and runs[1].startswith("hello") and runs[2].startswith("yes there")


def test_ignore_think_prefix(tokenizer):
    assert _targets(tokenizer, _enc(tokenizer, "ignore_think_prefix"))[0] == "\n</think>\n\nhello<|im_end|>\n"


def test_parse_names_and_refusals():
    assert parse("last_round+ignore_empty_think") == LossScale("last_round", ("ignore_empty_think",))
    assert parse("ignore_empty_think") == LossScale("default", ("ignore_empty_think",))
    assert parse(None) == LossScale()
    assert parse("hermes+ignore_empty_think") == LossScale("default", ("hermes", "ignore_empty_think"))
    with pytest.raises(ValueError, match="'hermes' weights parts of the answers, and `all`"):
        parse("all+hermes")
    with pytest.raises(ValueError, match="unknown loss scale 'nope'"):
        parse("last_round+nope")


def test_msswift_default_template(tokenizer):
    """ms-swift's `default` template (swift/template/templates/llm.py): its text, written out here, and
    its targets: the answers, and the eos token after the last one only (the blank line between rounds
    is ms-swift's ContextType.OTHER, no target)."""
    tok = tokenizer
    saved = tok.chat_template
    tok.chat_template = BUILTIN["default"]
    try:
        conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "yes"}]
        eos = tok.eos_token
        text = tok.apply_chat_template(conv, tokenize=False)
        assert text == ("You are a helpful assistant.\n\n### Human:\nhi\n\n### Assistant:\nhello\n\n"
                        f"### Human:\nagain\n\n### Assistant:\nyes{eos}")
        sys_conv = [{"role": "system", "content": "Be brief."}, *conv[:1]]
        assert tok.apply_chat_template(sys_conv, tokenize=False, add_generation_prompt=True) == \
            "Be brief.\n\n### Human:\nhi\n\n### Assistant:\n"
        assert _targets(tok, encode_messages(tok, conv, 512)) == ["hello", f"yes{eos}"]
        assert _targets(tok, encode_messages(tok, conv, 512, loss_scale=parse("last_round"))) == [f"yes{eos}"]
    finally:
        tok.chat_template = saved


def test_a_template_that_drops_an_answer_is_still_refused(tokenizer):
    """The relaxed turn end (a last turn ended otherwise than a middle one) still refuses a template
    that renders an earlier answer differently inside the conversation."""
    from swiftlite.errors import UserError
    tok = tokenizer
    saved = tok.chat_template
    tok.chat_template = ("{%- for m in messages -%}{%- if m['role'] == 'user' -%}U:{{ m['content'] }}\n"
                         "{%- elif loop.last -%}A:{{ m['content'] }}.{%- else -%}A:...\n{%- endif -%}{%- endfor -%}")
    try:
        conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        with pytest.raises(UserError, match="prefix by prefix"):
            encode_messages(tok, conv, 512)
    finally:
        tok.chat_template = saved


def test_the_cache_tells_loss_scales_apart(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": CONV}) + "\n")

    def tok(scale):
        return pipeline.tokenize_specs([str(data)], tokenizer, task="sft", max_length=512, packing=False,
                                       skip_bad_rows=False, load_from_cache_file=True, loss_scale=scale)
    a, b = tok(LossScale()), tok(parse("last_round"))
    assert a.rows[0]["input_ids"] == b.rows[0]["input_ids"]
    assert a.rows[0]["labels"] != b.rows[0]["labels"]
    assert tok(parse("last_round")).rows[0]["labels"] == b.rows[0]["labels"]


@pytest.mark.parametrize("argv,message", [
    (["--loss_scale", "react", "--loss_impl", "cce"], "--loss-scale react with --loss-impl cce: the fused kernel"),
    (["--loss_scale", "last_round"], None),
])
def test_sft_flags(argv, message):
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.errors import UserError
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", *argv])
    if message is None:
        assert load_config(config_file, values, validate_paths=False).data.loss_scale == "last_round"
        return
    with pytest.raises(UserError, match=message):
        load_config(config_file, values, validate_paths=False)


@pytest.mark.parametrize("task,argv,message", [
    ("pt", ["--loss_scale", "last_round"], "pt trains every token of plain-text rows"),
    ("rlhf", ["--rlhf_type", "dpo", "--loss_scale", "default"], "rlhf trains on the answer of each pair"),
    ("rlhf", ["--rlhf_type", "dpo", "--loss_type", "cross_entropy"], "is a loss of sft and pt"),
])
def test_other_commands_refuse_what_they_do_not_do(task, argv, message):
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.errors import UserError
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", *argv])
    with pytest.raises(UserError, match=message):
        load_config(config_file, values, validate_paths=False, task=task)


def test_pt_split_truncation_makes_consecutive_pieces(tmp_path, tokenizer):
    """--truncation_strategy split (ms-swift's, pre-training only): a long document becomes consecutive
    --max-length pieces, each a sample with every token a target; together they are the whole document."""
    text = "abcdefghij" * 30                       # 300 bytes: 300 tokens of the byte-level tokenizer, + eos
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "short"}) + "\n")
    tok = pipeline.tokenize_specs([str(data)], tokenizer, task="pt", max_length=128, packing=False,
                                  skip_bad_rows=False, use_cache=False, truncation_strategy="split")
    lengths = [len(r["input_ids"]) for r in tok.rows]
    assert lengths == [128, 128, 45, 6]
    whole = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert sum((r["input_ids"] for r in tok.rows[:3]), []) == whole
    assert all(r["labels"] == r["input_ids"] for r in tok.rows)
    assert tok.stats.rows == 2 and tok.stats.truncated == 0 and tok.stats.deleted == 0


@pytest.mark.parametrize("task,argv,message", [
    ("sft", ["--truncation_strategy", "split"], "--truncation-strategy split is for pt"),
    ("pt", ["--truncation_strategy", "split", "--lazy_tokenize", "true"], "with --lazy-tokenize"),
])
def test_split_truncation_refusals(task, argv, message):
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.errors import UserError
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", *argv])
    with pytest.raises(UserError, match=message):
        load_config(config_file, values, validate_paths=False, task=task)


def test_builtin_templates_are_the_names_the_rules_accept():
    from swiftlite.config.data_options import TEMPLATE_NAMES
    assert tuple(BUILTIN) == TEMPLATE_NAMES
