"""`swiftlite export --quant_method bnb --quant_bits 4|8` (ms-swift's examples/export/quantize/bnb.sh, with
`--model` a local folder, quantized as transformers loads it; a mixture of experts keeps the hub's
per-expert layout): a bitsandbytes folder that transformers loads as Linear4bit/Linear8bitLt layers,
whose dequantized weights are the source's within the quantization's error; a LoRA checkpoint is merged
first (the 16-bit export, then quantized; config.json keeps its keys for older readers); the options'
mistakes are refused together, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import cli_env, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 folder whose linear widths bitsandbytes' CPU kernels divide."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from swiftlite.models.presets import TINY_TOKENIZER, TINY_VOCAB
    d = tmp_path_factory.mktemp("bnb") / "tiny-qwen2"
    conf = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=512,
                       tie_word_embeddings=False, eos_token_id=258, pad_token_id=259, bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(conf).to(torch.bfloat16).save_pretrained(d)
    AutoTokenizer.from_pretrained(TINY_TOKENIZER).save_pretrained(d)
    return d


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def _dequantized(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """Every linear layer's weight as the loaded quantized model computes with it, and its layer type."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(folder, device_map={"": "cpu"})
    out, kind = {}, ""
    for name, mod in m.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            out[name + ".weight"] = bnb.functional.dequantize_4bit(mod.weight.data, mod.weight.quant_state).float()
            kind = "4bit"
        elif isinstance(mod, bnb.nn.Linear8bitLt):
            cb, scb = mod.weight.data, mod.weight.SCB
            out[name + ".weight"] = cb.float() * scb.float()[:, None] / 127.0
            kind = "8bit"
    return out, kind


@pytest.mark.parametrize("bits,tol", [(4, 0.2), pytest.param(8, 0.01, marks=pytest.mark.long)])
def test_bnb_export_of_a_model_folder(model_dir, tmp_path, bits, tol):
    out = tmp_path / f"q{bits}"
    flags = ["--bnb_4bit_quant_type", "nf4", "--bnb_4bit_use_double_quant", "true"] if bits == 4 else []
    log = run_cli(["export", "--model", model_dir, "--quant_method", "bnb", "--quant_bits", str(bits), *flags,
                   "--output_dir", out, "--verify"], env=cli_env()).stdout
    conf = json.loads((out / "config.json").read_text())
    qc = conf["quantization_config"]
    assert qc["quant_method"] == "bitsandbytes" and qc[f"load_in_{bits}bit"] is True
    if bits == 4:
        assert qc["bnb_4bit_quant_type"] == "nf4" and qc["bnb_4bit_use_double_quant"] is True
        assert qc["bnb_4bit_compute_dtype"] == "bfloat16"
    assert (conf.get("dtype") or conf.get("torch_dtype")) == "bfloat16"
    assert (out / "tokenizer.json").is_file() and "## Quantization" in (out / "README.md").read_text()
    assert "bit for bit" in (out / "README.md").read_text()        # --verify's reload check
    assert not list(tmp_path.glob(".*export-tmp*")), "a hidden work folder was left behind"
    src = _weights(model_dir)
    deq, kind = _dequantized(out)
    assert kind == f"{bits}bit" and len(deq) == 2 * 7           # every linear layer of the 2 decoder layers
    for name, w in deq.items():
        ref = src[name].float()
        err = float((w - ref).abs().max() / ref.abs().max())
        assert err <= tol, (name, err)
        assert err > 0, name                                    # it is quantized, not a copy
    written = _weights(out)
    assert written["lm_head.weight"].dtype == torch.bfloat16    # transformers keeps lm_head in 16 bits
    assert "quantizing: bitsandbytes" in log


def test_lora_checkpoint_is_merged_then_quantized(tmp_path):
    from swiftlite.demo import write_demo_data
    train, _ = write_demo_data(tmp_path / "data", n_train=32, n_val=4)
    run = tmp_path / "run"
    run_cli(["sft", "--model", "tiny-llama-2l", "--train_type", "lora", "--dataset", train, "--max_steps", "1",
             "--gradient_accumulation_steps", "1", "--per_device_train_batch_size", "2", "--max_length", "32",
             "--truncation_strategy", "right", "--learning_rate", "5e-2", "--output_dir", run],
            env=cli_env(SWIFTLITE_CACHE=str(tmp_path / "cache")))
    merged = tmp_path / "merged"
    run_cli(["export", "--adapters", run / "checkpoint-1", "--merge_lora", "true", "-o", merged])
    log = run_cli(["export", "--adapters", run / "checkpoint-1", "--quant_method", "bnb", "--quant_bits", "8"]).stdout
    out = run / "checkpoint-1-bnb-int8"                          # ms-swift's default name
    assert "the LoRA is merged into its base first" in log and (out / "config.json").is_file()
    deq, kind = _dequantized(out)
    ref = _weights(merged)
    assert kind == "8bit" and deq
    for name, w in deq.items():
        r = ref[name].float()
        assert float((w - r).abs().max() / r.abs().max()) <= 0.01, name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"   # the 16-bit export's keys


def test_moe_folder_keeps_the_hubs_expert_layout(tmp_path):
    """examples/export/quantize/moe/bnb.sh: a Qwen3-MoE folder (experts saved one by one, fused by
    transformers in memory) comes out with the same per-expert names, its Linear layers quantized."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from swiftlite.models.presets import TINY_TOKENIZER, TINY_VOCAB
    src = tmp_path / "moe"
    conf = Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                          num_experts_per_tok=2, vocab_size=TINY_VOCAB, max_position_embeddings=512,
                          tie_word_embeddings=False, eos_token_id=258, pad_token_id=259, bos_token_id=None)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(conf).to(torch.bfloat16).save_pretrained(src)
    AutoTokenizer.from_pretrained(TINY_TOKENIZER).save_pretrained(src)
    out = tmp_path / "q"
    run_cli(["export", "--model", src, "--quant_method", "bnb", "--quant_bits", "4", "--output_dir", out, "--verify"])
    names = set(_weights(out))
    assert {n for n in _weights(src) if ".experts." in n} <= names            # the hub's per-expert tensors
    assert "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4" in names
    assert "bit for bit" in (out / "README.md").read_text()


def test_quantization_mistakes_all_at_once(model_dir, tmp_path):
    r = run_cli(["export", "--model", model_dir, "--quant_method", "gptq", "--quant_bits", "4", "--bnb_4bit_quant_type",
                 "nf4", "--quant_n_samples", "128", "--output_dir", tmp_path / "o"], check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert [ln.split(":")[1].strip().split(" ")[0] for ln in lines] == [
        "--quant_n_samples", "--quant_method", "--quant_bits", "--bnb_4bit_quant_type"], lines
    assert "GPTQ calibrates on data" in lines[1]
    for argv, msg in [(["--quant_method", "bnb"], "--quant_method bnb needs --quant_bits 4 or 8"),
                      (["--quant_method", "bnb", "--quant_bits", "8", "--bnb_4bit_quant_type", "nf4"],
                       "--bnb_4bit_quant_type: applies to 4-bit quantization, not --quant_bits 8"),
                      (["--quant_bits", "4"], "--quant_bits: needs --quant_method bnb (a quantized export)")]:
        r = run_cli(["export", "--model", model_dir, *argv, "--output_dir", tmp_path / "o"], check=False)
        assert r.returncode == 2 and r.stderr.strip() == f"error: {msg}", r.stderr
    assert not (tmp_path / "o").exists()
