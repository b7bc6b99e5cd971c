"""`swiftlite export --quant_method fp8` (ms-swift's examples/export/quantize/fp8.sh, `--model` a local
folder): transformers' FineGrainedFP8 format written on the CPU, block by block with transformers' own
quantization operation. The folder's stored FP8 weights times their block scales are the source's to
FP8's rounding, transformers loads it (dequantizing, as it does without an FP8 GPU) with logits close to
the source's; layers the blocks do not divide and the head stay 16-bit and are named in
modules_to_not_convert; a LoRA checkpoint is merged first; a mixture of experts is written per expert
(the official FP8 checkpoints' layout) from either layout of its 16-bit tensors; wrong options are refused,
nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import cli_env, run_cli

pytestmark = pytest.mark.slow


# the bnb tests' tiny Qwen2 folder: q/o/gate/up/down widths of 128 and 256 (FP8 blocks divide them),
# k/v 64 (not); and their reader of a folder's tensors
from tests.e2e.test_export_bnb import _weights, model_dir  # noqa: E402,F401  (a module-scoped fixture)


def _dequantized(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.float().reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
            * scale[:, None, :, None]).reshape(w.shape)


def test_fp8_export_of_a_model_folder(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    out = tmp_path / "fp8"
    log = run_cli(["export", "--model", model_dir, "--quant_method", "fp8", "--output_dir", out, "--verify"]).stdout
    assert "quantizing: FP8 e4m3" in log
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert qc["activation_scheme"] == "dynamic" and qc["dequantize"] is False
    skipped = {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("k_proj", "v_proj")}
    assert set(qc["modules_to_not_convert"]) == {"lm_head", *skipped}
    src, got = _weights(model_dir), _weights(out)
    fp8 = {k for k, v in got.items() if v.dtype == torch.float8_e4m3fn}
    assert fp8 == {f"model.layers.{i}.{p}.weight" for i in range(2)
                   for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    for name in fp8:
        scale = got[name.replace(".weight", ".weight_scale_inv")]
        assert scale.dtype == torch.float32 and scale.shape == (src[name].shape[0] // 128, src[name].shape[1] // 128)
        ref = src[name].float()
        err = float((_dequantized(got[name], scale) - ref).abs().max() / ref.abs().max())
        assert 0 < err <= 2 ** -4, (name, err)                  # quantized, within e4m3's rounding
    for name in ("lm_head.weight", "model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight"):
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], src[name])
    assert "to FP8 rounding" in (out / "README.md").read_text()          # --verify's reload check
    assert (out / "tokenizer.json").is_file() and not list(tmp_path.glob(".*export-tmp*"))
    # transformers loads it (dequantized on this CPU): the logits are the source model's, nearly
    a = AutoModelForCausalLM.from_pretrained(model_dir)
    b = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lb = a(ids).logits.float().flatten(), b(ids).logits.float().flatten()
    assert torch.nn.functional.cosine_similarity(la, lb, dim=0) > 0.99


@pytest.mark.long   # the same path as test_export_bnb's, which CI runs
def test_lora_checkpoint_is_merged_then_quantized(model_dir, tmp_path):
    from swiftlite.demo import write_demo_data
    train, _ = write_demo_data(tmp_path / "data", n_train=32, n_val=4)
    run = tmp_path / "run"
    run_cli(["sft", "--model", model_dir, "--train_type", "lora", "--dataset", train, "--max_steps", "1",
             "--gradient_accumulation_steps", "1", "--per_device_train_batch_size", "2", "--max_length", "32",
             "--truncation_strategy", "right", "--learning_rate", "5e-2", "--output_dir", run],
            env=cli_env(SWIFTLITE_CACHE=str(tmp_path / "cache")))
    merged = tmp_path / "merged"
    run_cli(["export", "--adapters", run / "checkpoint-1", "--merge_lora", "true", "-o", merged])
    log = run_cli(["export", "--adapters", run / "checkpoint-1", "--quant_method", "fp8"]).stdout
    out = run / "checkpoint-1-fp8"                               # ms-swift's <checkpoint>-<method> name
    assert "the LoRA is merged into its base first" in log
    ref, got = _weights(merged), _weights(out)
    name = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(ref[name], _weights(model_dir)[name])   # the merge moved it
    deq = _dequantized(got[name], got[name.replace(".weight", ".weight_scale_inv")])
    assert float((deq - ref[name].float()).abs().max() / ref[name].float().abs().max()) <= 2 ** -4


def test_refusals(model_dir, tmp_path):
    r = run_cli(["export", "--model", model_dir, "--quant_method", "fp8", "--quant_bits", "8", "--bnb_4bit_quant_type",
                 "nf4", "--output_dir", tmp_path / "o"], check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --quant_bits: FP8's format has no such setting (e4m3 weights, a scale per 128 x 128 block)",
        "error: --bnb_4bit_quant_type: FP8's format has no such setting (e4m3 weights, a scale per 128 x 128 block)"]
    assert not (tmp_path / "o").exists()


def _tiny_moe(d: Path, fused: bool) -> Path:
    """A tiny Qwen3-MoE folder: expert projections of 128 x 256 and 256 x 128 (FP8 blocks divide them), q/o
    too, k/v 64 rows (not). `fused`: its tensors under transformers 5's in-memory names (experts.gate_up_proj,
    3-D), what the 16-bit export of a checkpoint writes; else the hub's per-expert tensors (save_pretrained)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from swiftlite.models.presets import TINY_TOKENIZER, TINY_VOCAB
    conf = Qwen3MoeConfig(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                          num_experts_per_tok=2, vocab_size=TINY_VOCAB, max_position_embeddings=512,
                          tie_word_embeddings=False, eos_token_id=258, pad_token_id=259, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(conf).to(torch.bfloat16)
    model.save_pretrained(d)
    AutoTokenizer.from_pretrained(TINY_TOKENIZER).save_pretrained(d)
    if fused:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"),
                  metadata={"format": "pt"})
    return d


def test_fp8_export_of_a_mixture_of_experts(tmp_path):
    """examples/export/quantize/moe/fp8.sh (`--model` a local folder): each expert's projections in FP8 under
    the hub's per-expert names, with their block scales; router, embeddings, norms and head 16-bit; and the
    same folder from a source holding the experts fused."""
    src = _tiny_moe(tmp_path / "moe", fused=False)
    out = tmp_path / "moe-fp8"
    log = run_cli(["export", "--model", src, "--quant_method", "fp8", "--output_dir", out, "--verify"]).stdout
    assert "(28 weights, 24 of them experts' projections)" in log
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    kept = ("self_attn.k_proj", "self_attn.v_proj", "mlp.gate")            # k/v: 64 rows; the router
    assert set(qc["modules_to_not_convert"]) == {"lm_head", *(f"model.layers.{i}.{m}" for i in range(2) for m in kept)}
    ref, got = _weights(src), _weights(out)
    experts = {f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in range(2) for e in range(4)
               for p in ("gate_proj", "up_proj", "down_proj")}
    assert experts <= set(ref)                                            # the source's own per-expert names
    fp8 = {k for k, v in got.items() if v.dtype == torch.float8_e4m3fn}
    assert fp8 == experts | {f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "o_proj")}
    for name in experts:
        scale = got[name.replace(".weight", ".weight_scale_inv")]
        assert scale.dtype == torch.float32 and scale.shape == (ref[name].shape[0] // 128, ref[name].shape[1] // 128)
        want = ref[name].float()
        err = float((_dequantized(got[name], scale) - want).abs().max() / want.abs().max())
        assert 0 < err <= 2 ** -4, (name, err)                   # quantized, within e4m3's rounding
    plain = [k for k in ref if k not in fp8]
    assert "model.layers.1.mlp.gate.weight" in plain and "model.embed_tokens.weight" in plain
    for name in plain:                 # router, embeddings, norms, head, k/v: 16-bit, as they were
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], ref[name]), name
    assert "to FP8 rounding" in (out / "README.md").read_text()          # --verify's reload check
    # the experts held fused (a checkpoint's 16-bit export): the same folder, bit for bit
    fused = _tiny_moe(tmp_path / "moe-fused", fused=True)
    assert "model.layers.0.mlp.experts.gate_up_proj" in _weights(fused)
    run_cli(["export", "--model", fused, "--quant_method", "fp8", "--output_dir", tmp_path / "fused-fp8", "--verify"])
    again = _weights(tmp_path / "fused-fp8")
    assert again.keys() == got.keys()
    assert all(torch.equal(again[k].view(torch.uint8), got[k].view(torch.uint8)) for k in got if k in fp8)
    assert all(torch.equal(again[k], got[k]) for k in got if k not in fp8)
