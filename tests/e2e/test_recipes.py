"""Every recipe runs with --dry-run: its flags are valid and it prints the launch plan."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli_env

RECIPES = sorted(p for p in (ROOT / "recipes").iterdir() if p.suffix in (".sh", ".sbatch"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_dry_run(recipe: Path, demo_data, tmp_path):
    train, _ = demo_data
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    env = cli_env(HOSTFILE=str(hostfile), DATA=str(train), DATASET=str(train), NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                  OUTPUT_DIR=str(tmp_path / "out"), DRY_RUN="1")
    env["PATH"] = str(Path(os.sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("NPROC_PER_NODE", None)
    proc = subprocess.run(["bash", str(recipe), "--dry-run"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend:" in proc.stdout and "launch:" in proc.stdout, proc.stdout
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"


def test_slurm_recipe_runs_hsdp(demo_data, tmp_path):
    """PARALLELISM=hsdp: the Slurm recipe plans hsdp over its 2 nodes x 8 processes."""
    train, _ = demo_data
    env = cli_env(DATA=str(train), OUTPUT_DIR=str(tmp_path / "out"), DRY_RUN="1", PARALLELISM="hsdp")
    env["PATH"] = str(Path(os.sys.executable).parent) + os.pathsep + env.get("PATH", "")
    for k in ("NPROC_PER_NODE", "SLURM_JOB_ID", "SLURM_NODELIST", "SLURM_JOB_NODELIST"):
        env.pop(k, None)
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "slurm_fsdp2.sbatch")], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend:        hsdp" in proc.stdout and "2 node(s) x 8 process(es) = 16" in proc.stdout, proc.stdout
