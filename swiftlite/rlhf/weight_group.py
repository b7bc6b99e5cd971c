"""The weight-sync group between a GRPO run in `--vllm_mode server` and a `swiftlite rollout` server:
a process group of its own (torch.distributed's ProcessGroupNCCL or ProcessGroupGloo built on a
TCPStore, not the run's default group), so the run's world and the server's engine workers never
share a world size or a rendezvous.

Members: the server's engine workers, ranks 0 .. W-1 (one per tensor-parallel shard of the engine),
and the run's main process, rank W. The server's rank 0 opens the store on the group port (ms-swift's
--vllm_server_group_port, 51216 by default), as ms-swift's server does; everyone else connects to it.
The run's main process broadcasts each tensor from rank W; every worker receives it.

The backend: NCCL when both sides hold the tensors on CUDA devices (the engine on a GPU and the run
on a GPU), gloo otherwise (the tensors cross on the CPU): the two sides agree on it before either joins
(the server reports its device in /get_world_size/; rlhf/rollout_client.py decides).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

#: The store's key prefix, so a store on that port from something else is never mistaken for ours.
PREFIX = "swiftlite-weight-sync"


class WeightGroup:
    """One member's handle on the group: `broadcast` a tensor from the run (rank world_size - 1)."""

    def __init__(self, pg: Any, store: Any, rank: int, world_size: int, backend: str):
        self.pg, self.store, self.rank, self.world_size, self.backend = pg, store, rank, world_size, backend

    @property
    def source(self) -> int:
        return self.world_size - 1

    def broadcast(self, t: torch.Tensor) -> None:
        """`t` sent from the run's rank to every member (in place on the receivers)."""
        import torch.distributed as dist
        opts = dist.BroadcastOptions()
        opts.rootRank = self.source
        self.pg.broadcast([t], opts).wait()
        if t.is_cuda:
            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        for obj in (self.pg, self.store):
            shutdown = getattr(obj, "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception:   # a peer already gone: nothing left to release
                    pass
        self.pg = self.store = None


def join(host: str, port: int, rank: int, world_size: int, *, backend: str, timeout_s: float) -> WeightGroup:
    """Join the group as `rank` of `world_size` (blocks until every member has joined, or `timeout_s`).
    Rank 0 opens the store on `port` (listening on every interface; `host` is what the others dial)."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(PREFIX, store)
    if backend == "nccl":
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    elif backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        raise ValueError(f"weight-sync backend {backend!r}: nccl or gloo")
    return WeightGroup(pg, store, rank, world_size, backend)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dt


__all__ = ["PREFIX", "WeightGroup", "dtype_name", "dtype_of", "join"]
