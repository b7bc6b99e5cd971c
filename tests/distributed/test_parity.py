"""Torch backends on 2 CPU processes (gloo) against one process: same losses, real sharding, exact resume.

Every run trains the tiny 2-layer Llama for 10 steps on the same global batch of 4 samples
(1 process x 4, 1 process x 2 x accumulation 2, 2 processes x 2), fp32, through the real CLI.
"""

from __future__ import annotations

import json
import shutil
import socket
import time

import pytest

from tests.conftest import ROOT, read_losses, read_state_bytes, run_cli, spawn_cli

STEPS = 10
REL_FP32 = 1e-4
REL_BF16 = 2e-2


def _base(train, out):
    return ["sft", "--model", "tiny-llama-2l", "--train-type", "full", "--dataset", train, "--torch-dtype", "fp32",
            "--learning-rate", "1e-3", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", STEPS, "--logging-steps", 1, "--save-steps", 5,
            "--output-dir", out, "--seed", 7]


@pytest.fixture(scope="module")
def runs(demo_data, tmp_path_factory):
    """Train each configuration once; tests compare their logs."""
    train, _val = demo_data
    root = tmp_path_factory.mktemp("parity")
    # ZeRO-3 with every parameter partitioned: tiny models would otherwise keep small params whole
    # and hide gather bugs (docs/design.md trap 7).
    zero3 = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    zero3["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    zero3_json = root / "zero3_all_partitioned.json"
    zero3_json.write_text(json.dumps(zero3))
    configs = {
        "single_b4": ["--parallelism", "single", "--per-device-train-batch-size", 4],
        "single_b2_ga2": ["--parallelism", "single", "--per-device-train-batch-size", 2,
                          "--gradient-accumulation-steps", 2],
        "ddp": ["--parallelism", "ddp", "--nproc-per-node", 2, "--per-device-train-batch-size", 2],
        "fsdp": ["--parallelism", "fsdp", "--nproc-per-node", 2, "--per-device-train-batch-size", 2],
        "fsdp_b1_ga2": ["--parallelism", "fsdp", "--nproc-per-node", 2, "--per-device-train-batch-size", 1,
                        "--gradient-accumulation-steps", 2],
        "fsdp1": ["--parallelism", "fsdp1", "--nproc-per-node", 2, "--per-device-train-batch-size", 2],
        "zero2": ["--parallelism", "zero2", "--nproc-per-node", 2, "--per-device-train-batch-size", 2],
        # ms-swift's zero0/zero1 presets (opsd.sh, reinforce_plus_plus.sh): stage 0 keeps DeepSpeed's clipped
        # fp32 norm (parallel/deepspeed.py _keep_fp32_norm), without which the first step's norm is nan
        "zero0": ["--deepspeed", "zero0", "--nproc-per-node", 2, "--per-device-train-batch-size", 2],
        "zero1": ["--deepspeed", "zero1", "--nproc-per-node", 2, "--per-device-train-batch-size", 2],
        "zero3": ["--parallelism", str(zero3_json), "--nproc-per-node", 2, "--per-device-train-batch-size", 2],
        "ddp_lora": ["--parallelism", "ddp", "--nproc-per-node", 2, "--per-device-train-batch-size", 2, "--lora"],
        "fsdp_qlora": ["--parallelism", "fsdp", "--nproc-per-node", 2, "--per-device-train-batch-size", 2,
                       "--qlora"],
        "fsdp_bf16": ["--parallelism", "fsdp", "--nproc-per-node", 2, "--per-device-train-batch-size", 2,
                      "--mixed-precision", "bf16"],
    }
    out = {}
    for name, extra in configs.items():
        d = root / name
        run_cli(_base(train, d) + extra, timeout=300)
        out[name] = d
    return out


def _assert_close(a: dict, b: dict, rel: float, steps=range(1, STEPS + 1)):
    for s in steps:
        assert abs(a[s] - b[s]) <= rel * abs(b[s]), f"step {s}: {a[s]} vs {b[s]} (rel tol {rel})"


def test_loss_falls(runs):
    losses = read_losses(runs["single_b4"])
    assert losses[STEPS] < losses[1] - 0.5, losses


@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp1", "fsdp_b1_ga2", "zero0", "zero1", "zero2", "zero3"])
def test_two_process_losses_equal_single_process(runs, name):
    _assert_close(read_losses(runs[name]), read_losses(runs["single_b4"]), REL_FP32)


def test_accumulation_equals_bigger_micro_batch(runs):
    _assert_close(read_losses(runs["single_b2_ga2"]), read_losses(runs["single_b4"]), REL_FP32)


def test_bf16_mixed_precision_close_to_fp32(runs):
    _assert_close(read_losses(runs["fsdp_bf16"]), read_losses(runs["single_b4"]), REL_BF16)


@pytest.mark.parametrize("name", ["fsdp", "fsdp1", "zero3"])
def test_sharded_backends_hold_half_the_state(runs, name):
    full = read_state_bytes(runs["single_b4"])[0]
    per_rank = read_state_bytes(runs[name])
    assert sorted(per_rank) == [0, 1]
    expected = {k: full[k] / 2 for k in ("params", "grads", "optimizer")}
    if name == "zero3":
        # DeepSpeed's optimizer also keeps an fp32 master partition of the parameters (1/N of them)
        expected["optimizer"] = (full["optimizer"] + full["params"]) / 2
    for rank, sb in per_rank.items():
        for key, want in expected.items():
            assert full[key] > 0
            assert abs(sb[key] - want) <= 0.02 * want, (name, rank, key, sb[key], want)


def test_ddp_holds_a_full_replica(runs):
    full = read_state_bytes(runs["single_b4"])[0]
    for rank, sb in read_state_bytes(runs["ddp"]).items():
        assert sb == full, (rank, sb, full)


@pytest.mark.parametrize("name", ["fsdp", "ddp", "fsdp1", "zero2", "zero3"])
def test_resume_from_checkpoint_is_bitwise_exact(runs, demo_data, tmp_path, name):
    train, _ = demo_data
    src = runs[name]
    out = tmp_path / "resumed"
    par = json.loads((src / "args.json").read_text())["parallel"]["parallelism"]
    extra = ["--parallelism", par]
    run_cli(_base(train, out) + extra + ["--nproc-per-node", 2, "--per-device-train-batch-size", 2,
                                         "--resume-from", src / "checkpoint-5"], timeout=300)
    resumed, ref = read_losses(out), read_losses(src)
    assert min(resumed) == 6, "the resumed run must start after the checkpoint"
    for s in range(6, STEPS + 1):
        assert resumed[s] == ref[s], f"step {s}: {resumed[s]!r} != {ref[s]!r}"


def test_fsdp_checkpoint_resumes_on_another_world_size(runs, demo_data, tmp_path):
    """DCP reshards: a 2-process FSDP2 checkpoint continues on 1 process with the same losses."""
    train, _ = demo_data
    out = tmp_path / "one_proc"
    run_cli(_base(train, out) + ["--parallelism", "fsdp", "--per-device-train-batch-size", 4,
                                 "--resume-from", runs["fsdp"] / "checkpoint-5"], timeout=300)
    _assert_close(read_losses(out), read_losses(runs["fsdp"]), REL_FP32, steps=range(6, STEPS + 1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_one_machine_match_single_node(runs, demo_data, tmp_path):
    """Two torchrun 'nodes' (one process each) rendezvous on 127.0.0.1 and train together."""
    train, _ = demo_data
    port = _free_port()
    out = tmp_path / "multinode"
    procs = []
    for node_rank in (0, 1):
        args = _base(train, out) + ["--parallelism", "fsdp", "--per-device-train-batch-size", 2,
                                    "--nnodes", 2, "--node-rank", node_rank, "--nproc-per-node", 1,
                                    "--master-addr", "127.0.0.1", "--master-port", port]
        procs.append(spawn_cli(args, merge_stderr=True))
        time.sleep(0.5)  # node 0 first: it checks the port is free, then hosts the store
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]
    _assert_close(read_losses(out), read_losses(runs["fsdp"]), REL_FP32)
    shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("name", ["zero2", "zero3", "fsdp", "fsdp1", "ddp"])
def test_saved_model_reloads_with_the_trained_weights(runs, name):
    """The HF folder each backend gathers at the end reloads with from_pretrained and gives the
    single-process model's logits (same training, so the same weights within fp32 reordering)."""
    import torch
    from transformers import AutoModelForCausalLM
    ids = torch.tensor([[257, 84, 82, 68, 81, 198, 81, 68, 85]])
    ref = AutoModelForCausalLM.from_pretrained(runs["single_b4"] / f"checkpoint-{STEPS}" / "model")
    got = AutoModelForCausalLM.from_pretrained(runs[name] / f"checkpoint-{STEPS}" / "model")
    assert set(got.state_dict()) == set(ref.state_dict())
    with torch.no_grad():
        a, b = got(ids).logits, ref(ids).logits
    assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), (a - b).abs().max()


@pytest.mark.parametrize("name,backend,train_type", [
    ("ddp", "ddp", "full"), ("fsdp", "fsdp", "full"), ("fsdp1", "fsdp1", "full"), ("zero2", "zero2", "full"),
    ("zero3", "zero3", "full"), ("ddp_lora", "ddp", "lora"), ("fsdp_qlora", "fsdp", "qlora")])
def test_memory_model_predicts_state_bytes_per_rank(runs, name, backend, train_type):
    """swiftlite estimate's model-state bytes per rank, from the config alone, against the bytes
    counted from the real tensors of each rank (within 5%)."""
    from swiftlite.planner import Workload, model_state_bytes, shape_from_model_arg
    shape = shape_from_model_arg("tiny-llama-2l")
    w = Workload(train_type=train_type, dtype="fp32", world_size=2, quant_bits=4 if train_type == "qlora" else None,
                 overhead_bytes=0)
    predicted = model_state_bytes(shape, w, backend)
    for rank, measured in read_state_bytes(runs[name]).items():
        for key in ("params", "grads", "optimizer"):
            assert abs(predicted[key] - measured[key]) <= 0.05 * measured[key], (rank, key, predicted, measured)


def test_zero3_loads_a_model_folder_partitioned(runs, demo_data, tmp_path):
    """A real checkpoint under ZeRO-3 is loaded inside zero.Init: training starts from its weights
    and each rank holds half of the parameters."""
    train, _ = demo_data
    out = tmp_path / "zero3_folder"
    folder = runs["single_b4"] / f"checkpoint-{STEPS}" / "model"
    run_cli(["sft", "--model", folder, "--train-type", "full", "--dataset", train, "--torch-dtype", "fp32",
             "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", 1,
             "--logging-steps", 1, "--output-dir", out, "--parallelism", "zero3", "--nproc-per-node", 2,
             "--per-device-train-batch-size", 2, "--save-hf-model", "false"], timeout=300)
    assert read_losses(out)[1] < read_losses(runs["single_b4"])[1] - 0.5, "starts from the trained weights"
    full = read_state_bytes(runs["single_b4"])[0]["params"]
    for sb in read_state_bytes(out).values():
        assert abs(sb["params"] - full / 2) <= 0.02 * full / 2
