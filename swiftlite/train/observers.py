"""What watches the step loop without changing its math: logging, the bench probe, fault injection.

The loop calls three hooks per step, in this order:

    before_step(step)                   0-based index of the step about to run
    before_optimizer(step, engine)      between the last backward and the optimizer step
    after_step(stats, engine)           StepStats of the step just done (1-based stats.step)

An observer implements the hooks it needs (`Observer` gives empty defaults). The loop owns none of
their state, so a benchmark or test hook never cuts into the training arithmetic.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from swiftlite.checkpoint import layout
from swiftlite import faults, profiling

#: The training-memory peak is read after this many steps (it is in step 2 or later: optimizer
#: states exist from the first step on, and the allocator's buffers settle after it).
MEMORY_STEPS = 3


class Observer:
    def before_step(self, step: int) -> None: ...
    def before_optimizer(self, step: int, engine: Any) -> None: ...
    def after_step(self, stats: Any, engine: Any) -> None: ...


class Observers(Observer):
    """Several observers, called in order."""

    def __init__(self, *items: Observer):
        self.items = items

    def before_step(self, step: int) -> None:
        for o in self.items:
            o.before_step(step)

    def before_optimizer(self, step: int, engine: Any) -> None:
        for o in self.items:
            o.before_optimizer(step, engine)

    def after_step(self, stats: Any, engine: Any) -> None:
        for o in self.items:
            o.after_step(stats, engine)


def memory_record() -> dict[str, float]:
    """This rank's peak memory for logging.jsonl: the CUDA allocator's on GPU, max RSS on CPU (MiB)."""
    peak = profiling.peak_memory()
    if "cuda_max_allocated_gib" in peak:
        return {"memory_gib": round(peak["cuda_max_allocated_gib"], 3)}
    return {"max_rss_mib": peak.get("max_rss_mib", 0.0)}


class LogObserver(Observer):
    """logging.jsonl records (every --logging-steps, the first and the last step), the progress bar,
    and the "first step done" line. The values of a record are HF Trainer's:

    - `loss`: the mean of the step losses of the logging window (the finite steps since the last
      record; HF's tr_loss / steps since the last log). The first record of a run is its first step
      alone, and with --logging-steps 1 each record is its own step's loss.
    - `lr`: the learning rate the record's step was taken with (read before the optimizer step, as
      HF's Trainer logs "the learning rate before update"): peak x lambda(step - 1).
    - task metrics (`StepStats.metrics`; rlhf's rewards/chosen, rewards/margins, logps/chosen, ...):
      window means, as the loss.
    - `grad_norm`: the record's own step (before clipping), as HF.
    - `tokens_per_s`: real tokens only (`StepStats.tokens`: no pad token, whatever the batch form),
      summed over every rank, per second of the logging window (`real_tokens` is that window's
      count); padded and padding-free runs of the same data therefore compare on the same tokens.

    The printed line adds `step=K (K/N, P%)`, the elapsed time and the ETA (remaining steps x mean
    step time of this process, the first step left out once there are others); the progress bar
    (terminal only) shows the step's loss and tokens/s."""

    def __init__(self, log: Any, *, logging_steps: int, total_steps: int, start_step: int,
                 steps_per_epoch: int, t0: float, is_main: bool):
        self.log, self.every, self.total, self.start = log, logging_steps, total_steps, start_step
        self.steps_per_epoch, self.t0, self.is_main = steps_per_epoch, t0, is_main
        self.tokens, self.t_window = 0, time.perf_counter()
        self.loss_sum, self.loss_steps = 0.0, 0
        self.metric_sums: dict[str, float] = {}   # StepStats.metrics of the window (rlhf's rewards/...)
        self.metric_steps: dict[str, int] = {}    # steps that logged each (KTO: a batch without desirable rows has no rewards/chosen)
        self.step_lr: float | None = None
        self.t_step = self.t_first = self.t_first_done = None

    def before_step(self, step: int) -> None:
        self.t_step = time.perf_counter()
        if self.t_first is None:
            self.t_first = self.t_step

    def before_optimizer(self, step: int, engine: Any) -> None:
        self.step_lr = engine.lr()  # the scheduler has not stepped yet: this step's learning rate

    def eta(self, done: int, now: float) -> float | None:
        """Seconds left: remaining steps x the mean step time of this process so far."""
        ran = done - self.start
        if self.t_first is None or ran <= 0:
            return None
        if ran > 1 and self.t_first_done is not None:
            mean = (now - self.t_first_done) / (ran - 1)
        else:
            mean = (now - self.t_first) / ran
        return max(0, self.total - done) * mean

    def after_step(self, stats: Any, engine: Any) -> None:
        done = stats.step
        now = time.perf_counter()
        if done == self.start + 1:
            self.t_first_done = now
        for name, (columns, rows) in getattr(stats, "tables", {}).items():   # GRPO's completions table
            self.log.table(name, columns, rows, done)
        if not (math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)):
            self.log.advance(done, "non-finite step")  # the guard logs it (train/guard.py)
            return
        self.tokens += stats.tokens
        self.loss_sum += stats.loss
        self.loss_steps += 1
        for k, v in getattr(stats, "metrics", {}).items():   # task metrics (StepStats.metrics)
            self.metric_sums[k] = self.metric_sums.get(k, 0.0) + v
            self.metric_steps[k] = self.metric_steps.get(k, 0) + 1
        if self.is_main and done == self.start + 1:
            self.log.print(f"first step done {now - self.t0:.2f} s after start")
        if done % self.every == 0 or done == self.total or done == self.start + 1:
            dt = now - self.t_window
            lr = self.step_lr if self.step_lr is not None else engine.lr()
            rec = {"step": done, "loss": self.loss_sum / self.loss_steps, "lr": lr,
                   "grad_norm": round(stats.grad_norm, 6),
                   "tokens_per_s": round(self.tokens / dt, 1) if dt > 0 else 0.0, "real_tokens": self.tokens,
                   "epoch": round(done / self.steps_per_epoch, 4),
                   "elapsed_s": round(now - self.t0, 2)}
            # Task metrics (rlhf: TRL's rewards/*, logps/*): window means over the steps that logged each.
            rec.update({k: v / self.metric_steps[k] for k, v in self.metric_sums.items()})
            rec.update(memory_record())
            self.log.log(rec, eta_s=self.eta(done, now))
            self.tokens, self.t_window = 0, time.perf_counter()
            self.loss_sum, self.loss_steps = 0.0, 0
            self.metric_sums, self.metric_steps = {}, {}
        step_s = now - self.t_step if self.t_step is not None else 0.0
        speed = f"  {stats.tokens / step_s:.0f} tok/s" if step_s > 0 else ""
        self.log.advance(done, f"loss {stats.loss:.4f}{speed}")


class BenchProbe(Observer):
    """What `swiftlite bench` and the memory tests read: per-step timings and traces (profiling.py,
    opt-in through SWIFTLITE_PROFILE / SWIFTLITE_BENCH_STATS), model-state bytes counted from the
    tensors on the first step (logs/state_rank<r>.json), and on CPU the training-memory window
    (logs/memory_rank<r>.json). `start()` is called before the model is built."""

    def __init__(self, run_dir: Path, world: Any, start_step: int, total_steps: int):
        self.run_dir, self.world, self.start_step, self.total = run_dir, world, start_step, total_steps
        self.window: Any = None
        self._before: dict | None = None
        self._cuda: int | None = None   # CUDA allocator peak at load (GPU runs)

    def start(self) -> None:
        profiling.reset()
        self.window = profiling.start_memory_window() if self.world.device == "cpu" else None

    def before_step(self, step: int) -> None:
        if step == self.start_step and self.window is not None:
            self.window["load_peak"] = profiling.window_peak(self.window)   # the model is built, no step yet
        if step == self.start_step:
            self._cuda = profiling.cuda_max_allocated()   # on a GPU: the allocator's peak at load
        profiling.step_hook(step, self.run_dir, self.world.rank)

    def before_optimizer(self, step: int, engine: Any) -> None:
        if step == self.start_step:
            self._before = engine.state_bytes()  # grads exist only between backward and step

    def after_step(self, stats: Any, engine: Any) -> None:
        step = stats.step - 1
        if step == self.start_step and self._before is not None:
            record_state_bytes(self.run_dir, self.world.rank, self._before, engine.state_bytes())
        if step == self.start_step and self._cuda is not None:
            profiling.record_cuda_memory(self.run_dir, self.world.rank, self._cuda, profiling.cuda_max_allocated())
        if step == min(self.start_step + MEMORY_STEPS, self.total) - 1:
            profiling.end_memory_window(self.run_dir, self.world.rank, self.window, stats.step - self.start_step)


def record_state_bytes(run_dir: Path, rank: int, before_step: dict, after_step: dict) -> None:
    """logs/state_rank<r>.json: model-state bytes this rank holds, counted from its tensors
    (parameters and gradients after the first backward, optimizer state after the first step)."""
    logs = run_dir / layout.LOGS_DIR
    logs.mkdir(exist_ok=True)
    rec = {"params": before_step["params"], "grads": before_step["grads"], "optimizer": after_step["optimizer"]}
    (logs / layout.rank_file("state", rank)).write_text(json.dumps(rec) + "\n")


class FaultInjector(Observer):
    """SWIFTLITE_FAULT (faults.py): fail on purpose after a chosen optimizer step, or poison a chosen
    step's gradients (tests)."""

    def before_optimizer(self, step: int, engine: Any) -> None:
        if faults.maybe_inject(step + 1, "grads") == "nan":
            faults.poison_gradients(engine.module)

    def after_step(self, stats: Any, engine: Any) -> None:
        faults.maybe_inject(stats.step, "step")
