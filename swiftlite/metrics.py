"""Run logging on rank 0: logging.jsonl (always), the loggers of --report-to (TensorBoard, W&B,
SwanLab), a rich progress bar on a terminal or plain lines without one, and PNG plots at the end.

Names as HF's Trainer writes them, so swiftlite runs line up with HF/TRL/ms-swift runs in the same
dashboard: logging.jsonl keeps swiftlite's keys (`loss`, `lr`, `grad_norm`, `eval_loss`, ...), and
the --report-to loggers get HF's tags (`hf_tags`: `train/loss`, `train/learning_rate`,
`train/grad_norm`, `train/epoch`, `eval/loss`, any other key under `train/` or `eval/`).
wandb and swanlab are optional extras, imported only when asked for; `check_report_to` refuses an
unknown or missing logger before any process starts (preflight).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swiftlite.checkpoint import layout
from swiftlite.errors import UserError

@dataclass(frozen=True)
class StepStats:
    """What one optimizer step produced (the same on every rank after the all-reduce): what the run
    logs. Made by each task's step (train/step.py, rlhf/step.py), read by the loop, the non-finite
    guard and the observers; defined here, below both, so rlhf does not import train."""
    step: int               # 1-based: the number of optimizer steps done
    loss: float             # token-mean loss of the global batch
    grad_norm: float        # global norm before clipping
    tokens: int             # real (non-pad) tokens of the global batch (what tokens/s counts)
    target_tokens: int      # tokens the loss was taken on, over the global batch (rlhf: pairs)
    metrics: dict[str, float] = field(default_factory=dict)   # task-specific means (rlhf: rewards/..., logps/...)
    # name -> (columns, rows) for the loggers' tables (GRPO's --log_completions "completions"; main rank only)
    tables: dict[str, tuple[list[str], list[list[Any]]]] = field(default_factory=dict)


#: --report-to loggers: name -> (the module it needs, the swiftlite extra that installs it).
REPORTERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "swanlab": ("swanlab", "swanlab")}
#: logging.jsonl key -> HF Trainer's log name (before HF's `rewrite_logs` adds train/ or eval/).
HF_NAMES = {"lr": "learning_rate"}
#: Keys that are not metrics (never sent to a logger).
NOT_METRICS = ("step", "time")


def _installed(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def report_targets(values: list[str]) -> list[str]:
    """--report-to values -> the loggers to start, in a fixed order. `all`: every one installed (as
    HF); `none` or nothing: none. An unknown value, `none` with others, or a logger whose package is
    missing is a one-line UserError naming it."""
    import difflib
    names = [str(v).strip() for v in values if str(v).strip()]
    choices = (*REPORTERS, "all", "none")
    for v in names:
        if v not in choices:
            close = difflib.get_close_matches(v, choices, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(f"--report-to {v}: unknown logger{hint}; choose from {', '.join(choices)}")
    if "none" in names:
        if len(set(names)) > 1:
            raise UserError(f"--report-to {' '.join(names)}: none cannot be combined with other loggers")
        return []
    if "all" in names:
        return [r for r, (module, _) in REPORTERS.items() if _installed(module)]
    for v in names:
        module, extra = REPORTERS[v]
        if not _installed(module):
            raise UserError(f"--report-to {v}: the {module} package is not installed; "
                            f"pip install 'swiftlite[{extra}]'")
    return [r for r in REPORTERS if r in names]


def check_report_to(cfg: Any) -> None:
    """Preflight: --report-to names known loggers whose packages are installed (UserError if not)."""
    report_targets(cfg.train.report_to)


def hf_tags(record: dict[str, Any]) -> dict[str, float]:
    """A logging.jsonl record as HF's Trainer logs it (`rewrite_logs`): eval_* -> eval/*, every other
    number -> train/<HF name>. Non-numbers and the step itself are left out."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if k in NOT_METRICS or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if k.startswith("eval_"):
            out[f"eval/{k[len('eval_'):]}"] = v
        else:
            out[f"train/{HF_NAMES.get(k, k)}"] = v
    return out


def _run_config(run_dir: Path) -> dict:
    """args.json (the resolved configuration, secrets redacted) as a logger's run config."""
    try:
        return json.loads((run_dir / layout.ARGS).read_text())
    except (OSError, ValueError):
        return {}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class _TensorBoard:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(run_dir / "runs"))

    def log(self, tags: dict[str, float], step: int) -> None:
        for k, v in tags.items():
            self.writer.add_scalar(k, v, step)

    def table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """TensorBoard has no table type: a markdown table under the TEXT tab (add_text renders it)."""
        def cell(v: Any) -> str:   # every line break (str.splitlines' set) as <br>: one row per line
            return "<br>".join(("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v))
                               .replace("|", "\\|").splitlines())
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
        self.writer.add_text(name, "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """A W&B run, started at the first record (args.json is written by then). Project, entity, mode
    (WANDB_MODE=offline), folder (WANDB_DIR) come from wandb's own environment variables, as with HF;
    the run is named after the run folder. Steps as HF's WandbCallback: `train/global_step`."""

    def __init__(self, run_dir: Path):
        import wandb
        self.wandb, self.run_dir, self.run = wandb, run_dir, None

    def log(self, tags: dict[str, float], step: int) -> None:
        self._start()
        self.run.log({**tags, "train/global_step": step})

    def _start(self) -> None:
        if self.run is None:
            try:
                self.run = self.wandb.init(name=self.run_dir.name, config=_run_config(self.run_dir))
            except Exception as e:  # not logged in, no network, a bad WANDB_* value: one line
                raise UserError(f"--report-to wandb: could not start a W&B run ({_first_line(e)}); run "
                                "`wandb login`, or set WANDB_MODE=offline to write the run locally") from None
            self.run.define_metric("train/global_step")
            self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """A wandb.Table (TRL's and ms-swift's `completions` table), at the step's x value."""
        self._start()
        self.run.log({name: self.wandb.Table(columns=columns, data=rows), "train/global_step": step})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class _SwanLab:
    """A SwanLab experiment (as HF's SwanLabCallback): named after the run folder, logged by step."""

    def __init__(self, run_dir: Path):
        import swanlab
        self.swanlab, self.run_dir, self.started = swanlab, run_dir, False

    def log(self, tags: dict[str, float], step: int) -> None:
        self._start()
        self.swanlab.log(tags, step=step)

    def _start(self) -> None:
        if not self.started:
            try:
                self.swanlab.init(experiment_name=self.run_dir.name, config=_run_config(self.run_dir))
            except Exception as e:
                raise UserError(f"--report-to swanlab: could not start a SwanLab experiment ({_first_line(e)}); "
                                "run `swanlab login`, or set SWANLAB_MODE=offline") from None
            self.started = True

    def table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """An echarts table, as ms-swift logs its `completions` to SwanLab."""
        self._start()
        self.swanlab.log({name: self.swanlab.echarts.Table().add(columns, rows)}, step=step)

    def close(self) -> None:
        if self.started:
            self.swanlab.finish()


SINKS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "swanlab": _SwanLab}


def clock(seconds: float) -> str:
    """H:MM:SS, as rich and tqdm show durations."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _value(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, float):
        return str(v)
    if math.isfinite(v) and abs(v) >= 1000:
        return f"{v:.0f}"  # tokens/s 14660, not 1.466e+04
    return f"{v:.4g}"


def format_line(record: dict[str, Any], total: int, eta_s: float | None = None) -> str:
    """The printed form of a record: `step=K (K/N, P%)`, its values, elapsed and ETA as H:MM:SS.
    The line starts with `step=K ` (scripts/fault_soak.py reads that)."""
    parts = []
    step = record.get("step")
    if step is not None:
        parts.append(f"step={step} ({step}/{total}, {100 * step / max(1, total):.0f}%)")
    for k, v in record.items():
        if k in ("time", "step", "real_tokens"):
            continue
        if k == "elapsed_s":
            parts.append(f"elapsed={clock(v)}")
            if eta_s is not None:
                parts.append(f"eta={clock(eta_s)}")
                eta_s = None
        elif k == "tokens_per_s":
            parts.append(f"tokens/s={_value(float(v))}")
        else:
            parts.append(f"{k}={_value(v)}")
    if eta_s is not None:
        parts.append(f"eta={clock(eta_s)}")
    return "  ".join(parts)


class RunLogger:
    """Everything a run reports; a no-op on ranks other than 0 (which still check --report-to, so
    every rank stops alike on a bad value)."""

    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, report_to: list[str],
                 start_step: int = 0, quiet: bool = False):
        targets = report_targets(report_to)
        self.enabled = enabled
        self.run_dir = run_dir
        self.total = total_steps
        self.quiet = quiet
        self._sinks: list[Any] = []
        self._progress = None
        self._task = None
        if not enabled:
            return
        self._fh = (run_dir / layout.LOGGING).open("a", encoding="utf-8")
        self._sinks = [SINKS[t](run_dir) for t in targets]
        if sys.stderr.isatty() and not quiet:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                      TextColumn("{task.fields[info]}"), transient=False)
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")

    def print(self, msg: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(msg, highlight=False, markup=False)
        else:
            print(msg, flush=True)

    def log(self, record: dict[str, Any], *, show: bool = True, eta_s: float | None = None) -> None:
        """Append `record` to logging.jsonl, send it to the --report-to loggers under HF's tags, and
        print it (with `eta_s`, the estimated time left, on the printed line only)."""
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._sinks:
            tags, step = hf_tags(record), int(record.get("step", 0))
            if tags:
                for sink in self._sinks:
                    sink.log(tags, step)
        if show:
            self.print(format_line(record, self.total, eta_s))

    def table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """A table (columns, rows of values) to every --report-to logger (`table` of each sink: W&B and
        SwanLab tables, TensorBoard a markdown text); logging.jsonl gets none (the task keeps its own file)."""
        if not self.enabled:
            return
        for sink in self._sinks:
            sink.table(name, columns, rows, step)

    def advance(self, step: int, info: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        for sink in self._sinks:
            sink.close()
        self._fh.close()


def read_log(run_dir: Path) -> list[dict]:
    p = run_dir / layout.LOGGING
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _series(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of `key`, the last record of a step winning (a resumed run logs a step again)."""
    by_step = {r["step"]: r[key] for r in records if key in r and "step" in r}
    return sorted(by_step.items())


#: The PNG charts of a run: file name, title, y label, (logging.jsonl key, legend label) per line.
CHARTS = (("train_loss.png", "loss", "loss", (("loss", "train"), ("eval_loss", "eval"))),
          ("learning_rate.png", "learning rate", "learning rate", (("lr", None),)))


def run_figures(records: list[dict]) -> dict[str, Any]:
    """file name -> matplotlib figure of each chart that has data: training and validation loss on one
    chart, the learning rate on another; steps on the x axis as integers, both axes labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    figures = {}
    for fname, title, ylabel, series in CHARTS:
        lines = [(label, pts) for key, label in series if (pts := _series(records, key))]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        for label, pts in lines:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label,
                    marker="o" if label == "eval" or len(pts) < 50 else None, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend()
        fig.tight_layout()
        figures[fname] = fig
    return figures


def plot_run(run_dir: Path) -> list[Path]:
    """images/train_loss.png (training and validation loss) and images/learning_rate.png, from
    logging.jsonl (`run_figures`)."""
    records = read_log(run_dir)
    if not records:
        return []
    figures = run_figures(records)
    import matplotlib.pyplot as plt
    out = run_dir / "images"
    out.mkdir(exist_ok=True)
    written = []
    for fname, fig in figures.items():
        fig.savefig(out / fname)
        plt.close(fig)
        written.append(out / fname)
    return written
