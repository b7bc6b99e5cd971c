"""--new_special_tokens (ms-swift's examples/train/new_special_tokens): tokens from a .txt file and the
command line become single special tokens, the embeddings grow to ms-swift's multiple of 128 with rows
drawn under --seed (the same on every rank and in every rebuild), a LoRA run trains and saves them
through --modules_to_save, and the export holds the grown vocabulary, the trained rows and the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import cli_env, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from swiftlite.models.presets import TINY_TOKENIZER, TINY_VOCAB
    d = tmp_path_factory.mktemp("newtok")
    conf = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=512,
                       tie_word_embeddings=False, eos_token_id=258, pad_token_id=259, bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(conf).save_pretrained(d / "model")
    AutoTokenizer.from_pretrained(TINY_TOKENIZER).save_pretrained(d / "model")
    (d / "tokens.txt").write_text("<tool>\n</tool>\n<|0|>\n")
    rows = [{"messages": [{"role": "user", "content": f"call {w}"},
                          {"role": "assistant", "content": f"<tool>{w}</tool> <y>"}]} for w in
            ("ab", "cd", "ef", "gh", "ij", "kl", "mn", "op")]
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _cfg(world: Path, *extra: str):
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    config_file, values = parse_run_args(["--model", str(world / "model"), "--dataset", str(world / "data.jsonl"),
                                          "--new_special_tokens", str(world / "tokens.txt"), "<y>", *extra])
    return load_config(config_file, values)


def test_tokens_vocab_and_seeded_rows(world):
    from swiftlite.models.loading import load_model, load_tokenizer, model_config, new_special_tokens
    cfg = _cfg(world, "--train_type", "full")
    assert new_special_tokens(cfg) == ["<tool>", "</tool>", "<|0|>", "<y>"]
    tok = load_tokenizer(cfg)
    assert len(tok) == 264
    ids = tok("<tool>x</tool><y>", add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<tool>") and len(ids) == 4      # each a single token
    assert model_config(cfg).vocab_size == 384                                   # ceil(264 / 128) * 128
    a, b = load_model(cfg), load_model(cfg)
    ea, eb = a.get_input_embeddings().weight, b.get_input_embeddings().weight
    assert ea.shape == (384, 64) and a.get_output_embeddings().weight.shape == (384, 64)
    assert torch.equal(ea, eb)                                                    # the new rows: seeded
    from safetensors.torch import load_file
    base = load_file(world / "model" / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(ea[:260], base)                                            # the old rows kept
    c = load_model(_cfg(world, "--train_type", "full", "--seed", "7"))
    assert not torch.equal(c.get_input_embeddings().weight[260:], ea[260:])


def test_rules(world, tmp_path):
    from swiftlite.errors import UserError
    with pytest.raises(UserError, match="--new_special_tokens with LoRA needs --modules_to_save embed_tokens lm_head"):
        _cfg(world, "--train_type", "lora")
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    config_file, values = parse_run_args(["--model", str(world / "model"), "--dataset", str(world / "data.jsonl"),
                                          "--new_special_tokens", str(tmp_path / "none.txt")])
    with pytest.raises(UserError, match="none.txt: file not found"):
        load_config(config_file, values)


def test_lora_run_trains_the_new_rows_and_exports_them(world, tmp_path):
    run = tmp_path / "run"
    env = cli_env(SWIFTLITE_CACHE=str(tmp_path / "cache"))
    log = run_cli(["sft", "--model", world / "model", "--train_type", "lora", "--modules_to_save", "embed_tokens",
                   "lm_head", "--dataset", world / "data.jsonl", "--new_special_tokens", world / "tokens.txt", "<y>",
                   "--max_steps", "2", "--gradient_accumulation_steps", "1", "--per_device_train_batch_size", "4",
                   "--learning_rate", "1e-2", "--max_length", "64", "--output_dir", run], env=env).stdout
    assert "loss=" in log
    out = tmp_path / "merged"
    run_cli(["export", "--ckpt", run, "--merge_lora", "true", "-o", out, "--verify"], env=env)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 384
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 264 and tok.convert_tokens_to_ids("<y>") == 263
    w = load_file(out / "model.safetensors")
    adapter = load_file(run / "checkpoint-2" / "adapter" / "adapter_model.safetensors")
    trained = adapter["base_model.model.model.embed_tokens.weight"]   # peft names the modules_to_save copy so
    assert trained.shape == (384, 64)
    assert torch.equal(w["model.embed_tokens.weight"].float(), trained.to(torch.bfloat16).float())
    # the rows of tokens the data uses moved from where the seeded resize drew them
    from swiftlite.models.loading import load_model
    start = load_model(_cfg(world, "--train_type", "full")).get_input_embeddings().weight
    tool = tok.convert_tokens_to_ids("<tool>")
    moved = float((trained[tool] - start[tool]).norm())
    decayed = float((trained[300] - start[300]).norm())   # a padding row no token uses: weight decay only
    assert moved > 10 * decayed > 0, (moved, decayed)
