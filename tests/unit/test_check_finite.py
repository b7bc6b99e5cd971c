"""checkpoint/state.check_finite looks at the values each rank holds, and only those: a ZeRO-3
partition's padding (DeepSpeed allocates it with torch.empty, so it may hold nan) is left out, which
a GRPO MoE full fine-tune on 7 ZeRO-3 processes hit (ms-swift's grpo/external/moe_full.sh: every
checkpoint refused as non-finite while the weights were finite)."""

from __future__ import annotations

import types

import pytest
import torch

from swiftlite.checkpoint.state import check_finite
from swiftlite.errors import UserError
from swiftlite.distributed import local_values


def _zero3_param(full: torch.Tensor, rank: int, world: int, pad_value: float) -> torch.nn.Parameter:
    """A parameter laid out as ZeRO-3 partitions it on `rank` of `world`: data empty, ds_tensor the
    rank's ceil(numel / world) elements, the tail past numel filled with `pad_value`."""
    size = -(-full.numel() // world)
    part = torch.full((size,), pad_value)
    start = rank * size
    n = max(0, min(size, full.numel() - start))
    part[:n] = full.reshape(-1)[start:start + n]
    part.ds_numel = size
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_tensor, p.ds_numel, p.ds_process_group = part, full.numel(), None
    return p


@pytest.fixture
def rank(monkeypatch):
    import torch.distributed as dist

    def set_rank(r: int) -> None:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: r)
        monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: None)   # the other ranks: all finite
    return set_rank


def test_local_values_of_a_zero3_partition_leave_the_padding_out(rank):
    full = torch.arange(7.0)                                # 7 elements on 2 ranks: partitions of 4
    rank(0)
    assert local_values(_zero3_param(full, 0, 2, float("nan"))).tolist() == [0, 1, 2, 3]
    rank(1)
    assert local_values(_zero3_param(full, 1, 2, float("nan"))).tolist() == [4, 5, 6]
    full = torch.arange(2.0)                                # 2 elements on 3 ranks: rank 2 holds none
    rank(2)
    assert local_values(_zero3_param(full, 2, 3, float("nan"))).numel() == 0


def test_local_values_of_whole_and_dtensor_parameters():
    p = torch.nn.Parameter(torch.ones(3))
    assert local_values(p) is p
    shard = torch.zeros(2)
    assert local_values(types.SimpleNamespace(to_local=lambda: shard)) is shard


def _engine(*params):
    module = torch.nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"p{i}", p)
    return types.SimpleNamespace(module=module)


def test_nan_in_the_padding_is_not_a_nan_weight(rank):
    rank(1)
    check_finite(_engine(_zero3_param(torch.arange(7.0), 1, 2, float("nan"))), step=2)   # no error


def test_nan_in_a_partition_refuses_the_checkpoint(rank):
    rank(1)
    full = torch.arange(7.0)
    full[5] = float("inf")
    with pytest.raises(UserError, match="checkpoint-2: the weights hold nan/inf"):
        check_finite(_engine(_zero3_param(full, 1, 2, 0.0)), step=2)
    with pytest.raises(UserError):      # a whole parameter too
        check_finite(_engine(torch.nn.Parameter(torch.tensor([1.0, float("nan")]))), step=2)
