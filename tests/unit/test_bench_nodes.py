"""`swiftlite bench --nnodes`: per-group byte counting (bench/groups.py), the local-node command lines
(bench/nodes.py) and the flags, without a training run (tests/distributed/test_topology_bytes.py runs one)."""

from __future__ import annotations

import json

import pytest

from swiftlite import bench
from swiftlite.bench.groups import link_bytes, rank_link_bytes
from swiftlite.bench.nodes import node_commands, node_log
from swiftlite.errors import UserError

# 2 nodes x 2 ranks, seen from rank 0: the world, its replica group (0, 2) and its node group (0, 1)
GROUPS = {"0": [0, 1, 2, 3], "1": [0, 2], "3": [0, 1]}


def _entry(rid, name, pg, ins, outs, dtype="Float"):
    return {"record_id": rid, "profiling_name": f"gloo:{name}", "process_group": [pg[0], pg[1]],
            "input_sizes": ins, "output_sizes": outs, "input_dtypes": [dtype] * len(ins),
            "output_dtypes": [dtype] * len(outs), "is_p2p": False}


ENTRIES = [
    _entry(0, "all_gather", ("3", "mesh_shard"), [[4]], [[2, 4]]),          # 8 floats gathered in the node
    _entry(1, "all_reduce", ("3", "mesh_shard"), [[8]], [[8]]),             # gloo's reduce-scatter of 8 floats
    _entry(2, "all_reduce", ("1", "mesh_replicate"), [[4]], [[4]]),         # the shard's all-reduce across
    _entry(3, "barrier", ("0", "default_pg"), [[1]], [[1]]),                # no bytes, not a trace collective
    _entry(4, "all_reduce", ("0", "default_pg"), [[1]], [[1]], "Double"),   # a scalar over the world
]


def test_bytes_by_group_with_the_traces_kinds():
    rec = {"groups": GROUPS, "entries": ENTRIES}
    kinds = ["all_gather", "reduce_scatter", "all_reduce", "all_reduce"]
    got = rank_link_bytes(rec, per_node=2, trace_kinds=kinds)
    assert got["kinds_from"] == "trace"
    # in the node: (1/2) x 32 B gathered + (1/2) x 32 B reduce-scattered (counted as called, not as gloo ran it)
    assert got["intra"] == 0.5 * 32 + 0.5 * 32
    # across: 2 (1/2) 16 B over the replica group + 2 (3/4) 8 B over the world
    assert got["inter"] == 2 * 0.5 * 16 + 2 * 0.75 * 8
    assert got["by_kind"] == {"all_gather": 16.0, "reduce_scatter": 16.0, "all_reduce": 16.0 + 12.0}
    assert got["groups"]["mesh_replicate[0, 2]"]["crosses_nodes"] is True
    assert got["groups"]["mesh_shard[0, 1]"]["crosses_nodes"] is False


def test_unpaired_trace_falls_back_to_the_recorders_kinds():
    rec = {"groups": GROUPS, "entries": ENTRIES}
    for kinds in (None, ["all_gather", "reduce_scatter"], ["broadcast"] * 4):
        got = rank_link_bytes(rec, per_node=2, trace_kinds=kinds)
        assert got["kinds_from"] == "flight recorder"
        assert got["intra"] == 0.5 * 32 + 2 * 0.5 * 32   # the node's all-reduce as gloo ran it
    # an entry of a group the rank did not record is left out rather than guessed
    got = rank_link_bytes({"groups": {"0": [0, 1, 2, 3]}, "entries": ENTRIES}, per_node=2)
    assert got["intra"] == 0 and got["inter"] == 2 * 0.75 * 8


def test_link_bytes_per_step_over_the_ranks(tmp_path):
    prof = tmp_path / "profile"
    prof.mkdir()
    assert link_bytes(prof, 2, 1) is None
    for rank in (0, 1):
        (prof / f"collectives_rank{rank}.json").write_text(json.dumps({"groups": GROUPS, "entries": ENTRIES}))
    got = link_bytes(prof, per_node=2, steps=2)
    assert got["ranks"] == 2 and got["kinds_from"] == "flight recorder"
    assert got["intra_node_bytes_per_step"] == (0.5 * 32 + 2 * 0.5 * 32) / 2
    assert got["inter_node_bytes_per_step"] == (2 * 0.5 * 16 + 2 * 0.75 * 8) / 2
    assert got["groups"]["mesh_replicate[0, 2]"]["bytes_per_step"] == 2 * 0.5 * 16 / 2


def test_node_commands_and_logs(tmp_path):
    cmds = node_commands(["python", "-m", "swiftlite", "sft"], 2, 29555)
    assert cmds[1][4:] == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
                           "29555"]
    assert [c[c.index("--node-rank") + 1] for c in cmds] == ["0", "1"]
    log = tmp_path / "hsdp.log"
    assert node_log(log, 0) == log and node_log(log, 1) == tmp_path / "hsdp.node1.log"


def test_hpz_json_is_planned_as_zero3pp(tmp_path):
    p = tmp_path / "pp.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": "auto"}}))
    (spec,) = bench.parse_backends(str(p))
    assert bench.planner_family(spec, 4) == "zero3pp"
    p.write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}}))
    assert bench.planner_family(spec, 4) == "zero3"


def test_nnodes_is_checked():
    # (the command line's one-line error: tests/bad_inputs, bench-zero-nodes)
    for bad in (0, -1, 1.5):
        with pytest.raises(UserError, match="--nnodes"):
            bench.BenchConfig(backends=bench.parse_backends("hsdp"), nnodes=bad).check()


def test_profiling_writes_the_windows_collectives_with_their_groups(tmp_path, monkeypatch):
    """profiling.py, in one gloo process: only the profiled window's collectives, with group ranks."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from swiftlite import profiling
    monkeypatch.setenv(profiling.ENV_PROFILE, "2:1")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")  # read when the process group is created
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        profiling.reset()
        t = torch.ones(6)
        for step in range(3):
            profiling.step_hook(step, tmp_path, 0)
            for _ in range(step + 1):   # step 2 (the profiled one) runs two all-reduces
                dist.all_reduce(t)
        profiling.finish()
        profiling.reset()
    finally:
        dist.destroy_process_group()
    rec = json.loads((tmp_path / "profile" / "collectives_rank0.json").read_text())
    assert rec["groups"] == {"0": [0]}
    assert [e["profiling_name"] for e in rec["entries"]] == ["gloo:all_reduce"] * 2
    assert rec["entries"][0]["input_sizes"] == [[6]]
