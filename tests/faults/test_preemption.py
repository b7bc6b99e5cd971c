"""Checkpoint on a signal, as clusters preempt: SIGTERM to every process (SLURM), SIGUSR1 to the
launcher alone; the run saves the step it was on, exits 75, and `--resume auto` reproduces the
uninterrupted run's later losses bit for bit. A second signal during that save abandons it cleanly."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from fault_helpers import TINY, env_for, swiftlite
from swiftlite import checkpoint as ckpt
from tests.conftest import read_losses, spawn_cli

pytestmark = pytest.mark.slow
STEPS = 24


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from swiftlite.demo import make_rows
    d = tmp_path_factory.mktemp("preempt")
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in make_rows(64, 0)) + "\n")
    return d


def _args(backend: str, out: str, *extra: str) -> list[str]:
    return ["sft", *TINY, "--dataset", "train.jsonl", "--per-device-train-batch-size", "2", "--parallelism",
            backend, "--nproc-per-node", "2", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", str(STEPS), "--output-dir", out, *extra]


def _start(args, env, cwd):
    return spawn_cli(args, env=env, cwd=cwd)


def _wait_for_step(run_dir, step: int, proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.communicate()[1][-2000:]}")
        if (run_dir / "logging.jsonl").is_file() and max(read_losses(run_dir) or {0: 0}) >= step:
            return
        time.sleep(0.1)
    raise AssertionError("the run did not reach the step in time")


_FULL: dict[str, dict[int, float]] = {}


def _uninterrupted(data, backend):
    """The uninterrupted run's losses (one run per backend, shared by the launchers' cases)."""
    if backend not in _FULL:
        env = env_for(data / "cache")
        r, _ = swiftlite(_args(backend, f"full-{backend}"), env, data, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        _FULL[backend] = read_losses(data / f"full-{backend}")
    return _FULL[backend]


@pytest.mark.parametrize("backend,how,launcher", [("fsdp", "all", "fork"), ("zero3", "launcher", "fork"),
                                                 pytest.param("fsdp", "launcher", "torchrun", marks=pytest.mark.long)])
def test_signal_saves_the_step_and_resume_is_exact(data, backend, how, launcher):
    full = _uninterrupted(data, backend)
    env = env_for(data / "cache")
    out = f"pre-{backend}-{launcher}"
    proc = _start(_args(backend, out, "--launcher", launcher), env, data)
    _wait_for_step(data / out, 4, proc)
    if how == "all":   # SLURM: SIGTERM to every process of the job
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            p.send_signal(signal.SIGTERM)
    else:              # SIGUSR1 to the launcher alone: it passes it on
        proc.send_signal(signal.SIGUSR1)
    t0 = time.monotonic()
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]
    assert time.monotonic() - t0 < 60  # well within a grace period
    marker = json.loads((data / out / "preempted").read_text())
    step = marker["step"]
    assert 4 <= step < STEPS and marker["checkpoint"] == f"checkpoint-{step}"
    assert ckpt.read_latest(data / out) == f"checkpoint-{step}" and "preempted by" in stdout
    assert max(read_losses(data / out)) == step   # it stopped at the step it was on
    r, _ = swiftlite(_args(backend, out, "--resume", "auto", "--launcher", launcher), env, data, timeout=600)
    assert r.returncode == 0 and f"resuming from checkpoint-{step}" in r.stdout, r.stderr[-3000:]
    resumed = read_losses(data / out)
    assert {s: resumed[s] for s in range(step + 1, STEPS + 1)} == {s: full[s] for s in range(step + 1, STEPS + 1)}
    assert not (data / out / "preempted").exists()   # the resumed run cleared the marker


def test_second_signal_during_the_save_abandons_it(data):
    env = env_for(data / "cache", SWIFTLITE_FAULT="phase=checkpoint,kind=sleep")
    out = "twice"
    proc = _start(_args("fsdp", out, "--save-steps", "2"), env, data)
    # Step 3 logged, not checkpoint-2 published: a signal landing between that publish and the end of its
    # save would find step 2 saved already and end the run (75) with no save left for a second signal.
    # After step 3 the first signal is followed by a save of its own (step 3) or by step 4's, each sleeping
    # SLEEP_S (6 s): the second signal, 3 s later, arrives while it is being written.
    _wait_for_step(data / out, 3, proc)
    assert ckpt.read_latest(data / out) == "checkpoint-2"
    proc.send_signal(signal.SIGTERM)
    time.sleep(3)  # the preemption save is now sleeping in its checkpoint phase
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode not in (0, 75) and "save was abandoned" in stderr, stderr[-2000:]
    assert ckpt.read_latest(data / out) in ("checkpoint-2", "checkpoint-4")
    latest = data / out / ckpt.read_latest(data / out)
    assert ckpt.verify_checkpoint(latest) is None
    assert not (data / out / "preempted").exists()
    r, _ = swiftlite(_args("fsdp", out, "--resume", "auto", "--gradient-accumulation-steps", "1",
                           "--gradient-checkpointing", "false", "--max-steps", "6"), env_for(data / "cache"), data,
                     timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
