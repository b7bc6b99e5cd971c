"""--neftune_noise_alpha (models/loading.add_neftune, transformers' NEFTune hook): training-mode
forwards get embedding noise of magnitude alpha/sqrt(L*d); eval-mode forwards (validation, export)
are unchanged. Fails if the flag is ignored or leaks into evaluation."""

from __future__ import annotations

import math

import pytest
import torch

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError


def model_of(*argv: str):
    from swiftlite.models.loading import prepare_model
    lora = [] if "full" in argv else ["--lora_dropout", "0"]
    config_file, values = parse_run_args(["--dataset", "train.jsonl", "--model", "tiny-llama-2l", *lora, *argv])
    cfg = load_config(config_file, values, validate_paths=False)
    torch.manual_seed(0)
    return prepare_model(cfg)


def test_neftune_changes_training_logits_only():
    ids = torch.arange(3, 35).unsqueeze(0)
    plain, noisy = model_of(), model_of("--neftune_noise_alpha", "5")
    with torch.no_grad():
        plain.train(), noisy.train()
        ref = plain(input_ids=ids).logits
        a, b = noisy(input_ids=ids).logits, noisy(input_ids=ids).logits
        assert torch.equal(plain(input_ids=ids).logits, ref)       # no dropout: plain training is deterministic
        assert (a - ref).abs().max() > 1e-4 and (a - b).abs().max() > 1e-4
        plain.eval(), noisy.eval()
        assert torch.equal(noisy(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_neftune_noise_magnitude():
    m = model_of("--neftune_noise_alpha", "5")
    emb = m.get_base_model().get_input_embeddings()
    ids = torch.arange(3, 35).unsqueeze(0)
    with torch.no_grad():
        emb.eval()
        clean = emb(ids)
        emb.train()
        noise = emb(ids) - clean
    bound = 5 / math.sqrt(ids.shape[1] * clean.shape[-1])
    assert bound * 0.9 < noise.abs().max().item() <= bound * (1 + 1e-6)


def test_neftune_full_fine_tune_and_bad_value():
    full = model_of("--train_type", "full", "--neftune_noise_alpha", "5")
    assert full.get_input_embeddings().neftune_noise_alpha == 5
    with pytest.raises(UserError, match="--neftune_noise_alpha must be >= 0"):
        model_of("--neftune_noise_alpha", "-1")
