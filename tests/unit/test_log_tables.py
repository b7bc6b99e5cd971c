"""RunLogger.table: GRPO's completions table reaches each --report-to logger in that logger's table
type (W&B: wandb.Table under `completions` at train/global_step; SwanLab: an echarts Table, as
ms-swift), checked against stand-in modules recording the calls (neither package is installed here)."""

from __future__ import annotations

import sys
import types

from swiftlite.metrics import RunLogger

COLUMNS = ["step", "prompt", "completion", "exact", "advantage"]
ROWS = [[3, "reverse: ab", "ba", 1.0, 0.7], [3, "reverse: ab", "ab", 0.0, -0.7]]


def _fake_wandb(calls):
    run = types.SimpleNamespace(log=lambda d: calls.append(("log", d)), define_metric=lambda *a, **k: None,
                                finish=lambda: calls.append(("finish",)))

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data
    return types.SimpleNamespace(init=lambda **kw: run, Table=Table)


def _fake_swanlab(calls):
    class Table:
        def add(self, headers, rows):
            self.headers, self.rows = headers, rows
            return self
    return types.SimpleNamespace(init=lambda **kw: calls.append(("init",)), echarts=types.SimpleNamespace(Table=Table),
                                 log=lambda d, step: calls.append(("log", d, step)), finish=lambda: None)


def test_wandb_and_swanlab_get_their_table(tmp_path, monkeypatch):
    wb, sw = [], []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(wb))
    monkeypatch.setitem(sys.modules, "swanlab", _fake_swanlab(sw))
    monkeypatch.setattr("swiftlite.metrics._installed", lambda module: True)
    log = RunLogger(tmp_path, enabled=True, total_steps=5, report_to=["wandb", "swanlab"], quiet=True)
    log.table("completions", COLUMNS, ROWS, 3)       # before any scalar record: the run starts here
    log.close()
    (kind, d), = [c for c in wb if c[0] == "log"]
    assert d["train/global_step"] == 3 and d["completions"].columns == COLUMNS and d["completions"].data == ROWS
    assert sw[0] == ("init",)
    _, d, step = sw[1]
    assert step == 3 and d["completions"].headers == COLUMNS and d["completions"].rows == ROWS


def test_a_disabled_logger_sends_nothing(tmp_path, monkeypatch):
    wb = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(wb))
    monkeypatch.setattr("swiftlite.metrics._installed", lambda module: True)
    log = RunLogger(tmp_path, enabled=False, total_steps=5, report_to=["wandb"], quiet=True)   # a rank other than 0
    log.table("completions", COLUMNS, ROWS, 3)
    assert wb == []


def test_a_logger_whose_package_is_missing_is_one_line(monkeypatch):
    """--report-to names a logger whose extra is not installed (the dev environment has them all: the
    package is hidden here): one line naming the extra, before anything starts."""
    import pytest

    from swiftlite import metrics
    from swiftlite.errors import UserError
    monkeypatch.setattr(metrics, "_installed", lambda module: module != "swanlab")
    with pytest.raises(UserError) as e:
        metrics.report_targets(["tensorboard", "swanlab"])
    assert str(e.value) == "--report-to swanlab: the swanlab package is not installed; pip install 'swiftlite[swanlab]'"
    assert metrics.report_targets(["all"]) == [r for r in metrics.REPORTERS if r != "swanlab"]
