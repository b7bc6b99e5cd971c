"""--rope_scaling and --max_model_len (ms-swift's): the rule of models/rope.py on transformers configs,
the refusals, and a run on a model folder whose trained and exported config carry the scaled rope."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from swiftlite.config import build_config, validate
from swiftlite.errors import UserError
from swiftlite.models import rope
from swiftlite.models.presets import TINY_TOKENIZER, get_preset
from tests.conftest import cli_env, main_in_process


def qwen2(**over):
    from transformers import AutoConfig
    return AutoConfig.for_model(**{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
                                   "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                   "vocab_size": 300, "max_position_embeddings": 4096, **over})


def opts(**values):
    return build_config({"model": "tiny-llama", **values}).model


def test_yarn_by_name_takes_ceil_of_the_ratio_as_factor():
    conf = rope.apply(qwen2(), opts(rope_scaling="yarn", max_model_len=10000))
    assert conf.rope_parameters == {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 4096,
                                    "rope_theta": 10000.0}
    assert conf.max_position_embeddings == 10000   # --max_model_len, not factor x original (12288)


def test_a_json_object_replaces_the_rope_and_sets_the_context():
    conf = rope.apply(qwen2(rope_theta=1e6), opts(rope_scaling='{"type": "linear", "factor": 2.0}'))
    assert conf.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    assert conf.max_position_embeddings == 8192    # original x factor, as ms-swift when --max_model_len is unset


def test_max_model_len_alone_keeps_a_default_rope_and_recomputes_a_scaled_one():
    plain = rope.apply(qwen2(), opts(max_model_len=6000))
    assert plain.rope_parameters["rope_type"] == "default" and "factor" not in plain.rope_parameters
    assert plain.max_position_embeddings == 6000
    scaled = qwen2(max_position_embeddings=16384,
                   rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
    longer = rope.apply(scaled, opts(max_model_len=32768))
    assert longer.rope_parameters["factor"] == 8.0 and longer.rope_parameters["original_max_position_embeddings"] == 4096
    assert longer.max_position_embeddings == 32768


def test_neither_flag_leaves_the_config_object_alone():
    conf = qwen2()
    assert rope.apply(conf, opts()) is conf


def test_the_scaled_rope_reaches_the_rotary_embedding():
    """Fails if the override is dropped before the model is built: yarn changes inv_freq and the
    attention scaling transformers' rotary embedding computes."""
    from transformers import AutoModelForCausalLM
    default = AutoModelForCausalLM.from_config(qwen2()).model.rotary_emb
    yarn = AutoModelForCausalLM.from_config(rope.apply(qwen2(), opts(rope_scaling="yarn", max_model_len=16384)))
    assert not torch.allclose(default.inv_freq, yarn.model.rotary_emb.inv_freq)
    assert yarn.model.rotary_emb.attention_scaling > 1.0 == default.attention_scaling


@pytest.mark.parametrize("values, words", [
    ({"rope_scaling": "ntk"}, "--rope_scaling ntk: give linear, dynamic, yarn, a JSON object or a .json file"),
    ({"rope_scaling": "yarn"}, "--rope_scaling yarn names no factor: add --max_model_len"),
    ({"rope_scaling": '{"factor": 2}'}, "names no rope type"),
    ({"rope_scaling": '{"type": "linear", "factor": 0.5}'}, "factor 0.5: a number >= 1 is needed"),
    ({"rope_scaling": "{oops", "max_model_len": 10}, "invalid JSON at 1:2"),
    ({"max_model_len": 0}, "--max_model_len 0: give the context length in tokens"),
])
def test_refusals_name_the_flag(values, words):
    with pytest.raises(UserError) as e:
        validate(build_config({"model": "tiny-llama", **values}), check_paths=False)
    assert words in str(e.value)


def test_a_rope_transformers_refuses_is_a_user_error():
    with pytest.raises(UserError, match="transformers refuses it"):
        rope.apply(qwen2(), opts(rope_scaling='{"type": "longrope", "factor": 2.0}', max_model_len=8192))


def test_a_json_file_is_read(tmp_path):
    f = tmp_path / "rope.json"
    f.write_text('{"rope_type": "dynamic", "factor": 2.0}')
    conf = rope.apply(qwen2(), opts(rope_scaling=str(f)))
    assert conf.rope_parameters["rope_type"] == "dynamic" and conf.max_position_embeddings == 8192


def _folder(tmp_path: Path) -> Path:
    """A tiny Llama saved as a model folder: the run loads it with from_pretrained (the config= path)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    folder = tmp_path / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**get_preset("tiny-llama-2l").config)).save_pretrained(folder)
    for f in TINY_TOKENIZER.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def test_run_trains_and_exports_the_scaled_rope(tmp_path):
    base = _folder(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": f"a{i}"}]}) + "\n"
                            for i in range(4)))
    out = tmp_path / "out"
    r = main_in_process(["sft", "--model", str(base), "--dataset", str(data), "--rope_scaling", "yarn",
                         "--max_model_len", "8192", "--max_steps", "1", "--gradient_accumulation_steps", "1",
                         "--output_dir", str(out)], env=cli_env())
    assert r.returncode == 0, r.stdout + r.stderr
    args = json.loads((out / "args.json").read_text())
    assert (args["model"]["rope_scaling"], args["model"]["max_model_len"], args["data"]["max_length"]) == (
        "yarn", 8192, 8192)   # --max_length defaults to the context the run gives the model
    exp = tmp_path / "exp"
    # LoRA, merged: export rebuilds the base from the run's config (export/source.model_config_for)
    r = main_in_process(["export", "--ckpt_dir", str(out / "checkpoint-1"), "--output_dir", str(exp),
                         "--merge_lora", "true"], env=cli_env())
    assert r.returncode == 0, r.stdout + r.stderr
    conf = json.loads((exp / "config.json").read_text())
    assert conf["rope_parameters"]["rope_type"] == "yarn" and conf["rope_parameters"]["factor"] == 4.0
    assert conf["rope_scaling"]["original_max_position_embeddings"] == 2048   # what transformers 4.x readers take
    assert conf["max_position_embeddings"] == 8192
    # the base folder itself is untouched: the override lives in the run's config only
    assert json.loads((base / "config.json").read_text())["max_position_embeddings"] == 2048
