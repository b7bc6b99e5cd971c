"""How a job starts: here, forked from here, or re-run under torchrun / the DeepSpeed launcher.

Already inside a launcher (RANK and WORLD_SIZE set), or one process asked for: run here. Otherwise
(--nproc-per-node / --nnodes, or ms-swift's env vars):

- one node (`--launcher auto`, the default, or `fork`): the ranks are forked from this process
  (`launch/fork.py`) once the preflight is done, on CPU builds of torch only under `auto`;
- several nodes, an elastic rendezvous, or `--launcher torchrun`: the same command line runs again
  under `python -m swiftlite.torchrun` (torchrun without its traceback), as an argument list, never
  a shell string;
- `--launcher deepspeed`: the DeepSpeed launcher (hostfile runs).
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from swiftlite import env
from swiftlite.config import RunConfig
# Whether torch is a CUDA/ROCm build, read without importing it: `--launcher auto` forks ranks only on
# CPU builds (a process that has touched CUDA cannot be forked safely; GPU runs keep torchrun's fresh
# interpreters). config.load uses it too (--torch-dtype auto is fp32 on a CPU build).
from swiftlite.config.load import gpu_torch_build
from swiftlite.distributed import free_port
from swiftlite.errors import UserError

#: The port every node of a multi-node job agrees on when --master-port is not given (torchrun's).
DEFAULT_MULTINODE_PORT = 29500


@dataclass(frozen=True)
class LaunchPlan:
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    command: list[str] | None  # the launcher to re-run under; None: this process runs or forks the ranks
    fork: bool = False         # fork the ranks of a one-node job from this process

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def port_in_use(addr: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr if addr not in ("localhost",) else "127.0.0.1", port))
        except OSError:
            return True
    return False


def _is_local(addr: str) -> bool:
    return addr in ("127.0.0.1", "localhost", "0.0.0.0") or addr == socket.gethostname()


def plan_launch(cfg: RunConfig, argv: list[str]) -> LaunchPlan:
    """Decide how to start the job; `argv` is the swiftlite command line after the program name."""
    p = cfg.parallel
    nproc = p.nproc_per_node or 1
    nnodes = p.nnodes or 1
    node_rank = p.node_rank or 0
    addr = p.master_addr or "127.0.0.1"
    if env.inside_launcher() or nproc * nnodes == 1:
        return LaunchPlan(nproc, nnodes, node_rank, addr, p.master_port, None)
    port = p.master_port
    if port is None:
        port = DEFAULT_MULTINODE_PORT if nnodes > 1 else free_port()
    elif node_rank == 0 and _is_local(addr) and port_in_use(addr, port):
        raise UserError(f"--master-port {port}: already in use on {addr}; pick another port or leave it unset")
    if nnodes == 1 and not p.rdzv_backend and (p.launcher == "fork" or
                                                (p.launcher == "auto" and not gpu_torch_build())):
        return LaunchPlan(nproc, nnodes, node_rank, addr, port, None, fork=True)
    if p.launcher == "fork":
        raise UserError("--launcher fork: forks the processes of one node only; use --launcher torchrun "
                        "for --nnodes > 1 or a rendezvous backend")
    if nnodes > 1 and p.master_addr is None and not p.rdzv_endpoint and not env.in_slurm():
        raise UserError(f"--nnodes {nnodes} needs --master-addr (the address of node 0, reachable from every "
                        "node; or MASTER_ADDR): without it each node would wait for a rendezvous on its own "
                        "127.0.0.1")
    if p.launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
               "--master_port", str(port)]
        if p.hostfile:
            if not Path(p.hostfile).is_file():
                raise UserError(f"--hostfile {p.hostfile}: file not found")
            cmd += ["--hostfile", p.hostfile, "--master_addr", addr]
        cmd += ["--module", "swiftlite", *argv]
    else:
        cmd = [sys.executable, "-m", "swiftlite.torchrun", f"--nproc-per-node={nproc}",
               f"--nnodes={nnodes}"]
        if p.rdzv_backend:
            cmd += [f"--rdzv-backend={p.rdzv_backend}", f"--rdzv-endpoint={p.rdzv_endpoint or f'{addr}:{port}'}",
                    f"--rdzv-id={p.rdzv_id or 'swiftlite'}"]
        else:
            cmd += [f"--node-rank={node_rank}", f"--master-addr={addr}", f"--master-port={port}"]
        cmd += ["-m", "swiftlite", *argv]
    return LaunchPlan(nproc, nnodes, node_rank, addr, port, cmd)
