"""The planner across nodes: hsdp / zero3pp memory and the intra- / inter-node bytes per link
(swiftlite/planner/topology.py, the formulas of its docstring and docs/backends.md "Across nodes")."""

from __future__ import annotations

import json

import pytest

from swiftlite.planner import Workload, estimate, model_state_bytes, shape_from_model_arg
from swiftlite.planner import comm_per_link
from swiftlite.planner.topology import group_crosses

TINY = shape_from_model_arg("tiny-llama")
PSI = TINY.n_params
GB = 10**9


def work(**kw) -> Workload:
    defaults = dict(train_type="full", dtype="bf16", gradient_checkpointing=True, max_length=512)
    defaults.update(kw)
    return Workload(**defaults)


def test_hsdp_states_are_fsdps_over_one_shard_group():
    # 2 nodes x 4: one copy of the states over 4 GPUs, as fsdp on 4
    across = model_state_bytes(TINY, work(world_size=8, gpus_per_node=4), "hsdp")
    assert across == model_state_bytes(TINY, work(world_size=4), "fsdp")
    assert across["optimizer"] == 8 * PSI // 4  # fp32 m + v of the master weights, a quarter each
    # --hsdp-shard-size 8 on 2 x 4: the shard group spans both nodes, the states are fsdp's over 8
    wide = model_state_bytes(TINY, work(world_size=8, gpus_per_node=4, hsdp_shard_size=8), "hsdp")
    assert wide == model_state_bytes(TINY, work(world_size=8), "fsdp")
    # a shard size that does not divide the world: the row is unavailable, with the flag named
    bad = estimate(TINY, work(world_size=8, gpus_per_node=4, hsdp_shard_size=3), "hsdp")
    assert not bad.available and "--hsdp-shard-size 3" in bad.note


def test_zero3pp_adds_hpz_secondary_partition():
    w = work(world_size=8, gpus_per_node=4)
    z3, pp = model_state_bytes(TINY, w, "zero3"), model_state_bytes(TINY, w, "zero3pp")
    # the 16-bit weights again, sharded over one node's 4 ranks (DeepSpeed's zero_hpz_partition_size)
    assert pp["params"] - z3["params"] == -(-2 * PSI // 4)
    assert (pp["grads"], pp["optimizer"]) == (z3["grads"], z3["optimizer"])
    # on one node there is no secondary partition: zero3pp is zero3
    one = work(world_size=4)
    assert model_state_bytes(TINY, one, "zero3pp") == model_state_bytes(TINY, one, "zero3")
    assert estimate(TINY, w, "zero3pp").temp_buffers == estimate(TINY, w, "zero3").temp_buffers


@pytest.mark.parametrize("dtype, e, g", [("fp32", 4, 4), ("bf16", 2, 4)])
def test_bytes_per_link_2x2(dtype, e, g):
    """2 nodes x 2 ranks. e: bytes gathered per param, g: gradient bytes reduced per param (FSDP
    reduces in fp32 under master weights; DeepSpeed in the 16-bit dtype)."""
    w = work(world_size=4, gpus_per_node=2, dtype=dtype)
    fsdp, hsdp = comm_per_link(TINY, w, "fsdp"), comm_per_link(TINY, w, "hsdp")
    zero3, zero3pp = comm_per_link(TINY, w, "zero3"), comm_per_link(TINY, w, "zero3pp")
    # fsdp: every collective over the 4 ranks of both nodes: 3/4 (2 gathers + 1 reduce-scatter)
    assert (fsdp.intra, fsdp.inter) == (0, int(0.75 * (2 * e + g) * PSI))
    # hsdp: gathers and reduce-scatter within the node (1/2 each), all-reduce of the half-shard across
    assert hsdp.intra == int(0.5 * (2 * e + g) * PSI)
    assert hsdp.inter == int(2 * 0.5 * g * PSI / 2)
    # zero3: 3/4 x 3 x 16-bit; zero3pp: the forward gather and the reduce-scatter over 4, the
    # backward gather from the node's secondary partition over 2
    assert (zero3.intra, zero3.inter) == (0, int(0.75 * 3 * e * PSI))
    assert zero3pp.inter == int(0.75 * 2 * e * PSI) and zero3pp.intra == int(0.5 * e * PSI)
    assert hsdp.inter < fsdp.inter and zero3pp.inter < zero3.inter


def test_one_node_is_all_intra_and_hsdp_is_fsdp():
    w = work(world_size=8)
    for backend in ("ddp", "fsdp", "hsdp", "zero2", "zero3", "zero3pp"):
        links = comm_per_link(TINY, w, backend)
        assert links.inter == 0 and links.intra > 0, backend
    assert comm_per_link(TINY, w, "hsdp") == comm_per_link(TINY, w, "fsdp")
    assert comm_per_link(TINY, w, "zero3pp") == comm_per_link(TINY, w, "zero3")
    assert comm_per_link(TINY, work(world_size=1), "single").total == 0


def test_lora_across_nodes_sends_only_adapter_grads():
    w = work(world_size=16, gpus_per_node=8, train_type="lora")
    hsdp = comm_per_link(TINY, w, "hsdp")
    adapters = TINY.lora_params(8, ("all-linear",))
    assert hsdp.inter == int(2 * 0.5 * 4 * adapters / 8)  # fp32 adapter grads, 1/8 each, 2 replicas


def test_group_crosses():
    assert not group_crosses([0, 1], 2) and group_crosses([1, 2], 2) and group_crosses([0, 2], 2)
    assert not group_crosses([4, 5, 6, 7], 4)


def test_estimate_across_nodes_lists_hsdp_and_zero3pp(capsys):
    """Acceptance: `estimate --gpus-per-node 8 --nnodes 4 --model llama-70b --train-type full`."""
    from swiftlite.cli import main
    args = ["estimate", "--gpus-per-node", "8", "--nnodes", "4", "--model", "llama-70b", "--train-type", "full"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "intra" in text and "inter" in text
    rows = {line.replace("*", " ").split()[0] for line in text.splitlines() if line.strip()}
    assert rows >= {"hsdp", "zero3pp", "fsdp", "zero3"}
    assert main(args + ["--json"]) == 0
    table = json.loads(capsys.readouterr().out)["table"]
    for name in ("hsdp", "zero3pp", "fsdp", "zero3"):
        est = table[name]
        assert est["comm_intra_node_bytes"] + est["comm_inter_node_bytes"] == est["comm_bytes_per_step"]
    assert table["hsdp"]["comm_inter_node_bytes"] < table["fsdp"]["comm_inter_node_bytes"] / 8
    assert table["zero3pp"]["comm_inter_node_bytes"] < table["zero3"]["comm_inter_node_bytes"]
    assert table["zero3pp"]["comm_intra_node_bytes"] > 0 and table["zero3"]["comm_intra_node_bytes"] == 0
    assert main(args + ["--hsdp-shard-size", "5"]) == 2
    assert "--hsdp-shard-size 5" in capsys.readouterr().err
