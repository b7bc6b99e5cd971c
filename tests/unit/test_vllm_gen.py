"""GRPO's colocated vLLM generation (swiftlite/rlhf/vllm_gen.py), on CPU, against FAKE_VLLM: a small
stand-in for the GPU-only `vllm` package (not installed here, and never to be: it pulls a CUDA torch),
put in sys.modules. The stand-in's LLM records how it was built, the weights handed to its model's
load_weights, its sleep/wake calls, and answers generate with token ids that depend only on each
request's seed. What it checks is swiftlite's glue: the weights vLLM receives are exactly the policy's
(full, and LoRA merged as base + B@A x scale with the policy left as it was), the engine and sampling
options, the tensors' layout (generate.sample's), and that a GRPO step on these completions gives the
same loss and gradients as on the same completions from `sample`. A real engine: scripts/gpu_check.sh.
"""

from __future__ import annotations

import copy
import json
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from swiftlite.parallel.gather import gathered
from swiftlite.rlhf import vllm_gen
from swiftlite.rlhf.generate import completion_seed, sample

EOS, PAD, VOCAB = 2, 0, 48


class FakeSamplingParams:
    """Stand-in for vllm.SamplingParams: keeps its keyword arguments."""

    def __init__(self, **kw):
        self.kw = kw
        self.__dict__.update(kw)


class FakeVllmModel:
    """Stand-in for the model inside vLLM's worker: records every load_weights call."""

    def __init__(self):
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights):
        self.loaded.extend((n, t.detach().clone()) for n, t in weights)


class FakeLLM:
    """Stand-in for vllm.LLM (FAKE_VLLM): completions from each request's seed alone."""
    built: list["FakeLLM"] = []

    def __init__(self, **kw):
        self.kw, self.calls, self.model = kw, [], FakeVllmModel()
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=self.model))))
        self.on_generate = None
        FakeLLM.built.append(self)

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append(("generate", len(prompts)))
        self.requests = (prompts, sampling_params)
        if self.on_generate:
            self.on_generate()
        outs = []
        for p, sp in zip(prompts, sampling_params):
            rng = random.Random(sp.seed)
            n = rng.randint(1, sp.max_tokens)
            ids = [rng.randrange(3, VOCAB) for _ in range(n)]
            stopped = n < sp.max_tokens or rng.random() < 0.5
            if stopped:
                ids[-1] = sp.stop_token_ids[0]
            # with logprobs=0: the sampled token's log-prob with each token (vLLM leaves the stop token out)
            lps = ([{t: SimpleNamespace(logprob=-0.1 * (k + 1))} for k, t in enumerate(ids[:-1] if stopped else ids)]
                   if getattr(sp, "logprobs", None) == 0 else None)
            outs.append(SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=[SimpleNamespace(
                token_ids=ids[:-1] if stopped and lps is not None else ids,
                finish_reason="stop" if stopped else "length", logprobs=lps,
                stop_reason=sp.stop_token_ids[0] if stopped else None)]))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    FAKE_VLLM = types.ModuleType("vllm")          # the stand-in module (module docstring)
    FAKE_VLLM.LLM, FAKE_VLLM.SamplingParams = FakeLLM, FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", FAKE_VLLM)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    FakeLLM.built.clear()
    return FAKE_VLLM


def _model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, pad_token_id=PAD, eos_token_id=EOS)
    return LlamaForCausalLM(conf).float()


def _options(**kw):
    o = dict(vllm_mode="colocate", vllm_gpu_memory_utilization=0.5, vllm_tensor_parallel_size=1, vllm_max_model_len=96,
             vllm_max_num_seqs=None, vllm_enable_prefix_caching=True, vllm_enforce_eager=True, vllm_enable_lora=False, sleep_level=0,
             move_model_batches=None, offload_model=False, offload_optimizer=False, max_completion_length=6,
             temperature=0.7, top_p=0.9, top_k=5, reward_weights=None, scale_rewards=None, log_completions=False,
             advantage_estimator="grpo", kl_in_reward=None, overlong_filter=False, log_rollout_offpolicy_metrics=False,
             dynamic_sample=False, stop_words=[])
    o.update(kw)
    return SimpleNamespace(**o)


WORLD = SimpleNamespace(rank=0, local_rank=0, world_size=1, device="cpu", is_main=True)
PROMPTS = [[[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 14]]]       # two micro-batches of two prompts


def _round(gen, model, seeds=((1, 2), (3, 4)), **kw):
    o = gen.o
    return gen.generate_round(model, model, gathered, PROMPTS, [list(s) for s in seeds], pad_id=PAD, eos_id=EOS,
                              max_new_tokens=o.max_completion_length, temperature=o.temperature, top_p=o.top_p,
                              top_k=o.top_k, device="cpu", **kw)


def test_full_weights_engine_and_sampling_options(fake_vllm):
    model = _model()
    gen = vllm_gen.VllmGenerator(_options(), dtype="float32", world=WORLD, per_device=2, steps_per_generation=4)
    out = _round(gen, model)
    llm = FakeLLM.built[0]
    # the engine: ms-swift's colocate options, external_launcher, weights from the sync only
    kw = llm.kw
    assert (kw["tensor_parallel_size"], kw["gpu_memory_utilization"], kw["max_model_len"], kw["max_num_seqs"],
            kw["enable_prefix_caching"], kw["enforce_eager"], kw["seed"], kw["dtype"]) == (1, 0.5, 96, 8, True, True, 0,
                                                                                          "float32")
    assert (kw["distributed_executor_backend"], kw["load_format"], kw["enable_sleep_mode"]) == \
        ("external_launcher", "dummy", False)
    conf = json.loads((Path(kw["model"]) / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["hidden_size"] == 16
    # the weights: exactly the policy's names and values, once
    loaded = dict(llm.model.loaded)
    assert len(loaded) == len(llm.model.loaded)
    want = dict(model.named_parameters())
    assert sorted(loaded) == sorted(want)
    assert all(torch.equal(loaded[n], want[n].detach()) for n in want)
    # sampling: one request per completion, n=1, the run's options and the completion's seed
    assert llm.calls.count(("generate", 4)) == 1
    assert len(out) == 2 and out[0][0].shape == (2, 3) and out[1][0].shape == (2, 4)


def test_sampling_params_mapping():
    ps = vllm_gen.sampling_params(FakeSamplingParams, [11, 12], temperature=0.7, top_p=0.9, top_k=5, max_tokens=6,
                                  eos_ids=[2, 7])
    assert [p.kw for p in ps] == [dict(n=1, temperature=0.7, top_p=0.9, top_k=5, max_tokens=6, stop_token_ids=[2, 7],
                                       seed=s, detokenize=False) for s in (11, 12)]


def test_vllm_enable_lora_says_the_weights_are_merged_instead(fake_vllm, capsys):
    gen = vllm_gen.VllmGenerator(_options(vllm_enable_lora=True), dtype="float32", world=WORLD, per_device=2,
                                 steps_per_generation=2)
    _round(gen, _model())
    assert "--vllm_enable_lora true: vLLM gets the merged weights" in capsys.readouterr().out


def test_lora_policy_sends_merged_weights_and_stays_unmerged(fake_vllm):
    from peft import LoraConfig, get_peft_model
    base = _model()
    names = [n for n, _ in base.named_parameters()]
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_()                                   # B = 0 at init would hide a wrong merge
    before = {n: p.detach().clone() for n, p in peft.named_parameters()}
    gen = vllm_gen.VllmGenerator(_options(), dtype="float32", world=WORLD, per_device=2, steps_per_generation=2)
    _round(gen, peft)
    loaded = dict(FakeLLM.built[0].model.loaded)
    assert sorted(loaded) == sorted(names)                    # the base model's names: no lora_, no base_layer
    scale = 8 / 4
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            pre = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            w = before[f"{pre}.base_layer.weight"] + before[f"{pre}.lora_B.default.weight"] @ \
                before[f"{pre}.lora_A.default.weight"] * scale
            torch.testing.assert_close(loaded[f"model.layers.{layer}.self_attn.{proj}.weight"], w)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(loaded[k], before[f"base_model.model.{k}"])
    merged = copy.deepcopy(peft).merge_and_unload().state_dict()      # peft's own merge agrees
    for n in names:
        torch.testing.assert_close(loaded[n], merged[n])
    # the policy: unmerged, every parameter as it was
    assert not any(getattr(m, "merged", False) for m in peft.modules())
    assert all(torch.equal(p, before[n]) for n, p in peft.named_parameters())


def test_layout_is_samples():
    """completion_layout on token lists == generate.sample's tensors on the same completions (HF's
    generate pads finished rows; sample cuts after the first EOS)."""
    prompts = [[5, 6, 7], [8]]
    comps = [[3, EOS], [4, 9, EOS, 11]]                # the second: a token after EOS (HF may emit it)
    got = vllm_gen.completion_layout(prompts, comps, pad_id=PAD, eos_ids=[EOS], device="cpu")
    want = sample(_Replay(comps), prompts, [0, 0], pad_id=PAD, eos_id=EOS, max_new_tokens=4, temperature=1.0,
                  top_p=1.0, top_k=-1, device="cpu")
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    assert got[2].tolist() == [[3, EOS, PAD, PAD], [4, 9, EOS, PAD]] and got[3].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert got[0].tolist() == [[5, 6, 7], [PAD, PAD, 8]] and got[1].tolist() == [[1, 1, 1], [0, 0, 1]]


class _Replay(torch.nn.Module):
    """A model whose generate returns given completions (padded as HF pads finished rows)."""

    def __init__(self, comps):
        super().__init__()
        self.comps = comps

    def generate(self, input_ids, attention_mask, generation_config, logits_processor, synced_gpus):
        assert synced_gpus is False          # one process: nothing to keep in step with
        n = max(len(c) for c in self.comps)
        tail = torch.tensor([c + [PAD] * (n - len(c)) for c in self.comps])
        return torch.cat([input_ids, tail], dim=1)


def test_sleep_level_and_offload_order(fake_vllm, monkeypatch):
    from swiftlite.parallel import offload
    moved = []
    monkeypatch.setattr(offload, "_to", lambda t, dev: (moved.append(str(dev)), t)[1])
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[3, 4]])).logits.sum().backward()
    opt.step()
    gen = vllm_gen.VllmGenerator(_options(sleep_level=2, offload_model=True, offload_optimizer=True), dtype="float32",
                                 world=WORLD, per_device=2, steps_per_generation=2)
    state = {}

    def during():
        state["moved"] = list(moved)
    gen._build(model)
    FakeLLM.built[0].on_generate = during
    _round(gen, model, offload=offload.offloaded(SimpleNamespace(root=lambda: model, optimizer=opt), model=True,
                                                  optim=True, device="cpu"))
    llm = FakeLLM.built[0]
    assert llm.kw["enable_sleep_mode"] is True
    kinds = [c[0] if c[0] != "wake_up" else c for c in llm.calls]
    assert kinds == ["sleep", ("wake_up", ("weights",)), "reset_prefix_cache", ("wake_up", ("kv_cache",)), "generate",
                     "sleep"] and llm.calls[-1] == ("sleep", 2)
    n_tensors = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers()) + \
        sum(1 for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    assert state["moved"] == ["cpu"] * n_tensors                     # all in CPU memory while vLLM generates
    assert moved == ["cpu"] * n_tensors + ["cpu"] * n_tensors        # and back to the device (cpu here) after


def test_offpolicy_metrics_read_vllms_log_probs(fake_vllm):
    """--log_rollout_offpolicy_metrics on the colocated path: the engine is asked for processed log-probs,
    each completion token gets vLLM's (the stop token, which vLLM leaves out, none), and the round's
    rollout_correction/* come from them."""
    from swiftlite.rlhf import grpo
    model = _model(1)
    gen = vllm_gen.VllmGenerator(_options(log_rollout_offpolicy_metrics=True), dtype="float32", world=WORLD,
                                 per_device=2, steps_per_generation=2)
    b = _grpo_batches(model, gen)
    b.options = _options(log_rollout_offpolicy_metrics=True)
    out = grpo.grpo_step(_Engine(model), b, 0)
    llm = FakeLLM.built[0]
    assert llm.kw["logprobs_mode"] == "processed_logprobs" and all(sp.logprobs == 0 for sp in llm.requests[1])
    lps = [s for mb in vllm_gen_rounds(b) for s in mb]
    # per completion: the mean of -0.1 x (k + 1) over its tokens with a log-prob
    expect = sum(-sum(v) / max(1, len(v)) for v in lps) / len(lps)   # none (a stop token alone): 0
    assert out.metrics["rollout_correction/rollout_log_ppl"] == pytest.approx(expect, rel=1e-6)
    assert out.metrics["rollout_correction/training_log_ppl"] > 0


def vllm_gen_rounds(b):
    """The known rollout log-probs of each micro-batch's completions, as FakeLLM gives them."""
    out = []
    for t in b.current.micro.values():
        rows = []
        for j in range(t["completion_ids"].shape[0]):
            n = int(t["completion_mask"][j].sum())
            last_is_stop = int(t["completion_ids"][j, n - 1]) == EOS
            rows.append([-0.1 * (k + 1) for k in range(n - 1 if last_is_stop else n)])
        out.append(rows)
    return out


def _grpo_batches(model, vllm):
    from swiftlite.rlhf.grpo import GrpoBatches
    from swiftlite.rlhf.grpo_data import GrpoPlan
    from swiftlite.rlhf.grpo_loss import GrpoLoss

    class Tok:
        pad_token_id, eos_token_id = PAD, EOS

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(str(i) for i in ids if i != EOS)

    class Reward:
        key, name = "len", "len"

        def __call__(self, completions, **kw):
            return [float(len(c)) for c in completions]
    rows = [{"input_ids": p, "prompt": [{"role": "user", "content": str(p)}], "columns": {}, "where": f"r{i}"}
            for i, p in enumerate([[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]])]
    plan = GrpoPlan(4, 2, 1, 2, 0, 2, 2, 1)
    b = GrpoBatches(rows, plan, PAD, WORLD, [Reward()], GrpoLoss("bnpo", 0.0, 0.2, 0.2, 6), options=_options(),
                    tokenizer=Tok())
    b.model, b.vllm = model, vllm
    return b


class _Engine:
    """The backend engine's surface grpo_step uses, on one CPU process."""

    def __init__(self, model):
        import contextlib
        self.model, self.optimizer = model, None
        self._null = contextlib.nullcontext

    def root(self):
        return self.model

    def autocast(self):
        return self._null()

    def micro_batch(self, last):
        return self._null()

    def backward(self, loss):
        loss.backward()

    def step(self):
        return 0.0


def test_grpo_step_on_vllm_completions_equals_sample_on_the_same(fake_vllm, monkeypatch):
    from swiftlite.rlhf import grpo
    model = _model(1)
    gen = vllm_gen.VllmGenerator(_options(), dtype="float32", world=WORLD, per_device=2, steps_per_generation=2)
    b = _grpo_batches(model, gen)
    a = grpo.grpo_step(_Engine(model), b, 0)
    grads_a = {n: p.grad.clone() for n, p in model.named_parameters()}
    plan = b.plan
    seeds = [completion_seed(plan.seed, 0, c) for mb in plan.rank_micro_batches(0) for c in mb]
    sent_prompts, sent = FakeLLM.built[0].requests
    assert [sp.seed for sp in sent] == seeds                           # each completion's own seed
    assert [p["prompt_token_ids"] for p in sent_prompts] == [b.rows[plan.prompts(0)[c // 2]]["input_ids"]
                                                            for mb in plan.rank_micro_batches(0) for c in mb]
    # the same completions, through generate.sample (a model whose generate replays them)
    texts = {}
    outs = FakeLLM.built[0].generate([{"prompt_token_ids": [0]}] * len(seeds),
                                     vllm_gen.sampling_params(FakeSamplingParams, seeds, temperature=0.7, top_p=0.9,
                                                              top_k=5, max_tokens=6, eos_ids=[EOS]))
    by_seed = {s: list(o.outputs[0].token_ids) for s, o in zip(seeds, outs)}
    real_sample = grpo.sample

    def replay(model_, prompts, seeds_, **kw):
        texts.setdefault("n", 0)
        texts["n"] += 1
        return real_sample(_Replay([by_seed[s] for s in seeds_]), prompts, seeds_,
                           **{k: v for k, v in kw.items() if k != "autocast"})
    monkeypatch.setattr(grpo, "sample", replay)
    model.zero_grad(set_to_none=True)
    b2 = _grpo_batches(model, None)
    c = grpo.grpo_step(_Engine(model), b2, 0)
    assert texts["n"] == 2                                             # sample ran, once per micro-batch
    assert a.loss == c.loss and a.metrics == c.metrics and a.loss != 0.0     # bnpo: length-weighted, not 0
    assert any(g.abs().sum() > 0 for g in grads_a.values())
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads_a[n]), n
    assert b.current.micro.keys() == b2.current.micro.keys()
    for k in b.current.micro:
        for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"):
            assert torch.equal(b.current.micro[k][name], b2.current.micro[k][name]), name


def test_qlora_policy_sends_dequantized_merged_weights(fake_vllm):
    """A 4-bit base (bitsandbytes on CPU): vLLM gets the dense model, dequant(base) + B@A x scale for
    the adapted layers, dequant(base) for the other 4-bit ones, the rest as they are."""
    bnb = pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnbf
    from peft import LoraConfig, get_peft_model
    base = _model()
    names = [n for n, _ in base.named_parameters()]
    for layer in base.model.layers:
        for parent, attr in ((layer.self_attn, "q_proj"), (layer.self_attn, "k_proj"), (layer.self_attn, "v_proj")):
            lin = getattr(parent, attr)
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.float32,
                                  quant_type="nf4")
            q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4")
            setattr(parent, attr, q.to("cpu"))
    base.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}   # as loaded 4-bit
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_()
    gen = vllm_gen.VllmGenerator(_options(), dtype="float32", world=WORLD, per_device=2, steps_per_generation=2)
    _round(gen, peft)
    loaded = dict(FakeLLM.built[0].model.loaded)
    assert sorted(loaded) == sorted(names)
    attn = peft.base_model.model.model.layers[1].self_attn
    w = attn.q_proj.base_layer.weight
    want = bnbf.dequantize_4bit(w.data, w.quant_state).float() + \
        attn.q_proj.lora_B["default"].weight @ attn.q_proj.lora_A["default"].weight * 2.0
    torch.testing.assert_close(loaded["model.layers.1.self_attn.q_proj.weight"], want.detach())
    k = attn.k_proj.weight
    assert loaded["model.layers.1.self_attn.k_proj.weight"].dtype == torch.float32
    assert torch.equal(loaded["model.layers.1.self_attn.k_proj.weight"], bnbf.dequantize_4bit(k.data, k.quant_state))
    assert type(attn.q_proj.base_layer.weight).__name__ == "Params4bit" and not attn.q_proj.merged
    assert json.loads((Path(FakeLLM.built[0].kw["model"]) / "config.json").read_text()).get("quantization_config") \
        is None


def test_move_model_batches_gathers_layer_groups_one_after_another(fake_vllm, monkeypatch):
    """ZeRO-3 + --move_model_batches (ZeRO-3 itself needs a GPU here: its gather is replaced by a
    recorder): each batch's parameters are gathered on their own, every weight is loaded inside the
    gather of its own parameters (a LoRA layer's base and adapter together), and the weights are the
    same as one whole-model sync."""
    from peft import LoraConfig, get_peft_model
    peft = get_peft_model(_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                               lora_dropout=0.0))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_()
    batches = vllm_gen.weight_batches(peft, 2)
    names = {n for n, _ in peft.named_parameters()}
    assert len(batches) == 3 and set().union(*batches) == names and sum(map(len, batches)) == len(names)
    assert all(".layers.0." in n for n in batches[0]) and all(".layers.1." in n for n in batches[1])
    held: list[set[int]] = []
    loads: list[tuple[str, bool]] = []
    import contextlib

    @contextlib.contextmanager
    def gather(params):
        held.append({id(p) for p in params})
        yield
        held.pop()
    monkeypatch.setattr(vllm_gen, "_zero3_gather", gather)
    monkeypatch.setattr(vllm_gen, "_zero3", lambda m: True)
    gen = vllm_gen.VllmGenerator(_options(move_model_batches=2), dtype="float32", world=WORLD, per_device=2,
                                 steps_per_generation=2)
    gen._build(peft)
    model = FakeLLM.built[0].model
    params = dict(peft.named_parameters())
    real = model.load_weights

    def load(weights):
        for name, _ in weights:
            lora = [n for n in params if n.startswith(f"base_model.model.{name.rsplit('.', 1)[0]}.") or
                    n == f"base_model.model.{name}"]
            loads.append((name, len(held) == 1 and all(id(params[n]) in held[0] for n in lora)))
        real(weights)
    model.load_weights = load
    _round(gen, peft)
    assert loads and all(ok for _, ok in loads), [n for n, ok in loads if not ok]
    batched = dict(model.loaded)
    whole = dict(vllm_gen.policy_weights(peft))
    assert sorted(batched) == sorted(whole) and all(torch.equal(batched[n], whole[n]) for n in whole)
