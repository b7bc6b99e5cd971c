"""DeepSpeed's environment: the variables it needs before import, the op-build cache and its stale
locks, and the process-group start (`_prepare_deepspeed`). Split from deepspeed.py (the engine and the
records), which re-exports the public names."""

from __future__ import annotations

import glob
import os
import sys
from typing import Any

from swiftlite import env as envvars
from swiftlite.distributed import World, free_port
from swiftlite.errors import UserError

DEFAULT_EXT_DIR = os.path.join("~", ".cache", "swiftlite", "torch_extensions")


def ds_env_defaults() -> dict[str, str]:
    """Set the environment DeepSpeed needs before it is imported; returns what was set.

    * DS_ACCELERATOR=cpu when there is no CUDA device (DeepSpeed then uses gloo).
    * TORCH_EXTENSIONS_DIR=~/.cache/swiftlite/torch_extensions (compiled ops are cached there).
    * RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT for a single process not started by a
      launcher (DeepSpeed otherwise tries MPI discovery and asks for mpi4py).
    """
    import torch

    set_: dict[str, str] = {}

    def default(k: str, v: str) -> None:
        if envvars.set_default(k, v):
            set_[k] = v

    if not torch.cuda.is_available():
        default("DS_ACCELERATOR", "cpu")
    default("TORCH_EXTENSIONS_DIR", os.path.expanduser(DEFAULT_EXT_DIR))
    if not envvars.has("WORLD_SIZE") and not envvars.has("RANK"):
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                     ("MASTER_ADDR", "127.0.0.1")):
            default(k, v)
        if not envvars.has("MASTER_PORT"):
            default("MASTER_PORT", str(free_port()))
    return set_


def stale_extension_locks(ext_dir: str | None = None) -> list[str]:
    """`lock` files left in the op-build cache (torch's cpp_extension FileBaton)."""
    root = os.path.expanduser(ext_dir or envvars.get("TORCH_EXTENSIONS_DIR") or DEFAULT_EXT_DIR)
    return sorted(set(glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock"))))


def check_extension_locks(ext_dir: str | None = None) -> None:
    """A compile killed half-way leaves `<TORCH_EXTENSIONS_DIR>/<op>/lock`, and every later build of
    that op waits on it forever. Call before any rank can start compiling (local rank 0, then a
    barrier): a lock present then is stale unless another job shares the cache."""
    locks = stale_extension_locks(ext_dir)
    if locks:
        raise UserError(f"stale DeepSpeed op-build lock {locks[0]} (a compile was interrupted; later builds "
                        "would hang): delete it, unless another DeepSpeed job is compiling into this cache")


def _skip_shm_comm_build() -> None:
    """DeepSpeed's CPU comm backend builds the shm_comm op at start-up (minutes, first time) only for
    inference_all_reduce; training never uses it. SWIFTLITE_DS_SHM_COMM=1 keeps DeepSpeed's behaviour."""
    if envvars.settings().ds_shm_comm:
        return
    import deepspeed.comm.torch  # noqa: F401  (the name is shadowed by torch in deepspeed.comm)
    mod = sys.modules["deepspeed.comm.torch"]
    if hasattr(mod, "build_shm_op"):
        mod.build_shm_op = lambda: None


def _prepare_deepspeed(world: World, timeout_s: int = 1800) -> Any:
    """Environment, stale-lock check, import, process group; returns the deepspeed module.

    The process group must exist before `zero.Init` or a DeepSpeed config is built: DeepSpeed
    otherwise takes world size 1 and fails its train_batch_size check (or partitions for 1 rank)."""
    ds_env_defaults()
    if world.local_rank == 0:
        check_extension_locks()
    import datetime

    import deepspeed
    import torch.distributed as dist
    _skip_shm_comm_build()
    # Always: deepspeed.comm wraps an existing torch process group, and zero.Init reads the world
    # size from deepspeed.comm (1 if it was never initialised, even when torch's group exists).
    deepspeed.init_distributed(verbose=False, timeout=datetime.timedelta(seconds=timeout_s))
    dist.barrier()  # no rank may start a compile before local rank 0 has looked for stale locks
    return deepspeed


