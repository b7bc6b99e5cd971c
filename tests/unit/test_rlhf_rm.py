"""rlhf/rm.py's pairwise loss against TRL's RewardTrainer formula written out by hand, the `margin`
column of the pair data, and the reward model's class (a one-output score head on the causal LM)."""

from __future__ import annotations

import math

import pytest
import torch

from swiftlite.errors import UserError
from swiftlite.rlhf.rm import RmMethod, rm_terms

RC = torch.tensor([1.5, -0.2, 0.3])
RR = torch.tensor([0.5, 0.4, 0.3])
MARGIN = torch.tensor([0.0, 0.5, 1.0])


def _logsig(x):
    return -math.log1p(math.exp(-x))


def test_pairwise_loss_with_margin_and_centring():
    loss, m = rm_terms(RmMethod(), RC, RR, MARGIN)
    for i in range(3):
        assert loss[i].item() == pytest.approx(-_logsig((RC[i] - RR[i] - MARGIN[i]).item()), abs=1e-6)
    assert m["accuracy"].tolist() == [1.0, 0.0, 0.0]
    assert m["margin"].tolist() == pytest.approx([1.0, -0.6, 0.0], abs=1e-6)
    assert m["mean_reward"].tolist() == pytest.approx([1.0, 0.1, 0.3], abs=1e-6)
    centred, _ = rm_terms(RmMethod(center_rewards_coefficient=0.01), RC, RR, torch.zeros(3))
    for i in range(3):
        want = -_logsig((RC[i] - RR[i]).item()) + 0.01 * (RC[i] + RR[i]).item() ** 2
        assert centred[i].item() == pytest.approx(want, abs=1e-6)
    # equal rewards and no margin: ln 2
    same, _ = rm_terms(RmMethod(), RC, RC, torch.zeros(3))
    assert torch.allclose(same, torch.full((3,), math.log(2)), atol=1e-7)


def test_margin_column_is_read_and_checked():
    from swiftlite.config import build_config
    from swiftlite.models.loading import load_tokenizer
    from swiftlite.rlhf.data import encode_pairs
    tok = load_tokenizer(build_config({"model": "tiny-llama-2l", "dataset": ["x.jsonl"]}, task="rlhf"))
    base = {"prompt": "reverse: ab", "chosen": "ba", "rejected": "ab"}
    rows, _ = encode_pairs([(base, "f:1"), ({**base, "margin": 2}, "f:2")], tok, 1000, "delete", False)
    assert [r["margin"] for r in rows] == [0.0, 2.0]
    with pytest.raises(UserError, match=r"^f:3: 'margin' must be a number, got 'big'"):
        encode_pairs([({**base, "margin": "big"}, "f:3")], tok, 1000, "delete", False)


def test_a_reward_model_run_builds_a_sequence_classification_model_with_one_output():
    from swiftlite.config import build_config
    from swiftlite.models.loading import load_model
    cfg = build_config({"model": "tiny-llama-2l", "dataset": ["x.jsonl"], "rlhf_type": "rm", "torch_dtype": "fp32"},
                       task="rlhf")
    model = load_model(cfg)
    assert type(model).__name__.endswith("ForSequenceClassification") and model.config.num_labels == 1
    assert model.score.out_features == 1 and model.config.pad_token_id is not None
    ids = torch.tensor([[5, 6, 7, model.config.pad_token_id]])
    assert model(input_ids=ids).logits.shape == (1, 1)


def test_a_qlora_reward_model_keeps_a_trainable_full_precision_score_head():
    """bitsandbytes leaves lm_head unquantized but not a classification head: the score layer must stay
    a plain Linear, trained in full (peft SEQ_CLS: a module to save) beside the adapter."""
    pytest.importorskip("bitsandbytes")
    from swiftlite.config import build_config
    from swiftlite.models.loading import prepare_model
    cfg = build_config({"model": "tiny-llama-2l", "dataset": ["x.jsonl"], "rlhf_type": "rm", "train_type": "qlora",
                        "torch_dtype": "fp32"}, task="rlhf")
    model = prepare_model(cfg)
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())        # the base is 4-bit
    heads = [(n, m) for n, m in model.named_modules() if n.endswith("score.modules_to_save.default")]
    assert len(heads) == 1 and type(heads[0][1]) is torch.nn.Linear
    assert all(p.requires_grad for p in heads[0][1].parameters())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("score" in n for n in trainable)
