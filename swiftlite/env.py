"""The process environment, read and written in one place.

Three kinds of variables matter to swiftlite:

* its own settings, ``SWIFTLITE_*`` (fault injection, profiling, caches, test and benchmark hooks),
  parsed by `settings()` into one frozen `Settings` (the names and meanings are listed there);
* the launcher's (torchrun / ms-swift names): RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (the
  DeepSpeed launcher's LOCAL_SIZE), MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE, NNODES, NODE_RANK
  (`launcher_values`, `world_vars`);
* third-party knobs that must be set before a library is imported (DS_ACCELERATOR,
  TORCH_EXTENSIONS_DIR, OMP_NUM_THREADS, TOKENIZERS_PARALLELISM): `set_default`.

Every other module asks here instead of touching `os.environ`, so a reader can find every variable
the program depends on in this file. Values are read at each call (tests and launchers change them
between calls); parsing is a handful of dict look-ups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

#: ms-swift's launcher variables -> the run-config field they fill when the flag is not given.
LAUNCHER_VARS = {"NPROC_PER_NODE": "nproc_per_node", "NNODES": "nnodes", "NODE_RANK": "node_rank",
                 "MASTER_ADDR": "master_addr", "MASTER_PORT": "master_port"}
#: What torchrun sets in each rank (removed from a child that must start a job of its own).
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")

PREFLIGHT_DONE = "SWIFTLITE_PREFLIGHT_DONE"
#: The job's facts (swiftlite/job.py), resolved by the launching process and handed to its ranks (JSON).
JOB_FACTS = "SWIFTLITE_JOB_FACTS"
FAULT = "SWIFTLITE_FAULT"
PROFILE = "SWIFTLITE_PROFILE"
PROFILE_DIR = "SWIFTLITE_PROFILE_DIR"
PROFILE_MEMORY = "SWIFTLITE_PROFILE_MEMORY"
BENCH_STATS = "SWIFTLITE_BENCH_STATS"
CACHE = "SWIFTLITE_CACHE"
DS_SHM_COMM = "SWIFTLITE_DS_SHM_COMM"
EXPORT_THROTTLE_S = "SWIFTLITE_EXPORT_THROTTLE_S"
EXPORT_MEMLOG = "SWIFTLITE_EXPORT_MEMLOG"
GPU_CHECK_DRYRUN = "SWIFTLITE_GPU_CHECK_DRYRUN"
#: One id per launched job (set by the first process that tokenizes, inherited by its ranks): the
#: tokenization cache entries this job wrote, which --load_from_cache_file false still reads.
DATA_SESSION = "SWIFTLITE_DATA_SESSION"
#: --add_version: "<output-dir>\t<vN-timestamp>", the run folder the launching process chose (its ranks,
#: which parse the same command again, use the same one).
RUN_VERSION = "SWIFTLITE_RUN_VERSION"


def _flag(value: str | None) -> bool:
    return (value or "").strip() not in ("", "0")


@dataclass(frozen=True)
class Settings:
    """swiftlite's own variables, parsed."""
    #: SWIFTLITE_PREFLIGHT_DONE=1: the launching process already validated this run (ranks skip it).
    preflight_done: bool = False
    #: SWIFTLITE_FAULT: a fault to inject (faults.py parses the spec).
    fault: str | None = None
    #: SWIFTLITE_PROFILE=K:N: torch.profiler window over optimizer steps (profiling.py).
    profile: str | None = None
    #: SWIFTLITE_PROFILE_DIR: where traces and stats go (default <run>/profile).
    profile_dir: str | None = None
    #: SWIFTLITE_PROFILE_MEMORY=1: record allocations in the trace.
    profile_memory: bool = False
    #: SWIFTLITE_BENCH_STATS=1: each rank writes profile/stats_rank<r>.json (swiftlite bench sets it).
    bench_stats: bool = False
    #: SWIFTLITE_CACHE: root of the tokenization cache (default ~/.cache/swiftlite).
    cache: Path = Path.home() / ".cache" / "swiftlite"
    #: SWIFTLITE_DS_SHM_COMM=1: let DeepSpeed build its shm_comm op (skipped by default).
    ds_shm_comm: bool = False
    #: SWIFTLITE_EXPORT_THROTTLE_S: seconds to sleep per exported tensor (tests of a kill mid-export).
    export_throttle_s: float = 0.0
    #: SWIFTLITE_EXPORT_MEMLOG: file where export records its RSS (scripts/bench_export_memory.py).
    export_memlog: str | None = None
    #: SWIFTLITE_GPU_CHECK_DRYRUN=1: scripts/gpu_check.sh rehearses on CPU.
    gpu_check_dryrun: bool = False

    @property
    def profiling(self) -> bool:
        return bool(self.profile) or self.bench_stats


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Parse the SWIFTLITE_* variables (of `environ`, default this process's environment)."""
    e = os.environ if environ is None else environ
    throttle = e.get(EXPORT_THROTTLE_S) or "0"
    try:
        throttle_s = float(throttle)
    except ValueError:
        from swiftlite.errors import UserError
        raise UserError(f"{EXPORT_THROTTLE_S}={throttle!r}: expected a number of seconds") from None
    return Settings(
        preflight_done=_flag(e.get(PREFLIGHT_DONE)), fault=e.get(FAULT) or None,
        profile=e.get(PROFILE) or None, profile_dir=e.get(PROFILE_DIR) or None,
        profile_memory=_flag(e.get(PROFILE_MEMORY)), bench_stats=_flag(e.get(BENCH_STATS)),
        cache=Path(e[CACHE]) if e.get(CACHE) else Settings.cache,
        ds_shm_comm=e.get(DS_SHM_COMM) == "1", export_throttle_s=throttle_s,
        export_memlog=e.get(EXPORT_MEMLOG) or None, gpu_check_dryrun=_flag(e.get(GPU_CHECK_DRYRUN)))


def data_session() -> str:
    """This job's data session (DATA_SESSION), made here the first time a process of the job asks."""
    if not os.environ.get(DATA_SESSION):
        import uuid
        os.environ[DATA_SESSION] = uuid.uuid4().hex
    return os.environ[DATA_SESSION]


# -- generic access (third-party and launcher variables) -------------------------------------------

def get(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def has(name: str) -> bool:
    return name in os.environ


def set_default(name: str, value: str) -> bool:
    """Set `name` unless it is set already; True when this call set it."""
    if name in os.environ:
        return False
    os.environ[name] = value
    return True


def update(values: Mapping[str, str]) -> None:
    os.environ.update({k: str(v) for k, v in values.items()})


def child_env(extra: Mapping[str, str] | None = None, *, drop_rank_vars: bool = False) -> dict[str, str]:
    """A copy of this environment for a subprocess, without torchrun's per-rank variables when
    `drop_rank_vars` (a child that starts a job of its own), plus `extra`."""
    out = {k: v for k, v in os.environ.items() if not (drop_rank_vars and k in RANK_VARS)}
    out.update({k: str(v) for k, v in (extra or {}).items()})
    return out


# -- the launcher's variables ----------------------------------------------------------------------

def inside_launcher() -> bool:
    """True in a rank started by torchrun / the DeepSpeed launcher (or forked by swiftlite): those set
    LOCAL_RANK. RANK and WORLD_SIZE alone are a platform's node-level variables (PAI-DLC, Kubeflow's
    PyTorchJob: this node's index and the node count), read by `launcher_values`, not a rank."""
    return "LOCAL_RANK" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def platform_node_vars() -> dict[str, str]:
    """A platform's node-level RANK / WORLD_SIZE (no LOCAL_RANK: no launcher started this process) as
    NODE_RANK / NNODES, which is how ms-swift's DLC example passes them (NNODES=$WORLD_SIZE
    NODE_RANK=$RANK swift sft ...); each node then starts NPROC_PER_NODE ranks."""
    e = os.environ
    if "LOCAL_RANK" in e or "TORCHELASTIC_RUN_ID" in e or "RANK" not in e or "WORLD_SIZE" not in e:
        return {}
    return {"NNODES": e["WORLD_SIZE"], "NODE_RANK": e["RANK"]}


def drop_platform_node_vars() -> None:
    """Once the config has read a platform's node-level RANK / WORLD_SIZE (`launcher_values`), remove
    them from this process: what it starts (torchrun, forked ranks) numbers the ranks itself, and no
    code of this launching process may take RANK for a rank of its own."""
    if platform_node_vars():
        for k in ("RANK", "WORLD_SIZE"):
            os.environ.pop(k, None)


def inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def launcher_values() -> dict[str, str]:
    """ms-swift's NPROC_PER_NODE/NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT as run-config fields, outside a
    launched rank (inside one, torchrun's own values describe the job)."""
    if inside_torchrun():
        return {}
    given = {**platform_node_vars(), **{v: os.environ[v] for v in LAUNCHER_VARS if v in os.environ}}
    return {key: given[var] for var, key in LAUNCHER_VARS.items() if var in given}


#: Set by Slurm in a job's environment (srun/sbatch): the job's nodes find node 0 from its node list.
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_NODELIST", "SLURM_JOB_NODELIST")


def in_slurm() -> bool:
    """True inside a Slurm job (SLURM_JOB_ID or SLURM_NODELIST set, not empty)."""
    return any(os.environ.get(v) for v in SLURM_VARS)


def launcher_var_for(field: str) -> str | None:
    """The environment variable that can fill a run-config field (for error messages)."""
    for var, key in LAUNCHER_VARS.items():
        if key == field and var in os.environ:
            return var
    node = {"NNODES": "WORLD_SIZE", "NODE_RANK": "RANK"}
    for var, key in LAUNCHER_VARS.items():
        if key == field and var in platform_node_vars():
            return f"{node[var]} (a platform's node-level variable, read as {var})"
    return None


@dataclass(frozen=True)
class WorldVars:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    has_master: bool = False
    has_local_world_size: bool = False   # the launcher said how many processes run on this node


def world_vars() -> WorldVars:
    """This rank's place as torchrun describes it (before the process group exists)."""
    e = os.environ
    # torchrun (and swiftlite's forked ranks) say LOCAL_WORLD_SIZE; the DeepSpeed launcher LOCAL_SIZE.
    local = e.get("LOCAL_WORLD_SIZE") or e.get("LOCAL_SIZE")
    return WorldVars(rank=int(e.get("RANK", 0)), local_rank=int(e.get("LOCAL_RANK", 0)),
                     world_size=int(e.get("WORLD_SIZE", 1)), local_world_size=int(local or 1),
                     has_master="MASTER_ADDR" in e, has_local_world_size=local is not None)


def rank() -> str | None:
    """RANK as set by the launcher, or None in a process not started by one."""
    return os.environ.get("RANK")
