"""A ZeRO checkpoint resumed at another world size, and under a torch backend, through DeepSpeed's
universal format (swiftlite/checkpoint/universal.py).

ZeRO-3 and ZeRO-2 on 2 processes write checkpoint-4 of an 8-step run (tiny-llama-2l, full fine-tune,
fp32, global batch 4 at every world size). Resumed on 1 process and on 4, steps 5-8 are within 1e-4
of the uninterrupted run (measured: within 3e-7). A kill during the conversion (SWIFTLITE_FAULT
phase=convert) leaves the checkpoint intact and the next resume converts again. Across formats, a
ZeRO-3 checkpoint resumed under `single`, and a `single` (DCP) one under ZeRO-3 on 2 processes, match
too (fp32 weights, AdamW moments and step, LR schedule, data position).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.conftest import cli_env, read_losses, run_cli

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 4
BASE = ["--model", "tiny-llama-2l", "--train-type", "full", "--torch-dtype", "fp32", "--logging-steps", "1",
        "--max-length", "64", "--learning-rate", "1e-3", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "8", "--save-steps", "4"]
TOL = 1e-4


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    from swiftlite.demo import write_demo_data
    root = tmp_path_factory.mktemp("resume_world_size")
    write_demo_data(root / "data", n_train=64, n_val=4)
    return root


def _env(root: Path, **extra: str) -> dict:
    env = cli_env(SWIFTLITE_CACHE=str(root / "cache"), **extra)
    env.pop("SWIFTLITE_FAULT", None) if "SWIFTLITE_FAULT" not in extra else None
    return env


def _sft(root: Path, out: str, backend: str, nproc: int, resume: Path | None = None, *, check: bool = True,
         **env: str):
    args = ["sft", *BASE, "--dataset", root / "data" / "train.jsonl", "--parallelism", backend,
            "--per-device-train-batch-size", GLOBAL_BATCH // nproc, "--output-dir", root / out]
    if nproc > 1:
        args += ["--nproc-per-node", nproc]
    if resume is not None:
        args += ["--resume-from", resume]
    return run_cli(args, env=_env(root, **env), check=check)


_full: dict[str, Path] = {}


def full_run(root: Path, stage: str) -> Path:
    """The uninterrupted 2-process run (its checkpoint-4 is what the resumes start from)."""
    if stage not in _full:
        _sft(root, f"full_{stage}", stage, 2)
        _full[stage] = root / f"full_{stage}"
    return _full[stage]


def _records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "logging.jsonl").read_text().splitlines()) if "loss" in r}


def assert_continues(full: Path, resumed: Path) -> None:
    """Steps 5-8 within TOL of the uninterrupted run, with its LR schedule and its batches."""
    a, b = read_losses(full), read_losses(resumed)
    assert sorted(b) == [5, 6, 7, 8], b
    worst = max(abs(a[s] - b[s]) for s in b)
    assert worst < TOL, (worst, a, b)
    assert a[8] < a[1] - 0.5                       # it trained: the comparison is not of flat curves
    ra, rb = _records(full), _records(resumed)
    for s in b:
        assert rb[s]["lr"] == pytest.approx(ra[s]["lr"], rel=1e-9), (s, ra[s], rb[s])   # schedule step carried
        assert rb[s]["real_tokens"] == ra[s]["real_tokens"], (s, ra[s], rb[s])         # the same batches


def test_zero3_resumes_on_one_and_four_processes(root):
    full = full_run(root, "zero3")
    ckpt = full / "checkpoint-4"
    r1 = _sft(root, "z3_on1", "zero3", 1, ckpt)
    assert "converting the ZeRO checkpoint to DeepSpeed's universal format" in r1.stdout
    assert ("notice: resumed checkpoint-4 (deepspeed, 2 process(es)) as zero3 x 1 through DeepSpeed's universal "
            "format: carried over the fp32 weights, the AdamW moments and step, the LR schedule, the data position "
            "(step 4); not carried: the RNG states") in r1.stdout
    assert_continues(full, root / "z3_on1")
    r4 = _sft(root, "z3_on4", "zero3", 4, ckpt)
    assert "using its universal conversion" in r4.stdout and "converting" not in r4.stdout   # converted once
    assert_continues(full, root / "z3_on4")
    from swiftlite.checkpoint.store import verify_checkpoint
    assert verify_checkpoint(ckpt) is None                      # the original checkpoint is untouched
    assert verify_checkpoint(ckpt / "ds_universal") is None      # and its conversion has its own manifest


@pytest.mark.long
def test_zero2_resumes_on_four_and_after_a_kill_during_conversion_on_one(root):
    from swiftlite.checkpoint.store import verify_checkpoint
    full = full_run(root, "zero2")
    ckpt = full / "checkpoint-4"
    killed = _sft(root, "z2_on1", "zero2", 1, ckpt, check=False, SWIFTLITE_FAULT="step=4,phase=convert,kind=kill")
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL, 137), (killed.returncode, killed.stderr[-2000:])
    assert "injected kill" in killed.stderr
    assert (ckpt / ".tmp-ds_universal").is_dir() and not (ckpt / "ds_universal").exists()
    assert verify_checkpoint(ckpt) is None                      # ds/ and every file of the manifest intact
    r1 = _sft(root, "z2_on1", "zero2", 1, ckpt)                  # the same command again
    assert "converting the ZeRO checkpoint" in r1.stdout        # the interrupted conversion is redone
    assert not (ckpt / ".tmp-ds_universal").exists() and verify_checkpoint(ckpt / "ds_universal") is None
    assert_continues(full, root / "z2_on1")
    _sft(root, "z2_on4", "zero2", 4, ckpt)
    assert_continues(full, root / "z2_on4")


def test_across_formats_zero3_to_single_and_dcp_to_zero3(root):
    full = full_run(root, "zero3")
    r = _sft(root, "z3_single", "single", 1, full / "checkpoint-4")
    assert "as single x 1 through DeepSpeed's universal format: carried over the fp32 weights, the AdamW moments" \
        in r.stdout
    assert_continues(full, root / "z3_single")
    # the other way: a torch backend's DCP checkpoint (1 process) continued by ZeRO-3 on 2
    _sft(root, "full_single", "single", 1)
    ckpt = root / "full_single" / "checkpoint-4"
    r = _sft(root, "single_z3", "zero3", 2, ckpt)
    assert "converting the DCP checkpoint to DeepSpeed's universal format" in r.stdout
    assert "notice: resumed checkpoint-4 (single, 1 process(es)) as zero3 x 2 through DeepSpeed's universal" in r.stdout
    assert_continues(root / "full_single", root / "single_z3")
