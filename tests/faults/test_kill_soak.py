"""The crash soak in small (scripts/fault_soak.py runs the full 20-kill version): SIGKILL a run 3
times (a timed kill after a logged step, a kill inside a checkpoint write, one inside a step),
resume each time; no checkpoint is ever corrupt or half-written, and the final weights equal the
uninterrupted run's bit for bit."""

from __future__ import annotations


import pytest

from tests.conftest import load_script

pytestmark = pytest.mark.slow


def test_three_kills_resume_to_identical_weights(tmp_path):
    soak = load_script("fault_soak")
    lines = []
    s = soak.soak(tmp_path, kills=3, seed=3, steps=6, log=lines.append, modes=["timed", "fault", "step"])
    report = "\n".join(lines)
    assert s["kills"] == 3, report
    assert not s["problems"], report + "\n" + "\n".join(s["problems"])
    assert not s["mismatches"], report
    assert s["kinds"]["fault"] == s["kinds"]["timed"] == s["kinds"]["step"] == 1, s["kinds"]
    assert s["ok"], report
