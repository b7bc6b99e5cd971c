"""The memory model counts DPO's frozen reference copy: the weights in the compute dtype, sharded like
the policy's parameters; nothing for LoRA (adapter off) or precomputed log-probs."""

from __future__ import annotations

from swiftlite.planner.memory import Workload, estimate, reference_bytes
from swiftlite.planner.shape import shape_from_model_arg


def test_reference_copy_bytes_per_backend():
    shape = shape_from_model_arg("tiny-llama")
    copy = Workload(train_type="full", dtype="bf16", world_size=2, reference="copy")
    whole = shape.n_params * 2
    assert reference_bytes(shape, copy, "ddp") == whole
    assert reference_bytes(shape, copy, "zero2") == whole            # ZeRO-2 shards optimizer state only
    for b in ("fsdp", "fsdp1", "zero3"):
        assert reference_bytes(shape, copy, b) == -(-whole // 2)
    none = Workload(train_type="full", dtype="bf16", world_size=2)
    for b in ("ddp", "fsdp", "zero3"):
        with_ref, without = estimate(shape, copy, b), estimate(shape, none, b)
        assert with_ref.total - without.total == with_ref.reference == reference_bytes(shape, copy, b)
    hsdp = Workload(train_type="full", dtype="bf16", world_size=4, gpus_per_node=2, reference="copy")
    assert reference_bytes(shape, hsdp, "hsdp") == -(-whole // 2)    # sharded within a node's group of 2
    lora = Workload(train_type="lora", dtype="bf16", world_size=2)
    assert reference_bytes(shape, lora, "fsdp") == 0


def test_workload_from_an_rlhf_config():
    from swiftlite.config import build_config
    from swiftlite.planner.recommend import workload_from_config
    # max_length as the run settles it (job.resolve_run: the model's context) when the user gives none
    base = {"model": "tiny-llama", "dataset": ["x.jsonl"], "per_device_train_batch_size": 3, "max_length": 2048}
    full = workload_from_config(build_config({**base, "train_type": "full"}, task="rlhf"), 2, None)
    assert full.reference == "copy" and full.micro_batch == 6 and full.loss_impl == "plain"
    pre = build_config({**base, "train_type": "full", "precompute_ref_log_probs": True}, task="rlhf")
    assert workload_from_config(pre, 2, None).reference == "none"
    assert workload_from_config(build_config({**base, "train_type": "lora"}, task="rlhf"), 2, None).reference == "none"
    kto = build_config({**base, "train_type": "full", "rlhf_type": "kto"}, task="rlhf")
    assert workload_from_config(kto, 2, None).reference == "copy"     # KTO holds DPO's reference
    kto_lora = build_config({**base, "train_type": "lora", "rlhf_type": "kto"}, task="rlhf")
    assert workload_from_config(kto_lora, 2, None).reference == "none"  # the adapter disabled
    for no_ref in ("cpo", "rm"):
        c = build_config({**base, "train_type": "full", "rlhf_type": no_ref}, task="rlhf")
        assert workload_from_config(c, 2, None).reference == "none"
    sft = workload_from_config(build_config({**base, "train_type": "full"}, task="sft"), 2, None)
    assert sft.reference == "none" and sft.micro_batch == 3
