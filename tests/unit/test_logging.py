"""Logging as HF/ms-swift users expect: --report-to checked (unknown values and missing extras are
one-line errors), HF's tag names in TensorBoard and W&B (offline run read back), the logged loss is
the mean of the logging window, plain lines carry step k/N, elapsed, ETA and tokens/s, and the plots
have labelled axes, integer steps and train + eval loss on one chart."""

from __future__ import annotations

import json
import re
import struct
import sys
import types
from pathlib import Path

import pytest

from swiftlite import metrics
from swiftlite.errors import UserError
from swiftlite.train.observers import LogObserver
from tests.conftest import cli_env, run_cli

# ---------------------------------------------------------------------------------------------
# --report-to


@pytest.mark.parametrize("values,message", [
    (["tensorbord"], "--report-to tensorbord: unknown logger (did you mean tensorboard?); choose from "
                     "tensorboard, wandb, swanlab, all, none"),
    (["mlflow"], "--report-to mlflow: unknown logger; choose from"),
    (["none", "wandb"], "--report-to none wandb: none cannot be combined with other loggers"),
])
def test_report_to_refuses_unknown_values(values, message):
    with pytest.raises(UserError) as e:
        metrics.report_targets(values)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_report_to_values(monkeypatch):
    installed = {"tensorboard", "wandb"}
    monkeypatch.setattr(metrics, "_installed", lambda module: module in installed)
    assert metrics.report_targets([]) == []
    assert metrics.report_targets(["none"]) == []
    assert metrics.report_targets(["wandb", "tensorboard"]) == ["tensorboard", "wandb"]
    assert metrics.report_targets(["all"]) == ["tensorboard", "wandb"]  # those installed, as HF
    for name in ("swanlab", "wandb"):
        installed.discard(name)
        with pytest.raises(UserError) as e:
            metrics.report_targets([name])
        assert str(e.value) == (f"--report-to {name}: the {name} package is not installed; "
                                f"pip install 'swiftlite[{name}]'")


def test_check_report_to_reads_the_config(monkeypatch):
    from swiftlite.config import load_config
    cfg = load_config(None, {"dataset": ["x.jsonl"], "report_to": "tensorboard,wandbb"})  # comma list, a typo
    with pytest.raises(UserError, match="--report-to wandbb: unknown logger"):
        metrics.check_report_to(cfg)
    monkeypatch.setattr(metrics, "_installed", lambda module: False)
    with pytest.raises(UserError, match=r"pip install 'swiftlite\[swanlab\]'"):
        metrics.check_report_to(load_config(None, {"dataset": ["x.jsonl"], "report_to": ["swanlab"]}))


def test_hf_tag_names():
    rec = {"time": 1.0, "step": 3, "loss": 2.5, "lr": 1e-4, "grad_norm": 0.5, "epoch": 0.1, "tokens_per_s": 9.0}
    assert metrics.hf_tags(rec) == {"train/loss": 2.5, "train/learning_rate": 1e-4, "train/grad_norm": 0.5,
                                    "train/epoch": 0.1, "train/tokens_per_s": 9.0}
    assert metrics.hf_tags({"step": 3, "eval_loss": 1.5}) == {"eval/loss": 1.5}
    assert metrics.hf_tags({"step": 3, "skipped_step": "loss is nan", "skipped_steps": 1}) == {
        "train/skipped_steps": 1}


def test_a_logger_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    def init(**kw):
        raise RuntimeError("No API key configured.\nUse `wandb login`")
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setattr(metrics, "_installed", lambda module: True)
    log = metrics.RunLogger(tmp_path, enabled=True, total_steps=2, report_to=["wandb"], quiet=True)
    with pytest.raises(UserError) as e:
        log.log({"step": 1, "loss": 2.0}, show=False)
    assert str(e.value) == ("--report-to wandb: could not start a W&B run (No API key configured.); run "
                            "`wandb login`, or set WANDB_MODE=offline to write the run locally")


def test_swanlab_gets_hf_tags_by_step(tmp_path, monkeypatch):
    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)),
                                 log=lambda data, step: calls.append(("log", data, step)),
                                 finish=lambda: calls.append(("finish",)))
    monkeypatch.setitem(sys.modules, "swanlab", fake)
    monkeypatch.setattr(metrics, "_installed", lambda module: True)
    (tmp_path / "args.json").write_text(json.dumps({"train": {"seed": 1}}))
    log = metrics.RunLogger(tmp_path, enabled=True, total_steps=2, report_to=["swanlab"], quiet=True)
    log.log({"step": 1, "loss": 2.0, "lr": 0.1}, show=False)
    log.log({"step": 2, "eval_loss": 1.0}, show=False)
    log.close()
    assert calls == [("init", {"experiment_name": tmp_path.name, "config": {"train": {"seed": 1}}}),
                     ("log", {"train/loss": 2.0, "train/learning_rate": 0.1}, 1),
                     ("log", {"eval/loss": 1.0}, 2), ("finish",)]


# ---------------------------------------------------------------------------------------------
# LogObserver: windowed loss, the step's lr, the printed line


class FakeLog:
    def __init__(self, total: int):
        self.records, self.lines, self.total = [], [], total

    def log(self, rec, *, show=True, eta_s=None):
        self.records.append(rec)
        self.lines.append(metrics.format_line(rec, self.total, eta_s))

    def print(self, msg):
        pass

    def advance(self, step, info=""):
        self.info = info


class FakeEngine:
    def __init__(self):
        self.k = 0

    def lr(self):
        return 0.1 * self.k  # "after the scheduler step" would be 0.1 x step


class Stats(types.SimpleNamespace):
    pass


def drive(losses, every: int, start: int = 0):
    log, engine = FakeLog(len(losses) + start), FakeEngine()
    obs = LogObserver(log, logging_steps=every, total_steps=len(losses) + start, start_step=start,
                      steps_per_epoch=100, t0=0.0, is_main=True)
    for i, loss in enumerate(losses):
        step = start + i
        obs.before_step(step)
        engine.k = step  # the lr the step is taken with
        obs.before_optimizer(step, engine)
        engine.k = step + 1  # the scheduler steps inside engine.step()
        obs.after_step(Stats(step=step + 1, loss=loss, grad_norm=1.0, tokens=10), engine)
    return log


def test_logged_loss_is_the_window_mean():
    log = drive([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], every=3)
    assert [(r["step"], r["loss"]) for r in log.records] == [(1, 1.0), (3, 2.5), (6, 5.0), (7, 7.0)]
    assert [r["real_tokens"] for r in log.records] == [10, 20, 30, 10]
    # a skipped (non-finite) step is not in the mean; --logging-steps 1: each step's own loss
    log = drive([1.0, 2.0, float("nan"), 4.0, 6.0], every=2)
    assert [(r["step"], r["loss"]) for r in log.records] == [(1, 1.0), (2, 2.0), (4, 4.0), (5, 6.0)]
    losses = [0.3, 1.7, 2.9, 0.1]
    assert [r["loss"] for r in drive(losses, every=1).records] == losses
    # a resumed run: its first record is its own first step
    assert [(r["step"], r["loss"]) for r in drive([1.0, 2.0, 3.0, 4.0], every=3, start=4).records] == [
        (5, 1.0), (6, 2.0), (8, 3.5)]


def test_logged_lr_is_the_steps_own():
    log = drive([1.0] * 4, every=1)
    assert [r["lr"] for r in log.records] == pytest.approx([0.0, 0.1, 0.2, 0.3])


def test_progress_bar_shows_loss_and_tokens_per_s():
    assert re.fullmatch(r"loss 1\.5000  \d+ tok/s", drive([1.0, 1.5], every=1).info)


LINE = re.compile(r"^step=(\d+) \((\d+)/(\d+), (\d+)%\)  loss=\S+  lr=\S+  grad_norm=\S+  tokens/s=\S+  "
                  r"epoch=\S+  elapsed=\d+:\d\d:\d\d  eta=\d+:\d\d:\d\d(  \S+=\S+)*$")


def test_plain_line_format():
    rec = {"time": 1.0, "step": 3, "loss": 2.34567, "lr": 3e-5, "grad_norm": 1.5, "tokens_per_s": 14660.4,
           "real_tokens": 100, "epoch": 0.03, "elapsed_s": 3725.0, "max_rss_mib": 542.9}
    line = metrics.format_line(rec, 10, eta_s=65.2)
    assert line == ("step=3 (3/10, 30%)  loss=2.346  lr=3e-05  grad_norm=1.5  tokens/s=14660  epoch=0.03  "
                    "elapsed=1:02:05  eta=0:01:05  max_rss_mib=542.9")
    assert LINE.match(line)
    assert metrics.format_line({"step": 10, "eval_loss": 1.25}, 10) == "step=10 (10/10, 100%)  eval_loss=1.25"
    assert all(LINE.match(x) for x in drive([1.0] * 5, every=2).lines)


def test_eta_is_remaining_steps_times_mean_step_time(monkeypatch):
    import swiftlite.train.observers as obs_mod
    now = [0.0]
    monkeypatch.setattr(obs_mod.time, "perf_counter", lambda: now[0])
    log = FakeLog(10)
    obs = LogObserver(log, logging_steps=1, total_steps=10, start_step=0, steps_per_epoch=10, t0=0.0,
                      is_main=True)
    for step, t_end in enumerate([5.0, 6.0, 7.0, 8.0]):  # the first step is slow (warm-up)
        obs.before_step(step)
        now[0] = t_end
        obs.after_step(Stats(step=step + 1, loss=1.0, grad_norm=1.0, tokens=10), FakeEngine())
    assert obs.eta(4, 8.0) == pytest.approx(6 * 1.0)  # 6 steps left x 1 s (first step left out)
    assert obs.eta(1, 5.0) == pytest.approx(9 * 5.0)  # one step done: its own time
    assert "  elapsed=0:00:08  eta=0:00:06  " in log.lines[-1]


# ---------------------------------------------------------------------------------------------
# Plots


def test_plots_label_axes_use_integer_steps_and_put_eval_with_train():
    from matplotlib.ticker import MaxNLocator
    recs = [{"step": s, "loss": 3.0 / s, "lr": 0.1} for s in range(1, 6)] + [{"step": 5, "eval_loss": 1.0}]
    figs = metrics.run_figures(recs)
    assert set(figs) == {"train_loss.png", "learning_rate.png"}
    ax = figs["train_loss.png"].axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", "loss")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train", "eval"]
    assert isinstance(ax.xaxis.get_major_locator(), MaxNLocator)
    assert all(float(t).is_integer() for t in ax.get_xticks())
    assert figs["learning_rate.png"].axes[0].get_ylabel() == "learning rate"


# ---------------------------------------------------------------------------------------------
# A run: TensorBoard and W&B (offline) with HF's tags, its plain lines, the windowed mean


def _wandb_records(path: Path):
    """The records of an offline W&B run file (run-<id>.wandb: a LevelDB-style log of protobuf
    Records: a 7-byte header, 32 KiB blocks, each chunk crc32/length/type then its bytes)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, pos, buf = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


RUN_ARGS = ["sft", "--model", "tiny-llama", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max_steps", 7, "--per_device_train_batch_size", 2,
            "--learning_rate", "1e-3", "--warmup_steps", 2, "--save_steps", 4]


@pytest.fixture(scope="module")
def runs(demo_data, tmp_path_factory):
    """The same run twice: --logging-steps 1 with TensorBoard (and W&B offline when installed), and
    --logging-steps 3."""
    train, val = demo_data
    work = tmp_path_factory.mktemp("logging")
    report = ["tensorboard"] + (["wandb"] if metrics._installed("wandb") else [])
    env = cli_env(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(work))
    each = run_cli([*RUN_ARGS, "--dataset", train, "--val_dataset", val, "--logging_steps", 1,
                    "--report_to", *report, "--output_dir", work / "each"], env=env, timeout=300)
    window = run_cli([*RUN_ARGS, "--dataset", train, "--val_dataset", val, "--logging_steps", 3,
                      "--output_dir", work / "window"], timeout=300)
    return work, each, window


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "logging.jsonl").read_text().splitlines()]


def test_windowed_loss_in_a_run(runs):
    work, _, _ = runs
    each = {r["step"]: r["loss"] for r in _records(work / "each") if "loss" in r}
    window = {r["step"]: r["loss"] for r in _records(work / "window") if "loss" in r}
    assert sorted(each) == list(range(1, 8))
    assert sorted(window) == [1, 3, 6, 7]
    expect = {1: each[1], 3: (each[2] + each[3]) / 2, 6: (each[4] + each[5] + each[6]) / 3, 7: each[7]}
    for step, value in expect.items():
        assert window[step] == pytest.approx(value, rel=1e-6), (step, window, each)


def test_plain_lines_of_a_run(runs):
    _, each, window = runs
    for proc, steps in ((each, range(1, 8)), (window, (1, 3, 6, 7))):
        lines = [x for x in proc.stdout.splitlines() if x.startswith("step=") and "loss=" in x
                 and "eval_loss" not in x]
        assert [int(LINE.match(x).group(1)) for x in lines] == list(steps), proc.stdout
        assert all(LINE.match(x).group(3) == "7" for x in lines)


def test_tensorboard_has_hf_tags(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    work, _, _ = runs
    acc = EventAccumulator(str(work / "each" / "runs"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "train/epoch", "eval/loss"} <= tags, tags
    assert not {"loss", "lr", "eval_loss"} & tags
    recs = _records(work / "each")
    for tag, key in (("train/loss", "loss"), ("train/learning_rate", "lr"), ("eval/loss", "eval_loss")):
        want = [(r["step"], r[key]) for r in recs if key in r]
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == [(s, pytest.approx(v, rel=1e-6)) for s, v in want]


def test_wandb_offline_run_has_hf_keys_and_values(runs):
    pytest.importorskip("wandb")
    work, _, _ = runs
    files = list((work / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history, run, config = [], None, {}
    for rec in _wandb_records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "run":
            run = rec.run
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    assert run is not None and run.display_name == "each"
    assert config["train"]["max_steps"] == 7  # args.json is the run's config
    recs = _records(work / "each")
    train = [h for h in history if "train/loss" in h]
    assert [h["train/global_step"] for h in train] == [r["step"] for r in recs if "loss" in r]
    for h, r in zip(train, [r for r in recs if "loss" in r]):
        assert (h["train/loss"], h["train/learning_rate"], h["train/grad_norm"]) == pytest.approx(
            (r["loss"], r["lr"], r["grad_norm"]))
    evals = [(h["train/global_step"], h["eval/loss"]) for h in history if "eval/loss" in h]
    assert evals == [(r["step"], pytest.approx(r["eval_loss"])) for r in recs if "eval_loss" in r]
