"""The best validation metric of a run and ms-swift's early stopping (`--metric_for_best_model`,
`--greater_is_better`, `--early_stop_interval`).

HF Trainer keeps `state.best_metric`: after each evaluation, the metric replaces it when strictly
better (`Trainer._determine_best_metric`). ms-swift's EarlyStopCallback (swift/callbacks/early_stop.py)
looks at it after each checkpoint save: if it improved on the value the callback saw at the previous
save, the count restarts, else it grows by one; at `early_stop_interval` the run stops, the checkpoint
just saved being the last. Both are reproduced here as written, including that a save without a new
evaluation counts as one without improvement (hence ms-swift's advice: --eval_steps = --save_steps).

best_metric and best_global_step go into each checkpoint's trainer_state.json and come back on
resume; the count, like the callback's, starts again at zero.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from swiftlite.errors import UserError


class BestMetric:
    def __init__(self, cfg: Any, resume_path: Path | None = None):
        t = cfg.train
        self.name = t.metric_for_best_model or "loss"            # ms-swift's default
        self.key = self.name if self.name.startswith("eval_") else f"eval_{self.name}"   # HF's prefixing
        self.greater = t.greater_is_better if t.greater_is_better is not None else "loss" not in self.name
        self.interval = t.early_stop_interval
        self.best: float | None = None
        self.best_step: int | None = None
        if resume_path is not None and not cfg.checkpoint.resume_only_model:
            from swiftlite.checkpoint import layout
            state = json.loads((resume_path / layout.TRAINER_STATE).read_text())
            self.best, self.best_step = state.get("best_metric"), state.get("best_global_step")
        self.seen: float | None = None   # the callback's own best_metric (its value at the previous save)
        self.count = 0

    def _better(self, a: float, b: float) -> bool:
        return a > b if self.greater else a < b

    def evaluated(self, record: dict, step: int) -> None:
        """An evaluation's record ({"eval_loss": ...}): the best so far moves when strictly better."""
        if self.key not in record:
            have = ", ".join(k for k in record if k.startswith("eval_"))
            raise UserError(f"--metric_for_best_model {self.name}: validation logs {have}, not {self.key}")
        value = float(record[self.key])
        if self.best is None or self._better(value, self.best):
            self.best, self.best_step = value, step

    def state(self) -> dict:
        """The keys a checkpoint's trainer_state.json records (HF's names)."""
        if self.best is None:
            return {}
        return {"best_metric": self.best, "best_global_step": self.best_step,
                "metric_for_best_model": self.key}

    def saved(self) -> bool:
        """After a checkpoint save: True when the run should stop (ms-swift's on_save)."""
        if self.interval is None:
            return False
        if self.seen is None or (self.best is not None and self._better(self.best, self.seen)):
            self.seen, self.count = self.best, 0
        else:
            self.count += 1
        return self.count >= self.interval

    def stop_line(self, step: int, last: Path | None) -> str:
        return (f"early stop at step {step}: {self.key} has not improved for {self.interval} checkpoints "
                f"(best {self.best} at step {self.best_step}, --early_stop_interval {self.interval}); "
                f"last checkpoint {last}")
