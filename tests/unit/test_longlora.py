"""--train_type longlora (models/longlora.py): S2-Attn equals the paper's grouping written out head by head
(groups of max_length / 4, half the heads shifted by half a group, causal inside each group), on padded and
grouped-query inputs; eval mode is the model's own attention; a LongLoRA model trains the same LoRA weights
as --train_type lora and differs from it only in training-mode attention; packing is refused."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from swiftlite.config import build_config
from swiftlite.errors import UserError
from swiftlite.models.longlora import s2_attention


def _reference(q, k, v, max_length):
    """S2-Attn, one head and one group at a time: position i of group j of a shifted head is the padded
    sequence's position (j*G + i + G/2) mod P."""
    b, h, n, d = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    p = max(n, max_length)
    p += (-p) % 4
    g = p // 4

    def pad(t):
        return torch.cat([t, t.new_zeros(b, h, p - n, d)], 2)
    q, k, v = pad(q), pad(k), pad(v)
    out = torch.zeros(b, h, p, d, dtype=q.dtype)
    causal = torch.triu(torch.ones(g, g, dtype=torch.bool), 1)
    for head in range(h):
        shift = g // 2 if head >= h // 2 else 0
        for j in range(p // g):
            idx = [(j * g + i + shift) % p for i in range(g)]
            s = q[:, head, idx] @ k[:, head, idx].transpose(-1, -2) / math.sqrt(d)
            o = s.masked_fill(causal, float("-inf")).softmax(-1) @ v[:, head, idx]
            for i, at in enumerate(idx):
                out[:, head, at] = o[:, i]
    return out[:, :, :n].transpose(1, 2)


@pytest.mark.parametrize("n,max_length,kv", [(16, 16, 4), (12, 16, 2), (13, 10, 1), (24, 8, 4)])
def test_s2_attention_is_the_grouping_written_out(n, max_length, kv):
    torch.manual_seed(n)
    q, k, v = torch.randn(2, 4, n, 8, dtype=torch.float64), *torch.randn(2, 2, kv, n, 8, dtype=torch.float64)
    got, _ = s2_attention(SimpleNamespace(training=True), q, k, v, None, max_length=max_length, base="sdpa")
    assert got.shape == (2, n, 4, 8)
    torch.testing.assert_close(got, _reference(q, k, v, max_length), rtol=1e-10, atol=1e-10)
    # and it is not full causal attention (that would make the test above meaningless)
    full = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4 // kv, 1),
                                                            v.repeat_interleave(4 // kv, 1), is_causal=True)
    assert (got - full.transpose(1, 2)).abs().max() > 1e-3


def test_eval_mode_is_the_models_own_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 4, 10, 8), torch.randn(1, 4, 10, 8)
    mod = SimpleNamespace(training=False, is_causal=True)
    got, _ = s2_attention(mod, q, k, v, None, max_length=16, base="sdpa")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(got, want)


def _model(train_type):
    from swiftlite.models.loading import prepare_model
    cfg = build_config({"model": "tiny-llama-2l", "train_type": train_type, "max_length": 32, "seed": 1,
                        "torch_dtype": "fp32", "lora_dropout": 0.0, "gradient_checkpointing": False}, source="t")
    return prepare_model(cfg)


def test_a_longlora_model_differs_from_lora_only_in_training_attention():
    lora, long = _model("lora"), _model("longlora")
    assert [n for n, p in long.named_parameters() if p.requires_grad] == \
        [n for n, p in lora.named_parameters() if p.requires_grad]           # the same LoRA adapter
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    long.load_state_dict(lora.state_dict())
    ids = torch.randint(3, 200, (2, 20))
    with torch.no_grad():
        assert torch.equal(lora.eval()(input_ids=ids).logits, long.eval()(input_ids=ids).logits)
    a, b = lora.train()(input_ids=ids).logits, long.train()(input_ids=ids).logits
    assert (a - b).abs().max() > 1e-3
    b.sum().backward()
    assert all(p.grad is not None for p in long.parameters() if p.requires_grad)


def test_rows_are_never_packed():
    from swiftlite.models.loading import batch_form
    cfg = build_config({"model": "tiny-llama-2l", "train_type": "longlora"}, source="t")
    assert not batch_form(cfg).padding_free and "longlora" in batch_form(cfg).reason
    for extra in ({"packing": True}, {"padding_free": True}):
        with pytest.raises(UserError, match="with --train_type longlora: S2-Attn groups the positions of one row"):
            batch_form(build_config({"model": "tiny-llama-2l", "train_type": "longlora", **extra}, source="t"))
