"""The planner's GRPO terms: the generation KV cache (2 x layers x kv_heads x head_dim x (prompt +
completion) x completions per micro-batch x dtype bytes), the weights a sharded backend gathers for
the round, and `swiftlite estimate --rlhf-type grpo` (completions as the batch, the reference copy
unless --beta 0)."""

from __future__ import annotations

import pytest

from swiftlite.errors import UserError
from swiftlite.planner.memory import Workload, estimate, generation_bytes, kv_cache_bytes
from swiftlite.planner.render import run_estimate
from swiftlite.planner.shape import shape_from_model_arg

QWEN = shape_from_model_arg("qwen2.5-7b")     # 28 layers, 4 KV heads of 128


def _w(**kw):
    base = dict(train_type="full", dtype="bf16", max_length=1536, micro_batch=8, world_size=8,
                generation_length=1536, gpu_memory_bytes=80 * 10**9)
    return Workload(**{**base, **kw})


def test_kv_cache_is_the_formula():
    assert (QWEN.layers, QWEN.kv_heads, QWEN.head_dim) == (28, 4, 128)
    assert kv_cache_bytes(QWEN, _w()) == 2 * 28 * 4 * 128 * 1536 * 8 * 2          # 0.66 GiB
    assert kv_cache_bytes(QWEN, _w(dtype="fp32")) == 2 * 28 * 4 * 128 * 1536 * 8 * 4
    assert kv_cache_bytes(QWEN, _w(generation_length=0)) == 0                       # not GRPO: no term


def test_generation_round_per_backend():
    w = _w()
    kv = kv_cache_bytes(QWEN, w)
    assert generation_bytes(QWEN, w, "ddp") == kv == generation_bytes(QWEN, w, "zero2")   # whole weights already
    assert generation_bytes(QWEN, w, "fsdp") == kv + QWEN.n_params * 2 == generation_bytes(QWEN, w, "zero3")
    one_unit = QWEN.n_nonlayer_params + QWEN.n_layer_params                          # fsdp1: root + a layer
    assert generation_bytes(QWEN, w, "fsdp1") == pytest.approx(kv + one_unit * 2, abs=2)
    q = _w(train_type="qlora")                                                      # gathered 4-bit
    assert kv < generation_bytes(QWEN, q, "fsdp") - kv < QWEN.n_params * 2 // 2


def test_the_round_is_a_phase_of_the_total():
    lean = _w(generation_length=0)
    for backend in ("ddp", "fsdp", "zero3"):
        plain, grpo = estimate(QWEN, lean, backend), estimate(QWEN, _w(), backend)
        assert grpo.generation == generation_bytes(QWEN, _w(), backend)
        others = plain.total - (plain.params + plain.grads + plain.optimizer + plain.reference + plain.overhead)
        assert grpo.total - plain.total == max(0, grpo.generation - others)


def test_estimate_accepts_grpo():
    d = run_estimate("qwen2.5-7b", gpus=8, max_length=1024, micro_batch=8, rlhf_type="grpo",
                     max_completion_length=512)
    assert d.workload.generation_length == 1536 and d.workload.micro_batch == 8    # completions, not pairs
    est = d.table["fsdp"]
    assert est.reference > 0 and est.generation == generation_bytes(QWEN, d.workload, "fsdp")
    assert run_estimate("qwen2.5-7b", gpus=8, rlhf_type="grpo", beta=0.0).table["fsdp"].reference == 0
    assert run_estimate("qwen2.5-7b", gpus=8, rlhf_type="dpo").table["fsdp"].generation == 0
    with pytest.raises(UserError, match="--max-completion-length"):
        run_estimate("qwen2.5-7b", rlhf_type="grpo", max_completion_length=0)
