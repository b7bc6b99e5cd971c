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

from typing import TYPE_CHECKING, Any

from swiftlite import env as envvars
from swiftlite.errors import UserError
from swiftlite.parallel.base import Backend, FrozenModel, register_backend
from swiftlite.parallel.fsdp2 import (FSDP2_OPTIONS, check_cpu_offload, check_one_process, check_precision,
                                      check_quantized_base, check_reshard_size, fsdp2_engine, frozen_on_mesh,
                                      policy_mesh)

if TYPE_CHECKING:
    import torch

    from swiftlite.distributed import World
    from swiftlite.parallel.torch_engine import TorchEngine


def shard_size(cfg: Any, world_size: int, local_world_size: int | None = None) -> int:
    """Ranks per shard group: --hsdp-shard-size, else the processes per node: inside a rank the
    launcher's LOCAL_WORLD_SIZE (torchrun and swiftlite's own launcher set it, on every node), before
    launch --nproc-per-node. With neither, one node is assumed (world size)."""
    size = cfg.parallel.hsdp_shard_size
    if size is None:
        size = local_world_size or cfg.parallel.nproc_per_node or world_size
    return int(size)


def _problem(cfg: Any, world_size: int, shard: int) -> str | None:
    given = cfg.parallel.hsdp_shard_size is not None
    what = f"--hsdp-shard-size {shard}" if given else f"hsdp's shard size ({shard}: the processes per node)"
    if shard < 1 or shard > world_size or world_size % shard:
        return (f"{what} must divide the {world_size} processes (world = replicas x shard size)"
                + ("" if given else "; set --hsdp-shard-size"))
    return check_reshard_size(cfg, shard, backend="hsdp")


def mesh_shape(cfg: Any, world_size: int, local_world_size: int | None) -> tuple[int, int]:
    """(replicate, shard) sizes of the device mesh; a world the shard size does not divide is refused."""
    shard = shard_size(cfg, world_size, local_world_size)
    problem = _problem(cfg, world_size, shard)
    if problem:
        raise UserError(problem)
    return world_size // shard, shard


def _check_shard_size(cfg: Any, world_size: int, choice: Any = None) -> str | None:
    """Before launch: the shard size against the planned world (--nnodes x --nproc-per-node)."""
    return (check_one_process(cfg, world_size, backend="hsdp")
            or _problem(cfg, world_size, shard_size(cfg, world_size)))


def _local_world_size(cfg: Any, world: "World") -> int | None:
    """The processes per node as the launcher reports them (LOCAL_WORLD_SIZE, or the DeepSpeed
    launcher's LOCAL_SIZE); None when it does not (a launcher that
    sets RANK/WORLD_SIZE only), then --nproc-per-node or, lacking that, a refusal: a guess of 1 would
    silently replicate the whole model on every rank."""
    if envvars.world_vars().has_local_world_size:
        return world.local_world_size
    if cfg.parallel.hsdp_shard_size is None and cfg.parallel.nproc_per_node is None:
        raise UserError("--parallelism hsdp: the launcher did not say how many processes run per node "
                        "(LOCAL_WORLD_SIZE is not set): pass --hsdp-shard-size or --nproc-per-node")
    return None


def hsdp(model: "torch.nn.Module", cfg: Any, world: "World", total_steps: int, choice: Any = None) -> "TorchEngine":
    shape = mesh_shape(cfg, world.world_size, _local_world_size(cfg, world))
    return fsdp2_engine(model, cfg, world, total_steps, shape, ("replicate", "shard"))


def frozen_hsdp(model: "torch.nn.Module", cfg: Any, world: "World", engine: Any, choice: Any = None) -> FrozenModel:
    """DPO's frozen reference copy (`Backend.frozen_copy`): FSDP2 on the policy's own (replicate, shard)
    mesh, so the copy is sharded within the shard group and replicated across, as the policy is."""
    mesh = policy_mesh(engine.root())
    if mesh.ndim != 2:
        raise UserError(f"rlhf: the hsdp policy is sharded on a {mesh.ndim}-D mesh, not (replicate, shard) (internal)")
    return frozen_on_mesh(model, cfg, world, mesh)


register_backend(Backend(
    name="hsdp", engine="hsdp", factory=hsdp, one_process="single",
    shards=(True, True, True), memory_family="hsdp", estimate=True, loading="sharded",
    frozen_copy=frozen_hsdp,
    options=FSDP2_OPTIONS | {"hsdp_shard_size"},
    checks=(check_quantized_base, check_precision, _check_shard_size, check_cpu_offload),
    summary="HSDP (FSDP2 on a replicate x shard mesh): sharded within --hsdp-shard-size ranks, replicated across"))
