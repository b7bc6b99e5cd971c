"""Shared test helpers: the CLI in a subprocess, demo data, reading a run's logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """Import scripts/<name>.py as a module (benchmarks and soaks that tests run in small)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_cli(args: list[str], *, timeout: float = 600, check: bool = True, env: dict | None = None,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """`python -m swiftlite ARGS` in a subprocess; on failure (check=True) show its output."""
    proc = subprocess.run([sys.executable, "-m", "swiftlite", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env or cli_env(), cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"swiftlite {' '.join(map(str, args))} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_plan_job(worker: Path, plan: list[dict], root: Path, name: str, procs: int, timeout: float) -> None:
    """Run a worker script on a JSON plan of runs (root/NAME.json), on one process or under torchrun
    with `procs` ranks, with a clean rank environment; its output goes to root/NAME.log."""
    plan_file = root / f"{name}.json"
    plan_file.write_text(json.dumps(plan, default=str))
    env = cli_env()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE"):
        env.pop(k, None)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
                if procs > 1 else [sys.executable])
    log = root / f"{name}.log"
    with open(log, "w") as fh:
        rc = subprocess.run([*launcher, str(worker), str(plan_file)], stdout=fh, stderr=subprocess.STDOUT,
                            env=env, timeout=timeout).returncode
    if rc != 0:
        raise AssertionError(f"job {name} exited {rc}\n{log.read_text()[-6000:]}")


def read_losses(run_dir: str | Path) -> dict[int, float]:
    """step -> training loss from logging.jsonl (the last record of a step wins: resumed runs)."""
    out: dict[int, float] = {}
    for line in (Path(run_dir) / "logging.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def read_state_bytes(run_dir: str | Path) -> dict[int, dict]:
    logs = Path(run_dir) / "logs"
    return {int(p.stem.replace("state_rank", "")): json.loads(p.read_text())
            for p in logs.glob("state_rank*.json")}


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> tuple[Path, Path]:
    """(train.jsonl, val.jsonl) of the demo task, small."""
    from swiftlite.demo import write_demo_data
    d = tmp_path_factory.mktemp("demo_data")
    return write_demo_data(d, n_train=256, n_val=32)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tokenization cache per test session (never the user's)."""
    os.environ["SWIFTLITE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield


#: What a launcher sets for a rank. A test that joins a process group in-process (or a library it
#: calls, such as DeepSpeed's init) may leave them in os.environ; a later CLI subprocess would then
#: think it is a rank under torchrun and skip the launcher's checks.
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leaked_rank_env():
    before = {k: os.environ.get(k) for k in RANK_VARS}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def pytest_collection_modifyitems(config, items):
    """Mark each test with its kind (its folder): `-m "not distributed"`, `-m e2e`, ..."""
    for item in items:
        kind = Path(str(item.fspath)).parent.name
        if kind in ("unit", "distributed", "e2e", "faults", "bad_inputs"):
            item.add_marker(getattr(pytest.mark, kind))


def cases(items, long=(), ids=lambda c: c[0]):
    """pytest.param for each case of a parametrized test, id `ids(case)`; the ids in `long` are marked
    `long` (run by `scripts/test.sh --all`, not by CI: the CI suite checks the claim on the others)."""
    out = []
    for c in items:
        cid = ids(c)
        out.append(pytest.param(c, id=cid, marks=[pytest.mark.long] if cid in long else []))
    unknown = set(long) - {ids(c) for c in items}
    assert not unknown, f"long names no case: {sorted(unknown)}"
    return out


class LazyRuns(dict):
    """A module's training runs, each made the first time a test asks for it (`train(key)`), then
    kept: a test left out (`-m "not long"`) costs nothing, and the runs the others share still run once."""

    def __init__(self, train):
        super().__init__()
        self._train = train

    def __missing__(self, key):
        self[key] = value = self._train(key)
        return value
