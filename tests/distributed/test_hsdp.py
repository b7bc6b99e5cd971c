"""hsdp (FSDP2 on a (replicate, shard) mesh) on 4 CPU processes as 2 local nodes x 2, against one process.

The hsdp run is two torchrun "nodes" of 2 processes each on 127.0.0.1, so the shard size comes from
its default (LOCAL_WORLD_SIZE = 2): a (2, 2) mesh. fp32, tiny 2-layer Llama, global batch 4.
Also here: the FSDP2 knobs (partial resharding to 2 of 4 ranks, prefetch depth 2) on fsdp x 4, and
LoRA on hsdp, each against one process.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import cli_env, read_losses, read_state_bytes, run_cli

STEPS = 6
REL = 1e-4


def _base(train, out, *, train_type="full", hf_model=False):
    return ["sft", "--model", "tiny-llama-2l", "--train-type", train_type, "--dataset", train,
            "--torch-dtype", "fp32", "--learning-rate", "1e-3", "--max-steps", STEPS, "--logging-steps", 1,
            "--save-steps", 3, "--output-dir", out, "--seed", 7, "--save-hf-model", str(hf_model).lower()] + (
            ["--lora-dropout", 0] if train_type != "full" else [])  # dropout masks depend on the rank count


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(args: list) -> None:
    """The same command as node 0 and node 1 (2 processes each), rendezvous on 127.0.0.1."""
    port = _free_port()
    procs = []
    for node_rank in (0, 1):
        full = args + ["--nnodes", 2, "--node-rank", node_rank, "--nproc-per-node", 2,
                       "--master-addr", "127.0.0.1", "--master-port", port]
        procs.append(subprocess.Popen([sys.executable, "-m", "swiftlite", *map(str, full)], env=cli_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        time.sleep(0.5)  # node 0 first: it hosts the store
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]


@pytest.fixture(scope="module")
def runs(demo_data, tmp_path_factory):
    train, _ = demo_data
    root = tmp_path_factory.mktemp("hsdp")
    out = {name: root / name for name in ("single", "hsdp", "fsdp_knobs", "single_lora", "hsdp_lora")}
    run_cli(_base(train, out["single"], hf_model=True) + ["--parallelism", "single", "--per-device-train-batch-size", 4])
    _two_nodes(_base(train, out["hsdp"], hf_model=True) + ["--parallelism", "hsdp", "--per-device-train-batch-size", 1])
    run_cli(_base(train, out["fsdp_knobs"]) + ["--parallelism", "fsdp", "--nproc-per-node", 4,
                                               "--per-device-train-batch-size", 1, "--reshard-after-forward", 2,
                                               "--forward-prefetch", 2, "--backward-prefetch", 2])
    run_cli(_base(train, out["single_lora"], train_type="lora", hf_model=True) + ["--parallelism", "single",
                                                                   "--per-device-train-batch-size", 4])
    run_cli(_base(train, out["hsdp_lora"], train_type="lora", hf_model=True) + [
        "--parallelism", "hsdp", "--nproc-per-node", 4, "--hsdp-shard-size", 2, "--per-device-train-batch-size", 1])
    return out


def _assert_close(a: dict, b: dict, steps=range(1, STEPS + 1)):
    for s in steps:
        assert abs(a[s] - b[s]) <= REL * abs(b[s]), f"step {s}: {a[s]} vs {b[s]} (rel tol {REL})"


@pytest.mark.parametrize("name,ref", [("hsdp", "single"), ("fsdp_knobs", "single"), ("hsdp_lora", "single_lora")])
def test_losses_match_one_process(runs, name, ref):
    _assert_close(read_losses(runs[name]), read_losses(runs[ref]))
    assert read_losses(runs[ref])[STEPS] < read_losses(runs[ref])[1] - 0.1  # it trains


def test_each_rank_holds_half_of_the_state(runs):
    """A (2, 2) mesh: every parameter sharded over 2 ranks and replicated twice, so each of the 4
    ranks holds 1/2 of the parameters, gradients and AdamW state (1/4 would mean a flat 4-way shard,
    the whole would mean pure replication)."""
    full = read_state_bytes(runs["single"])[0]
    per_rank = read_state_bytes(runs["hsdp"])
    assert sorted(per_rank) == [0, 1, 2, 3]
    for rank, sb in per_rank.items():
        for key in ("params", "grads", "optimizer"):
            want = full[key] / 2
            assert full[key] > 0
            assert abs(sb[key] - want) <= 0.02 * want, (rank, key, sb[key], want)


@pytest.mark.parametrize("how", ["fsdp_2proc", "single"])
def test_checkpoint_resumes_on_another_world_size(runs, demo_data, tmp_path, how):
    """DCP reshards the hsdp checkpoint (4 ranks, (2, 2) mesh) onto fsdp x 2 and onto one process:
    steps 4-6 continue the hsdp run."""
    train, _ = demo_data
    out = tmp_path / how
    extra = (["--parallelism", "fsdp", "--nproc-per-node", 2, "--per-device-train-batch-size", 2] if how == "fsdp_2proc"
             else ["--parallelism", "single", "--per-device-train-batch-size", 4])
    run_cli(_base(train, out) + extra + ["--resume-from", runs["hsdp"] / "checkpoint-3"])
    resumed = read_losses(out)
    assert min(resumed) == 4, "the resumed run starts after the checkpoint"
    _assert_close(resumed, read_losses(runs["hsdp"]), steps=range(4, STEPS + 1))


def test_gathered_model_and_adapter_equal_the_one_process_ones(runs):
    """What hsdp gathers from the 2-D mesh at the end (the HF folder; LoRA: the peft adapter) holds
    the one-process run's weights (same training: equal within fp32 reordering)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    ids = torch.tensor([[257, 84, 82, 68, 81, 198, 81, 68, 85]])
    ref = AutoModelForCausalLM.from_pretrained(runs["single"] / f"checkpoint-{STEPS}" / "model")
    got = AutoModelForCausalLM.from_pretrained(runs["hsdp"] / f"checkpoint-{STEPS}" / "model")
    with torch.no_grad():
        a, b = got(ids).logits, ref(ids).logits
    assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), (a - b).abs().max()
    ref_ad = load_file(runs["single_lora"] / f"checkpoint-{STEPS}" / "adapter" / "adapter_model.safetensors")
    got_ad = load_file(runs["hsdp_lora"] / f"checkpoint-{STEPS}" / "adapter" / "adapter_model.safetensors")
    assert set(got_ad) == set(ref_ad) and ref_ad
    for k in ref_ad:
        assert got_ad[k].shape == ref_ad[k].shape, k
        assert torch.allclose(got_ad[k], ref_ad[k], atol=1e-4, rtol=1e-3), (k, (got_ad[k] - ref_ad[k]).abs().max())
