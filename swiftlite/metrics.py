"""Run logging on rank 0: logging.jsonl (always), TensorBoard (optional), a rich progress bar, and
loss / learning-rate PNG plots at the end."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from swiftlite.checkpoint import layout


class RunLogger:
    """Everything a run reports; a no-op on ranks other than 0."""

    def __init__(self, run_dir: Path, *, enabled: bool, total_steps: int, report_to: list[str],
                 start_step: int = 0, quiet: bool = False):
        self.enabled = enabled
        self.run_dir = run_dir
        self.total = total_steps
        self.quiet = quiet
        self._tb = None
        self._progress = None
        self._task = None
        if not enabled:
            return
        self._fh = (run_dir / layout.LOGGING).open("a", encoding="utf-8")
        if {"tensorboard", "all"} & set(report_to):
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(run_dir / "runs"))
            except ImportError:
                self.print("warning: tensorboard is not installed; --report-to tensorboard ignored")
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
            self._progress.console.print(msg, highlight=False)
        else:
            print(msg, flush=True)

    def log(self, record: dict[str, Any], *, show: bool = True) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self._tb.add_scalar(k, v, step)
        if show:
            parts = []
            for k, v in record.items():
                if k == "time":
                    continue
                parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
            self.print("  ".join(parts))

    def advance(self, step: int, info: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        self._fh.close()


def read_log(run_dir: Path) -> list[dict]:
    p = run_dir / layout.LOGGING
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def plot_run(run_dir: Path) -> list[Path]:
    """images/train_loss.png, images/learning_rate.png (and eval_loss.png) from logging.jsonl."""
    records = read_log(run_dir)
    if not records:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = run_dir / "images"
    out.mkdir(exist_ok=True)
    written = []
    for key, fname, title in (("loss", "train_loss.png", "training loss"),
                              ("lr", "learning_rate.png", "learning rate"),
                              ("eval_loss", "eval_loss.png", "validation loss")):
        pts = [(r["step"], r[key]) for r in records if key in r and "step" in r]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / fname)
        plt.close(fig)
        written.append(out / fname)
    return written
