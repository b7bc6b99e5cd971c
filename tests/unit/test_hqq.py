"""--quant_method hqq (models/hqq.py): the base's linear layers become hqq's HQQLinear with ms-swift's
(transformers' HqqConfig) settings, LoRA trains on top of them through peft's HQQ layer, the planner
counts their bytes, the export reads them dequantized, and what cannot work is refused before launch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hqq")

from swiftlite.cli import parse_run_args  # noqa: E402
from swiftlite.config import load_config  # noqa: E402
from swiftlite.errors import UserError  # noqa: E402


def _cfg(*argv: str):
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--torch-dtype", "fp32",
                                          *argv])
    return load_config(config_file, values, validate_paths=False)


def _model(cfg):
    from swiftlite.models.loading import load_model
    return load_model(cfg)


def test_decoder_linears_are_quantized_the_heads_are_not_and_logits_stay_close():
    cfg = _cfg("--quant_method", "hqq", "--quant_bits", "4")
    assert cfg.quant_method == "hqq" and cfg.quant_bits == 4
    plain = _model(_cfg("--train-type", "lora"))
    q = _model(cfg)
    kinds = {n: type(m).__name__ for n, m in q.named_modules() if type(m).__name__ in ("HQQLinear", "Linear")}
    assert kinds["lm_head"] == "Linear"
    body = {n: k for n, k in kinds.items() if n != "lm_head"}
    assert len(body) == 2 * 7 and set(body.values()) == {"HQQLinear"}   # 2 layers x q,k,v,o,gate,up,down
    layer = q.model.layers[0].self_attn.q_proj
    assert layer.W_q.dtype == torch.uint8 and layer.meta["nbits"] == 4 and layer.meta["group_size"] == 64
    assert layer.meta["axis"] == 1                                   # transformers' HqqConfig default
    assert q.config.quantization_config["quant_method"] == "hqq"
    ids = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = plain(input_ids=ids).logits, q(input_ids=ids).logits
    assert not torch.equal(a, b)                                      # quantized: not the 16-bit weights
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos > 0.98, cos
    # what the forward multiplies by, as the export reads it: close to the 16-bit weight, 4-bit error
    from swiftlite.checkpoint.readers import ModelReader
    w = ModelReader(q).read(["model.layers.0.self_attn.q_proj.weight"])["model.layers.0.self_attn.q_proj.weight"]
    ref = plain.model.layers[0].self_attn.q_proj.weight.detach()
    assert w.shape == ref.shape and not torch.equal(w, ref)
    assert float((w - ref).abs().max()) < 0.25 * float(ref.abs().max())


def test_hqq_axis_and_bits_reach_the_quantizer():
    q = _model(_cfg("--quant_method", "hqq", "--quant_bits", "2", "--hqq_axis", "0"))
    meta = q.model.layers[1].mlp.down_proj.meta
    assert meta["nbits"] == 2 and meta["axis"] == 0


def test_planner_bytes_are_the_layers_bytes():
    """states.quantized_bytes for hqq: packed weights plus a scale and a zero point per 64 weights,
    against the tensors the quantized layers hold."""
    from swiftlite.planner.memory import Workload
    from swiftlite.planner.states import quantized_bytes
    # 3-bit: 10 groups to an int32, padded per layer; this model's 32-group k/v layers pad 25%
    for bits, rel in ((4, 0.001), (8, 0.001), (3, 0.05)):
        q = _model(_cfg("--quant_method", "hqq", "--quant_bits", str(bits)))
        layers = [m for m in q.modules() if type(m).__name__ == "HQQLinear"]
        n = sum(m.in_features * m.out_features for m in layers)
        held = sum(m.W_q.numel() * m.W_q.element_size() + sum(
            m.meta[k].numel() * m.meta[k].element_size() for k in ("scale", "zero")) for m in layers)
        w = Workload(train_type="lora", dtype="fp32", quant_bits=bits, quant_method="hqq")
        assert quantized_bytes(n, w) == pytest.approx(held, rel=rel), bits


def test_lora_wraps_every_hqq_layer_and_trains_only_the_adapter():
    from swiftlite.models.lora import apply_lora
    cfg = _cfg("--quant_method", "hqq", "--quant_bits", "4", "--lora_rank", "4")
    model = apply_lora(_model(cfg), cfg)
    wrapped = [n for n, m in model.named_modules() if type(m).__name__ == "HqqLoraLinear"]
    assert len(wrapped) == 14
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    before_q = layer.base_layer.W_q.clone()
    before_b = layer.lora_B["default"].weight.clone()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype.is_floating_point for p in trainable)
    opt = torch.optim.SGD(trainable, lr=0.1)
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert not torch.equal(layer.lora_B["default"].weight, before_b)
    assert torch.equal(layer.base_layer.W_q, before_q)


@pytest.mark.parametrize("argv,words", [
    (("--quant_method", "hqq", "--quant_bits", "5"), "--quant-bits with --quant-method hqq must be 1, 2, 3, 4 or 8"),
    (("--quant_method", "hqq"), "--quant-method hqq needs --quant-bits"),
    (("--quant_bits", "4", "--hqq_axis", "1"), "--hqq-axis applies to --quant-method hqq"),
    (("--quant_method", "hqq", "--quant_bits", "4", "--hqq_axis", "2"), "--hqq-axis must be 0 or 1"),
    (("--quant_method", "hqq", "--quant_bits", "4", "--bnb_4bit_quant_type", "fp4"),
     "--bnb-4bit-quant-type is a bitsandbytes option; this run's base is quantized with HQQ"),
    (("--quant_method", "hqq", "--quant_bits", "4", "--compile", "true"),
     "--compile with an HQQ-quantized base is not available"),
])
def test_rules(argv, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        _cfg(*argv)


def test_sharding_backends_are_refused_the_whole_parameter_ones_are_not():
    from types import SimpleNamespace

    from swiftlite.models.hqq import hqq_problem
    from swiftlite.parallel.base import find_backend

    def choice(name):   # what the resolver hands preflight: the name and its backend record
        return SimpleNamespace(name=name, record=find_backend(name))
    cfg = _cfg("--quant_method", "hqq", "--quant_bits", "4")
    for name in ("fsdp", "fsdp1", "hsdp", "zero3"):
        why = hqq_problem(cfg, choice(name))
        assert why and f"--parallelism {name}" in why and "single, ddp or zero2" in why
    for name in ("single", "ddp", "zero2", "zero2_offload"):
        assert hqq_problem(cfg, choice(name)) is None
    assert hqq_problem(_cfg("--quant_bits", "4"), choice("fsdp")) is None   # bitsandbytes: every backend


def test_auto_and_the_planner_pick_backends_that_keep_whole_parameters():
    from swiftlite.planner.memory import Workload, unavailable_reason
    from swiftlite.planner.recommend import resolve_auto
    assert resolve_auto(_cfg("--quant_method", "hqq", "--quant_bits", "4"), 2, None).backend == "ddp"
    assert resolve_auto(_cfg("--quant_bits", "4"), 2, None).backend == "fsdp"     # bitsandbytes: sharded
    w = Workload(train_type="lora", quant_bits=4, quant_method="hqq", world_size=8)
    assert "HQQ" in unavailable_reason(w, "fsdp") and "HQQ" in unavailable_reason(w, "zero3")
    assert unavailable_reason(w, "ddp") == "" and unavailable_reason(w, "zero2") == ""
