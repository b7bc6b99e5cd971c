"""Process group setup and teardown (nccl on CUDA, gloo on CPU)."""

from __future__ import annotations

import datetime
import os

from swiftlite.parallel.base import World


def init_distributed(timeout_s: int = 1800) -> World:
    """Join the process group torchrun describes (RANK/WORLD_SIZE env); one process needs none."""
    import torch
    import torch.distributed as dist
    env = World.from_env()
    cuda = torch.cuda.is_available()
    device = f"cuda:{env.local_rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(env.local_rank)
    if env.world_size == 1 or "MASTER_ADDR" not in os.environ:
        return World(device=device)
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return World(rank=dist.get_rank(), local_rank=env.local_rank, world_size=dist.get_world_size(),
                 local_world_size=env.local_world_size, device=device, dist_backend=backend)


def teardown() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum floats over ranks (used for logged losses); identity on one process."""
    import torch
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def broadcast_object(obj):
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
