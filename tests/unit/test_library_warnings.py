"""Library warnings of a training process (torch.distributed's c10d FutureWarnings, DDP's and transformers'
renamed arguments) go to <run>/logs/warnings_rank<r>.log, not the console."""

from __future__ import annotations

import warnings

import pytest

from swiftlite.train.library_warnings import keep_library_warnings
from tests.conftest import run_cli


def test_warnings_held_until_the_run_folder_exists_then_written(tmp_path, capsys):
    log = keep_library_warnings()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            log._previous = warnings.showwarning   # what catch_warnings restores to
            warnings.showwarning = log._show
            warnings.warn("before the folder", FutureWarning)
            log.open(tmp_path, 1)
            warnings.warn("after", DeprecationWarning)
    finally:
        log.close()
    text = (tmp_path / "logs" / "warnings_rank1.log").read_text()
    assert "FutureWarning: before the folder" in text and "DeprecationWarning: after" in text
    assert text.index("before the folder") < text.index("after") and log.count == 2
    assert capsys.readouterr().err == ""


def test_a_ddp_run_prints_no_library_warning(tmp_path, demo_data):
    train, _ = demo_data
    out = tmp_path / "o"
    proc = run_cli(["sft", "--model", "tiny-llama-2l", "--dataset", f"{train}#16", "--max-steps", "1",
                    "--gradient-accumulation-steps", "1", "--torch-dtype", "fp32", "--parallelism", "ddp",
                    "--nproc-per-node", "2", "--save-hf-model", "false", "--output-dir", out], timeout=300,
                    fresh=True)
    assert "Warning" not in proc.stderr and "warnings.warn" not in proc.stderr, proc.stderr[-2000:]
    kept = (out / "logs" / "warnings_rank0.log").read_text()
    assert "FutureWarning" in kept and "broadcast_buffers" in kept      # DDP's renamed argument, kept
    assert "gradient_checkpointing_enable" not in kept                 # swiftlite's own call: silenced


@pytest.mark.parametrize("parallelism", ["fsdp", "zero2", "zero3"])
def test_sharded_runs_print_no_library_warning(tmp_path, demo_data, parallelism):
    """FSDP2 and DeepSpeed (their own FutureWarnings and deprecations, torch.distributed's c10d ones): kept
    in the run's warnings log, none on the console."""
    train, _ = demo_data
    out = tmp_path / "o"
    proc = run_cli(["sft", "--model", "tiny-llama-2l", "--dataset", f"{train}#16", "--max-steps", "1",
                    "--gradient-accumulation-steps", "1", "--torch-dtype", "fp32", "--parallelism", parallelism,
                    "--nproc-per-node", "2", "--save-hf-model", "false", "--output-dir", out], timeout=300,
                    fresh=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Warning" not in proc.stderr and "warnings.warn" not in proc.stderr, proc.stderr[-2000:]
    if parallelism.startswith("zero"):   # DeepSpeed warns on every run here: kept, not shown
        assert "Warning" in (out / "logs" / "warnings_rank0.log").read_text()
