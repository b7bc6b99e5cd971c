"""Runs that meet the real world: a nan/inf step, a full disk during a save, a dataset edited
between a run and its resume, a second run started on the same folder."""

from __future__ import annotations

import json
import math
import time

import pytest
from safetensors.torch import load_file

from fault_helpers import TINY, env_for, swiftlite
from swiftlite import checkpoint as ckpt
from tests.conftest import spawn_cli

pytestmark = pytest.mark.slow


@pytest.fixture()
def folder(tmp_path):
    from swiftlite.demo import make_rows
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in make_rows(48, 0)) + "\n")
    return tmp_path


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "logging.jsonl").read_text().splitlines()]


def _all_finite(run_dir) -> bool:
    """Every weight of every checkpoint's HF copy is finite."""
    for c in ckpt.list_checkpoints(run_dir):
        for f in (c / "model").glob("*.safetensors"):
            for t in load_file(str(f)).values():
                if t.is_floating_point() and not bool(t.isfinite().all()):
                    return False
    return True


BASE = ["sft", *TINY, "--dataset", "train.jsonl", "--per-device-train-batch-size", "4", "--output-dir", "run"]


def test_nan_stops_with_one_line_naming_the_step(folder):
    env = env_for(folder / "cache")
    r, _ = swiftlite([*BASE, "--parallelism", "fsdp", "--nproc-per-node", "2", "--learning-rate", "1e8",
                      "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "8", "--save-steps", "1"], env, folder)
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: ") and " at step " in err and ("nan" in err or "inf" in err), r.stderr[-2000:]
    assert "last good checkpoint: checkpoint-" in err or "no checkpoint saved yet" in err
    assert _all_finite(folder / "run")


def test_nan_skip_counts_the_step_and_goes_on(folder):
    env = env_for(folder / "cache", SWIFTLITE_FAULT="step=3,phase=grads,kind=nan")
    r, _ = swiftlite([*BASE, "--parallelism", "fsdp", "--nproc-per-node", "2", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "5",
                      "--nan-policy", "skip"], env, folder)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = _records(folder / "run")
    skipped = [x for x in recs if "skipped_step" in x]
    assert [x["step"] for x in skipped] == [3] and "grad norm is nan" in skipped[0]["skipped_step"]
    assert sorted(x["step"] for x in recs if "loss" in x) == [1, 2, 4, 5]
    assert all(math.isfinite(x["loss"]) for x in recs if "loss" in x) and _all_finite(folder / "run")
    # the skipped step left the weights alone: stopping policy on the same fault names the step
    env2 = env_for(folder / "cache", SWIFTLITE_FAULT="step=3,phase=grads,kind=nan")
    r2, _ = swiftlite([*BASE[:-1], "run2", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "5"], env2, folder)
    assert r2.returncode == 2 and "grad norm is nan at step 3" in r2.stderr


def test_full_disk_during_a_save_keeps_every_earlier_checkpoint(folder):
    env = env_for(folder / "cache", SWIFTLITE_FAULT="step=4,phase=checkpoint,kind=enospc")
    r, _ = swiftlite([*BASE, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "6", "--save-steps", "2"], env, folder)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "no space left writing checkpoint-4" in r.stderr and str(folder / "run") in r.stderr
    run = folder / "run"
    assert [c.name for c in ckpt.list_checkpoints(run)] == ["checkpoint-2"]
    assert ckpt.read_latest(run) == "checkpoint-2"
    assert ckpt.verify_checkpoint(run / "checkpoint-2") is None    # intact: its manifest and every checksum hold
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp-")]
    r2, _ = swiftlite([*BASE, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "6", "--save-steps", "2", "--resume"], env_for(folder / "cache"), folder)
    assert r2.returncode == 0 and "resuming from checkpoint-2" in r2.stdout, r2.stderr[-2000:]
    assert ckpt.read_latest(run) == "checkpoint-6"


def test_resume_after_the_dataset_changed_is_refused_naming_it(folder):
    env = env_for(folder / "cache")
    r, _ = swiftlite([*BASE, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "2"], env, folder)
    assert r.returncode == 0, r.stderr[-2000:]
    from swiftlite.demo import make_rows
    with open(folder / "train.jsonl", "a") as f:
        f.write("\n".join(json.dumps(x) for x in make_rows(8, 9)) + "\n")
    r2, _ = swiftlite([*BASE, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "4", "--resume"], env, folder)
    assert r2.returncode == 2 and r2.stderr.count("\n") == 1
    assert "other data" in r2.stderr and "data.rows" in r2.stderr and "data.sha256" in r2.stderr
    r3, _ = swiftlite([*BASE, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "4", "--resume", "--ignore-data-skip"], env, folder)
    assert r3.returncode == 0, r3.stderr[-2000:]
    assert "changed data.rows" in r3.stdout and ckpt.read_latest(folder / "run") == "checkpoint-4"


def test_second_run_on_the_same_folder_stops_naming_the_first(folder):
    env = env_for(folder / "cache")
    # the first run trains until it is killed below (its lock must still be held then)
    first = spawn_cli([*BASE, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false",
                       "--max-steps", "100000"], env=env, cwd=folder)
    try:
        lock = folder / "run" / ".lock"
        deadline = time.monotonic() + 120
        while not (lock.is_file() and lock.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert lock.read_text().split()[0] == str(first.pid)
        r, _ = swiftlite([*BASE, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "4", "--overwrite-output-dir"], env, folder)
        assert r.returncode == 2 and f"pid {first.pid}" in r.stderr, r.stderr[-2000:]
        # the refusal comes from preflight (no timing here: the machine is busy with the first run): one
        # line, and nothing trained or launched
        assert r.stdout.strip() == "" and r.stderr.count("\n") == 1, (r.stdout[-2000:], r.stderr[-2000:])
    finally:
        first.kill()
        first.wait()
    # the first run is gone: its lock is taken over, with a notice
    r2, _ = swiftlite([*BASE, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "2", "--overwrite-output-dir"], env, folder)
    assert r2.returncode == 0 and f"taking over" in r2.stdout and f"pid {first.pid}" in r2.stdout, r2.stdout[-2000:]
