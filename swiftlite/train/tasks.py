"""What each training command runs: its data pipeline, its step function, its validation and the
engine setup it needs, in one table (`TASKS`). sft and pt share the token-level pipeline; rlhf trains
on preference pairs (swiftlite/rlhf/). Preflight and the trainer both ask `task_of(cfg)`, so what is
checked before launch is what trains.

    task = task_of(cfg)
    train, val, plan = task.prepare_data(cfg, tokenizer, world_size, progress=...)
    batches = task.make_batches(cfg, train, plan, tokenizer, world)   # what task.step consumes
    engine = task.setup(run) or engine      # rlhf: the reference (adapter off, or precomputed log-probs)
    stats = task.step(engine, batches, step, data_step=..., before_optimizer=...)
    metrics = task.evaluate(run)            # {"eval_loss": ..., ...}
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


def _ref(name: str) -> Callable[..., Any]:
    mod, _, attr = name.partition(":")
    return getattr(importlib.import_module(mod), attr)


@dataclass(frozen=True)
class Task:
    """One command's pieces, named "module:function" (imported on use: preflight needs no torch model)."""
    prepare: str       # (cfg, tokenizer, world_size, *, progress=None) -> (train, val or None, BatchPlan)
    batches: str       # (cfg, train, plan, tokenizer, world) -> the object `step` reads
    step: str          # (engine, batches, step, *, data_step=None, before_optimizer=None) -> StepStats
    evaluate: str      # (run) -> {"eval_loss": float, ...}
    setup: str | None = None   # (run) -> the engine the loop drives (None: the backend's engine as built)

    def prepare_data(self, *args: Any, **kw: Any) -> Any:
        return _ref(self.prepare)(*args, **kw)

    def make_batches(self, *args: Any) -> Any:
        return _ref(self.batches)(*args)

    def step_fn(self) -> Callable[..., Any]:
        return _ref(self.step)

    def run_evaluate(self, run: Any) -> dict:
        return _ref(self.evaluate)(run)

    def setup_engine(self, run: Any) -> Any:
        return _ref(self.setup)(run) if self.setup else run.engine


_TOKENS = Task(prepare="swiftlite.data.pipeline:prepare_datasets", batches="swiftlite.train.run:token_batches",
               step="swiftlite.train.step:train_step", evaluate="swiftlite.train.evaluate:evaluate_run")
TASKS: dict[str, Task] = {
    "sft": _TOKENS,
    "pt": _TOKENS,
    "rlhf": Task(prepare="swiftlite.rlhf.data:prepare_pairs", batches="swiftlite.rlhf.step:pair_batches",
                 step="swiftlite.rlhf.step:preference_step", evaluate="swiftlite.rlhf.step:evaluate_pairs",
                 setup="swiftlite.rlhf.reference:setup"),
}


def task_of(cfg: Any) -> Task:
    return TASKS[cfg.task]
