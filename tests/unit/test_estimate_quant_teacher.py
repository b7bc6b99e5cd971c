"""`swiftlite estimate --quant-method hqq` and `--teacher-model` (GRPO): the same byte counts the run's
planner uses (planner/states.quantized_bytes for HQQ, the teacher with the reference copy), and the
one-line refusals."""

from __future__ import annotations

import pytest

from swiftlite.errors import UserError
from swiftlite.planner.render import run_estimate
from swiftlite.planner.shape import shape_from_model_arg


def _row(decision, name):
    return decision.table[name]


def test_hqq_base_bytes_follow_the_bits_and_the_sharding_rows_are_not_available():
    kw = dict(model="qwen2.5-7b", train_type="lora", gpus=2, gpu_memory="80GB")
    bnb4 = run_estimate(quant_bits=4, **kw)
    hqq4 = run_estimate(quant_bits=4, quant_method="hqq", **kw)
    hqq2 = run_estimate(quant_bits=2, quant_method="hqq", **kw)
    assert hqq2.table["ddp"].peak < hqq4.table["ddp"].peak
    # the same 4 bits: HQQ's scale and zero point per 64 weights in bf16 against bitsandbytes' constants
    assert hqq4.table["ddp"].peak != bnb4.table["ddp"].peak
    assert hqq4.backend in ("ddp", "zero2", "single") and "fsdp" in bnb4.table
    assert hqq4.table.get("fsdp") is None or not hqq4.table["fsdp"].fits
    with pytest.raises(UserError, match=r"--quant-method hqq needs --quant-bits"):
        run_estimate(quant_method="hqq", **kw)
    with pytest.raises(UserError, match=r"--quant-method 'gptq': choose bnb or hqq"):
        run_estimate(quant_method="gptq", quant_bits=4, **kw)


def test_a_grpo_teacher_is_counted_with_the_reference():
    kw = dict(model="qwen2.5-0.5b", train_type="lora", gpus=1, gpu_memory="80GB", rlhf_type="grpo", beta=0.0)
    alone = run_estimate(**kw)
    taught = run_estimate(teacher_model="qwen2.5-7b", **kw)
    teacher = shape_from_model_arg("qwen2.5-7b").n_params * 2          # bf16
    assert taught.table["single"].reference - alone.table["single"].reference == teacher
    with pytest.raises(UserError, match=r"--teacher-model needs --rlhf-type grpo"):
        run_estimate(teacher_model="qwen2.5-7b", model="qwen2.5-0.5b")
