"""`train(cfg)`: build the run, then the step loop — a handful of calls, observers around them.

    run = build_run(cfg)                                   # train/run.py
    for step in range(start, total):
        observers.before_step(step)
        stats = train_step(engine, batches, step, ...)      # the arithmetic: train/step.py
        observers.after_step(stats, engine)                # log, bench probe, fault injection
        guard.check(stats)                                 # nan/inf: stop or skip (train/guard.py)
        validate and checkpoint when due; stop on a signal (train/preempt.py)

docs/design.md describes the numerics and the order in which a run is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swiftlite.checkpoint import layout
from swiftlite.config import RunConfig, save_args


@dataclass
class TrainResult:
    run_dir: Path
    final_checkpoint: Path | None
    losses: list[float]
    steps: int


def _first_line(run) -> str:
    from swiftlite.data.collate import PADDED
    st = run.train_data.stats
    cfg, task = run.cfg, run.task
    # sft/pt --packing: the samples are packs of whole rows (the row counts are in the parentheses)
    unit = "packs of rows" if cfg.data.packing and task.unit == "row" else f"{task.unit}s"
    sp = getattr(run.batches, "sp", None)
    return (f"swiftlite: {run.choice.name} x {run.world.world_size} process(es) on {run.world.device}, "
            + (f"sequence parallel in groups of {sp.size} ({run.world.world_size // sp.size} data-parallel), "
               if sp is not None else "")
            + task.describe(run)
            + (f"streamed train {unit} (so far: " if getattr(run.train_data, "stream", None) is not None
               else f"{len(run.train_data.rows)} train {unit} (")
            + f"{st.truncated} truncated to {cfg.data.max_length}, "
            f"{len(st.skipped)} skipped, {st.deleted} longer than {cfg.data.max_length} deleted, "
            f"{st.no_target} without target), "
            f"{len(run.val_data.rows) if run.val_data else 0} validation {unit}, global batch "
            f"{run.batches.plan.global_batch}, {run.total_steps} steps, "
            f"{(run.batches.form or PADDED).describe(cfg.data.packing, cfg.data.max_length)}, "
            f"attention {getattr(getattr(run.model, 'config', None), '_attn_implementation', None) or '?'}"
            + (f", {'weights from' if cfg.checkpoint.resume_only_model else 'resuming from'} {run.resume_path.name}"
               if run.resume_path else "")
            + (" (data order restarted: --ignore-data-skip)" if run.resume_path and cfg.train.ignore_data_skip else ""))


def train(cfg: RunConfig, facts: Any = None) -> TrainResult:
    """Run one training job in this process (one rank of it when launched under torchrun).
    `facts`: the job's facts (swiftlite/job.py) when this process resolved them."""
    from swiftlite.train.observers import BenchProbe
    from swiftlite.train.preempt import Preemption
    from swiftlite.train.run import build_run

    # Signals are caught from the start: one that comes while the run is being built is acted on
    # after the first step.
    preempt = Preemption(cfg.checkpoint.save_on_signal)
    try:
        run, probe = build_run(cfg, BenchProbe, facts)
        try:
            return _loop(run, probe, preempt)
        finally:
            if run.lock is not None:
                run.lock.release()
    finally:
        preempt.restore()


class Checkpointer:
    """Saves the run's checkpoints and remembers the newest good one. While a save is being written,
    a second preemption signal abandons it (train/preempt.py)."""

    def __init__(self, run: Any, preempt: Any, best: Any = None):
        self.run, self.preempt, self.best = run, preempt, best
        self.last: Path | None = run.resume_path
        self.cadence = run.cadence   # --save-strategy epoch: every epoch

    def save(self, step: int) -> Path:
        from swiftlite.checkpoint.state import save_training_state
        r = self.run
        self.preempt.saving = True
        try:
            facts = {**(r.facts or {}), **(self.best.state() if self.best is not None else {})}
            self.last = save_training_state(r.engine, r.model, r.tokenizer, r.cfg, r.world, r.run_dir, step,
                                            r.choice.key, facts, fmt=r.choice.record.checkpoint_format)
        finally:
            self.preempt.saving = False
        return self.last

    def maybe_save(self, done: int) -> bool:
        """Save when --save-steps says so; True when it did."""
        every = self.cadence.save_steps
        if every and done % every == 0:
            self.save(done)
            return True
        return False

    def saved_at(self, step: int) -> bool:
        return self.last is not None and self.last.name == layout.checkpoint_name(step)


def _start_logging(run: Any) -> Any:
    from swiftlite.metrics import RunLogger
    cfg, world = run.cfg, run.world
    log = RunLogger(run.run_dir, enabled=world.is_main, total_steps=run.total_steps,
                    report_to=cfg.train.report_to, start_step=run.start_step)
    if world.is_main:
        cadence = run.cadence
        save_args(cfg, run.run_dir / layout.ARGS, save_steps=cadence.save_steps, eval_steps=cadence.eval_steps)
        log.print(_first_line(run))
        skipped = run.train_data.stats.skipped
        for msg in skipped[:5]:
            log.print(f"skipped: {msg}")
        if len(skipped) > 5:
            log.print(f"skipped: ... and {len(skipped) - 5} more")
    return log


def _loop(run: Any, probe: Any, preempt: Any) -> TrainResult:
    from swiftlite.distributed import barrier
    from swiftlite.metrics import plot_run
    from swiftlite.train.guard import NonFiniteGuard
    from swiftlite.train.observers import FaultInjector, LogObserver, Observers
    from swiftlite.train.preempt import write_marker
    train_step = run.task.step_fn()   # the command's step (train/tasks.py): sft/pt train/step.py, rlhf rlhf/step.py

    cfg, world, engine, start, total = run.cfg, run.world, run.engine, run.start_step, run.total_steps
    log = _start_logging(run)
    observers = Observers(probe, LogObserver(log, logging_steps=cfg.train.logging_steps, total_steps=total,
                                             start_step=start, steps_per_epoch=run.batches.plan.steps_per_epoch,
                                             t0=run.t0, is_main=world.is_main), FaultInjector())
    from swiftlite.train.best import BestMetric
    best = BestMetric(cfg, run.resume_path)   # best_metric, and --early_stop_interval (train/best.py)
    ckpt = Checkpointer(run, preempt, best)
    guard = NonFiniteGuard(cfg.train.nan_policy, cfg.train.max_skipped_steps, engine, log)
    eval_every = ckpt.cadence.eval_steps or ckpt.cadence.save_steps
    # --ignore-data-skip (HF's meaning): a resumed run restarts the data order at its first batch
    # instead of skipping the batches the checkpoint already trained on.
    data_offset = start if cfg.train.ignore_data_skip else 0

    def validate(step: int) -> None:
        if run.val_data is not None:
            run.eval_step = step
            record = run.task.run_evaluate(run)
            best.evaluated(record, step)
            log.log({"step": step, **record})

    losses: list[float] = []
    # --dataloader_num_workers: the steps this run will train, built ahead in DataLoader workers.
    prefetch = getattr(run.batches, "prefetch", None)
    if prefetch is not None:
        prefetch(start - data_offset, total - data_offset)
    try:
        engine.train()
        for step in range(start, total):
            observers.before_step(step)
            stats = train_step(engine, run.batches, step, data_step=step - data_offset,
                               before_optimizer=lambda e, s=step: observers.before_optimizer(s, e))
            observers.after_step(stats, engine)
            if guard.check(stats, ckpt.last):
                losses.append(stats.loss)
            done = stats.step
            if done == total:
                break
            if eval_every and done % eval_every == 0:
                validate(done)
            if ckpt.maybe_save(done) and best.saved():   # the same on every rank: all-reduced metric
                if world.is_main:
                    log.print(best.stop_line(done, ckpt.last))
                    plot_run(run.run_dir)
                barrier()
                return TrainResult(run.run_dir, ckpt.last, losses, done)
            if preempt.agreed():  # a signal: this step is done on every rank; save it and end
                if not ckpt.saved_at(done):
                    ckpt.save(done)
                if world.is_main:
                    write_marker(run.run_dir, done, ckpt.last, preempt.signum)
                    log.print(f"preempted at step {done}: saved {ckpt.last}; resume with --resume auto")
                barrier()
                return TrainResult(run.run_dir, ckpt.last, losses, done)
        validate(total)
        if start < total or ckpt.last is None:
            ckpt.save(total)
        if world.is_main:
            log.print(f"saved {ckpt.last}")
            plot_run(run.run_dir)
        barrier()
        return TrainResult(run.run_dir, ckpt.last, losses, total)
    finally:
        if hasattr(run.batches, "close"):
            run.batches.close()
        log.close()
