"""Run here, or re-execute under torchrun (or the DeepSpeed launcher) for multi-process runs.

Already inside torchrun (RANK and WORLD_SIZE set)? Run directly. Otherwise, with more than one
process asked for (--nproc-per-node / --nnodes or ms-swift's env vars), the same command line is run
again under `python -m torch.distributed.run`, as an argument list (never a shell string). A failed
rank stops the job; each rank writes its error to <output_dir>/logs/rank<r>.err and the launcher
shows the first failing rank's error.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from swiftlite.config import RunConfig
from swiftlite.errors import UserError


@dataclass(frozen=True)
class LaunchPlan:
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    command: list[str] | None  # None: run in this process

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def inside_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(addr: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr if addr not in ("localhost",) else "127.0.0.1", port))
        except OSError:
            return True
    return False


def plan_launch(cfg: RunConfig, argv: list[str]) -> LaunchPlan:
    """Decide how to start the job; `argv` is the swiftlite command line after the program name."""
    p = cfg.parallel
    nproc = p.nproc_per_node or 1
    nnodes = p.nnodes or 1
    node_rank = p.node_rank or 0
    addr = p.master_addr or "127.0.0.1"
    if inside_launcher() or nproc * nnodes == 1:
        return LaunchPlan(nproc, nnodes, node_rank, addr, p.master_port, None)
    port = p.master_port
    if port is None:
        if nnodes > 1:
            port = 29500  # every node must agree on it: a fixed default, as torchrun's
        else:
            port = free_port()
    elif node_rank == 0 and _is_local(addr) and port_in_use(addr, port):
        raise UserError(f"--master-port {port}: already in use on {addr}; pick another port or leave it unset")
    if p.launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
               "--master_port", str(port)]
        if p.hostfile:
            if not Path(p.hostfile).is_file():
                raise UserError(f"--hostfile {p.hostfile}: file not found")
            cmd += ["--hostfile", p.hostfile, "--master_addr", addr]
        cmd += ["--module", "swiftlite", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--nnodes={nnodes}"]
        if p.rdzv_backend:
            cmd += [f"--rdzv-backend={p.rdzv_backend}", f"--rdzv-endpoint={p.rdzv_endpoint or f'{addr}:{port}'}",
                    f"--rdzv-id={p.rdzv_id or 'swiftlite'}"]
        else:
            cmd += [f"--node-rank={node_rank}", f"--master-addr={addr}", f"--master-port={port}"]
        cmd += ["-m", "swiftlite", *argv]
    return LaunchPlan(nproc, nnodes, node_rank, addr, port, cmd)


def _is_local(addr: str) -> bool:
    return addr in ("127.0.0.1", "localhost", "0.0.0.0") or addr == socket.gethostname()


def run_launched(plan: LaunchPlan, cfg: RunConfig) -> int:
    """Run the launcher; on failure show the failing rank's error. Returns the exit code."""
    assert plan.command is not None
    print("launching: " + shlex.join(plan.command), flush=True)
    logs = Path(cfg.train.output_dir) / "logs"
    for old in logs.glob("rank*.err") if logs.is_dir() else []:
        old.unlink()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        rc = subprocess.run(plan.command, env=env).returncode
    except KeyboardInterrupt:
        return 130
    if rc == 0:
        return 0
    errs = sorted(logs.glob("rank*.err")) if logs.is_dir() else []
    for e in errs:
        text = e.read_text(errors="replace").strip()
        if text:
            print(f"error: {e.stem} failed: {text.splitlines()[0]}", file=sys.stderr)
            return 2 if text.startswith("user error:") else 1
    print(f"error: the launcher exited with code {rc} (see the rank output above)", file=sys.stderr)
    return rc if rc > 0 else 1


def record_rank_failure(cfg: RunConfig | None, message: str, user_error: bool) -> None:
    """Called in a rank that fails: write its error where the launcher looks for it."""
    rank = os.environ.get("RANK")
    if rank is None or cfg is None:
        return
    logs = Path(cfg.train.output_dir) / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"rank{rank}.err").write_text(("user error: " if user_error else "") + message + "\n")
    except OSError:
        pass
