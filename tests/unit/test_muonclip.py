"""MuonClip (--optimizer muonclip, swiftlite/muonclip.py): --optim_args read as ms-swift reads them, the
update is ms-swift's (its step, written out below as the reference), the logit bound is max|q| x max|k| x
scale of the rotated queries and keys and counts training forwards only, and the clip shrinks exactly
the query/key projections."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.config.muonclip_options import muonclip_args
from swiftlite.errors import UserError
from swiftlite.muonclip import MuonClip, build


def cfg_of(*argv: str):
    config_file, values = parse_run_args(["--dataset", "train.jsonl", "--model", "tiny-llama-2l", *argv])
    return load_config(config_file, values, validate_paths=False)


def tiny(cfg=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    if cfg is not None and cfg.is_peft:
        from swiftlite.models.lora import apply_lora
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = apply_lora(m, cfg)
    return m


def test_optim_args_as_msswift_reads_them():
    assert muonclip_args(None) == {"momentum": 0.95, "nesterov": False, "newton_schulz_steps": 5, "qk_clip_tau": 100.0,
                                   "qk_clip_enabled": True, "rms_scale_factor": 0.2, "weight_decay": None}
    got = muonclip_args("qk_clip_threshold=10000, nesterov=True,momentum=0.9,newton_schulz_steps=3")
    assert got["qk_clip_tau"] == 10000 and got["nesterov"] is True and got["momentum"] == 0.9 and \
        got["newton_schulz_steps"] == 3
    for bad, msg in (("tau", "'tau' is not key=value"), ("betas=0.9", "MuonClip reads momentum"),
                     ("nesterov=2", "nesterov takes true or false"), ("newton_schulz_steps=0.5", "an integer >= 1"),
                     ("momentum=-1", "a number >= 0")):
        with pytest.raises(ValueError, match=msg):
            muonclip_args(bad)
    with pytest.raises(UserError, match="only --optimizer muonclip reads it"):
        cfg_of("--optim_args", "momentum=0.9")
    with pytest.raises(UserError, match="--lorap_lr_ratio with --optimizer muonclip"):
        from swiftlite.optim import optim_problem
        c = cfg_of("--optimizer", "muonclip", "--lorap_lr_ratio", "16")
        raise UserError(optim_problem(c))


def test_groups_are_msswifts():
    cfg = cfg_of("--optimizer", "muonclip", "--train_type", "full", "--weight_decay", "0.05")
    model = tiny()
    opt = build(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [(g["apply_muon"], g["is_qk"], sorted(names[id(p)] for p in g["params"])) for g in opt.param_groups]
    qk, other, rest = groups
    assert qk[:2] == (True, True) and all("q_proj" in n or "k_proj" in n for n in qk[2]) and len(qk[2]) == 4
    assert other[:2] == (True, False) and not any("embed" in n or "norm" in n or "lm_head" in n for n in other[2])
    assert rest[:2] == (False, False) and any("embed_tokens" in n for n in rest[2]) and any("lm_head" in n for n in
                                                                                             rest[2])
    assert all(g["weight_decay"] == 0.05 for g in opt.param_groups)      # --weight_decay, every group (ms-swift)
    lora = cfg_of("--optimizer", "muonclip", "--optim_args", "weight_decay=0")
    opt = build(tiny(lora), lora)
    assert opt.param_groups[0]["is_qk"] and all(g["weight_decay"] == 0 for g in opt.param_groups)
    assert len(opt.param_groups[0]["params"]) == 2 * 2 * 2                  # lora_A/B of q_proj, k_proj x 2 layers


def _msswift_step(p, grad, buf, *, lr, momentum, wd, nesterov, ns_steps, rms, apply_muon, is_qk, tau, max_logits):
    """ms-swift's MuonClip.step for one parameter (swift/optimizers/muonclip.py at 3602360a), as the reference."""
    buf.mul_(momentum).add_(grad)
    if apply_muon and p.ndim >= 2:
        a, b, c = (3.4445, -4.7750, 2.0315)
        X = buf.bfloat16() / (buf.norm() + 1e-7)
        transposed = buf.size(0) > buf.size(1)
        if transposed:
            X = X.T
        for _ in range(ns_steps):
            A = X @ X.T
            B = b * A + c * A @ A
            X = a * X + B @ X
        if transposed:
            X = X.T
        update = X.to(buf.dtype) * (math.sqrt(max(p.shape[0], p.shape[1])) * rms)
    else:
        update = buf
    if nesterov:
        update = grad.add(update, alpha=momentum)
    if wd != 0:
        p.mul_(1 - lr * wd)
    if is_qk and max_logits is not None and max_logits > tau:
        g = math.sqrt(tau / max_logits)
        p.mul_(g)
        update = update * g
    p.add_(update, alpha=-lr)


@pytest.mark.parametrize("nesterov", [False, True])
def test_step_is_msswifts(nesterov):
    torch.manual_seed(1)
    params = [torch.randn(6, 4, requires_grad=True), torch.randn(3, 7, requires_grad=True),
              torch.randn(5, requires_grad=True)]
    ref = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in ref]
    settings = dict(momentum=0.9, nesterov=nesterov, newton_schulz_steps=5, qk_clip_tau=2.0, qk_clip_enabled=True,
                    rms_scale_factor=0.2, weight_decay=0.1)
    groups = [dict(params=[params[0]], apply_muon=True, is_qk=True), dict(params=[params[1]], apply_muon=True,
                                                                          is_qk=False),
              dict(params=[params[2]], apply_muon=False, is_qk=False)]

    class Fixed:            # the step's logit bound, as the hooks would report it
        def __init__(self):
            self.values = [5.0, 1.0, None]

        def consume(self):
            return self.values.pop(0)
    opt = MuonClip(groups, lr=0.02, bound=Fixed(), **settings)
    for peak in (5.0, 1.0, None):
        grads = [torch.randn_like(p) for p in ref]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, (r, g, b) in enumerate(zip(ref, grads, bufs)):
            _msswift_step(r, g, b, lr=0.02, momentum=0.9, wd=0.1, nesterov=nesterov, ns_steps=5, rms=0.2,
                          apply_muon=i < 2, is_qk=i == 0, tau=2.0, max_logits=peak)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.detach(), r, rtol=0, atol=1e-6)
    assert float(opt.state[params[0]]["step"]) == 3.0


def _rotated_qk(model, ids):
    """The queries and keys each attention layer's logits use, after RoPE (transformers' own
    apply_rotary_pos_emb on the layer's inputs), by layer."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    got = []

    def hook(attn, args, kwargs, out):
        h = kwargs["hidden_states"]
        b, t, _ = h.shape
        q = attn.q_proj(h).view(b, t, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(b, t, -1, attn.head_dim).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        got.append((*apply_rotary_pos_emb(q, k, cos, sin), attn.scaling))
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    model(ids)
    for h in handles:
        h.remove()
    return got


def test_the_bound_is_cauchy_schwarz_on_the_rotated_queries_and_keys_and_counts_training_forwards_only():
    cfg = cfg_of("--optimizer", "muonclip", "--train_type", "full")
    model = tiny()
    opt = build(model, cfg)
    ids = torch.randint(0, 64, (2, 9))
    model.eval()
    model(ids)                                            # evaluation: not counted
    model.train()
    with torch.no_grad():
        model(ids)                                        # no gradients (generation, reference passes): not counted
    assert opt.bound.peak is None
    model.train()
    layers = _rotated_qk(model, ids)
    want = max(q.norm(dim=-1).max() * k.norm(dim=-1).max() * s for q, k, s in layers).detach()
    # every query against every key of its group (GQA), mask or not: the largest logit any layer can have
    exact = max((q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * s).max()
                for q, k, s in layers)
    assert opt.bound.peak is not None
    torch.testing.assert_close(opt.bound.peak, want, rtol=1e-5, atol=0)
    assert float(want) >= float(exact.detach()) > 0
    model(ids)                                            # a second micro-batch of the step: the maximum stays
    assert opt.bound.consume() == pytest.approx(float(want), rel=1e-5) and opt.bound.peak is None


def test_the_clip_shrinks_exactly_the_query_and_key_projections():
    cfg = cfg_of("--optimizer", "muonclip", "--train_type", "full", "--optim_args", "qk_clip_tau=0.01,weight_decay=0")
    model = tiny()
    opt = build(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randint(0, 64, (2, 9))).logits.sum().backward()
    peak = float(opt.bound.peak)
    for g in opt.param_groups:
        g["lr"] = 0.0                                     # no update: what moves is the clip alone
    opt.step()
    gamma = math.sqrt(0.01 / peak)
    for n, p in model.named_parameters():
        scale = gamma if ("q_proj" in n or "k_proj" in n) else 1.0
        torch.testing.assert_close(p.detach(), before[n] * scale, rtol=1e-6, atol=0, msg=n)
    off = cfg_of("--optimizer", "muonclip", "--train_type", "full", "--optim_args", "qk_clip_enabled=false")
    assert build(tiny(), off).bound is None
