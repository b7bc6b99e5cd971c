"""HSDP: FSDP2 over a 2-D device mesh (replicate, shard) -- hybrid sharding across nodes.

Each group of `--hsdp-shard-size` ranks (default: the processes per node) holds one fully sharded
copy of the model, as fsdp does within it; the copies are replicas of each other. Parameter
all-gathers and gradient reduce-scatters stay inside a shard group (inside a node, on the fast
link); only the reduce-scattered gradient shards are all-reduced across the replicas (the slow
link carries 1/shard_size of the gradient bytes, once per step). `fully_shard` given a 2-D mesh does
this itself (FSDP2's HSDP); everything else -- precision, LoRA/QLoRA, compile, activation
checkpointing, DCP checkpoints that resume on any world size -- is fsdp's (parallel/fsdp2.py).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from swiftlite.errors import UserError
from swiftlite.parallel.base import Backend, register_backend
from swiftlite.parallel.fsdp2 import (FSDP_OPTIONS, apply_fsdp2, check_precision, check_quantized_base,
                                      mixed_precision_dtypes, refuse_cpu_offload_without_gpu)

if TYPE_CHECKING:
    import torch

    from swiftlite.distributed import World
    from swiftlite.parallel.torch_engine import TorchEngine


def shard_size(cfg: Any, world_size: int, local_world_size: int | None) -> int:
    """Ranks per shard group: --hsdp-shard-size, else the processes per node."""
    size = cfg.parallel.hsdp_shard_size
    if size is None:
        size = local_world_size or cfg.parallel.nproc_per_node or world_size
    return int(size)


def mesh_shape(cfg: Any, world_size: int, local_world_size: int | None) -> tuple[int, int]:
    """(replicate, shard) sizes of the device mesh; a world the shard size does not divide is refused."""
    shard = shard_size(cfg, world_size, local_world_size)
    if shard < 1 or world_size % shard:
        raise UserError(f"--hsdp-shard-size {shard}: it must divide the {world_size} processes "
                        "(replicate groups x shard groups)")
    return world_size // shard, shard


def _check_shard_size(cfg: Any, world_size: int, choice: Any = None) -> str | None:
    size = cfg.parallel.hsdp_shard_size
    if size is not None and (size < 1 or world_size % size):
        return (f"--hsdp-shard-size {size}: it must divide the {world_size} processes "
                "(world = replicas x shard size)")
    return None


def hsdp(model: "torch.nn.Module", cfg: Any, world: "World", total_steps: int, choice: Any = None) -> "TorchEngine":
    from torch.distributed.device_mesh import init_device_mesh

    from swiftlite.optim import master_weights, upcast_trainable
    from swiftlite.parallel.torch_engine import TorchEngine
    refuse_cpu_offload_without_gpu(cfg, world)
    if master_weights(cfg):
        upcast_trainable(model)
    device_type = "cuda" if world.device.startswith("cuda") else "cpu"
    if not cfg.parallel.cpu_offload:
        model = model.to(world.device)
    mesh = init_device_mesh(device_type, mesh_shape(cfg, world.world_size, world.local_world_size),
                            mesh_dim_names=("replicate", "shard"))
    apply_fsdp2(model, mesh, mp=mixed_precision_dtypes(cfg),
                reshard_after_forward=cfg.parallel.reshard_after_forward,
                cpu_offload=cfg.parallel.cpu_offload)

    def sync(last: bool):
        # As fsdp: reduce-scatter (and, for HSDP, the all-reduce across replicas) only at the end
        # of an accumulation window.
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return TorchEngine(model, cfg, world, total_steps, no_sync=sync)


register_backend(Backend(
    name="hsdp", engine="hsdp", factory=hsdp, one_process="single",
    shards=(True, True, True), memory_family="hsdp", estimate=True,
    options=FSDP_OPTIONS | {"hsdp_shard_size"},
    checks=(check_quantized_base, check_precision, _check_shard_size),
    summary="HSDP (FSDP2 on a replicate x shard mesh): sharded within --hsdp-shard-size ranks, replicated across"))
