"""GRPO --reward_model (ms-swift's default reward-model plugin): a one-output sequence classifier's score of
the conversation rendered with its own chat template, the folder checks, the rules and the planner's count."""

from __future__ import annotations

import json
import re

import pytest
import torch


def build_tiny_qwen2(d, cls_name, **config):
    """A tiny Qwen2 folder of class `cls_name` (random weights, fp32) with the repository's tokenizer."""
    import transformers
    from transformers import AutoTokenizer, Qwen2Config

    from swiftlite.models.presets import TINY_TOKENIZER, TINY_VOCAB
    conf = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=TINY_VOCAB, eos_token_id=258, pad_token_id=259,
                       bos_token_id=None, **config)
    torch.manual_seed(0)
    getattr(transformers, cls_name)(conf).save_pretrained(d)
    AutoTokenizer.from_pretrained(TINY_TOKENIZER).save_pretrained(d)
    return d


def build_tiny_rm(d):
    """A tiny one-output Qwen2 classifier folder, as an exported `--rlhf_type rm` run is (also used by the
    GRPO e2e test)."""
    return build_tiny_qwen2(d, "Qwen2ForSequenceClassification", max_position_embeddings=512, num_labels=1)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_tiny_rm(tmp_path_factory.mktemp("rm") / "tiny-rm")


CONVS = [[{"role": "user", "content": "reverse: abcd"}, {"role": "assistant", "content": "dcba"}],
         [{"role": "user", "content": "reverse: a much longer word here"}, {"role": "assistant", "content": "x y"}]]


def test_the_score_is_the_classifiers_first_logit_on_its_template(rm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from swiftlite.rlhf.reward_model import RewardModelScorer
    scorer = RewardModelScorer(str(rm_dir), "cpu", torch.float32)
    got = scorer(["dcba", "x y"], messages=CONVS)
    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    for conv, score in zip(CONVS, got):   # each alone, unpadded
        ids = tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            want = float(model(**ids).logits[0, 0])
        assert score == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert got[0] != got[1]


def test_folder_checks(rm_dir, tmp_path):
    from swiftlite.rlhf.reward_model import config_problem
    assert config_problem(str(rm_dir)) is None
    assert config_problem("org/reward-model") is None            # a hub id: read when the run loads it
    assert "model folder not found" in config_problem(str(tmp_path / "nothere"))
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert "a Qwen2ForCausalLM with 2 outputs" in config_problem(str(lm))
    assert config_problem(str(lm), "genrm") is None and config_problem(str(lm), "my_plugin") is None
    assert "the genrm plugin asks a causal LM" in config_problem(str(rm_dir), "genrm")


@pytest.mark.parametrize("argv,message", [
    (["--reward_model", "{rm}", "--reward_model_plugin", "default", "default"], "has 2 values for 1 --reward-model"),
    (["--reward_funcs", "format", "--reward_model", "{rm}", "--reward_weights", "1"],
     "--reward-weights has 1 values for 1 --reward-funcs and 1 --reward-model"),
    (["--reward_funcs", "format", "--reward_model_plugin", "default"], "--reward-model-plugin applies to --reward-model"),
    (["--reward_model", "{rm}", "--reward_model_plugin", "default"], None),
])
def test_rules(rm_dir, tmp_path, argv, message):
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.errors import UserError
    argv = [a.format(rm=rm_dir, tmp=tmp_path) for a in argv]
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--rlhf_type", "grpo",
                                          *argv])
    if message is None:   # a reward model alone is a reward source
        cfg = load_config(config_file, values, validate_paths=False, task="rlhf")
        assert cfg.rlhf.reward_model == [str(rm_dir)] and cfg.rlhf.reward_funcs == [] and \
            cfg.rlhf.reward_model_plugin == ["default"]
        return
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(config_file, values, validate_paths=False, task="rlhf")


def test_the_planner_counts_a_whole_copy_per_rank(rm_dir):
    from dataclasses import replace

    from swiftlite.models.source import resolve_model
    from swiftlite.planner.memory import Workload, reference_bytes
    from swiftlite.planner.recommend import _reward_model_params
    n = _reward_model_params([str(rm_dir)])
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    assert n == sum(p.numel() for p in model.parameters())
    shape = resolve_model("tiny-llama-2l").shape()
    w = Workload(world_size=4)
    for backend in ("ddp", "fsdp", "zero3"):
        base = reference_bytes(shape, w, backend)
        assert reference_bytes(shape, replace(w, reward_model_params=n), backend) - base == n * w.elem, backend
