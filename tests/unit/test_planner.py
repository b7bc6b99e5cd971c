"""Memory model and backend recommendation (swiftlite/planner/, swiftlite/sizes.py).

The scenario expectations below were worked out by hand from the formulas in docs/estimate.md
(GB = 1e9; usable = 90% of a GPU, "with room" = 80%; bf16, gradient checkpointing, micro-batch 1,
1 GiB = 1.07 GB overhead unless a row says otherwise). The comments keep the arithmetic, and every
case sits well clear of its threshold, so small refinements of the model do not flip them.
"""

from __future__ import annotations

import io
import json

import pytest

from swiftlite.errors import UserError
from swiftlite.models.presets import PRESETS, param_count
from swiftlite.planner import (
    GiB, Workload, comm_bytes_per_step, estimate, model_state_bytes, quantized_bytes, recommend,
    resolve_auto, shape_from_config, shape_from_model_arg,
)

GB = 10**9


def work(**kw) -> Workload:
    # The hand-computed scenarios below count the plain loss's logits (12 bytes per token x vocab).
    defaults = dict(dtype="bf16", gradient_checkpointing=True, max_length=2048, micro_batch=1, loss_impl="plain")
    defaults.update(kw)
    return Workload(**defaults)


# Llama-3 numbers used below (param_count of the presets):
#   llama-1b  Ψ = 1.236e9 (tied), h 2048;   llama-8b Ψ = 8.03e9, h 4096, i 14336, 32 layers
#   llama-70b Ψ = 70.55e9, h 8192, 80 layers, linear weights 68.45e9; vocab 128256
#   logits at 2048 tokens: 2048 * 128256 * 12 B = 3.15 GB; at 1024: 1.58 GB
SCENARIOS = [
    # id, model, workload kwargs, expected backend, reason substring
    ("1b-full-8x80-ddp", "llama-1b", dict(train_type="full", world_size=8, gpu_memory_bytes=80 * GB),
     # 16Ψ = 19.8 GB + acts ~3.5 (logits 3.15) + 1.07 = 24.4 GB <= 64 (80%); grads are DDP's buckets
     "ddp", "fits on every GPU with room"),
    ("1b-full-8x30-no-room", "llama-1b", dict(train_type="full", world_size=8, gpu_memory_bytes=30 * GB),
     # ddp 24.4 GB: under 27 (90%) but over 24 (80%) -> no room; fsdp: 16Ψ/8 = 2.5 + 3.5 + root
     # (tied embed 0.53 + its grads 0.53) + 2 layers 0.24 + 0.12 + 1.07 = 8.5 GB
     "fsdp", "shards params, grads and optimizer state over 8 GPUs"),
    ("8b-full-8x40-fsdp", "llama-8b", dict(train_type="full", world_size=8, gpu_memory_bytes=40 * GB),
     # ddp 16Ψ = 128 GB no; fsdp 16Ψ/8 = 16.1 + acts 4.3 + root 2.1 + root grads 2.1 + 2 layers 0.87
     # + layer grads 0.44 + 1.07 = 27 GB <= 36
     "fsdp", "FSDP2 shards"),
    ("70b-full-32x80-fsdp", "llama-70b", dict(train_type="full", world_size=32, gpu_memory_bytes=80 * GB),
     # one node of 32: 16Ψ/32 = 35.3 + acts 6.6 + root 4.2 + root grads 4.2 + 2 layers 3.4 + layer
     # grads 1.7 + 1.07 = 56.5 GB <= 72
     "fsdp", "over 32 GPUs"),
    # Across nodes (4 x 8): hsdp's states over one node, 16Ψ/8 = 141 GB, do not fit; zero3pp = zero3's
    # 16Ψ/32 = 35.3 + hpZ's secondary weights 2Ψ/8 = 17.6 + acts 6.6 + gathered 2.0 + buckets 0.25
    # + 1.07 = 63 GB <= 72. Inter-node: (31/32)(2Ψ + 2Ψ) = 273 GB vs zero3's (31/32) 6Ψ = 410 GB.
    ("70b-full-4x8x80-zero3pp", "llama-70b", dict(train_type="full", world_size=32, gpus_per_node=8,
                                                  gpu_memory_bytes=80 * GB),
     "zero3pp", "hsdp does not fit"),
    # fp16 across nodes: no torch backend (loss scaling), zero2 = 2Ψ + 14Ψ/32 = 172 GB no: zero3pp
    ("70b-fp16-4x8x80-zero3pp", "llama-70b", dict(train_type="full", dtype="fp16", world_size=32,
                                                  gpus_per_node=8, gpu_memory_bytes=80 * GB),
     "zero3pp", "hsdp is out (fp16 needs loss scaling"),
    # 8B across 2 x 8: ddp 16Ψ = 128 GB no; hsdp = fsdp's 8-GPU numbers, 16Ψ/8 = 16.1 + acts 4.3 +
    # root 2.1 + root grads 2.1 + 2 layers 0.87 + layer grads 0.44 + 1.07 = 27 GB <= 72
    ("8b-full-2x8x80-hsdp", "llama-8b", dict(train_type="full", world_size=16, gpus_per_node=8,
                                             gpu_memory_bytes=80 * GB),
     "hsdp", "keeps the gathers and reduce-scatters inside the node"),
    # ... and on 2 x 8 x 40 GB as well (27 <= 36); fsdp would be 16Ψ/16 = 8 GB less but all its
    # gathers cross nodes
    ("8b-full-2x8x40-hsdp", "llama-8b", dict(train_type="full", world_size=16, gpus_per_node=8,
                                             gpu_memory_bytes=40 * GB),
     "hsdp", "across 2 nodes one node's 8 GPUs hold the sharded states"),
    # 1B across 2 x 8: a replica fits with room (24.4 GB <= 64): ddp, as on one node
    ("1b-full-2x8x80-ddp", "llama-1b", dict(train_type="full", world_size=16, gpus_per_node=8,
                                            gpu_memory_bytes=80 * GB),
     "ddp", "fits on every GPU with room"),
    ("70b-full-8x80-offload", "llama-70b", dict(train_type="full", world_size=8, gpu_memory_bytes=80 * GB),
     # fsdp/zero3: 16Ψ/8 = 141 GB > 72 before anything else; offload leaves ~10 GB on each GPU
     "zero3_offload", "only offload fits"),
    ("70b-full-8x40-offload", "llama-70b", dict(train_type="full", world_size=8, gpu_memory_bytes=40 * GB),
     # GPU: acts 6.6 + largest module (embedding 1.05e9 * 2 = 2.1) + buckets 0.25 + 1.07 = 10 GB <= 36
     "zero3_offload", "not checked: pass --cpu-memory"),
    ("70b-full-8x80-1TB-none", "llama-70b", dict(train_type="full", world_size=8, gpu_memory_bytes=80 * GB,
                                                 cpu_memory_bytes=1000 * GB),
     # offload CPU per node: 8 ranks * (2 + 2 + 4 + 12)Ψ/8 = 20Ψ = 1411 GB > 900 GB usable
     "none", "of CPU memory per node"),
    ("7b-full-1x80-offload", "qwen2.5-7b", dict(train_type="full", world_size=1, gpu_memory_bytes=80 * GB),
     # 16 * 7.6e9 = 122 GB > 72 GB on one GPU: no sharding possible, only offload
     "zero3_offload", "only offload fits"),
    ("405b-full-8x80-offload", "llama-405b", dict(train_type="full", world_size=8, gpu_memory_bytes=80 * GB),
     # fsdp 16Ψ/8 = 812 GB; offload GPU side: acts ~13 + largest module 4.2 + buckets + 1 = ~19 GB
     "zero3_offload", "only offload fits"),
    ("405b-full-8x80-2TB-none", "llama-405b", dict(train_type="full", world_size=8, gpu_memory_bytes=80 * GB,
                                                   cpu_memory_bytes=2000 * GB),
     # offload needs 20Ψ = 8.1 TB per node > 1.8 TB usable
     "none", "no backend fits"),
    ("8b-lora-1x24-single", "llama-8b", dict(train_type="lora", world_size=1, gpu_memory_bytes=24 * GB,
                                             max_length=1024),
     # base 2Ψ = 16.06 + adapters 21e6 * 16 B = 0.34 + acts (inputs 0.27 + one layer 0.33 + logits 1.58)
     # + 1.07 = 19.6 GB <= 21.6
     "single", "one GPU holds the whole run"),
    ("8b-qlora-1x24-single", "llama-8b", dict(train_type="qlora", world_size=1, gpu_memory_bytes=24 * GB),
     # 4-bit linears 6.98e9 * 0.516 = 3.6 + embed/head 2.1 + adapters 0.34 + acts 4.3 + 1.07 = 11.4 GB
     "single", "no communication"),
    ("70b-qlora-2x24-none", "llama-70b", dict(train_type="qlora", world_size=2, gpu_memory_bytes=24 * GB),
     # base (35.3 four-bit + 4.2 embed/head) / 2 = 19.8 GB + logits 3.15 + 1.07 > 21.6 for every
     # sharded backend, and bitsandbytes weights cannot be offloaded
     "none", "the smallest requirement is"),
    ("70b-qlora-4x24-fsdp", "llama-70b", dict(train_type="qlora", world_size=4, gpu_memory_bytes=24 * GB,
                                              max_length=1024),
     # base/4 = 9.9 + adapters 104e6 * 16 / 4 = 0.41 + acts (1.34 + 0.65 + 1.58) + root 4.2 + 2 layers
     # 0.89 + 1.07 = 20.0 GB <= 21.6; ddp holds the whole 39.5 GB base
     "fsdp", "FSDP2 shards"),
    ("1b-fp16-8x80-zero2", "llama-1b", dict(train_type="full", dtype="fp16", world_size=8,
                                            gpu_memory_bytes=80 * GB),
     # ddp/fsdp cannot do fp16; zero2 = 2Ψ + 14Ψ/8 = 4.6 + acts 3.5 + 1.07 = 9.2 GB <= 64
     "zero2", "fp16 needs DeepSpeed's loss scaling"),
    ("1b-fp16-1x80-zero2", "llama-1b", dict(train_type="full", dtype="fp16", world_size=1,
                                            gpu_memory_bytes=80 * GB),
     # single is out for fp16; one-rank zero2 = 16Ψ = 19.8 + 3.5 + 1.07 = 24.4 GB <= 64
     "zero2", "fp16"),
    ("8b-fp16-8x40-zero3", "llama-8b", dict(train_type="full", dtype="fp16", world_size=8,
                                            gpu_memory_bytes=40 * GB),
     # zero2 = 2Ψ + 14Ψ/8 = 16.1 + 14.1 = 30.1 + 4.3 + 1.07 = 35.5 > 32 (80%); zero3 = 16Ψ/8 = 16.1 + 4.3
     # + embedding 1.05 + buckets 0.06 + 1.07 = 22.5 GB <= 36
     "zero3", "fsdp is out"),
    ("8b-full-8x40-old-torch", "llama-8b", dict(train_type="full", world_size=8, gpu_memory_bytes=40 * GB,
                                                fsdp2_available=False),
     # as 8b-full-8x40 but without fully_shard: zero3 22.5 GB <= 36
     "zero3", "needs torch >= 2.4"),
    ("tiny-1x80-single", "tiny-llama", dict(train_type="full", dtype="fp32", world_size=1,
                                            gpu_memory_bytes=80 * GB, gradient_checkpointing=False),
     "single", "single: one GPU"),
]


@pytest.mark.parametrize("model, kw, backend, reason", [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS])
def test_recommend_scenarios(model, kw, backend, reason):
    decision = recommend(shape_from_model_arg(model), work(**kw))
    assert decision.backend == backend, decision.reason
    assert reason in decision.reason


def test_no_room_case_really_fits_ddp():
    """The 20% room rule, not a failure to fit, is what moves 1B full on 8x30GB to fsdp."""
    decision = recommend(shape_from_model_arg("llama-1b"),
                         work(train_type="full", world_size=8, gpu_memory_bytes=30 * GB))
    assert decision.table["ddp"].fits is True
    assert decision.backend == "fsdp"


def test_unavailable_backends_are_marked():
    d = recommend(shape_from_model_arg("llama-8b"), work(train_type="qlora", world_size=2, gpu_memory_bytes=24 * GB))
    assert not d.table["zero3_offload"].available and "bitsandbytes" in d.table["zero3_offload"].note
    d = recommend(shape_from_model_arg("llama-1b"), work(dtype="fp16", world_size=2, gpu_memory_bytes=80 * GB))
    assert all(not d.table[b].available for b in ("ddp", "fsdp", "fsdp1"))


# --------------------------------------------------------------------------------------------------
# Accounting

TINY = shape_from_model_arg("tiny-llama")
PSI = TINY.n_params


@pytest.mark.parametrize("n", [2, 4])
def test_bf16_full_model_states(n):
    w = work(train_type="full", world_size=n)
    # fp32 master weights: DeepSpeed keeps them in its optimizer (ZeRO split 2 + 2 + 12) ...
    s = model_state_bytes(TINY, w, "zero3")
    assert (s["params"], s["grads"], s["optimizer"]) == (2 * PSI // n, 2 * PSI // n, 12 * PSI // n)
    # ... the torch backends hold fp32 parameters, fp32 gradients and fp32 AdamW state (4 + 4 + 8)
    for backend in ("fsdp", "fsdp1"):
        s = model_state_bytes(TINY, w, backend)
        assert (s["params"], s["grads"], s["optimizer"]) == (4 * PSI // n, 4 * PSI // n, 8 * PSI // n)
        assert sum(s.values()) == 16 * PSI // n
    s = model_state_bytes(TINY, w, "zero2")
    assert s["params"] == 2 * PSI and s["grads"] + s["optimizer"] == 14 * PSI // n
    assert model_state_bytes(TINY, w, "ddp") == {"params": 4 * PSI, "grads": 4 * PSI, "optimizer": 8 * PSI}


@pytest.mark.parametrize("n", [2, 4])
def test_pure_bf16_full_model_states(n):
    """--pure-bf16: bf16 params, grads and AdamW m/v on the torch backends (8 bytes); DeepSpeed's
    bf16_master_weights_and_grads + bf16_optimizer_states keep a bf16 "master" copy too (10 bytes)."""
    w = work(train_type="full", world_size=n, pure_bf16=True)
    for backend in ("fsdp", "fsdp1"):
        s = model_state_bytes(TINY, w, backend)
        assert (s["params"], s["grads"], s["optimizer"]) == (2 * PSI // n, 2 * PSI // n, 4 * PSI // n)
    assert model_state_bytes(TINY, w, "ddp") == {"params": 2 * PSI, "grads": 2 * PSI, "optimizer": 4 * PSI}
    s = model_state_bytes(TINY, w, "zero3")
    assert (s["params"], s["grads"], s["optimizer"]) == (2 * PSI // n, 2 * PSI // n, 6 * PSI // n)


def test_fp32_full_model_states_match_torch_layout():
    """fp32, no mixed precision: what FSDP2/DDP + AdamW hold (the lead's distributed test compares)."""
    w = work(train_type="full", dtype="fp32", world_size=2, overhead_bytes=0)
    assert model_state_bytes(TINY, w, "fsdp") == {"params": 4 * PSI // 2, "grads": 4 * PSI // 2,
                                                  "optimizer": 8 * PSI // 2}
    assert model_state_bytes(TINY, w, "ddp") == {"params": 4 * PSI, "grads": 4 * PSI, "optimizer": 8 * PSI}
    # ZeRO keeps an fp32 master partition even for fp32 weights: 4 + 8 bytes of optimizer state
    assert model_state_bytes(TINY, w, "zero2") == {"params": 4 * PSI, "grads": 4 * PSI // 2,
                                                   "optimizer": 12 * PSI // 2}
    assert sum(model_state_bytes(TINY, w, "ddp").values()) == 16 * PSI
    est = estimate(TINY, w, "fsdp")
    assert est.overhead == 0 and est.params + est.grads + est.optimizer == 16 * PSI // 2


def test_offload_moves_states_to_cpu():
    w = work(train_type="full", world_size=4, gpus_per_node=4)
    est = estimate(TINY, w, "zero3_offload")
    assert est.params == est.grads == est.optimizer == 0
    # params 2Ψ + the 16-bit gradient partition buffer 2Ψ + fp32 grads 4Ψ + optimizer 12Ψ, sharded over 4
    # ranks, 4 ranks per node (measured from DeepSpeed's tensors: tests/distributed/test_estimator_terms.py)
    assert est.cpu_offloaded == 20 * PSI // 4 and est.cpu_per_node == 20 * PSI


def _tiny_hf_model(cfg: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))


def _peft_trainable(model, r: int) -> int:
    from peft import LoraConfig, get_peft_model
    peft_model = get_peft_model(model, LoraConfig(r=r, target_modules="all-linear", task_type="CAUSAL_LM"))
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def test_lora_params_equal_peft_count():
    model = _tiny_hf_model(PRESETS["tiny-llama"].config)
    assert TINY.n_params == sum(p.numel() for p in model.parameters())
    assert TINY.lora_params(8) == _peft_trainable(model, 8)


def test_lora_state_bytes():
    n_lora = TINY.lora_params(8)
    w = work(train_type="lora", world_size=2)
    s = model_state_bytes(TINY, w, "fsdp")
    # frozen bf16 base 2Ψ + fp32 adapters (peft upcasts them) 4 * n, all sharded by 2
    assert s == {"params": (2 * PSI + 4 * n_lora) // 2, "grads": 4 * n_lora // 2, "optimizer": 8 * n_lora // 2}
    s = model_state_bytes(TINY, w, "zero3")  # DeepSpeed: 16-bit adapters + fp32 master in the optimizer
    assert s == {"params": (2 * PSI + 2 * n_lora) // 2, "grads": 2 * n_lora // 2, "optimizer": 12 * n_lora // 2}


def test_qlora_base_bytes():
    w = work(train_type="qlora")
    assert w.quant_bits == 4
    n = 64 * 256 * 10
    assert quantized_bytes(n, w) == n // 2 + n // 64 + 4 * n // (64 * 256)  # 4.127 bits per weight
    assert abs(quantized_bytes(n, w) * 8 / n - 4.127) < 0.001
    s = model_state_bytes(TINY, w, "single")
    other = PSI - TINY.n_linear_params  # embeddings, norms, lm_head stay bf16
    assert s["params"] == quantized_bytes(TINY.n_linear_params, w) + 2 * other + 4 * TINY.lora_params(8)


@pytest.mark.parametrize("n", [2, 8])
def test_comm_bytes(n):
    w = work(train_type="full", world_size=n)
    ring = (n - 1) / n
    for backend in ("zero3", "zero3_offload"):
        assert comm_bytes_per_step(TINY, w, backend) == int(3 * ring * 2 * PSI)
    # FSDP gathers bf16 parameters and reduce-scatters fp32 gradients (reduce_dtype) under master weights
    for backend in ("fsdp", "fsdp1"):
        assert comm_bytes_per_step(TINY, w, backend) == int(ring * (2 * 2 + 4) * PSI)
    # DDP all-reduces the gradients in their dtype: fp32 under bf16 master weights, bf16 with --pure-bf16
    assert comm_bytes_per_step(TINY, w, "ddp") == int(2 * ring * 4 * PSI)
    assert comm_bytes_per_step(TINY, work(train_type="full", world_size=n, pure_bf16=True), "ddp") == \
        int(2 * ring * 2 * PSI)
    assert comm_bytes_per_step(TINY, w, "zero2") == int(2 * ring * 2 * PSI)
    assert comm_bytes_per_step(TINY, work(world_size=1), "single") == 0


def test_activations_checkpointing_and_logits():
    # fsdp computes in bf16 (its gathered parameters are cast); single/ddp autocast: see test_autocast_*
    shape = shape_from_model_arg("llama-8b")
    on = estimate(shape, work(world_size=1, gradient_checkpointing=True), "fsdp").activations
    off = estimate(shape, work(world_size=1, gradient_checkpointing=False), "fsdp").activations
    logits = 2048 * shape.vocab * 12
    # checkpointing keeps each layer's input (s*h*2 bytes) plus one layer recomputed at a time
    per_layer = (off - logits) // shape.layers
    assert on == logits + shape.layers * 2048 * shape.hidden * 2 + per_layer
    assert off - logits > 5 * (on - logits)
    # doubling the micro-batch doubles activations
    twice = estimate(shape, work(world_size=1, micro_batch=2), "fsdp").activations
    assert twice == 2 * on


# --------------------------------------------------------------------------------------------------
# Shapes


def test_preset_shapes_match_param_count():
    for name, preset in PRESETS.items():
        assert shape_from_model_arg(name).n_params == param_count(preset.config), name


@pytest.mark.parametrize("cfg", [
    PRESETS["tiny-llama"].config,
    {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "tie_word_embeddings": True},
], ids=["llama", "qwen2-bias-tied"])
def test_formula_matches_meta_device(cfg):
    from swiftlite.models.shape import _shape_from_meta
    formula, meta = shape_from_config(cfg), _shape_from_meta(cfg, "")
    for f in ("n_params", "n_linear_params", "n_layer_params", "n_layer_linear_params", "largest_module_params"):
        assert getattr(formula, f) == getattr(meta, f), f
    assert formula.lora_params(8) == meta.lora_params(8)


def test_unknown_architecture_uses_meta_device():
    cfg = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300, "n_positions": 128}
    shape = shape_from_config(cfg, "gpt2-tiny")
    model = _tiny_hf_model(cfg)
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert shape.layers == 2 and shape.hidden == 64
    assert shape.lora_params(8) == _peft_trainable(model, 8)  # GPT-2's Conv1D counts as linear


def test_shape_from_model_arg_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama-8b"].config))
    assert shape_from_model_arg(str(tmp_path)).n_params == param_count(PRESETS["llama-8b"].config)


@pytest.mark.parametrize("setup, arg, words", [
    (None, "no-such-model", ["--model no-such-model: unknown preset"]),
    ("empty", "{tmp}", ["no config.json"]),
    ("bad-json", "{tmp}", ["invalid JSON"]),
    ("no-type", "{tmp}", ["no model_type"]),
    ("weird-type", "{tmp}", ["not-a-real-arch"]),
])
def test_shape_from_model_arg_errors(tmp_path, setup, arg, words):
    if setup == "bad-json":
        (tmp_path / "config.json").write_text("{oops")
    elif setup == "no-type":
        (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    elif setup == "weird-type":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-real-arch"}))
    with pytest.raises(UserError) as e:
        shape_from_model_arg(arg.format(tmp=tmp_path))
    for word in words:
        assert word in str(e.value)


def test_workload_rejects_bad_combinations():
    with pytest.raises(UserError, match="--quant-bits"):
        Workload(train_type="full", quant_bits=4)
    with pytest.raises(UserError, match="--train-type"):
        Workload(train_type="dpo")
    with pytest.raises(UserError, match="--max-length"):
        Workload(max_length=0)


# --------------------------------------------------------------------------------------------------
# estimate CLI helpers and --parallelism auto


@pytest.mark.parametrize("text, expected", [
    ("80GB", 80 * 10**9), ("80gb", 80 * 10**9), ("24GiB", 24 * 2**30), ("80", 80 * 10**9),
    ("40 GB", 40 * 10**9), ("79.6GiB", int(79.6 * 2**30)), ("512MiB", 512 * 2**20), ("2TB", 2 * 10**12),
    (80, 80 * 10**9),
])
def test_parse_size(text, expected):
    from swiftlite.sizes import parse_size
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "80XB", "eighty", "-5GB", "0", "1e400GB", "80 G B"])
def test_parse_size_errors(text):
    from swiftlite.sizes import parse_size
    with pytest.raises(UserError) as e:
        parse_size(text, "--gpu-memory")
    assert "--gpu-memory" in str(e.value) and repr(text) in str(e.value)


def test_run_estimate_and_render():
    from rich.console import Console

    from swiftlite.planner.render import render, run_estimate
    d = run_estimate("llama-8b", train_type="lora", gpus=2, gpu_memory="24GB", gradient_checkpointing=True)
    assert d.backend in {"fsdp", "ddp"} and d.workload.world_size == 2
    buf = io.StringIO()
    render(d, Console(file=buf, width=80))
    out = buf.getvalue()
    assert "Recommendation" in out and "zero3_offload" in out and "comm/step" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    json.dumps(d.to_dict())  # plain data for --json


def test_run_estimate_errors():
    from swiftlite.planner.render import run_estimate
    with pytest.raises(UserError, match="--gpus"):
        run_estimate("tiny-llama", gpus=0)
    with pytest.raises(UserError, match="'lots'"):
        run_estimate("tiny-llama", gpu_memory="lots")


def test_resolve_auto():
    from swiftlite.config import build_config
    # max_length as the run settles it (job.resolve_run: the model's context) when the user gives none
    cfg = build_config({"model": "tiny-llama", "dataset": ["x.jsonl"], "max_length": 2048})
    assert resolve_auto(cfg, 1, None).backend == "single"
    cpu = resolve_auto(cfg, 2, None)
    assert cpu.backend == "fsdp" and "CPU" in cpu.reason
    assert resolve_auto(cfg, 1, 80 * GB).backend == "single"
    assert resolve_auto(cfg, 4, 80 * GB).backend == "ddp"
    big = build_config({"model": "llama-70b", "dataset": ["x.jsonl"], "torch_dtype": "bf16", "max_length": 131072})
    with pytest.raises(UserError, match="--parallelism auto"):
        resolve_auto(big, 1, 1 * GiB)
    # across nodes: hsdp on CPU; on GPU the topology comes from --nnodes / --nproc-per-node
    nodes = build_config({"model": "tiny-llama", "dataset": ["x.jsonl"], "nnodes": 2, "nproc_per_node": 2,
                          "max_length": 2048})
    assert resolve_auto(nodes, 4, None).backend == "hsdp"
    big_nodes = {"model": "llama-70b", "dataset": ["x.jsonl"], "torch_dtype": "bf16", "nnodes": 4,
                 "nproc_per_node": 8, "gradient_checkpointing": True, "max_length": 2048}
    full = resolve_auto(build_config({**big_nodes, "train_type": "full"}), 32, 80 * GB)
    assert full.backend == "zero3pp"  # as 70b-full-4x8x80-zero3pp
    # LoRA (the default): the frozen base over one node's 8 GPUs fits; only adapter grads cross nodes
    lora = resolve_auto(build_config(big_nodes), 32, 80 * GB)
    assert lora.backend == "hsdp" and lora.table["hsdp"].comm_inter_node_bytes < 10**9
    # --hsdp-shard-size reaches the estimate: 16 GPUs per shard group span two nodes
    wide = resolve_auto(build_config({**big_nodes, "hsdp_shard_size": 16}), 32, 80 * GB)
    assert wide.table["hsdp"].params < lora.table["hsdp"].params
    assert wide.table["hsdp"].comm_inter_node_bytes > lora.table["hsdp"].comm_inter_node_bytes


def test_auto_in_a_run_reads_the_gpu_memory(monkeypatch, capsys):
    """The trainer's `auto` passes the GPU's memory to the planner (CUDA faked here): 70B QLoRA on
    one 24 GB GPU cannot fit (a one-line error naming the need), on 80 GB it runs single; on CPU
    memory is not asked."""
    from types import SimpleNamespace

    import torch

    from swiftlite.config import build_config
    from swiftlite.train.run import resolve_run_here

    def resolve_backend(cfg, world):
        return resolve_run_here(cfg, world).choice
    cfg = build_config({"model": "llama-70b", "dataset": ["x.jsonl"], "train_type": "qlora",
                        "torch_dtype": "bf16", "parallelism": "auto", "max_length": 1024,
                        "gradient_checkpointing": True})
    world = SimpleNamespace(device="cuda:0", device_type="cuda",
                            distributed=False, world_size=1, local_world_size=1, is_main=True)
    memory = {"total": 80 * GB}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: SimpleNamespace(total_memory=memory["total"]))
    expected = resolve_auto(cfg, 1, 80 * GB, gpus_per_node=1)
    assert resolve_backend(cfg, world).name == expected.backend == "single"
    assert expected.reason in capsys.readouterr().out
    memory["total"] = 24 * GB
    with pytest.raises(UserError, match="--parallelism auto"):
        resolve_backend(cfg, world)
    cpu = SimpleNamespace(device="cpu", device_type="cpu",
                          distributed=False, world_size=2, local_world_size=2, is_main=True)
    assert resolve_backend(cfg, cpu).name == "fsdp"


# --------------------------------------------------------------------------------------------------
# The table's rows come from the backend registry


@pytest.fixture
def toy_backend():
    """A backend registered at run time, as a plugin would: ddp's memory family, listed by estimate."""
    from swiftlite.parallel.base import Backend, register_backend, unregister_backend
    rec = register_backend(Backend(name="toy_ddp", engine="ddp", factory=lambda *args: None,
                                   memory_family="ddp", estimate=True))
    try:
        yield rec
    finally:
        unregister_backend(rec.name)


def test_registered_backend_gets_a_row_with_its_family_numbers(toy_backend):
    from dataclasses import replace

    from rich.console import Console

    from swiftlite.planner import estimate_all
    from swiftlite.planner.render import render, run_estimate
    w = work(train_type="lora", world_size=2, gpu_memory_bytes=24 * GB)
    table = estimate_all(shape_from_model_arg("llama-8b"), w)
    assert "toy_ddp" in table
    assert table["toy_ddp"] == replace(table["ddp"], backend="toy_ddp")
    d = run_estimate("llama-8b", train_type="lora", gpus=2, gpu_memory="24GB")
    buf = io.StringIO()
    render(d, Console(file=buf, width=80))
    rows = {cells[0]: cells[1:] for cells in (line.lstrip("* ").split() for line in buf.getvalue().splitlines())
            if cells and cells[0] in d.table}
    assert rows["toy_ddp"] == rows["ddp"]


def test_registered_backend_is_gone_after_unregister():
    from swiftlite.planner import estimate_all
    assert "toy_ddp" not in estimate_all(TINY, work(world_size=2, gpu_memory_bytes=80 * GB))


def test_estimate_cli_flags(tmp_path, capsys):
    """--json, --lora/--qlora, --cpu-memory and --external-plugins, through the command line."""
    import sys

    from swiftlite.cli import main
    from swiftlite.parallel.base import unregister_backend
    assert main(["estimate", "--model", "llama-8b", "--qlora", "--gpus", "2", "--gpu-memory", "24",
                 "--cpu-memory", "256GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["train_type"] == "qlora" and out["workload"]["quant_bits"] == 4
    assert out["workload"]["gpu_memory_bytes"] == 24 * GB and out["workload"]["cpu_memory_bytes"] == 256 * 2**30
    assert out["backend"] in out["table"] and "ddp" in out["table"]

    assert main(["estimate", "--lora", "--qlora"]) == 2
    assert main(["estimate", "--lora", "--train-type", "full"]) == 2
    assert "pick one train type" in capsys.readouterr().err

    plugin = tmp_path / "toy_plugin.py"
    plugin.write_text("from swiftlite.parallel.base import Backend, register_backend\n"
                      "register_backend(Backend(name='toy_plugin', engine='ddp', factory=lambda *a: None,\n"
                      "                         memory_family='fsdp', shards=(True, True, True)))\n")
    try:
        assert main(["estimate", "--lora", "--gpus", "2", "--external-plugins", str(plugin)]) == 0
        text = capsys.readouterr().out
        assert "toy_plugin" in text and "Recommendation" in text
    finally:
        unregister_backend("toy_plugin")
        sys.modules.pop("swiftlite_plugin_toy_plugin", None)


# -- --sequence_parallel_size (Ulysses): a rank computes 1/N of every sequence ---------------------------

def test_sequence_parallel_counts_a_ranks_share_of_the_tokens():
    """Every per-token activation and the loss's logits count max_length / N tokens per rank; the
    states are the backend's as without (its ranks still shard them)."""
    from swiftlite.planner.activations import activation_bytes
    shape = shape_from_model_arg("llama-8b")          # 8 kv heads: N = 2, 4 or 8 repeats none
    long = work(train_type="lora", max_length=131072, world_size=8, sequence_parallel=8)
    short = work(train_type="lora", max_length=131072 // 8, world_size=8)
    assert activation_bytes(shape, long) == activation_bytes(shape, short)
    a, b = estimate(shape, long, "zero3"), estimate(shape, short, "zero3")
    assert (a.params, a.grads, a.optimizer, a.activations) == (b.params, b.grads, b.optimizer, b.activations)


def test_sequence_parallel_over_more_ranks_than_kv_heads_adds_their_copies():
    from swiftlite.planner.activations import activation_bytes
    shape = shape_from_model_arg("qwen2.5-7b")        # 4 kv heads of 128: N = 8 repeats k and v to the 28 heads
    w = work(train_type="lora", max_length=65536, world_size=8, sequence_parallel=8, gradient_checkpointing=False)
    plain = work(train_type="lora", max_length=65536 // 8, world_size=8, gradient_checkpointing=False)
    extra = 2 * (28 - 4) * 128 * 2 * (65536 // 8) * shape.layers   # k and v, 24 more heads, bf16, per token
    assert activation_bytes(shape, w) - activation_bytes(shape, plain) == extra


def test_sequence_parallel_must_divide_the_world():
    with pytest.raises(UserError, match="--sequence-parallel-size 3 does not divide a world of 8"):
        work(world_size=8, sequence_parallel=3)


def test_estimate_cli_takes_the_sequence_parallel_size():
    from swiftlite.planner.render import run_estimate
    alone = run_estimate("qwen2.5-7b", train_type="lora", gpus=8, max_length=131072)
    shared = run_estimate("qwen2.5-7b", train_type="lora", gpus=8, max_length=131072, sequence_parallel_size=8)
    assert alone.backend == "none" and shared.backend != "none"   # 128k tokens fit only split 8 ways
    with pytest.raises(UserError, match="--rlhf-type dpo"):
        run_estimate("qwen2.5-7b", gpus=8, rlhf_type="dpo", sequence_parallel_size=2)
    run_estimate("qwen2.5-7b", gpus=8, rlhf_type="grpo", sequence_parallel_size=2)
