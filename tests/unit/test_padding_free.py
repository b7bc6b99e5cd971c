"""Padding-free batches and exact packing: the batch forms, a packed row against the row alone, the
support rule per architecture, --attn_impl checks, and the forms training and evaluation use."""

from __future__ import annotations

import pytest
import torch

from swiftlite.config import load_config
from swiftlite.data.collate import BatchForm, collate, concat_rows, count_targets, pack_rows, real_tokens
from swiftlite.data.tokenize import IGNORE
from swiftlite.errors import UserError
from swiftlite.models import loading
from swiftlite.models.presets import get_preset
from swiftlite.parallel.loss import token_loss_sum

TOL = 1e-5

ROWS = [{"input_ids": [5, 6, 7, 8, 9, 10, 11], "labels": [IGNORE, IGNORE, 7, 8, 9, 10, 11]},
        {"input_ids": [12, 13, 14], "labels": [IGNORE, 13, 14]},
        {"input_ids": [15, 16, 17, 18, 19], "labels": [15, IGNORE, 17, 18, 19]}]


def _cfg(**values):
    return load_config(None, {"dataset": ["unused.jsonl"], **values}, task="sft")


def _tiny(impl: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    conf = AutoConfig.for_model(**get_preset("tiny-llama-2l").config)
    conf.use_cache = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32, attn_implementation=impl)
    assert model.config._attn_implementation == impl
    return model.eval()


# -- the batch forms ---------------------------------------------------------------------------------

def test_padding_free_batch_is_one_sequence_with_per_row_positions_and_no_mask():
    b = concat_rows(ROWS)
    assert set(b) == {"input_ids", "labels", "position_ids"}  # no attention_mask: it would undo the isolation
    assert b["input_ids"].shape == (1, 15)
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1, 2, 3, 4]]
    # a row's first token is never predicted from the previous row
    assert b["labels"].tolist() == [[IGNORE, IGNORE, 7, 8, 9, 10, 11, IGNORE, 13, 14, IGNORE, IGNORE, 17, 18, 19]]
    padded = collate(ROWS, pad_id=0)
    assert padded["input_ids"].shape == (3, 7) and "attention_mask" in padded
    assert count_targets(b) == count_targets(padded) == 10
    assert real_tokens(b) == real_tokens(padded) == 15


def test_packs_are_always_concatenated_never_padded_with_a_mask():
    packs = pack_rows(ROWS, 10)
    assert [len(p["input_ids"]) for p in packs] == [10, 5]
    for form in (False, True):
        b = collate(packs, pad_id=0, padding_free=form)
        assert "attention_mask" not in b and b["input_ids"].shape == (1, 15)
        assert b["position_ids"].tolist() == concat_rows(ROWS)["position_ids"].tolist()
        assert b["labels"].tolist() == concat_rows(ROWS)["labels"].tolist()


# -- exactness on a model ----------------------------------------------------------------------------

def _row_losses(logits: torch.Tensor, batch: dict, bounds: list[tuple[int, int]]) -> list[torch.Tensor]:
    out = []
    for s, e in bounds:
        lg, lab = logits[:, s:e][:, :-1], batch["labels"][:, s:e][:, 1:]
        out.append(torch.nn.functional.cross_entropy(lg.reshape(-1, lg.size(-1)).float(), lab.reshape(-1),
                                                     ignore_index=IGNORE, reduction="sum"))
    return out


@pytest.mark.parametrize("impl", ["sdpa", "eager", "flex_attention"])
def test_packed_rows_give_each_row_its_own_logits_and_loss(impl):
    if impl == "flex_attention":
        try:
            model = _tiny(impl)
            with torch.no_grad():
                model(input_ids=torch.tensor([[5, 6, 7]]), position_ids=torch.tensor([[0, 1, 2]]))
        except Exception as e:  # noqa: BLE001 - flex needs a compiler toolchain on CPU
            pytest.skip(f"flex_attention does not run on this CPU torch {torch.__version__}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    else:
        model = _tiny(impl)
    a, b = ROWS[0], ROWS[2]
    (pack,) = pack_rows([a, b], 64)
    batch = collate([pack], pad_id=0)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        alone = [model(input_ids=torch.tensor([r["input_ids"]])).logits for r in (a, b)]
        # what the old collate did: the same pack with an attention mask, rows attending to each other
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                      attention_mask=torch.ones_like(batch["input_ids"])).logits
    n = len(a["input_ids"])
    bounds = [(0, n), (n, packed.shape[1])]
    for (s, e), ref in zip(bounds, alone):
        torch.testing.assert_close(packed[:, s:e], ref, rtol=TOL, atol=TOL)
    assert (leaky[:, n:] - alone[1]).abs().max() > 1e-2, "the masked pack must differ (else the test proves nothing)"
    row_alone = [_row_losses(ref, {"labels": torch.tensor([r["labels"]])}, [(0, ref.shape[1])])[0]
                 for ref, r in zip(alone, (a, b))]
    for got, ref in zip(_row_losses(packed, batch, bounds), row_alone):
        assert abs(float(got) - float(ref)) <= TOL * abs(float(ref)), (float(got), float(ref))
    with torch.no_grad():
        total = token_loss_sum(model, batch)
    assert abs(float(total) - float(sum(row_alone))) <= TOL * float(sum(row_alone))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_padding_free_batch_equals_padded_batch_in_loss_and_gradients(impl):
    model = _tiny(impl).train()
    losses, grads = [], []
    for pf in (False, True):
        model.zero_grad()
        loss = token_loss_sum(model, collate(ROWS, pad_id=0, padding_free=pf))
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert abs(losses[0] - losses[1]) <= TOL * abs(losses[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


# -- which models can be padding-free ---------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gpt2", "gpt_neox", "gemma"])
def test_supported_architectures(model_type):
    from transformers import CONFIG_MAPPING
    assert loading.packed_sequence_support(CONFIG_MAPPING[model_type]()) is None


@pytest.mark.parametrize("model_type,why", [("opt", "without the position ids"), ("mamba", "recurrent"),
                                            ("jamba", "recurrent"), ("qwen3_next", "linear-attention")])
def test_unsupported_architectures_say_why(model_type, why):
    from transformers import CONFIG_MAPPING
    assert why in loading.packed_sequence_support(CONFIG_MAPPING[model_type]())


def _small(model_type):
    from transformers import CONFIG_MAPPING
    return CONFIG_MAPPING[model_type](hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, n_embd=32, n_layer=2, n_head=4,
                                      ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=128, n_positions=128)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "opt"])
def test_support_rule_agrees_with_a_real_forward(model_type):
    """What the rule says (read from the model's source) is what a packed forward does."""
    from transformers import AutoModelForCausalLM
    conf = _small(model_type)
    conf.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa").eval()
    a, b = torch.randint(3, 120, (1, 9)), torch.randint(3, 120, (1, 6))
    with torch.no_grad():
        alone = model(input_ids=b).logits
        packed = model(input_ids=torch.cat([a, b], 1),
                       position_ids=torch.cat([torch.arange(9), torch.arange(6)])[None]).logits[:, 9:]
    exact = bool((packed - alone).abs().max() <= TOL)
    assert exact == (loading.packed_sequence_support(conf) is None)


def test_batch_form_default_forced_and_refused():
    from transformers import CONFIG_MAPPING
    form = loading.batch_form(_cfg())
    assert form.padding_free and "default" in form.reason
    assert form.describe() == "padding-free batches (default; --padding_free false pads)"
    off = loading.batch_form(_cfg(padding_free="false"))
    assert not off.padding_free and off.describe() == "padded batches (--padding_free false)"
    assert loading.batch_form(_cfg(packing=True)).describe(True, 512).startswith("packed to 512 tokens, rows isolated")
    opt = CONFIG_MAPPING["opt"]()
    auto = loading.batch_form(_cfg(), opt)
    assert not auto.padding_free and "OPTForCausalLM" in auto.reason
    for forced in ({"padding_free": True}, {"packing": True}):
        with pytest.raises(UserError, match="OPTForCausalLM builds its attention mask without the position ids"):
            loading.batch_form(_cfg(**forced), opt)


# -- --attn_impl -----------------------------------------------------------------------------------

def test_attn_impl_is_a_config_choice():
    assert _cfg(attn_impl="eager").model.attn_impl == "eager"
    assert _cfg().model.attn_impl is None and _cfg().data.padding_free is None
    with pytest.raises(UserError, match="is not one of"):
        _cfg(attn_impl="flash")


def test_check_attn_impl(monkeypatch):
    for ok in (None, "sdpa", "eager", "flex_attention"):  # torch 2.13 CPU runs these
        loading.check_attn_impl(_cfg(attn_impl=ok))
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="--attn_impl flash_attention_2 needs a CUDA GPU"):
            loading.check_attn_impl(_cfg(attn_impl="flash_attention_2"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("flash_attn") else real(name, *a))
    with pytest.raises(UserError, match="needs the flash-attn package"):
        loading.check_attn_impl(_cfg(attn_impl="flash_attention_2"))
    with pytest.raises(UserError, match="needs the flash-attn-3 package"):
        loading.check_attn_impl(_cfg(attn_impl="flash_attention_3"))
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    with pytest.raises(UserError, match="flex_attention needs torch >= 2.5 \\(this is 2.4.1\\)"):
        loading.check_attn_impl(_cfg(attn_impl="flex_attention"))


def test_packing_cannot_be_padded():
    with pytest.raises(UserError, match="--packing with --padding_free false"):
        loading.check_attn_impl(_cfg(packing=True, padding_free=False))


def test_attn_impl_reaches_the_model():
    model = loading.prepare_model(_cfg(attn_impl="eager", model="tiny-llama-2l"))
    assert model.config._attn_implementation == "eager"


# -- training and evaluation use the run's form ------------------------------------------------------

class _Recorder:
    """An engine that records what it is given (and returns a loss that needs a backward)."""

    def __init__(self):
        self.batches = []
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, batch):
        self.batches.append(batch)
        return self.w * float((batch["labels"][:, 1:] != IGNORE).sum())

    def micro_batch(self, last):
        import contextlib
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def step(self):
        return 0.0

    def eval(self):
        pass

    def train(self):
        pass


@pytest.mark.parametrize("padding_free", [False, True])
def test_train_step_and_evaluate_use_the_form_and_count_real_tokens(padding_free):
    from swiftlite.data.loader import BatchPlan
    from swiftlite.data.pipeline import Tokenized, DataStats
    from swiftlite.distributed import World
    from swiftlite.train.evaluate import evaluate
    from swiftlite.train.step import TokenBatches as Batches
    from swiftlite.train.step import train_step
    rows = ROWS * 2
    targets = [sum(1 for x in r["labels"][1:] if x != IGNORE) for r in rows]
    batches = Batches(rows, BatchPlan(len(rows), 3, 1, 2, 0), 0, World(), targets, BatchForm(padding_free))
    eng = _Recorder()
    stats = train_step(eng, batches, 0)
    assert stats.tokens == sum(len(r["input_ids"]) for r in rows)   # real tokens, no padding counted
    assert stats.target_tokens == sum(targets) and stats.loss == pytest.approx(1.0)
    assert all(("attention_mask" in b) != padding_free for b in eng.batches)
    eng.batches.clear()
    cfg = _cfg(padding_free=str(padding_free).lower(), per_device_eval_batch_size=2)
    assert evaluate(eng, Tokenized(rows, DataStats()), cfg, World(), 0) == pytest.approx(1.0)
    assert eng.batches and all(("attention_mask" in b) != padding_free for b in eng.batches)
    assert all(b["input_ids"].shape[0] == 1 for b in eng.batches) == padding_free
