"""--init_weights lora-ga (models/lora_ga.py, peft's preprocess_loraga): A and B start as the top
singular vectors of the gradient averaged over the first rows, the base keeps W - s B0 A0 (so the model
starts where the base was), the rows matter, the saved adapter is a plain LoRA of the original base, and
the refusals. Each test fails if the initialisation is ignored. On a tiny in-memory model."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from swiftlite.errors import UserError
from tests.unit.test_lora_variants import cfg_of, q_proj, tiny_qwen2

GA = ("--init_weights", "lora-ga", "--lora_rank", "4", "--lora_alpha", "8", "--lora_ga_batch_size", "2",
      "--lora_ga_iters", "2")


def _rows(seed: int, n: int = 4, length: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, 64, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 4 + ids[4:]})
    return rows


def _ga(rows, *argv: str):
    from swiftlite.models.lora import apply_lora
    cfg = cfg_of(*GA, *argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cfg, apply_lora(tiny_qwen2(0), cfg, grad_rows=rows)


def _mean_gradient(rows) -> torch.Tensor:
    """q_proj's weight gradient averaged over the two batches of two rows, as the estimation computes it."""
    model = tiny_qwen2(0)
    w = model.model.layers[0].self_attn.q_proj.weight
    total = torch.zeros_like(w)
    for i in (0, 2):
        ids = torch.tensor([r["input_ids"] for r in rows[i:i + 2]])
        labels = torch.tensor([r["labels"] for r in rows[i:i + 2]])
        model.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        total += w.grad
    return total / 2


def test_adapter_starts_from_the_gradient_and_the_model_from_the_base():
    rows = _rows(0)
    cfg, model = _ga(rows)
    layer = q_proj(model)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert torch.count_nonzero(b) > 0                       # not LoRA's B = 0
    # ArB2r: A is the gradient's top r right singular vectors (up to sign)
    _, _, vh = torch.linalg.svd(_mean_gradient(rows))
    cos = torch.nn.functional.cosine_similarity(a, vh[:4], dim=1).abs()
    assert cos.min() > 0.99, cos
    # the base holds W - s B0 A0: the wrapped model computes what the base did
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids).logits, tiny_qwen2(0).eval()(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    assert (layer.base_layer.weight - tiny_qwen2(0).model.layers[0].self_attn.q_proj.weight).abs().max() > 1e-6


def test_the_rows_and_the_options_reach_peft():
    _, first = _ga(_rows(0))
    _, other = _ga(_rows(1))
    a1, a2 = (q_proj(m).lora_A["default"].weight for m in (first, other))
    assert not torch.allclose(a1, a2, atol=1e-3)            # other rows, other gradient, other A
    _, a2r = _ga(_rows(0), "--lora_ga_direction", "A2rBr")
    assert not torch.allclose(q_proj(a2r).lora_A["default"].weight, a1, atol=1e-3)
    cfg, unit = _ga(_rows(0), "--lora_ga_scale", "unit")
    b_stable, b_unit = q_proj(first).lora_B["default"].weight, q_proj(unit).lora_B["default"].weight
    # stable scales B by out_features^0.25 / sqrt(gamma) = 32^0.25 / 4
    torch.testing.assert_close(b_stable, b_unit * 32 ** 0.25 / 16 ** 0.5, rtol=1e-4, atol=1e-6)


def test_saved_adapter_is_a_plain_lora_of_the_original_base(tmp_path):
    from peft import PeftModel, get_peft_model_state_dict

    from swiftlite.hf_io import write_adapter
    _, model = _ga(_rows(0))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    ids = torch.arange(1, 17).unsqueeze(0)
    trained = model.eval()(input_ids=ids).logits
    write_adapter(model, get_peft_model_state_dict(model), tmp_path / "adapter")
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["r"] == 8 and conf["init_lora_weights"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = PeftModel.from_pretrained(tiny_qwen2(0), str(tmp_path / "adapter"))
    torch.testing.assert_close(reloaded.eval()(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("argv,message", [
    (("--lora_ga_iters", "4"), "--lora_ga_iters is an option of LoRA-GA: add --init_weights lora-ga"),
    (("--init_weights", "lora-ga", "--train_type", "qlora"), "bitsandbytes-quantized base cannot hold"),
    (("--init_weights", "lora-ga", "--lora_ga_iters", "0"), "--lora_ga_batch_size, --lora_ga_iters"),
    (("--init_weights", "lora-ga", "--streaming", "true", "--max_steps", "2"), "--init_weights lora-ga with --streaming"),
    (("--init_weights", "lora-ga", "--lora_ga_direction", "down"), "flags: lora_ga_direction='down' is not one of"),
])
def test_refusals(argv, message):
    with pytest.raises(UserError) as e:
        cfg_of(*argv)
    assert message in str(e.value)


def test_no_rows_is_a_user_error():
    with pytest.raises(UserError, match="no training rows"):
        _ga([])
