"""hsdp (FSDP2 on a (replicate, shard) mesh) on 4 CPU processes as 2 local nodes x 2, against one process.

The hsdp run is two torchrun "nodes" of 2 processes each on 127.0.0.1, so the shard size comes from
its default (LOCAL_WORLD_SIZE = 2): a (2, 2) mesh. fp32, tiny 2-layer Llama, global batch 4.
Also here: LoRA on hsdp against one process, and the FSDP2 knobs (partial resharding to 2 of 4
ranks, prefetch depth 2) applied by apply_fsdp2 on 4 forked ranks against the unsharded model.
"""

from __future__ import annotations

import socket
import time

import pytest

from tests.conftest import read_losses, read_state_bytes, run_cli, spawn_cli

STEPS = 6
REL = 1e-4


def _base(train, out, *, train_type="full", hf_model=False):
    return ["sft", "--model", "tiny-llama-2l", "--train-type", train_type, "--dataset", train,
            "--torch-dtype", "fp32", "--learning-rate", "1e-3", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", STEPS, "--logging-steps", 1,
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
        procs.append(spawn_cli(full, merge_stderr=True))
        time.sleep(0.5)  # node 0 first: it hosts the store
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]


@pytest.fixture(scope="module")
def runs(demo_data, tmp_path_factory):
    train, _ = demo_data
    root = tmp_path_factory.mktemp("hsdp")
    out = {name: root / name for name in ("single", "hsdp", "single_lora", "hsdp_lora")}
    run_cli(_base(train, out["single"], hf_model=True) + ["--parallelism", "single", "--per-device-train-batch-size", 4])
    _two_nodes(_base(train, out["hsdp"], hf_model=True) + ["--parallelism", "hsdp", "--per-device-train-batch-size", 1])
    run_cli(_base(train, out["single_lora"], train_type="lora", hf_model=True) + ["--parallelism", "single",
                                                                   "--per-device-train-batch-size", 4])
    run_cli(_base(train, out["hsdp_lora"], train_type="lora", hf_model=True) + [
        "--parallelism", "hsdp", "--nproc-per-node", 4, "--hsdp-shard-size", 2, "--per-device-train-batch-size", 1])
    return out


def _assert_close(a: dict, b: dict, steps=range(1, STEPS + 1)):
    for s in steps:
        assert abs(a[s] - b[s]) <= REL * abs(b[s]), f"step {s}: {a[s]} vs {b[s]} (rel tol {REL})"


@pytest.mark.parametrize("name,ref", [("hsdp", "single"), ("hsdp_lora", "single_lora")])
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


def _knobs_rank(rank: int, world: int, port: int, queue) -> None:
    """One of 4 forked ranks: the same tiny Llama on every rank, sharded by apply_fsdp2 with
    reshard_after_forward=2 and prefetch depth 2; reports the mesh a layer's weight sits on after
    forward and after backward, and the largest gap between its gradients and the unsharded model's."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from swiftlite.parallel.fsdp2 import apply_fsdp2
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        ref = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                           num_attention_heads=2, num_key_value_heads=2))
        model = copy.deepcopy(ref)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))   # the same batch everywhere
        ref(input_ids=ids, labels=ids).loss.backward()
        apply_fsdp2(model, init_device_mesh("cpu", (world,)), mp=None, reshard_after_forward=2, cpu_offload=False,
                    forward_prefetch=2, backward_prefetch=2)
        loss = model(input_ids=ids, labels=ids).loss
        w = model.model.layers[0].mlp.up_proj.weight
        after_forward = (tuple(w.device_mesh.shape), tuple(w.to_local().shape))
        loss.backward()
        w = model.model.layers[0].mlp.up_proj.weight
        after_backward = (tuple(w.device_mesh.shape), tuple(w.to_local().shape))
        gap = max(float((p.grad.full_tensor() - r.grad).abs().max())
                  for p, r in zip(model.parameters(), ref.parameters()))
        queue.put((rank, after_forward, after_backward, gap))
    finally:
        dist.destroy_process_group()


def test_partial_reshard_and_prefetch_keep_the_gradients(tmp_path):
    """--reshard-after-forward 2 on 4 ranks: after forward a layer's weight is held on a (2, 2) mesh
    (sharded over 2 ranks: half of its rows, where a full reshard keeps a quarter), after backward on
    the 4-rank mesh again; the gradients equal the unsharded model's (fp32, within 1e-6)."""
    import torch.multiprocessing as mp
    import transformers  # noqa: F401 - imported once here, not in each forked rank

    from swiftlite.distributed import free_port
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(_knobs_rank, args=(4, free_port(), queue), nprocs=4, start_method="fork", join=False)
    deadline = time.time() + 240
    while not procs.join(timeout=max(1.0, deadline - time.time())):
        assert time.time() < deadline, "forked ranks did not finish"
    results = sorted(queue.get() for _ in range(4))
    for rank, after_forward, after_backward, gap in results:
        assert after_forward == ((2, 2), (16, 16)), (rank, after_forward)   # up_proj weight is 32 x 16
        assert after_backward == ((4,), (8, 16)), (rank, after_backward)
        assert gap <= 1e-6, (rank, gap)
