"""`swiftlite bench --nnodes N` on one machine: each column runs as N local "nodes".

Every node is its own `swiftlite sft ... --nnodes N --node-rank r --master-addr 127.0.0.1
--master-port P` -- the command a real multi-node job runs on each host -- so swiftlite's launcher
starts torch's (`torchrun --nnodes N --node-rank r`) once per node, the ranks are numbered
node-major (rank // processes-per-node is the node), LOCAL_WORLD_SIZE is one node's processes, and
the backends build their node-local groups (hsdp's shard group, ZeRO++'s hpZ partition) as they
would on N hosts. The links are all loopback here, so the step times say nothing about a network;
the bytes that crossed the node boundary are counted per process group (bench/groups.py).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swiftlite.bench.groups import link_bytes
from swiftlite.errors import UserError

if TYPE_CHECKING:
    from swiftlite.bench.spec import BenchConfig

LOCALHOST = "127.0.0.1"

#: torch's flight recorder: entries kept per rank (a ring buffer). The bench sets it in each run's
#: environment so that profiling.py can write the profiled window's collectives with their process
#: groups; a profiled window with more collectives than this loses its oldest ones.
FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
FR_BUFFER_SIZE = 20000


def kill_group(proc: subprocess.Popen) -> None:
    """End a run's whole process group (launcher and ranks): SIGTERM, then SIGKILL after 15 s."""
    import os
    import signal
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def node_commands(cmd: list[str], nnodes: int, port: int) -> list[list[str]]:
    """The `swiftlite sft` command line of each local node."""
    return [cmd + ["--nnodes", str(nnodes), "--node-rank", str(r), "--master-addr", LOCALHOST,
                   "--master-port", str(port)] for r in range(nnodes)]


def node_log(log_path: Path, node: int) -> Path:
    """Node 0 writes the column's log; node r > 0 writes <label>.node<r>.log next to it."""
    return log_path if node == 0 else log_path.with_name(f"{log_path.stem}.node{node}{log_path.suffix}")


def run_nodes(cmds: list[list[str]], log_path: Path, env: dict[str, str], timeout_s: float,
              gpus_per_node: int | None = None) -> int | None:
    """Start every node, wait for all; the first that fails ends the others (they would wait for it
    at the next collective until the timeout). Returns the first non-zero exit code, 0, or None on
    timeout. Each node runs in its own session, so a kill takes its launcher and ranks together.
    `gpus_per_node`: node r sees GPUs r*n .. r*n+n-1 only (CUDA_VISIBLE_DEVICES), as a host of its own
    would; None on CPU."""
    procs, logs = [], []
    try:
        for r, cmd in enumerate(cmds):
            log = node_log(log_path, r).open("w")
            logs.append(log)
            node_env = dict(env)
            if gpus_per_node:
                node_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(r * gpus_per_node + i) for i in range(gpus_per_node))
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=node_env,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                for p in procs:
                    if p.poll() is None:
                        kill_group(p)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                for p in procs:
                    kill_group(p)
                return None
            time.sleep(0.2)
    except BaseException:  # Ctrl-C, or SIGTERM from an outer timeout: take every node down with us
        for p in procs:
            kill_group(p)
        raise
    finally:
        for log in logs:
            log.close()


def collect_links(cfg: "BenchConfig", family: str | None, res: Any, prof_dir: Path, nproc: int,
                  dtype: str, shape: Any, steps: int) -> None:
    """Fill the per-link figures of `res` (a runner.BackendResult): intra-/inter-node bytes per step
    counted from the run's collectives by process group (bench/groups.py), next to the planner's
    (planner/topology.py)."""
    counted = link_bytes(prof_dir, nproc, steps)
    if counted is not None:
        res.intra_node_bytes = counted["intra_node_bytes_per_step"]
        res.inter_node_bytes = counted["inter_node_bytes_per_step"]
        res.comm_groups = counted["groups"]
        res.comm_bytes_by_kind = counted["bytes_by_kind"]
        res.link_kinds_from = counted["kinds_from"]
    if shape is None or family is None:
        return
    from swiftlite import planner as plan
    from swiftlite.planner import comm_per_link
    if family not in plan.SHARDING:
        return
    try:
        w = plan.Workload(train_type=cfg.train_type, dtype=dtype, max_length=cfg.max_length,
                          micro_batch=cfg.per_device_train_batch_size,
                          gradient_checkpointing=cfg.gradient_checkpointing, world_size=nproc * cfg.nnodes,
                          gpus_per_node=nproc, overhead_bytes=0)
        theory = comm_per_link(shape, w, family)
    except UserError as e:
        res.error = res.error or f"estimate: {e}"
        return
    res.intra_node_bytes_theory, res.inter_node_bytes_theory = theory.intra, theory.inter
    if res.inter_node_bytes is not None and theory.inter:
        res.inter_node_ratio = res.inter_node_bytes / theory.inter


__all__ = ["FR_BUFFER_ENV", "FR_BUFFER_SIZE", "LOCALHOST", "collect_links", "kill_group", "node_commands", "node_log",
           "run_nodes"]
