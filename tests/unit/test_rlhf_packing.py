"""Padding-free and packed pair batches (rlhf/packing.py): the rules per --rlhf-type, the batch layout,
packs that never split a pair, and on a tiny model (fp32, sdpa) the same pair losses and gradients as
padded batches, for one micro-batch and for a packed step against the same pairs unpacked."""

from __future__ import annotations

import contextlib

import pytest
import torch

from swiftlite.data.tokenize import IGNORE
from swiftlite.errors import UserError
from swiftlite.rlhf.data import collate_pairs
from swiftlite.rlhf.loss import Method
from swiftlite.rlhf.packing import PackedPlan, pack_pairs

TOL = 1e-5


def _pair(prompt: list[int], chosen: list[int], rejected: list[int]) -> dict:
    def side(ans):
        return prompt + ans, [IGNORE] * len(prompt) + ans
    (ci, cl), (ri, rl) = side(chosen), side(rejected)
    return {"chosen_ids": ci, "chosen_labels": cl, "rejected_ids": ri, "rejected_labels": rl, "margin": 0.0}


PAIRS = [_pair([5, 6, 7], [8, 9, 10, 258], [11, 258]),
         _pair([12, 13], [14, 258], [15, 16, 17, 18, 258]),
         _pair([19, 20, 21, 22, 23], [24, 25, 258], [26, 27, 28, 258]),
         _pair([30], [31, 32, 33, 34, 35, 258], [36, 258]),
         _pair([40, 41, 42], [43, 258], [44, 45, 258])]


# -- the rules -----------------------------------------------------------------------------------------

def _validate(values: dict):
    from swiftlite.config import build_config, validate
    cfg = build_config({"model": "tiny-llama-2l", "dataset": ["x.jsonl"], **values}, task="rlhf")
    cfg.explicit = frozenset(values) | {"model", "dataset"}
    validate(cfg, check_paths=False)
    return cfg


@pytest.mark.parametrize("kind", ["dpo", "orpo", "simpo", "cpo"])
@pytest.mark.parametrize("flag", [{"packing": True}, {"padding_free": True}])
def test_pair_methods_take_packing_and_padding_free(kind, flag):
    _validate({"rlhf_type": kind, **flag})


_GRPO = {"reward_funcs": ["accuracy"]}


@pytest.mark.parametrize("kind,extra,flag,name", [
    ("kto", {}, {"packing": True}, "--packing"), ("kto", {}, {"padding_free": True}, "--padding-free true"),
    ("rm", {}, {"packing": True}, "--packing"), ("rm", {}, {"padding_free": True}, "--padding-free true"),
    ("grpo", _GRPO, {"packing": True}, "--packing"),   # grpo takes --padding_free true (rlhf/generate.token_logps)
])
def test_other_rlhf_types_refuse_them_naming_the_type(kind, extra, flag, name):
    with pytest.raises(UserError) as e:
        _validate({"rlhf_type": kind, **extra, **flag})
    msg = str(e.value)
    assert msg.startswith(f"{name} with --rlhf-type {kind}: ") and "\n" not in msg


def test_grpo_takes_padding_free():
    assert _validate({"rlhf_type": "grpo", **_GRPO, "padding_free": True}).data.padding_free is True


# -- the batch layout ----------------------------------------------------------------------------------

def test_padding_free_pairs_are_one_sequence_chosen_then_rejected():
    rows = PAIRS[:2]
    b = collate_pairs(rows, 259, padding_free=True)
    assert set(b) == {"input_ids", "labels", "position_ids"}
    seqs = [r["chosen_ids"] for r in rows] + [r["rejected_ids"] for r in rows]
    assert b["input_ids"][0].tolist() == sum(seqs, [])
    assert b["position_ids"][0].tolist() == sum((list(range(len(s))) for s in seqs), [])
    padded = collate_pairs(rows, 259)
    assert int((b["labels"][:, 1:] != IGNORE).sum()) == int((padded["labels"][:, 1:] != IGNORE).sum())


def test_packs_hold_whole_pairs_within_max_length_in_order():
    lengths = [len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in PAIRS]   # 13, 14, 16, 10, 10
    packs = pack_pairs(PAIRS, 28)
    assert sorted(i for p in packs for i in p) == list(range(len(PAIRS)))
    assert all(sum(lengths[i] for i in p) <= 28 for p in packs)
    assert packs == [[0, 1], [2, 3], [4]]
    assert pack_pairs(PAIRS, 12) == [[0], [1], [2], [3], [4]]   # longer than max_length: a pack of its own

    class Inner:
        global_batch, steps_per_epoch = 2, 1

        def micro_batches(self, step, rank):
            return [[2], [0]]

        def all_micro_batches(self, step):
            return [[2], [0]]

        def global_order(self, step):
            return [2, 0]
    plan = PackedPlan(Inner(), packs)
    assert plan.micro_batches(0, 0) == [[4], [0, 1]] and plan.global_order(0) == [4, 0, 1]
    assert plan.global_batch == 2 and plan.steps_per_epoch == 1


# -- exactness on a model ------------------------------------------------------------------------------

def _tiny(seed: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from swiftlite.models.presets import get_preset
    conf = AutoConfig.for_model(**get_preset("tiny-llama-2l").config)
    conf.use_cache = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()   # no dropout: both forms see the same function


class _Engine:
    """What rlhf/step.py asks of a backend's engine, on a bare model: backward, and step records the
    gradients (no update, so every form is measured at the same weights)."""

    def __init__(self, model):
        self.model = model
        self.grads: dict[str, torch.Tensor] = {}

    def root(self):
        return self.model

    def autocast(self):
        return contextlib.nullcontext()

    def micro_batch(self, last):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return 0.0


class _Frozen:
    def __init__(self, module):
        self.module = module

    def autocast(self):
        return contextlib.nullcontext()


class _Plan:
    def __init__(self, micro):
        self.micro = micro
        self.global_batch = sum(len(mb) for mb in micro)
        self.steps_per_epoch = 1

    def micro_batches(self, step, rank):
        return self.micro

    def all_micro_batches(self, step):
        return self.micro

    def global_order(self, step):
        return [i for mb in self.micro for i in mb]


def _batches(plan, method, padding_free: bool):
    from swiftlite.data.collate import BatchForm
    from swiftlite.distributed import World
    from swiftlite.rlhf.reference import ModuleReference
    from swiftlite.rlhf.step import PairBatches
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device="cpu")
    targets = [sum(1 for x in r["chosen_labels"][1:] if x != IGNORE) for r in PAIRS]
    b = PairBatches(PAIRS, plan, 259, world, method, targets, form=BatchForm(padding_free, "test"))
    b.reference = ModuleReference(_Frozen(_tiny(1))) if method.needs_reference else None
    return b


METHODS = {"dpo": Method("dpo", 0.1, nll_weight=0.1), "orpo": Method("orpo", 0.1, nll_weight=1.0),
           "simpo": Method("simpo", 2.0, nll_weight=1.0, simpo_gamma=0.5), "cpo": Method("cpo", 0.1, nll_weight=1.0)}


@pytest.mark.parametrize("kind", ["dpo", "orpo", "simpo", "cpo"])
def test_padding_free_pair_logps_loss_and_gradient_equal_padded(kind):
    from swiftlite.rlhf.reference import module_logps
    from swiftlite.rlhf.step import preference_step
    model = _tiny(0)
    padded, free = collate_pairs(PAIRS, 259), collate_pairs(PAIRS, 259, padding_free=True)
    with torch.no_grad():
        lp_pad, n_pad = module_logps(model, padded)
        lp_free, n_free = module_logps(model, free)
    assert n_pad.tolist() == n_free.tolist() and len(n_free) == 2 * len(PAIRS)
    assert torch.allclose(lp_pad, lp_free, atol=TOL)
    assert float(lp_pad.abs().min()) > 1.0       # real log-probs, not an empty sum
    engine = _Engine(model)
    out = {}
    for form in (False, True):
        stats = preference_step(engine, _batches(_Plan([[0, 1, 2, 3, 4]]), METHODS[kind], form), 0)
        out[form] = (stats, engine.grads)
    (s0, g0), (s1, g1) = out[False], out[True]
    assert s1.loss == pytest.approx(s0.loss, abs=TOL)
    for k, v in s0.metrics.items():
        assert s1.metrics[k] == pytest.approx(v, abs=TOL), k
    name = "model.layers.0.self_attn.q_proj.weight"
    assert float(g0[name].abs().max()) > 1e-6      # a gradient that the check below can tell apart
    assert torch.allclose(g1[name], g0[name], atol=TOL)
    assert torch.allclose(g1["lm_head.weight"], g0["lm_head.weight"], atol=TOL)


def test_a_packed_step_trains_on_the_same_pairs_as_unpacked():
    """Packs [[0, 1], [2, 3], [4]] in two micro-batches of packs give the loss, metrics and gradient of
    the five pairs in padded micro-batches of 2, 2 and 1 (DPO, rpo_alpha: both normalisations)."""
    from swiftlite.rlhf.step import preference_step
    model = _tiny(0)
    engine = _Engine(model)
    method = METHODS["dpo"]
    unpacked = preference_step(engine, _batches(_Plan([[0, 1], [2, 3], [4]]), method, False), 0)
    g0 = engine.grads
    packs = pack_pairs(PAIRS, 28)
    assert packs == [[0, 1], [2, 3], [4]]
    packed = preference_step(engine, _batches(PackedPlan(_Plan([[0, 1], [2]]), packs), method, True), 0)
    g1 = engine.grads
    assert packed.loss == pytest.approx(unpacked.loss, abs=TOL)
    assert packed.metrics["rewards/margins"] == pytest.approx(unpacked.metrics["rewards/margins"], abs=TOL)
    assert packed.tokens == unpacked.tokens
    for name in ("model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight"):
        assert float(g0[name].abs().max()) > 1e-6
        assert torch.allclose(g1[name], g0[name], atol=TOL)
