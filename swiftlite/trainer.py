"""The training run, top to bottom: data, model, engine, the step loop, eval, checkpoints.

Numerics (DESIGN.md): each optimizer step consumes one global batch (per-device x world x
accumulation samples, the same samples whatever the world size). Each micro-batch's summed token loss
is scaled by world_size / (target tokens of the whole global batch), so the averaged gradient is the
gradient of the global token-mean loss, and the logged loss (summed over ranks) equals the
single-process one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swiftlite import checkpoint as ckpt
from swiftlite import faults, profiling
from swiftlite.checkpoint.run_dir import prepare_run_dir
from swiftlite.checkpoint.state import (export_weights, load_training_state, record_state_bytes,  # noqa: F401
                                        save_training_state)
from swiftlite.config import RunConfig, save_args
from swiftlite.errors import UserError


@dataclass
class TrainResult:
    run_dir: Path
    final_checkpoint: Path | None
    losses: list[float]
    steps: int


def _progress_factory(enabled: bool):
    """A rich progress bar around an iterable (rank 0, interactive terminals only)."""
    import sys

    def make(desc: str, total: int):
        def wrap(it):
            if not enabled or not sys.stderr.isatty() or total < 1000:
                return it
            from rich.progress import track
            return track(it, description=desc, total=total, transient=True)
        return wrap
    return make


def train(cfg: RunConfig) -> TrainResult:
    """Run one training job in this process (one rank of it when launched under torchrun)."""
    import torch

    from swiftlite.data.collate import collate
    from swiftlite.data.loader import BatchPlan, select
    from swiftlite.data.pipeline import split_validation, tokenize_specs
    from swiftlite.distributed import all_reduce_sum, barrier, init_distributed
    from swiftlite.metrics import RunLogger, plot_run
    from swiftlite.models.loading import load_tokenizer, model_config, prepare_model, resolve_model
    from swiftlite.parallel.base import build_engine

    import warnings
    t0 = time.perf_counter()
    # DCP warns on every single-process save that no process group exists: that is intended here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    world = init_distributed(cfg.parallel.ddp_timeout)
    backend = resolve_backend(cfg, world)
    run_dir = prepare_run_dir(cfg, world.is_main)
    barrier()

    resume_path: Path | None = None
    if cfg.checkpoint.resume_from:
        resume_path = ckpt.resolve_resume_arg(cfg.checkpoint.resume_from)
    elif cfg.checkpoint.resume:
        resume_path = ckpt.find_resume(run_dir, log=print if world.is_main else (lambda *_: None))

    source = resolve_model(cfg.model.model)
    tokenizer = load_tokenizer(cfg, source)

    # Rank 0 tokenizes (and fills the cache) first; the others then read the cache.
    def tokenize(specs):
        return tokenize_specs(specs, tokenizer, task=cfg.task, max_length=cfg.data.max_length,
                              packing=cfg.data.packing, skip_bad_rows=cfg.data.skip_bad_rows,
                              progress=_progress_factory(world.is_main))
    if world.is_main:
        train_data = tokenize(cfg.data.dataset)
    barrier()
    if not world.is_main:
        train_data = tokenize(cfg.data.dataset)
    val_data = None
    if cfg.data.val_dataset:
        val_data = tokenize(cfg.data.val_dataset)
    elif cfg.data.split_dataset_ratio > 0:
        train_data, val_data = split_validation(train_data, cfg.data.split_dataset_ratio, cfg.train.seed)
    if not train_data.rows:
        raise UserError(f"--dataset {' '.join(cfg.data.dataset)}: no usable rows "
                        f"(read {train_data.stats.rows}, skipped {len(train_data.stats.skipped)}, "
                        f"{train_data.stats.no_target} without an answer)")

    plan = BatchPlan(len(train_data.rows), cfg.train.per_device_train_batch_size, world.world_size,
                     cfg.train.gradient_accumulation_steps, cfg.train.seed)
    if plan.steps_per_epoch == 0:
        raise UserError(f"--dataset has {len(train_data.rows)} rows, fewer than one global batch of "
                        f"{plan.global_batch} (per-device {plan.per_device} x {plan.world_size} processes x "
                        f"accumulation {plan.accumulation})")
    total_steps = (cfg.train.max_steps if cfg.train.max_steps > 0
                   else max(1, math.ceil(cfg.train.num_train_epochs * plan.steps_per_epoch)))

    torch.manual_seed(cfg.train.seed + world.rank)
    memory_window = profiling.start_memory_window() if world.device == "cpu" else None
    # The backend may build the model in a context of its own (ZeRO-3: partitioned as it loads).
    init_context = backend.record.model_init_context(cfg, world, lambda: model_config(cfg, source), backend)
    model = prepare_model(cfg, source, world, init_context=init_context)
    peft_model = model
    engine = build_engine(model, cfg, world, total_steps, backend)

    start_step = 0
    if resume_path is not None:
        state = load_training_state(engine, resume_path, world, cfg, backend)
        start_step = state["global_step"]

    log = RunLogger(run_dir, enabled=world.is_main, total_steps=total_steps,
                    report_to=cfg.train.report_to, start_step=start_step)
    if world.is_main:
        save_args(cfg, run_dir / "args.json")
        st = train_data.stats
        log.print(f"swiftlite: {backend.name} x {world.world_size} process(es) on {world.device}, "
                  f"{len(train_data.rows)} train rows ({st.truncated} truncated to {cfg.data.max_length}, "
                  f"{len(st.skipped)} skipped, {st.no_target} without target), "
                  f"{len(val_data.rows) if val_data else 0} validation rows, global batch {plan.global_batch}, "
                  f"{total_steps} steps" + (f", resuming from {resume_path.name}" if resume_path else ""))
        for msg in st.skipped[:5]:
            log.print(f"skipped: {msg}")
        if len(st.skipped) > 5:
            log.print(f"skipped: ... and {len(st.skipped) - 5} more")

    targets = [train_data.targets(i) for i in range(len(train_data.rows))]
    pad_id = tokenizer.pad_token_id
    losses: list[float] = []
    last_ckpt: Path | None = resume_path
    tokens_window, t_window = 0, time.perf_counter()
    eval_every = cfg.train.eval_steps or cfg.checkpoint.save_steps
    engine.train()
    for step in range(start_step, total_steps):
        profiling.step_hook(step, run_dir, world.rank)  # no-op unless SWIFTLITE_PROFILE/_BENCH_STATS
        global_targets = sum(targets[i] for mb in plan.all_micro_batches(step) for i in mb)
        scale = world.world_size / max(1, global_targets)
        local_loss = 0.0
        local_tokens = 0
        micro = plan.micro_batches(step, world.rank)
        for m, mb in enumerate(micro):
            batch = {k: v.to(world.device) for k, v in collate(select(train_data.rows, mb), pad_id).items()}
            local_tokens += int(batch["attention_mask"].sum())
            with engine.micro_batch(last=m == len(micro) - 1):
                loss_sum = engine.forward(batch)
                engine.backward(loss_sum * scale)
            local_loss += float(loss_sum.detach())
        if step == start_step:
            before = engine.state_bytes()  # grads exist only between backward and step
        grad_norm = engine.step()
        if step == start_step:
            record_state_bytes(run_dir, world.rank, before, engine.state_bytes())
        if step == min(start_step + MEMORY_STEPS, total_steps) - 1:  # optimizer states exist by then
            profiling.end_memory_window(run_dir, world.rank, memory_window, step + 1 - start_step)
        faults.maybe_inject(step + 1, "step")
        loss_total, tokens_total = all_reduce_sum([local_loss, float(local_tokens)])
        loss = loss_total / max(1, global_targets)
        losses.append(loss)
        tokens_window += tokens_total
        done = step + 1
        if world.is_main and done == start_step + 1:
            log.print(f"first step done {time.perf_counter() - t0:.2f} s after start")
        if done % cfg.train.logging_steps == 0 or done == total_steps or done == start_step + 1:
            dt = time.perf_counter() - t_window
            rec = {"step": done, "loss": loss, "lr": engine.lr(), "grad_norm": round(grad_norm, 6),
                   "tokens_per_s": round(tokens_window / dt, 1) if dt > 0 else 0.0,
                   "epoch": round(done / plan.steps_per_epoch, 4), "elapsed_s": round(time.perf_counter() - t0, 2)}
            rec.update(_memory())
            log.log(rec)
            tokens_window, t_window = 0, time.perf_counter()
        log.advance(done, f"loss {loss:.4f}")
        if val_data is not None and eval_every and done % eval_every == 0 and done != total_steps:
            log.log({"step": done, "eval_loss": evaluate(engine, val_data, cfg, world, pad_id)})
        if cfg.checkpoint.save_steps and done % cfg.checkpoint.save_steps == 0 and done != total_steps:
            last_ckpt = save_training_state(engine, peft_model, tokenizer, cfg, world, run_dir, done, backend.key)
    if val_data is not None:
        log.log({"step": total_steps, "eval_loss": evaluate(engine, val_data, cfg, world, pad_id)})
    if start_step < total_steps or last_ckpt is None:
        last_ckpt = save_training_state(engine, peft_model, tokenizer, cfg, world, run_dir, total_steps, backend.key)
    if world.is_main:
        log.print(f"saved {last_ckpt}")
        plot_run(run_dir)
    log.close()
    barrier()
    return TrainResult(run_dir, last_ckpt, losses, total_steps)


MEMORY_STEPS = 3  # the training-memory peak is read after this many steps (the peak is in step 2 or later)


def resolve_backend(cfg: RunConfig, world: Any) -> Any:
    """The backend this rank builds: `parallel.resolve.resolve_backend` with the smallest GPU of the
    whole job (every rank must pick the same one) and, for `auto` on CUDA, the model's shape."""
    from swiftlite.parallel.resolve import resolve_backend as resolve
    choice = resolve(cfg, world.world_size, lambda: smallest_gpu_memory(world),
                     shape=lambda: _shape_for_auto(cfg), gpus_per_node=world.local_world_size)
    if world.is_main and choice.requested == "auto":
        print(f"--parallelism auto: {choice.name} ({choice.reason})", flush=True)
    return choice


def smallest_gpu_memory(world: Any) -> int | None:
    """Total memory of the smallest GPU in the job (every rank must pick the same backend), or None
    on CPU."""
    import torch
    if not world.device.startswith("cuda"):
        return None
    total = torch.cuda.get_device_properties(torch.device(world.device)).total_memory
    if world.distributed:
        import torch.distributed as dist
        t = torch.tensor([total], dtype=torch.int64, device=world.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        total = int(t.item())
    return int(total)


def _shape_for_auto(cfg: RunConfig) -> Any:
    """The model's shape for the memory model: presets and local folders directly, a hub id from its
    downloaded config (never its weights)."""
    from swiftlite.models.loading import model_config, resolve_model
    from swiftlite.parallel.plan import shape_from_config, shape_from_model_arg
    source = resolve_model(cfg.model.model)
    if source.kind in ("preset", "folder"):
        return shape_from_model_arg(cfg.model.model)
    return shape_from_config(model_config(cfg, source).to_dict(), cfg.model.model)


def _memory() -> dict[str, float]:
    """Peak memory of this rank: the CUDA allocator on GPU, max RSS on CPU (MiB)."""
    import torch
    if torch.cuda.is_available():
        return {"memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}
    import resource
    return {"max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def evaluate(engine: Any, val_data: Any, cfg: RunConfig, world: Any, pad_id: int) -> float:
    """Token-mean validation loss over all ranks. Every rank runs the same number of forwards
    (sharded backends need every rank in each collective), padding with fully masked batches."""
    import torch

    from swiftlite.data.collate import collate
    from swiftlite.data.tokenize import IGNORE
    from swiftlite.distributed import all_reduce_sum
    rows = val_data.rows
    bs = cfg.train.per_device_eval_batch_size
    mine = list(range(world.rank, len(rows), world.world_size))
    per_rank = math.ceil(len(rows) / world.world_size)
    n_batches = math.ceil(per_rank / bs)
    total, count = 0.0, 0
    engine.eval()
    with torch.no_grad():
        for b in range(n_batches):
            idx = mine[b * bs:(b + 1) * bs]
            if idx:
                batch_rows = [rows[i] for i in idx]
            else:  # this rank ran out: a dummy batch that contributes nothing
                batch_rows = [{"input_ids": rows[0]["input_ids"], "labels": [IGNORE] * len(rows[0]["labels"])}]
            batch = {k: v.to(world.device) for k, v in collate(batch_rows, pad_id).items()}
            total += float(engine.forward(batch))
            count += int((batch["labels"][:, 1:] != IGNORE).sum())
    engine.train()
    total, count = all_reduce_sum([total, float(count)])
    return round(total / max(1.0, count), 6)
