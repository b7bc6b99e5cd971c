"""The planner's GKD workload (planner/recommend.workload, planner/render.run_estimate): the teacher's weights,
the generation round of on-policy steps, and both models' logits with the divergence's tensors
(activations.GKD_LOGIT_BYTES per token x vocab entry instead of plain logits' LOGIT_BYTES)."""

from __future__ import annotations

import dataclasses

from swiftlite.planner.activations import GKD_LOGIT_BYTES, LOGIT_BYTES, logit_bytes
from swiftlite.planner.memory import Workload
from swiftlite.planner.render import run_estimate
from swiftlite.models.source import resolve_model


def test_gkd_logits_are_counted_at_their_own_bytes():
    shape = resolve_model("qwen2.5-0.5b").shape()
    w = Workload(train_type="full", dtype="bf16", max_length=1024, micro_batch=2, loss_impl="plain")
    g = dataclasses.replace(w, plain_logit_bytes=GKD_LOGIT_BYTES)
    assert logit_bytes(shape, w) == 2 * 1024 * shape.vocab * LOGIT_BYTES
    assert logit_bytes(shape, g) == 2 * 1024 * shape.vocab * GKD_LOGIT_BYTES


def test_estimate_counts_the_teacher_generation_and_logits():
    common = dict(model="qwen2.5-0.5b", gpus=2, max_length=1024, max_completion_length=256, parallelism="fsdp")
    gkd = run_estimate(rlhf_type="gkd", teacher_model="qwen2.5-7b", **common)
    alone = run_estimate(rlhf_type="gkd", **common)
    est, est_alone = gkd.table["fsdp"], alone.table["fsdp"]
    teacher = resolve_model("qwen2.5-7b").shape().n_params * 2 // 2      # bf16, sharded over 2 GPUs
    assert abs((est.total - est_alone.total) - teacher) < 0.01 * teacher
    assert est.generation > 0          # on-policy steps generate (max_length + completion tokens)
    # one micro-batch of 1280 tokens: the GKD logits term over plain logits' at this vocabulary
    shape = resolve_model("qwen2.5-0.5b").shape()
    assert est_alone.activations >= 1280 * shape.vocab * GKD_LOGIT_BYTES
