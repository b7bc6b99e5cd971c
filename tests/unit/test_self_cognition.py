"""--model_name / --model_author: ms-swift's self-cognition substitution on local data of that format
(swift/dataset/dataset/llm.SelfCognitionPreprocessor: {{NAME}}/{{AUTHOR}} in query and response, the
first value for rows tagged zh, the second for the others)."""

from __future__ import annotations

import json

import pytest

from swiftlite.config import load_config
from swiftlite.errors import UserError
from swiftlite.launch.preflight import resolve_for_launch

ROWS = [{"query": "你是谁？", "response": "我是{{NAME}}，由{{AUTHOR}}训练的人工智能助手。", "tag": "zh"},
        {"query": "who are you?", "response": "I am {{NAME}}, an AI assistant trained by {{AUTHOR}}.", "tag": "en"},
        {"query": "Is {{NAME}} your name?", "response": "Yes, I am {{NAME}}.", "tag": "en"}]


def _files(tmp_path):
    sc = tmp_path / "self_cognition.jsonl"
    sc.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS))
    other = tmp_path / "alpaca.jsonl"
    other.write_text(json.dumps({"instruction": "Say {{NAME}}", "output": "{{NAME}}"}) + "\n")
    return sc, other


def _prepare(tmp_path, datasets, **extra):
    from swiftlite.data.pipeline import prepare_datasets
    from swiftlite.models.loading import load_tokenizer, resolve_model
    cfg = load_config(None, {"model": "tiny-llama-2l", "dataset": [str(d) for d in datasets],
                             "output_dir": str(tmp_path / "o"), "gradient_accumulation_steps": 1, **extra}, task="sft")
    tok = load_tokenizer(cfg, resolve_model(cfg.model.model))
    train, _, _ = prepare_datasets(resolve_for_launch(cfg, 1).config, tok, 1)
    if hasattr(train.rows, "items"):   # lazy
        rows = [train.rows[i] for i in range(len(train.rows))]
    else:
        rows = train.rows
    return [tok.decode(r["input_ids"]) for r in rows]


def test_names_fill_the_self_cognition_rows_only(tmp_path):
    sc, other = _files(tmp_path)
    texts = _prepare(tmp_path, [sc, other], model_name=["小黄", "Xiao Huang"], model_author=["魔搭", "ModelScope"])
    assert len(texts) == 4
    assert "我是小黄，由魔搭训练的人工智能助手。" in texts[0]
    assert "I am Xiao Huang, an AI assistant trained by ModelScope." in texts[1]
    assert "Is Xiao Huang your name?" in texts[2] and "Yes, I am Xiao Huang." in texts[2]
    assert "{{NAME}}" in texts[3]                       # not that format: as written (ms-swift: another dataset)
    assert not any("{{" in t for t in texts[:3])


def test_one_value_serves_both_and_an_unset_flag_leaves_its_placeholder(tmp_path):
    sc, _ = _files(tmp_path)
    texts = _prepare(tmp_path, [sc], model_name=["Swifty"], lazy_tokenize=True)
    assert "我是Swifty，由{{AUTHOR}}训练" in texts[0] and "I am Swifty, an AI assistant trained by {{AUTHOR}}." in texts[1]
    # another name is another cache key: never a stale substitution
    assert "I am Other" in _prepare(tmp_path, [sc], model_name=["Other"], load_from_cache_file=True)[1]


def test_refusals(tmp_path):
    sc, other = _files(tmp_path)
    with pytest.raises(UserError, match=r"^--model_name: no --dataset/--val-dataset source .* is in ms-swift's "
                                        r"self-cognition format"):
        _prepare(tmp_path, [other], model_name=["X"])
    with pytest.raises(UserError, match=r"--model_author a b c: takes one name, or two"):
        _prepare(tmp_path, [sc], model_author=["a", "b", "c"])
    with pytest.raises(UserError, match=r"--model-name applies to sft and pt"):
        load_config(None, {"dataset": ["d.jsonl"], "model_name": ["X"]}, task="rlhf", validate_paths=False)


def test_streamed_rows_are_filled_too(tmp_path):
    from swiftlite.data.pipeline import prepare_datasets
    from swiftlite.data.stream import StreamBatches
    from swiftlite.distributed import World
    from swiftlite.models.loading import load_tokenizer, resolve_model
    sc, _ = _files(tmp_path)
    cfg = load_config(None, {"model": "tiny-llama-2l", "dataset": [str(sc)], "output_dir": str(tmp_path / "o"),
                             "gradient_accumulation_steps": 1, "streaming": True, "max_steps": 3,
                             "model_name": ["小黄", "Xiao Huang"]}, task="sft")
    tok = load_tokenizer(cfg, resolve_model(cfg.model.model))
    train, _, plan = prepare_datasets(resolve_for_launch(cfg, 1).config, tok, 1)
    b = StreamBatches(train, plan, tok.pad_token_id, World(), None, 0, True, None)
    texts = [tok.decode(b.step_data(k).micro[0]["input_ids"][0]) for k in range(3)]
    b.close()
    assert "我是小黄，由{{AUTHOR}}训练" in texts[0] and "I am Xiao Huang" in texts[1] and "Yes, I am Xiao Huang." in texts[2]
