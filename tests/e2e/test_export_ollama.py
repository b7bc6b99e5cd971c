"""`swiftlite export --to_ollama true` (ms-swift's examples/export/ollama.sh): the Modelfile's TEMPLATE,
rendered the way ollama renders a legacy template, gives the same text as the chat template for one
exchange, with and without a system prompt; stop words and sampling settings come from the model; a
LoRA checkpoint is merged first and the Modelfile sits next to the weights (FROM .); `--model M` alone
points at M as it is (ms-swift's)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.e2e.test_msswift_scripts import in_process as main_in_process

#: Qwen2.5's chat template, reduced to what shapes one exchange: a default system turn when the
#: conversation has none.
QWEN_LIKE = ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba "
             "Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for m in messages %}{{- "
             "'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if "
             "add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
#: Llama-3's shape: a bos token first, headers, an eot token that is not the eos.
LLAMA_LIKE = ("{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
              " + m['content'] + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
              "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
#: A template that renders past answers with a thinking block its generation prompt does not open.
THINKING = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + ('<think>\\n\\n</think>\\n\\n' if "
            "m['role'] == 'assistant' else '') + m['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if "
            "add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def go_render(template: str, system: str, prompt: str, response: str) -> str:
    """ollama's rendering of the legacy template subset a Modelfile here uses: `{{ if .X }}A{{ else }}B{{ end }}`,
    `{{ if .X }}A{{ end }}` and the `.System`, `.Prompt`, `.Response` fields."""
    values = {"System": system, "Prompt": prompt, "Response": response}

    def cond(m: re.Match) -> str:
        return m.group(2) if values[m.group(1)] else (m.group(3) or "")
    out = re.sub(r"\{\{ if \.(\w+) \}\}(.*?)(?:\{\{ else \}\}(.*?))?\{\{ end \}\}", cond, template, flags=re.S)
    return re.sub(r"\{\{ \.(\w+) \}\}", lambda m: values[m.group(1)], out)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from swiftlite.models.presets import TINY_TOKENIZER, TINY_VOCAB
    d = tmp_path_factory.mktemp("ollama") / "model"
    conf = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=TINY_VOCAB, max_position_embeddings=256,
                       eos_token_id=258, pad_token_id=259, bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(conf).save_pretrained(d)
    AutoTokenizer.from_pretrained(TINY_TOKENIZER).save_pretrained(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [258], "temperature": 0.7, "top_p": 0.8,
                                                          "top_k": 20, "repetition_penalty": 1.05}))
    return d


def _template(text: str) -> str:
    return text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]


@pytest.mark.parametrize("chat", [None, QWEN_LIKE, LLAMA_LIKE], ids=["chatml", "qwen-default-system", "llama-bos"])
def test_template_renders_as_the_chat_template(model_dir, chat):
    from transformers import AutoTokenizer

    from swiftlite.export.ollama import modelfile
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if chat is not None:
        tok.chat_template = chat
    if chat == LLAMA_LIKE:
        tok.bos_token = "<|endoftext|>"
    text = modelfile(tok, {}, ".", "--model m")
    tpl = _template(text)
    for system in ("Be brief.", ""):
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
        want = tok.apply_chat_template(msgs, tokenize=False)
        assert go_render(tpl, system, "What is 2+2?", "4") == want, (system, tpl)
        gen = tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
        # generating, ollama renders the last exchange up to {{ .Response }}: what the model continues
        assert go_render(tpl.split("{{ .Response }}")[0], system, "What is 2+2?", "") == gen
    assert text.startswith("FROM .\n")


def test_refuses_what_one_exchange_cannot_express(model_dir):
    from transformers import AutoTokenizer

    from swiftlite.errors import UserError
    from swiftlite.export.ollama import modelfile
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.chat_template = THINKING
    with pytest.raises(UserError, match="opens an answer differently"):
        modelfile(tok, {}, ".", "--ckpt c")
    tok.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        modelfile(tok, {}, ".", "--ckpt c")


def test_model_alone_and_merged_lora(model_dir, tmp_path):
    """ollama.sh as written (`--model M --to_ollama true --output_dir D`): D/Modelfile FROM M, stop words and
    sampling settings from M's generation config; a LoRA checkpoint: merged, the Modelfile next to the weights."""
    out = tmp_path / "Qwen2.5-1.5B-Instruct-ollama"
    rc, err = main_in_process(["export", "--model", str(model_dir), "--to_ollama", "true", "--output_dir", str(out)],
                              tmp_path)
    assert rc == 0, err
    text = (out / "Modelfile").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile"]
    assert text.splitlines()[0] == f"FROM {model_dir.resolve()}"
    for line in ('PARAMETER stop "<|im_end|>"', "PARAMETER temperature 0.7", "PARAMETER top_p 0.8",
                 "PARAMETER top_k 20", "PARAMETER repeat_penalty 1.05"):
        assert line in text.splitlines(), line
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": f"a{i}"}]}) + "\n"
                            for i in range(8)))
    run = tmp_path / "run"
    rc, err = main_in_process(["sft", "--model", str(model_dir), "--dataset", str(data), "--train_type", "lora",
                               "--max_steps", "1", "--save_steps", "1", "--gradient_accumulation_steps", "1",
                               "--output_dir", str(run)], tmp_path)
    assert rc == 0, err
    rc, err = main_in_process(["export", "--ckpt", str(run), "--to_ollama", "--output_dir", str(tmp_path / "o")],
                              tmp_path)
    assert rc == 0, err
    names = {p.name for p in (tmp_path / "o").iterdir()}
    assert {"Modelfile", "config.json", "model.safetensors"} <= names and "adapter_config.json" not in names
    assert (tmp_path / "o" / "Modelfile").read_text().startswith("FROM .\n")
    rc, err = main_in_process(["export", "--ckpt", str(run), "--to_ollama", "--quant_method", "bnb", "--quant_bits",
                               "4", "--output_dir", str(tmp_path / "q")], tmp_path)
    assert rc == 2 and "--to_ollama with --quant_method bnb" in err and not (tmp_path / "q").exists()
