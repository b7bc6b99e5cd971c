"""This process's place in the job (`World`), and process group setup and teardown (nccl on CUDA,
gloo on CPU)."""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

from swiftlite import env as envvars


@dataclass(frozen=True)
class World:
    """This process's place in the job."""
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: str = "cpu"           # "cpu" or "cuda:<local_rank>"
    dist_backend: str | None = None  # "gloo"/"nccl" when a process group exists

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.dist_backend is not None

    @property
    def device_type(self) -> str:
        """The device type, cuda or cpu: what device meshes and autocast take (derived here only)."""
        return "cuda" if self.device.startswith("cuda") else "cpu"

    @staticmethod
    def from_env() -> "World":
        """World as torchrun describes it in the environment (before init)."""
        v = envvars.world_vars()
        return World(rank=v.rank, local_rank=v.local_rank, world_size=v.world_size,
                     local_world_size=v.local_world_size)


def init_distributed(timeout_s: int = 1800) -> World:
    """Join the process group torchrun describes (RANK/WORLD_SIZE env); one process needs none."""
    import torch
    import torch.distributed as dist
    env = World.from_env()
    cuda = torch.cuda.is_available()
    device = f"cuda:{env.local_rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(env.local_rank)
    if env.world_size == 1 or not envvars.has("MASTER_ADDR"):
        return World(device=device)
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return World(rank=dist.get_rank(), local_rank=env.local_rank, world_size=dist.get_world_size(),
                 local_world_size=env.local_world_size, device=device, dist_backend=backend)


def teardown() -> None:
    import gc

    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        # Collect the run's engine (sharded modules, finished gloo work) while the group is alive: freed
        # later, at interpreter shutdown, gloo's threads can abort the process after a good run.
        gc.collect()
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


def gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's `obj` (picklable, made here: never a file's contents), in rank order; [obj] on one process."""
    import torch.distributed as dist
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def local_values(p: Any) -> Any:
    """The values of parameter `p` this rank holds (here, not in parallel/, so that checkpoint/ reads it
    without importing the backends), flat where sharded: a DTensor's local shard (FSDP2);
    a ZeRO-3 partition (`ds_tensor`) less its padding, since DeepSpeed rounds every partition up to
    ceil(numel / world) and allocates the padding with torch.empty, so on world sizes that do not
    divide a parameter the last ranks' tails hold whatever was in memory (nan included); else `p`."""
    if hasattr(p, "to_local"):
        return p.to_local()
    part = getattr(p, "ds_tensor", None)
    if part is None:
        return p
    import torch.distributed as dist
    size = getattr(part, "ds_numel", part.numel())
    rank = dist.get_rank(group=getattr(p, "ds_process_group", None)) if dist.is_initialized() else 0
    start = rank * size
    return part.reshape(-1).narrow(0, 0, max(0, min(size, p.ds_numel - start)))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (for a rendezvous on this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
