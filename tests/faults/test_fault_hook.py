"""SWIFTLITE_FAULT parsing and matching (swiftlite/faults.py); no training here."""

import os
import signal
import subprocess
import sys

import pytest

from swiftlite import faults
from swiftlite.errors import UserError


def test_parse_full_spec():
    f = faults.parse("rank=1,step=3,kind=raise")
    assert (f.rank, f.step, f.kind, f.phase) == (1, 3, "raise", "step")
    f = faults.parse("kind=kill; phase=checkpoint")
    assert (f.rank, f.step, f.kind, f.phase) == (None, None, "kill", "checkpoint")


@pytest.mark.parametrize("spec, msg", [
    ("rank=1,step=3", "kind must be one of"),
    ("kind=explode", "kind must be one of"),
    ("kind=raise,phase=eval", "phase must be one of"),
    ("kind=raise,step=three", "must be integers"),
    ("kind=raise,when=now", "unknown key 'when'"),
    ("raise", "expected key=value pairs"),
])
def test_parse_rejects_bad_specs(spec, msg):
    with pytest.raises(UserError, match=msg):
        faults.parse(spec)


def test_matches_rank_step_phase():
    f = faults.parse("rank=1,step=3,kind=raise")
    assert f.matches(3, "step", 1)
    assert not f.matches(3, "step", 0)
    assert not f.matches(2, "step", 1)
    assert not f.matches(3, "checkpoint", 1)
    assert faults.parse("kind=hang").matches(7, "step", 5)


def test_maybe_inject_raises_only_where_asked(monkeypatch):
    monkeypatch.setenv("SWIFTLITE_FAULT", "rank=1,step=3,kind=raise")
    monkeypatch.setenv("RANK", "0")
    faults.maybe_inject(3)                    # another rank: nothing
    monkeypatch.setenv("RANK", "1")
    faults.maybe_inject(2)                    # another step: nothing
    faults.maybe_inject(3, "checkpoint")      # another phase: nothing
    with pytest.raises(faults.InjectedFault, match=r"rank 1, step 3, phase step"):
        faults.maybe_inject(3)


def test_unset_is_a_no_op(monkeypatch):
    monkeypatch.delenv("SWIFTLITE_FAULT", raising=False)
    for s in range(5):
        faults.maybe_inject(s)
        faults.maybe_inject(s, "checkpoint")


def test_kill_and_hang_really_happen():
    code = "from swiftlite import faults; faults.maybe_inject(2); print('survived')"
    env = {**os.environ, "SWIFTLITE_FAULT": "step=2,kind=kill"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL and "survived" not in r.stdout
    env["SWIFTLITE_FAULT"] = "step=2,kind=hang"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3)


def test_only_faults_py_reads_the_variable():
    """The variable is read in env.py (the one module that reads the environment) and consumed by
    faults.py alone."""
    from pathlib import Path
    pkg = Path(faults.__file__).parent
    readers = [p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py") if "settings().fault" in p.read_text()]
    assert readers == ["faults.py"], readers
    from swiftlite import env
    assert env.settings({"SWIFTLITE_FAULT": "step=2,kind=kill"}).fault == "step=2,kind=kill"
