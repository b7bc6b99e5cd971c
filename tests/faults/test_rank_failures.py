"""A crashed or hung rank ends the whole 2-process job, and the last line names the rank.

SWIFTLITE_FAULT makes rank 1 fail after optimizer step 2 (swiftlite/faults.py)."""

from __future__ import annotations

import re

import pytest

from fault_helpers import TINY, env_for, swiftlite

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from swiftlite.demo import write_demo_data
    d = tmp_path_factory.mktemp("rank_failures")
    write_demo_data(d / "data", n_train=40, n_val=4)
    return d


def _last_error(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.startswith("error: ")]
    assert lines, stderr[-3000:]
    return lines[-1]


def test_raise_on_rank1_ends_the_job_naming_rank1(work):
    env = env_for(work / "cache", SWIFTLITE_FAULT="rank=1,step=2,kind=raise")
    r, dt = swiftlite(["sft", *TINY, "--dataset", "data/train.jsonl", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "4", "--nproc-per-node", "2",
                       "--ddp-timeout", "60", "--output-dir", "raise"], env, work, timeout=240)
    assert r.returncode != 0
    line = _last_error(r.stderr)
    assert line == "error: rank1 failed: InjectedFault: injected fault (rank 1, step 2, phase step)", line
    assert dt < 200, f"took {dt:.0f} s"
    assert not (work / "raise" / "checkpoint-4").exists()


def test_hang_on_rank1_ends_within_the_ddp_timeout_naming_rank1(work):
    """--ddp-timeout 20: rank 0's next collective gives up after 20 s, the launcher stops rank 1 and
    reports where it hung. The job ends within the timeout plus shutdown, counted from the hang."""
    env = env_for(work / "cache", SWIFTLITE_FAULT="rank=1,step=2,kind=hang")
    r, dt = swiftlite(["sft", *TINY, "--dataset", "data/train.jsonl", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "4", "--nproc-per-node", "2",
                       "--ddp-timeout", "20", "--output-dir", "hang"], env, work, timeout=300)
    assert r.returncode != 0
    line = _last_error(r.stderr)
    assert re.match(r"error: rank1 hung: stopped answering collectives \(stuck at faults\.py:\d+ in maybe_inject\(\)",
                    line), line
    assert "rank0 gave up after --ddp-timeout 20s" in line and "Timed out" in line, line
    # from the hang to the end of the job: the 20 s timeout plus the launcher's shutdown
    hang_at = (work / "hang" / "logging.jsonl").stat().st_mtime  # last step logged before the hang
    end = (work / "hang" / "logs" / "rank1.stack").stat().st_mtime  # rank 1 stopped by the launcher
    assert 15 <= end - hang_at <= 50, f"hang -> stop took {end - hang_at:.0f} s"
    assert dt < 240, f"took {dt:.0f} s"
