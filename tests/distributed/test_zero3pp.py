"""zero3pp (ZeRO-3 + ZeRO++ hpZ) on 4 CPU processes as 2 local nodes x 2, against one process.

Two torchrun "nodes" of 2 processes on 127.0.0.1; zero_hpz_partition_size is the preset's "auto",
filled from --nproc-per-node (2), so each node keeps a secondary copy of the weights sharded over its
2 processes. The JSON is the zero3pp preset with every parameter partitioned
(stage3_param_persistence_threshold 0: docs/design.md trap 7). fp32, tiny 2-layer Llama, global batch 4.
qwZ/qgZ cannot run here (CPU): their refusal is in tests/unit/test_fsdp_knobs.py and the bad-input catalogue.
"""

from __future__ import annotations

import json

import pytest

from swiftlite.parallel.ds_config import PRESET_DIR
from tests.conftest import read_losses, read_state_bytes, run_cli
from tests.distributed.test_hsdp import STEPS, _assert_close, _base, _two_nodes

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def runs(demo_data, tmp_path_factory):
    train, _ = demo_data
    root = tmp_path_factory.mktemp("zero3pp")
    ds = json.loads((PRESET_DIR / "zero3pp.json").read_text())
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == "auto"
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    cfg = root / "zero3pp_all_partitioned.json"
    cfg.write_text(json.dumps(ds))
    out = {"single": root / "single", "zero3pp": root / "zero3pp"}
    run_cli(_base(train, out["single"]) + ["--parallelism", "single", "--per-device-train-batch-size", 4])
    _two_nodes(_base(train, out["zero3pp"]) + ["--parallelism", cfg, "--per-device-train-batch-size", 1])
    return out


def test_losses_match_one_process(runs):
    _assert_close(read_losses(runs["zero3pp"]), read_losses(runs["single"]))


def test_hpz_keeps_a_secondary_partition_per_node(runs):
    """Counted from the tensors after the first backward: each rank holds its 1/4 primary partition
    plus its 1/2 share of its node's secondary copy (hpZ on), 1/4 of the gradients, and 1/4 of the
    fp32 master weights and AdamW moments."""
    full = read_state_bytes(runs["single"])[0]
    per_rank = read_state_bytes(runs["zero3pp"])
    assert sorted(per_rank) == [0, 1, 2, 3]
    want = {"params": full["params"] / 4 + full["params"] / 2, "grads": full["grads"] / 4,
            "optimizer": (full["optimizer"] + full["params"]) / 4}
    for rank, sb in per_rank.items():
        for key, w in want.items():
            assert abs(sb[key] - w) <= 0.02 * w, (rank, key, sb[key], w)
