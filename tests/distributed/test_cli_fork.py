"""The tests' forked launch of a command (tests/cli_fork.py, conftest.run_cli) is what `python -m swiftlite`
does in a fresh interpreter: the same resolved arguments, losses and per-rank state for a 2-process run, the
same one-line refusal and exit code; a timeout ends the command and the ranks it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests import cli_fork
from tests.conftest import cli_env, read_losses, read_state_bytes, run_cli


def _args(train, out, *extra):
    return ["sft", "--model", "tiny-llama-2l", "--train-type", "full", "--dataset", f"{train}#32",
            "--torch-dtype", "fp32", "--max-steps", "3", "--logging-steps", "1", "--save-steps", "3",
            "--gradient-accumulation-steps", "1", "--parallelism", "fsdp", "--nproc-per-node", "2",
            "--per-device-train-batch-size", "2", "--seed", "7", "--output-dir", out, *extra]


def _resolved(out):
    args = json.loads((out / "args.json").read_text())
    args["train"].pop("output_dir")
    return args


def test_a_forked_run_is_a_fresh_interpreters_run(demo_data, tmp_path):
    if not cli_fork.forkable(cli_env(), cli_env()):
        pytest.skip("SWIFTLITE_TEST_SUBPROCESS=1 / SWIFTLITE_TEST_FORK=0: every command is a real interpreter")
    train, _ = demo_data
    forked, fresh = tmp_path / "forked", tmp_path / "fresh"
    srv = cli_fork.server(cli_env())
    assert srv is not None and cli_fork.forkable(cli_env(), srv.env), "this run would not be forked"
    before = srv.last_pid
    a = run_cli(_args(train, forked), timeout=300)
    assert srv.proc.poll() is None and srv.last_pid not in (None, before)   # it went through the helper
    b = run_cli(_args(train, fresh), timeout=300, fresh=True)
    assert _resolved(forked) == _resolved(fresh)
    la, lb = read_losses(forked), read_losses(fresh)
    assert la.keys() == lb.keys() == {1, 2, 3} and la == lb
    assert read_state_bytes(forked) == read_state_bytes(fresh)
    assert a.stdout.count("step=") == b.stdout.count("step=") == 3


def test_a_refusal_is_the_same_line_and_exit_code(demo_data, tmp_path):
    train, _ = demo_data
    bad = _args(train, tmp_path / "o", "--lora_rank", "-1")
    a = run_cli(bad, check=False, timeout=120)
    b = run_cli(bad, check=False, timeout=120, fresh=True)
    assert a.returncode == b.returncode == 2
    assert a.stderr == b.stderr and a.stderr.startswith("error: ") and "Traceback" not in a.stderr
    assert not (tmp_path / "o").exists()


def test_a_timeout_ends_the_command_and_its_ranks(demo_data, tmp_path):
    train, _ = demo_data
    env = cli_env()
    srv = cli_fork.server(env)
    if srv is None:
        pytest.skip("SWIFTLITE_TEST_SUBPROCESS=1 / SWIFTLITE_TEST_FORK=0: nothing is forked")
    assert cli_fork.forkable(env, srv.env), "this test's environment is no longer the helper's"
    args = [str(a) for a in _args(train, tmp_path / "o")]
    args[args.index("--max-steps") + 1] = "100000"
    with pytest.raises(subprocess.TimeoutExpired):
        srv.run(args, env, None, timeout=8)
    pgid = srv.last_pid
    time.sleep(1)
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[2]) == pgid and stat[0] != "Z":   # fields after the name: state, ppid, pgrp
            left.append(pid)
    assert not left, f"processes of the timed-out command still running: {left}"
    assert srv.proc.poll() is None   # the helper itself lives on


def test_commands_run_at_once_and_each_exit_reaches_its_own_handle(demo_data, tmp_path):
    """`start` leaves a command running (a node, a server): a second one started after it ends first and is
    collected while the first still runs; the first, killed, is collected with its signal."""
    train, _ = demo_data
    env = cli_env()
    srv = cli_fork.server(env)
    if srv is None:
        pytest.skip("SWIFTLITE_TEST_SUBPROCESS=1 / SWIFTLITE_TEST_FORK=0: nothing is forked")
    args = [str(a) for a in _args(train, tmp_path / "long")]
    args[args.index("--max-steps") + 1] = "100000"
    args[args.index("--nproc-per-node") + 1] = "1"   # one process is enough to be still running
    first = cli_fork.start(args, env, env, None)
    second = cli_fork.start([str(a) for a in _args(train, tmp_path / "bad", "--lora_rank", "-1")], env, env, None)
    assert first is not None and second is not None and first.pid != second.pid
    out, err = second.communicate(timeout=120)
    assert second.returncode == 2 and err.startswith("error: "), err
    assert first.poll() is None   # still training
    first.kill_group()
    assert first.wait(timeout=60) == -signal.SIGKILL
    assert not (tmp_path / "bad").exists()


WORKER = """
import json, os, sys, time
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
out = sys.argv[1]
with open(f"{out}.{os.environ['RANK']}", "w") as f:
    json.dump({"env": {k: os.environ.get(k) for k in names}, "argv": sys.argv, "path0": sys.path[0]}, f)
if sys.argv[2] == "fail" and os.environ["RANK"] == "1":
    sys.exit(7)
if sys.argv[2] == "fail":
    time.sleep(300)   # ended by the launcher once rank 1 has failed
"""


def test_a_worker_script_runs_on_ranks_as_torchrun_runs_it(tmp_path):
    """conftest.run_worker: torchrun's variables for each forked rank, the script's folder first on the path;
    a rank that fails ends the others and gives the job its exit code."""
    from tests.conftest import run_worker
    if cli_fork.server(cli_env()) is None:
        pytest.skip("SWIFTLITE_TEST_SUBPROCESS=1 / SWIFTLITE_TEST_FORK=0: workers run under torchrun")
    worker = tmp_path / "w" / "worker.py"
    worker.parent.mkdir()
    worker.write_text(WORKER)
    p = run_worker(worker, [tmp_path / "ok", "ok"], procs=2, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    seen = [json.loads((tmp_path / f"ok.{r}").read_text()) for r in (0, 1)]
    for rank, rec in enumerate(seen):
        env = rec["env"]
        assert [env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")] == [str(rank)] * 2 + ["2"] * 2
        assert env["MASTER_ADDR"] == "127.0.0.1" and rec["path0"] == str(worker.parent)
        assert rec["argv"] == [str(worker), str(tmp_path / "ok"), "ok"]
    assert seen[0]["env"]["MASTER_PORT"] == seen[1]["env"]["MASTER_PORT"]
    assert seen[0]["env"]["TORCHELASTIC_RUN_ID"] == seen[1]["env"]["TORCHELASTIC_RUN_ID"] is not None
    t0 = time.monotonic()
    p = run_worker(worker, [tmp_path / "bad", "fail"], procs=2, timeout=120)
    assert p.returncode == 7 and time.monotonic() - t0 < 60   # rank 0's sleep was cut short


def test_what_is_forked_and_what_gets_a_fresh_interpreter(monkeypatch):
    monkeypatch.delenv("SWIFTLITE_TEST_SUBPROCESS", raising=False)
    monkeypatch.delenv("SWIFTLITE_TEST_FORK", raising=False)
    base = cli_env()
    # a platform's world and an injected fault are read when the command runs: the usual helper forks them
    assert cli_fork.forkable(dict(base, NPROC_PER_NODE="2", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"), base)
    assert cli_fork.forkable(dict(base, SWIFTLITE_FAULT="step=2,kind=kill"), base)
    # a value a library may read at import: not from the usual helper, from one started with that value
    for var, value in (("OMP_NUM_THREADS", "2"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "info")):
        env = dict(base, **{var: value})
        assert not cli_fork.forkable(env, base) and not cli_fork.needs_fresh(env), var
        assert cli_fork.import_time_values(env) != cli_fork.import_time_values(base)
    # allocator and loader variables: a fresh interpreter, whatever helper runs
    for var, value in (("PYTORCH_CUDA_ALLOC_CONF", "x"), ("MALLOC_ARENA_MAX", "2"), ("LD_PRELOAD", "x.so")):
        assert cli_fork.needs_fresh(dict(base, **{var: value})), var
    monkeypatch.setenv("SWIFTLITE_TEST_FORK", "0")
    assert cli_fork.needs_fresh(base) and cli_fork.server(base) is None
