"""`train(cfg)`: build the run, then the step loop — a handful of calls, observers around them.

    run = build_run(cfg)
    for step in range(start, total):
        observers.before_step(step)
        stats = train_step(engine, batches, step, ...)      # the math: step.py
        observers.after_step(stats, engine)                # log, bench probe, fault injection
        validate and checkpoint when due

docs/design.md describes the numerics and the order in which a run is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
    cfg = run.cfg
    return (f"swiftlite: {run.choice.name} x {run.world.world_size} process(es) on {run.world.device}, "
            f"{len(run.train_data.rows)} train rows ({st.truncated} truncated to {cfg.data.max_length}, "
            f"{len(st.skipped)} skipped, {st.no_target} without target), "
            f"{len(run.val_data.rows) if run.val_data else 0} validation rows, global batch "
            f"{run.batches.plan.global_batch}, {run.total_steps} steps, "
            f"{(run.batches.form or PADDED).describe(cfg.data.packing, cfg.data.max_length)}, "
            f"attention {getattr(getattr(run.model, 'config', None), '_attn_implementation', None) or '?'}"
            + (f", resuming from {run.resume_path.name}" if run.resume_path else "")
            + (" (data order restarted: --ignore-data-skip)" if run.resume_path and cfg.train.ignore_data_skip else ""))


def train(cfg: RunConfig) -> TrainResult:
    """Run one training job in this process (one rank of it when launched under torchrun)."""
    from swiftlite.checkpoint.state import save_training_state
    from swiftlite.distributed import barrier
    from swiftlite.metrics import RunLogger, plot_run
    from swiftlite.train.evaluate import evaluate
    from swiftlite.train.observers import BenchProbe, FaultInjector, LogObserver, Observers
    from swiftlite.train.run import build_run
    from swiftlite.train.step import train_step

    run, probe = build_run(cfg, BenchProbe)
    world, engine, start, total = run.world, run.engine, run.start_step, run.total_steps
    log = RunLogger(run.run_dir, enabled=world.is_main, total_steps=total, report_to=cfg.train.report_to,
                    start_step=start)
    if world.is_main:
        save_args(cfg, run.run_dir / layout.ARGS)
        log.print(_first_line(run))
        skipped = run.train_data.stats.skipped
        for msg in skipped[:5]:
            log.print(f"skipped: {msg}")
        if len(skipped) > 5:
            log.print(f"skipped: ... and {len(skipped) - 5} more")
    observers = Observers(probe, LogObserver(log, logging_steps=cfg.train.logging_steps, total_steps=total,
                                             start_step=start, steps_per_epoch=run.batches.plan.steps_per_epoch,
                                             t0=run.t0, is_main=world.is_main), FaultInjector())

    def save(step: int) -> Path:
        return save_training_state(engine, run.model, run.tokenizer, cfg, world, run.run_dir, step, run.choice.key)

    # --ignore-data-skip (HF's meaning): a resumed run restarts the data order at its first batch
    # instead of skipping the batches the checkpoint already trained on.
    data_offset = start if cfg.train.ignore_data_skip else 0
    eval_every = cfg.train.eval_steps or cfg.checkpoint.save_steps
    losses: list[float] = []
    last_ckpt: Path | None = run.resume_path
    engine.train()
    for step in range(start, total):
        observers.before_step(step)
        stats = train_step(engine, run.batches, step, data_step=step - data_offset,
                           before_optimizer=lambda e, s=step: observers.before_optimizer(s, e))
        observers.after_step(stats, engine)
        losses.append(stats.loss)
        done = stats.step
        if run.val_data is not None and eval_every and done % eval_every == 0 and done != total:
            log.log({"step": done, "eval_loss": evaluate(engine, run.val_data, cfg, world, run.batches.pad_id)})
        if cfg.checkpoint.save_steps and done % cfg.checkpoint.save_steps == 0 and done != total:
            last_ckpt = save(done)
    if run.val_data is not None:
        log.log({"step": total, "eval_loss": evaluate(engine, run.val_data, cfg, world, run.batches.pad_id)})
    if start < total or last_ckpt is None:
        last_ckpt = save(total)
    if world.is_main:
        log.print(f"saved {last_ckpt}")
        plot_run(run.run_dir)
    log.close()
    barrier()
    return TrainResult(run.run_dir, last_ckpt, losses, total)
