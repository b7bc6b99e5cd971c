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


#: Commands a test may run inside the pytest process (`run_cli`): those that train, export or plan in the
#: calling process. Each CLI subprocess pays about 7 s of imports (torch, transformers, peft, bitsandbytes)
#: before doing a few seconds of work; in-process, the suite pays them once.
IN_PROCESS_COMMANDS = {"sft", "pt", "rlhf", "export", "estimate", "infer", "models"}

#: Single-process commands with DeepSpeed (--parallelism zero*, offload presets, a JSON) still get their
#: own process: DeepSpeed and transformers' zero3 hook keep process-wide state that the next run would see.
#: Environment variables that make a command more than this one process (a launcher forks ranks, a
#: platform names a world) or make it end the process on purpose (SWIFTLITE_FAULT: kill, exit, hang).
_OWN_PROCESS_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NNODES", "NODE_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                     "SWIFTLITE_FAULT", "PET_NNODES", "MASTER_ADDR")


def wants_own_process(args: list[str], env: dict[str, str]) -> bool:
    """True where `run_cli` must start `python -m swiftlite`: anything but one single-process command."""
    if os.environ.get("SWIFTLITE_TEST_SUBPROCESS") == "1":   # run every command as its own process
        return True
    if not args or str(args[0]) not in IN_PROCESS_COMMANDS:
        return True
    if env.get("NPROC_PER_NODE", "1") not in ("", "1"):
        return True
    for i, a in enumerate(args[:-1]):
        flag = a.replace("_", "-")
        if flag in ("--nproc-per-node", "--nnodes") and args[i + 1] != "1":
            return True
        if flag in ("--parallelism", "--parallelism-type", "--deepspeed") and _deepspeed(args[i + 1]):
            return True    # DeepSpeed keeps process-wide state (its comm backend, transformers' zero3 hook)
        if flag == "--config" and any(w in Path(args[i + 1]).read_text(errors="replace")
                                      for w in ("nproc", "zero", "deepspeed", ".json")):
            return True    # a config file that may start ranks or choose DeepSpeed
    if any(a.replace("_", "-").startswith(("--nproc-per-node=", "--nnodes=")) and not a.endswith("=1")
           for a in args):
        return True
    if any(k.startswith("MALLOC_") for k in env):
        return True    # allocator settings are read at start-up: a memory measurement's process
    return any(env.get(k) for k in _OWN_PROCESS_VARS)


def _deepspeed(value: str) -> bool:
    v = value.lower()
    return v.startswith("zero") or v.endswith(".json") or "offload" in v


def run_cli(args: list[str], *, timeout: float = 600, check: bool = True, env: dict | None = None,
            cwd: str | Path | None = None, own_process: bool = False,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """`swiftlite ARGS`; on failure (check=True) show its output.

    A single-process command runs in this process (`main_in_process`), with `env` as its whole
    environment and its output captured, as a subprocess would see and give them. `own_process=True`
    (or a command that launches ranks, injects a fault, or sets SWIFTLITE_TEST_SUBPROCESS=1) runs it as
    `python -m swiftlite` instead: for what must not happen to the test process (a kill, a hang, a plugin
    that patches torch or swiftlite functions for good, a registration that outlives the run). Such a
    command is forked from the worker's warm helper interpreter where that gives the same run
    (`forked_cli`, tests/cli_fork.py: the helper never runs a command, so what one command patches or
    registers dies with its fork). `fresh=True` always starts a new interpreter: for what only a fresh one
    shows (first-time import warnings, memory high-water marks that include the imports)."""
    env = env or cli_env()
    args = [str(a) for a in args]
    if fresh or own_process or wants_own_process(args, env):
        proc = None if fresh else forked_cli(args, env, cwd, timeout)
        if proc is None:
            proc = subprocess.run([sys.executable, "-m", "swiftlite", *args], capture_output=True,
                                  text=True, timeout=timeout, env=env, cwd=cwd)
    else:
        proc = main_in_process(args, env=env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"swiftlite {' '.join(args)} exited {proc.returncode}\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


#: Commands the warm helper may fork (tests/cli_fork.py imports what they import): those that may run in
#: this process, and the servers (a rollout engine, a teacher's OpenAI-style endpoint).
FORKABLE_COMMANDS = IN_PROCESS_COMMANDS | {"rollout", "deploy"}


def forked_cli(args: list[str], env: dict[str, str], cwd: str | Path | None,
               timeout: float) -> subprocess.CompletedProcess | None:
    """A command that needs a process of its own, forked from this worker's warm helper interpreter for its
    import-time variables (tests/cli_fork.py) and waited for; None where it needs a fresh interpreter
    (`cli_fork.needs_fresh`: allocator variables among others) or is none of FORKABLE_COMMANDS."""
    if not args or args[0] not in FORKABLE_COMMANDS:
        return None
    from tests import cli_fork
    return cli_fork.run(args, env, cli_env(), cwd, timeout)


def spawn_cli(args: list, *, env: dict | None = None, cwd: str | Path | None = None,
              merge_stderr: bool = False, log: Path | None = None):
    """`python -m swiftlite ARGS` started and left running (a node of a two-node run, a server): a handle
    with Popen's pid/poll/wait/communicate/terminate/kill, forked from the warm helper where `forked_cli`
    would fork it, else a subprocess.Popen. Its output is piped (text; stderr into stdout with
    `merge_stderr`), or written to the file `log` (both streams)."""
    env = env or cli_env()
    args = [str(a) for a in args]
    if args and args[0] in FORKABLE_COMMANDS:
        from tests import cli_fork
        handle = cli_fork.start(args, env, cli_env(), cwd, merge_stderr, log)
        if handle is not None:
            return handle
    cmd = [sys.executable, "-m", "swiftlite", *args]
    if log is not None:
        with open(log, "w") as f:
            return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    return subprocess.Popen(cmd, env=env, cwd=cwd, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)


def main_in_process(args: list[str], *, env: dict[str, str] | None = None,
                    cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """swiftlite's CLI entry in this process, as `python -m swiftlite ARGS` would run it.

    What a fresh process would not inherit is set for the call and put back after: the environment
    (`env`, whole), the working directory, sys.argv, one intra-op thread (cli_env's OMP_NUM_THREADS=1,
    which torch reads only at start-up), signal handlers, warning filters, logging handlers, the plugin
    registries (`--external_plugins` files register rewards and backends). An exception the CLI does
    not turn into an exit code is printed as the interpreter would, exit 1."""
    import contextlib
    import io
    import logging
    import signal
    import traceback
    import warnings

    import torch

    from swiftlite.cli import main
    from swiftlite.parallel import base as backends
    from swiftlite.plugin import orms
    env = env if env is not None else cli_env()
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    saved_threads = torch.get_num_threads()
    sigs = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)]
    saved_sigs = {s: signal.getsignal(s) for s in sigs}
    roots = [logging.getLogger(), logging.getLogger("swiftlite")]
    saved_handlers = [(lg, list(lg.handlers), lg.level) for lg in roots]
    backends._load_builtins()
    saved_orms, saved_backends = dict(orms), (dict(backends._REGISTRY), dict(backends._ALIASES))
    out, err = io.StringIO(), io.StringIO()
    rc = 1
    os.environ.clear()
    os.environ.update(env)
    if "SWIFTLITE_CACHE" in saved_env:   # the session's cache (_isolated_cache), never the user's
        os.environ.setdefault("SWIFTLITE_CACHE", saved_env["SWIFTLITE_CACHE"])
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = ["swiftlite", *args]
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", saved_threads)))
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(args))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                traceback.print_exc()
                rc = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
        torch.set_num_threads(saved_threads)
        for s, h in saved_sigs.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        for lg, handlers, level in saved_handlers:
            for h in lg.handlers[:]:
                if h not in handlers:
                    lg.removeHandler(h)
                    h.close()
            lg.setLevel(level)
        orms.clear()
        orms.update(saved_orms)
        for live, kept in zip((backends._REGISTRY, backends._ALIASES), saved_backends):
            live.clear()
            live.update(kept)
    return subprocess.CompletedProcess(["swiftlite", *args], rc, out.getvalue(), err.getvalue())


#: What a launcher sets for a rank: a worker's environment starts without them (a clean rank environment).
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE",
             "TORCHELASTIC_RUN_ID", "GROUP_RANK")


def run_worker(worker: Path, args: list, *, procs: int = 1, env: dict | None = None, cwd: str | Path | None = None,
               timeout: float = 600, log: Path | None = None) -> subprocess.CompletedProcess:
    """A test's worker script (`python WORKER ARGS`, or `torchrun --standalone --nproc-per-node=PROCS WORKER
    ARGS`) in a clean rank environment: forked from the warm helper where that gives the same run
    (tests/cli_fork.py's `_ranks` sets torchrun's variables for each forked rank), else in fresh interpreters.
    Its output is captured, or written to `log` (both streams). A timeout kills it and its ranks."""
    env = dict(env or cli_env())
    for k in RANK_VARS:
        env.pop(k, None)
    args = [str(a) for a in args]
    from tests import cli_fork
    handle = cli_fork.start(args, env, cli_env(), cwd, log=log, script=Path(worker), procs=procs)
    if handle is not None:
        try:
            out, err = handle.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            handle.kill_group()
            handle.wait(60)
            raise
        return subprocess.CompletedProcess(handle.args, handle.returncode, out, err)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
                if procs > 1 else [sys.executable])
    cmd = [*launcher, str(worker), *args]
    if log is None:
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout).returncode
    return subprocess.CompletedProcess(cmd, rc, "", "")


def run_plan_job(worker: Path, plan: list[dict], root: Path, name: str, procs: int, timeout: float) -> None:
    """Run a worker script on a JSON plan of runs (root/NAME.json), on one process or on `procs` ranks
    (`run_worker`); its output goes to root/NAME.log."""
    plan_file = root / f"{name}.json"
    plan_file.write_text(json.dumps(plan, default=str))
    log = root / f"{name}.log"
    rc = run_worker(worker, [plan_file], procs=procs, timeout=timeout, log=log).returncode
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


@pytest.fixture(autouse=True)
def _no_leaked_env():
    """Each test gets back the environment it started with. A test that joins a process group in-process (or
    a library it calls: DeepSpeed's init sets RANK, WORLD_SIZE, MASTER_PORT, TORCH_EXTENSIONS_DIR) would
    otherwise leave them in os.environ: a later CLI subprocess would think it is a rank under torchrun and
    skip the launcher's checks, and a forked one (tests/cli_fork.py) would find its environment different
    from the helper's and start a fresh interpreter for every command after it."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


#: The order the folders run in: the files of long multi-process tests first, the many short unit tests last.
#: pytest-xdist (`--dist loadfile`) hands files to its workers in collection order, so a long file collected last
#: would run alone at the end while the other worker waits; short files at the end fill the workers evenly.
STAGE_ORDER = ("faults", "distributed", "e2e", "bad_inputs", "unit")


def pytest_collection_modifyitems(config, items):
    """Mark each test with its kind (its folder): `-m "not distributed"`, `-m e2e`, ...; order the folders as
    STAGE_ORDER (each file's tests keep their order)."""
    def stage(item) -> int:
        kind = Path(str(item.fspath)).parent.name
        return STAGE_ORDER.index(kind) if kind in STAGE_ORDER else len(STAGE_ORDER)
    for item in items:
        kind = Path(str(item.fspath)).parent.name
        if kind in STAGE_ORDER:
            item.add_marker(getattr(pytest.mark, kind))
    items.sort(key=stage)


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
