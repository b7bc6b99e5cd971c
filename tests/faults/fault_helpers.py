"""Shared by the tests in tests/faults: environment and a `swiftlite` subprocess runner."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
TINY = ["--model", "tiny-llama-2l", "--train-type", "full", "--torch-dtype", "fp32", "--logging-steps", "1"]


def env_for(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE",
                        "NNODES", "NODE_RANK", "SWIFTLITE_FAULT", "SWIFTLITE_PREFLIGHT_DONE", "TORCHELASTIC_RUN_ID")}
    env.update({"SWIFTLITE_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    env.update(extra)
    return env


def swiftlite(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 300
              ) -> tuple[subprocess.CompletedProcess, float]:
    """`swiftlite ARGS` in a process of its own (conftest.run_cli's: forked from a warm helper where that is
    the same run) and its wall time."""
    from tests.conftest import run_cli
    t0 = time.monotonic()
    r = run_cli(args, env=env, cwd=cwd, timeout=timeout, check=False, own_process=True)
    return r, time.monotonic() - t0
