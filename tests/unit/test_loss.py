"""The loss (swiftlite/parallel/loss.py, chunked_ce.py): chunked against plain on tiny models.

Tolerances (fp32, CPU): summed loss within 1e-6 relative, every gradient within 1e-5 (max abs
difference relative to the largest entry of that gradient). Measured: loss <= 8e-8, gradients <= 1.2e-6.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from swiftlite.config import RunConfig  # noqa: E402
from swiftlite.data.tokenize import IGNORE  # noqa: E402
from swiftlite.errors import UserError  # noqa: E402
from swiftlite.parallel import loss as L  # noqa: E402
from swiftlite.parallel.chunked_ce import linear_cross_entropy_sum  # noqa: E402

REL_LOSS = 1e-6
REL_GRAD = 1e-5
VOCAB = 300


def _llama(tie: bool, vocab: int = VOCAB, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    conf = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128,
                       tie_word_embeddings=tie, pad_token_id=0, bos_token_id=None, eos_token_id=1)
    torch.manual_seed(seed)
    return LlamaForCausalLM(conf).float()


def _lora(model, targets=("q_proj", "v_proj", "gate_proj"), **kw):
    from peft import LoraConfig, get_peft_model
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets), **kw))
    with torch.no_grad():  # B starts at zero, which would leave A without gradient: make both non-trivial
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return pm


def _batch(vocab: int = VOCAB, b: int = 3, s: int = 20, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[:, :6] = IGNORE                 # a prompt
    labels[1, 15:] = IGNORE                # a padded row
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model, batch, opts):
    model.zero_grad(set_to_none=True)
    loss = L.token_loss_sum(model, batch, opts)
    (loss * 0.37).backward()               # any scale: the backward must honour the incoming gradient
    grads = {n: p.grad.detach().clone() / 0.37 for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def _assert_match(model, batch, chunk_tokens: int):
    plain, g_plain = _loss_and_grads(model, batch, L.LossOptions(impl="plain"))
    chunked, g_chunk = _loss_and_grads(model, batch, L.LossOptions(impl="chunked", chunk_tokens=chunk_tokens))
    assert abs(chunked - plain) <= REL_LOSS * abs(plain), (chunked, plain)
    assert g_plain.keys() == g_chunk.keys() and g_plain
    for n, g in g_plain.items():
        scale = float(g.abs().max())
        assert scale > 0, n
        err = float((g_chunk[n] - g).abs().max()) / scale
        assert err <= REL_GRAD, (n, err)
    return g_plain


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [0, 7], ids=["auto-chunk", "7-token-chunks"])
def test_chunked_equals_plain_full_finetune(tie, chunk):
    model = _llama(tie)
    grads = _assert_match(model, _batch(), chunk)
    names = set(grads)
    assert "model.embed_tokens.weight" in names
    assert ("lm_head.weight" in names) != tie   # tied: one parameter, its gradient has both parts


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_chunked_equals_plain_lora(tie):
    model = _lora(_llama(tie))
    grads = _assert_match(model, _batch(), 5)
    assert any("lora_A" in n for n in grads) and any("lora_B" in n for n in grads)
    assert not any("lm_head" in n or "embed_tokens" in n for n in grads)   # frozen


def test_lora_with_trained_head_and_embeddings():
    """modules_to_save (a wrapped, trained copy of lm_head/embeddings): the head is not a plain Linear,
    so it is called once on the target positions; still equal to plain."""
    model = _lora(_llama(False), targets=("q_proj",), modules_to_save=["lm_head", "embed_tokens"])
    grads = _assert_match(model, _batch(), 5)
    assert any("lm_head" in n for n in grads) and any("embed_tokens" in n for n in grads)
    lm = L.find_causal_lm(model)
    assert lm.__dict__["_swiftlite_head"].fused is False


def test_lora_on_lm_head_itself():
    model = _lora(_llama(False), targets=("q_proj", "lm_head"))
    grads = _assert_match(model, _batch(), 5)
    assert any("lm_head.lora_A" in n for n in grads)


def test_qlora_4bit_base():
    pytest.importorskip("bitsandbytes")
    import tempfile

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    with tempfile.TemporaryDirectory() as d:
        _llama(False, vocab=320).save_pretrained(d)   # 4-bit blocks want dims divisible by 64
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                               bnb_4bit_quant_storage=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(d, quantization_config=q, dtype=torch.float32)
    for m in model.modules():  # docs/design.md trap 1
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    model = _lora(model)
    assert type(model.get_output_embeddings()) is torch.nn.Linear   # bitsandbytes keeps the head dense
    _assert_match(model, _batch(vocab=320), 5)


def test_no_grad_validation_and_rows_without_targets():
    model = _llama(False)
    batch = _batch()
    with torch.no_grad():
        plain = float(L.token_loss_sum(model, batch, L.LossOptions(impl="plain")))
        chunked = float(L.token_loss_sum(model, batch, L.LossOptions(impl="chunked", chunk_tokens=4)))
    assert abs(chunked - plain) <= REL_LOSS * abs(plain)
    empty = dict(batch, labels=torch.full_like(batch["labels"], IGNORE))   # evaluate()'s dummy batch
    model.zero_grad(set_to_none=True)
    loss = L.token_loss_sum(model, empty, L.LossOptions(impl="chunked"))
    assert float(loss.detach()) == 0.0
    loss.backward()                        # still tied to the head: DDP/ZeRO see every parameter used
    assert model.lm_head.weight.grad is not None and float(model.lm_head.weight.grad.abs().sum()) == 0.0


def test_original_forward_is_kept_for_generation():
    model = _llama(False)
    ids = _batch()["input_ids"]
    before = model(input_ids=ids).logits
    L.token_loss_sum(model, _batch(), L.LossOptions())
    assert "forward" in model.__dict__ and "forward" in model.lm_head.__dict__
    after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert torch.equal(model.lm_head(before[..., :32]), torch.nn.functional.linear(before[..., :32], model.lm_head.weight))


def test_softcapped_logits_use_the_plain_path():
    model = _llama(False)
    model.config.final_logit_softcapping = 30.0
    L.token_loss_sum(model, _batch(), L.LossOptions())
    assert model.__dict__["_swiftlite_head"] is None and "forward" not in model.__dict__


def test_kernel_matches_cross_entropy_with_bias_and_16bit():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(50, 16, generator=g, requires_grad=True)
    w = (torch.randn(40, 16, generator=g) * 0.3).requires_grad_()
    b = torch.randn(40, generator=g, requires_grad=True)
    y = torch.randint(0, 40, (50,), generator=g)
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w, b).float(), y, reduction="sum")
    ref_g = torch.autograd.grad(ref, (h, w, b))
    out = linear_cross_entropy_sum(h, w, b, y, 8)
    out_g = torch.autograd.grad(out, (h, w, b))
    assert abs(float(out) - float(ref)) <= REL_LOSS * abs(float(ref))
    for a, c in zip(out_g, ref_g):
        assert float((a - c).abs().max()) <= REL_GRAD * float(c.abs().max())
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(hb, wb).float(), y, reduction="sum")
    out = linear_cross_entropy_sum(hb, wb, None, y, 8)
    assert out.dtype == torch.float32 and abs(float(out) - float(ref)) <= 1e-3 * abs(float(ref))
    gh, gw = torch.autograd.grad(out, (hb, wb))
    assert gh.dtype == wb.dtype == gw.dtype == torch.bfloat16


def test_auto_chunk_size():
    assert L.chunk_tokens_for(151_936) == 128              # 64 MiB / (151,936 x 4 B) = 110 -> at least 128
    assert L.chunk_tokens_for(32_000) == 524
    assert L.chunk_tokens_for(260) > 60_000                # tiny vocabularies: one chunk
    assert L.chunk_tokens_for(151_936, 512) == 512


def test_schema_choices_are_the_loss_impls():
    spec = {f.name: f for f in dataclasses.fields(RunConfig().train)}["loss_impl"]
    assert tuple(spec.metadata["choices"]) == L.LOSS_IMPLS
    assert RunConfig().train.loss_impl == L.DEFAULT_LOSS_IMPL == "chunked"


def _cfg(**train):
    cfg = RunConfig()
    cfg.model = dataclasses.replace(cfg.model, torch_dtype="fp32")  # what load_config resolves auto to on CPU
    cfg.data = dataclasses.replace(cfg.data, max_length=512)        # and the model's context
    cfg.train = dataclasses.replace(cfg.train, **train)
    return cfg


@pytest.mark.parametrize("impl,extra", [("liger", "liger"), ("cce", "cce")])
def test_gpu_kernels_refused_on_cpu_and_without_package(impl, extra, monkeypatch):
    with pytest.raises(UserError, match="no GPU") as e:
        L.check_loss_options(_cfg(loss_impl=impl), cuda=False)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(L, "_missing", lambda _module: True)
    with pytest.raises(UserError, match=rf"pip install 'swiftlite\[{extra}\]'"):
        L.check_loss_options(_cfg(loss_impl=impl), cuda=True)
    monkeypatch.setattr(L, "_missing", lambda _module: False)
    L.check_loss_options(_cfg(loss_impl=impl), cuda=True)


def test_use_liger_kernel_refused_on_cpu_and_without_package(monkeypatch):
    with pytest.raises(UserError, match="--use-liger-kernel .*no GPU"):
        L.check_loss_options(_cfg(use_liger_kernel=True), cuda=False)
    monkeypatch.setattr(L, "_missing", lambda _module: True)
    with pytest.raises(UserError, match=r"swiftlite\[liger\]"):
        L.check_loss_options(_cfg(use_liger_kernel=True), cuda=True)


def test_default_options_pass_everywhere():
    L.check_loss_options(RunConfig(), cuda=False)
    L.check_loss_options(_cfg(loss_impl="plain"), cuda=False)
    with pytest.raises(UserError, match="loss-chunk-tokens"):
        L.check_loss_options(_cfg(loss_chunk_tokens=-1), cuda=False)


# --------------------------------------------------------------------------------------------------
# The planner's loss term (planner/memory.py logit_bytes)


def test_planner_loss_term_by_impl():
    from swiftlite.planner import Workload, shape_from_model_arg
    from swiftlite.planner.memory import CHUNK_LOGIT_BYTES, LOGIT_BYTES, LOSS_IMPLS, logit_bytes
    assert LOSS_IMPLS == L.LOSS_IMPLS
    shape = shape_from_model_arg("llama-8b")            # vocab 128,256, hidden 4096
    v, h, tokens = shape.vocab, shape.hidden, 2048

    def w(**kw):
        return Workload(**{"dtype": "bf16", "max_length": 2048, "micro_batch": 1, **kw})
    assert Workload().loss_impl == "chunked"
    assert logit_bytes(shape, w(loss_impl="plain")) == tokens * v * LOGIT_BYTES
    rows = L.chunk_tokens_for(v)                       # 130 rows of 128,256 logits
    lora = logit_bytes(shape, w(train_type="lora"))
    assert lora == rows * v * (CHUNK_LOGIT_BYTES + 2) + 2 * tokens * h * 2
    assert logit_bytes(shape, w(train_type="full")) == lora + 4 * v * h   # fp32 accumulator of lm_head's grad
    assert logit_bytes(shape, w(train_type="full", dtype="fp32")) == rows * v * 4 + 2 * tokens * h * 4
    assert logit_bytes(shape, w(loss_impl="chunked", loss_chunk_tokens=512, train_type="lora")) == \
        512 * v * 6 + 2 * tokens * h * 2
    assert logit_bytes(shape, w(loss_impl="cce")) == 2 * tokens * h * 2
    liger = logit_bytes(shape, w(loss_impl="liger"))   # 2048 / ceil(128256 / 4096) = 64 rows
    assert liger == 64 * v * 2 + 2 * tokens * h * 2
    assert lora < logit_bytes(shape, w(loss_impl="plain")) / 15
    with pytest.raises(UserError, match="--loss-impl"):
        Workload(loss_impl="fused")


def test_workload_from_config_passes_the_loss():
    from swiftlite.planner import workload_from_config
    assert workload_from_config(_cfg(), 1, None).loss_impl == "chunked"
    w = workload_from_config(_cfg(loss_impl="plain", loss_chunk_tokens=64), 1, None)
    assert (w.loss_impl, w.loss_chunk_tokens) == ("plain", 64)


def test_with_activation_checkpointing():
    model = _lora(_llama(False))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _assert_match(model, _batch(), 5)


def _fake_kernel_modules(monkeypatch, calls):
    """Stand-ins for liger_kernel / cut_cross_entropy (GPU-only packages): the same maths in torch,
    so the routing (which tensors reach the kernel, and the reduction) is tested on CPU."""
    import sys
    import types

    def fused(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", **kw):
        calls.append(("liger", tuple(hidden.shape), tuple(weight.shape), reduction, ignore_index))
        logits = torch.nn.functional.linear(hidden, weight, bias).float()
        return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    def cce(e, c, targets, bias=None, ignore_index=-100, reduction="mean", **kw):
        calls.append(("cce", tuple(e.shape), tuple(c.shape), reduction, ignore_index))
        logits = torch.nn.functional.linear(e, c, bias).float()
        return torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)

    def instance(model, **flags):
        calls.append(("liger-kernels", type(model).__name__, flags))

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = fused
    transformers_pkg = types.ModuleType("liger_kernel.transformers")
    transformers_pkg._apply_liger_kernel_to_instance = instance
    transformers_pkg.functional = functional
    cce_pkg = types.ModuleType("cut_cross_entropy")
    cce_pkg.linear_cross_entropy = cce
    for name, mod in (("liger_kernel", types.ModuleType("liger_kernel")), ("liger_kernel.transformers", transformers_pkg),
                      ("liger_kernel.transformers.functional", functional), ("cut_cross_entropy", cce_pkg)):
        monkeypatch.setitem(sys.modules, name, mod)


@pytest.mark.parametrize("impl", ["liger", "cce"])
def test_gpu_kernels_get_the_gathered_targets(impl, monkeypatch):
    calls: list = []
    _fake_kernel_modules(monkeypatch, calls)
    model = _lora(_llama(False))
    batch = _batch()
    plain, g_plain = _loss_and_grads(model, batch, L.LossOptions(impl="plain"))
    fused, g_fused = _loss_and_grads(model, batch, L.LossOptions(impl=impl, liger_kernels=True))
    assert abs(fused - plain) <= REL_LOSS * abs(plain)
    for n, g in g_plain.items():
        assert float((g_fused[n] - g).abs().max()) <= REL_GRAD * float(g.abs().max()), n
    targets = int((batch["labels"][:, 1:] != IGNORE).sum())
    assert ("liger-kernels", "LlamaForCausalLM", {"rope": True, "rms_norm": True, "swiglu": True,
                                                  "cross_entropy": False, "fused_linear_cross_entropy": False}) in calls
    assert (impl, (targets, 32), (VOCAB, 32), "sum", IGNORE) in calls


def test_a_model_without_a_transformers_head_uses_the_plain_path():
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, 8)
            self.out = torch.nn.Linear(8, VOCAB)

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            return (self.out(self.emb(input_ids)),)

    toy, batch = Toy(), _batch()
    plain = L.token_loss_sum(toy, batch, L.LossOptions(impl="plain"))
    for _ in range(2):   # the second call answers from the cache
        assert torch.equal(L.token_loss_sum(toy, batch, L.LossOptions()), plain)


def _dft_reference(model, batch):
    """ms-swift's DFT (swift/trainers/utils.py per_token_loss_func), written out: per-token CE from the
    full fp32 logits, times exp(-CE) detached, summed."""
    import torch.nn.functional as F
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    y = batch["labels"][:, 1:].reshape(-1)
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y, ignore_index=IGNORE, reduction="none")
    return (ce * torch.exp(-ce).detach()).sum()


@pytest.mark.parametrize("impl,chunk,wrap", [("chunked", 7, None), ("plain", 0, None), ("chunked", 5, "head")],
                         ids=["chunked", "plain", "unfused-head"])
def test_dft_loss_matches_msswift_and_differs_from_ce(impl, chunk, wrap):
    model = _llama(False)
    if wrap == "head":   # a trained copy of lm_head: the head is not fused, its path computes DFT too
        model = _lora(model, targets=("q_proj",), modules_to_save=["lm_head"])
    batch = _batch()
    model.zero_grad(set_to_none=True)
    ref = _dft_reference(model, batch)
    (ref * 0.37).backward()
    g_ref = {n: p.grad.detach().clone() / 0.37 for n, p in model.named_parameters() if p.grad is not None}
    got, g_got = _loss_and_grads(model, batch, L.LossOptions(impl=impl, chunk_tokens=chunk, dft=True))
    assert abs(got - float(ref)) <= 1e-5 * abs(float(ref)), (got, float(ref))
    assert g_ref.keys() == g_got.keys() and g_ref
    for n, g in g_ref.items():
        err = float((g_got[n] - g).abs().max()) / max(float(g.abs().max()), 1e-12)
        assert err <= 1e-4, (n, err)
    ce, _ = _loss_and_grads(model, batch, L.LossOptions(impl=impl, chunk_tokens=chunk))
    assert got < 0.5 * ce     # random weights: every target's probability is ~1/vocab, so DFT is far smaller


def test_dft_refused_with_fused_kernels_and_for_rlhf():
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    base = ["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--enable_dft_loss", "true"]
    for extra, task, msg in [(["--loss_impl", "liger"], "sft", "fused kernel returns only the summed loss"),
                             (["--rlhf_type", "dpo"], "rlhf", "rlhf has its own losses")]:
        config_file, values = parse_run_args([*base, *extra])
        with pytest.raises(UserError, match=msg):
            load_config(config_file, values, validate_paths=False, task=task)
    config_file, values = parse_run_args(base)
    cfg = load_config(config_file, values, validate_paths=False)
    assert L.loss_options(cfg).dft is True


def _moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    conf = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                          num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=128,
                          tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=1)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(conf).float()


@pytest.mark.parametrize("impl", ["chunked", "plain"])
def test_router_aux_loss_is_the_models_own_weighted_by_targets(impl):
    """--router_aux_loss_coef: the loss sum gains coef x the model's own aux_loss (its forward's, with
    output_router_logits) x the micro-batch's target tokens (ms-swift's weighting once divided by the
    step's targets); the router's gradient changes with it."""
    model = _moe()
    batch = _batch()
    n = int((batch["labels"][:, 1:] != IGNORE).sum())
    ce, g_ce = _loss_and_grads(model, batch, L.LossOptions(impl=impl))
    got, g_aux = _loss_and_grads(model, batch, L.LossOptions(impl=impl, router_aux=0.5))
    with torch.no_grad():
        aux = float(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          output_router_logits=True).aux_loss)
    assert aux > 0
    assert got == pytest.approx(ce + 0.5 * aux * n, rel=1e-6)
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(g_aux[router], g_ce[router])


def test_router_aux_loss_needs_a_moe_model():
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.models.loading import check_moe_options
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl",
                                          "--router_aux_loss_coef", "1e-3", "--experts_impl", "grouped_mm"])
    cfg = load_config(config_file, values, validate_paths=False)
    with pytest.raises(UserError, match="--experts_impl, --router_aux_loss_coef: --model tiny-llama-2l is not a "
                                        "mixture-of-experts model"):
        check_moe_options(cfg)
    for extra, task, msg in [(["--router_aux_loss_coef", "-1"], "sft", "must be >= 0"),
                             (["--router_aux_loss_coef", "0.1", "--rlhf_type", "dpo"], "rlhf", "rlhf has its own")]:
        config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", *extra])
        with pytest.raises(UserError, match=msg):
            load_config(config_file, values, validate_paths=False, task=task)
