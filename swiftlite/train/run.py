"""Everything a training run needs before its first step, built in one visible order:

    world -> backend choice -> run folder -> resume point -> tokenizer -> data -> model -> engine
    -> training state from the checkpoint -> the engine's schedules (AdaLoRA, LISA: train/adalora.py,
    train/lisa.py) -> the task's engine setup (rlhf: its reference)

What differs between commands (data pipeline, batches, step function, validation, engine setup) is
one entry of train/tasks.py's TASKS, looked up once here (`Run.task`).

`build_run(cfg, probe)` returns a `Run`; the loop (loop.py) only steps it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swiftlite.config import RunConfig


@dataclass
class Run:
    cfg: RunConfig
    world: Any
    choice: Any                    # parallel.base.BackendChoice
    run_dir: Path
    resume_path: Path | None
    tokenizer: Any
    train_data: Any                # data.pipeline.Tokenized
    val_data: Any
    batches: Any                   # the task's batches (train/step.TokenBatches, rlhf/step.PairBatches)
    total_steps: int
    model: Any
    engine: Any
    start_step: int
    t0: float
    facts: dict                    # checkpoint/state.run_facts: what a resume must agree with
    lock: Any = None               # checkpoint/run_dir.RunLock held by rank 0
    task: Any = None               # train/tasks.Task: the command's data, step, validation, setup
    resolved: Any = None           # job.Resolved: the run as resolved (cfg is its config)
    eval_step: int = 0             # the optimizer steps done when validation runs (GKD draws its branch from it)

    @property
    def cadence(self) -> Any:
        """--save-steps / --eval-steps as this run applies them (job.Resolved.cadence of its plan)."""
        return self.resolved.cadence(self.batches.plan.steps_per_epoch)


def resolve_run_here(cfg: RunConfig, world: Any, facts: Any = None) -> Any:
    """The run this rank builds (swiftlite/job.py `rank_resolved`): the resolution its launcher handed
    over (`facts`, or the environment) when the smallest GPU of the whole job is the one it was made
    with, else resolved here by the same function (every rank must pick the same backend, so the job's
    smallest GPU decides). Its `config` is what every later stage reads."""
    from swiftlite.job import rank_resolved
    resolved = rank_resolved(cfg, world, facts, job_gpu_memory=lambda: smallest_gpu_memory(world))
    choice = resolved.choice
    if world.is_main and choice.requested == "auto":
        print(f"--parallelism auto: {choice.name} ({choice.reason})", flush=True)
    return resolved


def skeleton_mode(cfg: RunConfig, choice: Any) -> str | None:
    """How the model reaches this rank without ever being whole in 16 bits (models/sharded.py):
    "shard" where the record loads sharded (fsdp, hsdp, fsdp1; --sharded-loading false keeps the
    whole-model path) and for a 4-bit base under ZeRO-3 (filled and partitioned layer by layer by the
    engine), "fill" for a 4-bit base elsewhere (quantized weight by weight, then wrapped),
    None otherwise (from_pretrained, inside the record's init context: ZeRO-3's zero.Init).
    An adapter peft computes from the base weights (DoRA, PiSSA, OLoRA) cannot be built on a
    skeleton: refused with the way out (models/lora.check_skeleton; preflight asks this too)."""
    from swiftlite.models.lora import check_skeleton
    mode = None
    if choice.record.loading == "sharded" and cfg.parallel.sharded_loading:
        mode = "shard"
    elif cfg.quant_bits == 4 and cfg.quant_method == "bnb" and choice.record.loading == "partitioned":
        mode = "shard"   # ZeRO-3 fills the 4-bit skeleton layer by layer, partitioning each (parallel/deepspeed.py)
    elif cfg.quant_bits == 4 and cfg.quant_method == "bnb" and choice.record.loading != "sharded":
        mode = "fill"
    check_skeleton(cfg, mode)
    return mode


def smallest_gpu_memory(world: Any) -> int | None:
    """Total memory of the smallest GPU in the job (every rank must pick the same backend), or None
    on CPU."""
    import torch
    if world.device_type != "cuda":
        return None
    total = torch.cuda.get_device_properties(torch.device(world.device)).total_memory
    if world.distributed:
        import torch.distributed as dist
        t = torch.tensor([total], dtype=torch.int64, device=world.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        total = int(t.item())
    return int(total)


def _progress_factory(enabled: bool):
    """A rich progress bar around an iterable (rank 0, interactive terminals only, long files)."""
    import sys

    def make(desc: str, total: int):
        def wrap(it):
            if not enabled or not sys.stderr.isatty() or total < 1000:
                return it
            from rich.progress import track
            return track(it, description=desc, total=total, transient=True)
        return wrap
    return make


def prepare_data(cfg: RunConfig, tokenizer: Any, world: Any) -> tuple[Any, Any, Any]:
    """The same preparation preflight ran (the task's, with all its checks: data.pipeline.prepare_datasets
    for sft/pt): rank 0 first, so it fills the tokenization cache the other ranks then read."""
    from swiftlite.distributed import barrier
    from swiftlite.train.tasks import task_of
    task = task_of(cfg)
    from swiftlite.parallel.sequence import data_world
    # the data-parallel world: a group of --sequence_parallel_size ranks trains on the same rows
    data_size = data_world(world.rank, world.world_size, cfg.parallel.sequence_parallel_size)[1]
    result = None
    if world.is_main:
        result = task.prepare_data(cfg, tokenizer, data_size, progress=_progress_factory(True))
    barrier()
    if not world.is_main:
        result = task.prepare_data(cfg, tokenizer, data_size)
    return result


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.num_train_epochs * steps_per_epoch))


def build_run(cfg: RunConfig, probe_factory: Any = None, facts: Any = None) -> tuple[Run, Any]:
    """Build the run in the order of the module docstring. `probe_factory(run_dir, world, start_step,
    total_steps)` makes the observer that must see the model being built (observers.BenchProbe);
    `facts`: the job's facts when this process resolved them (swiftlite/job.py)."""
    import warnings

    import torch

    from swiftlite.checkpoint.run_dir import RunLock, prepare_run_dir, resume_point
    from swiftlite.checkpoint.state import load_training_state, run_facts
    from swiftlite.distributed import barrier, init_distributed
    from swiftlite.models.loading import load_tokenizer, model_config, prepare_model, resolve_model
    from swiftlite.parallel.base import build_engine
    from swiftlite.train.tasks import task_of

    t0 = time.perf_counter()
    # DCP warns on every single-process save that no process group exists: that is intended here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    from swiftlite.train.library_warnings import keep_library_warnings
    library_warnings = keep_library_warnings()   # to <run>/logs/warnings_rank<r>.log, not the console
    world = init_distributed(cfg.parallel.ddp_timeout)
    # The run: handed over by the launcher (dtype, max length, backend), or resolved here by the same
    # function when this rank was started by an external launcher. From here on `cfg` is the run's
    # concrete, sealed config (swiftlite/job.py), not the user's.
    resolved = resolve_run_here(cfg, world, facts)
    cfg, choice = resolved.config, resolved.choice
    try:
        run_dir = prepare_run_dir(cfg, world.is_main)
    except BaseException:
        library_warnings.close()
        raise
    lock = RunLock(run_dir).acquire() if world.is_main else None
    barrier()
    library_warnings.open(run_dir, world.rank)   # after the barrier: rank 0 has created the folder

    try:
        resume_path = resume_point(cfg, run_dir, log=print if world.is_main else (lambda *_: None))

        source = resolve_model(cfg.model.model)
        tokenizer = load_tokenizer(cfg, source)
        train_data, val_data, plan = prepare_data(cfg, tokenizer, world)
        steps = total_steps(cfg, plan.steps_per_epoch)
        task = task_of(cfg)
        batches = task.make_batches(cfg, train_data, plan, tokenizer, world)
        from swiftlite.parallel import sequence
        batches.sp = sequence.build(world, cfg.parallel.sequence_parallel_size, tokenizer.pad_token_id)
        # Pairs (rlhf) are hashed as their two sequences (rlhf/data.PairData.for_facts).
        facts = run_facts(cfg, train_data.for_facts() if hasattr(train_data, "for_facts") else train_data,
                          plan.global_batch)

        torch.manual_seed(cfg.train.seed + world.rank)
        start_guess = 0
        # The backend may build the model in a context of its own (ZeRO-3: partitioned as it loads).
        # Made before the probe starts its memory window: DeepSpeed's records load their libraries
        # here, which are not training memory.
        init_context = choice.record.model_init_context(cfg, world, lambda: model_config(cfg, source), choice)
        probe = probe_factory(run_dir, world, start_guess, steps) if probe_factory else None
        if probe is not None:
            probe.start()
        from swiftlite.errors import UserError
        from swiftlite.models.adapter import backend_problem as adapter_backend
        from swiftlite.models.llamapro import backend_problem
        for why in (backend_problem(cfg, choice), adapter_backend(cfg, choice)):
            if why:   # preflight refuses it; a rank started by another launcher too
                raise UserError(why)
        from swiftlite.models.lora_ga import estimation_rows
        model = prepare_model(cfg, source, world, init_context=init_context, skeleton=skeleton_mode(cfg, choice),
                              reentrant=choice.record.reentrant_checkpointing or not world.distributed,
                              total_steps=steps, grad_rows=estimation_rows(cfg, train_data))
        if batches.sp is not None:
            sequence.install(model)   # Ulysses attention in the sharded micro-batches (parallel/sequence.py)
        engine = build_engine(model, cfg, world, steps, choice)   # optimizer built here (trap 2)

        from swiftlite.train.lisa import resume_scope, with_lisa
        log = print if world.is_main else (lambda *_: None)
        start_step = 0
        if resume_path is not None:
            with resume_scope(model, cfg, resume_path):   # LISA: the optimizer state of the layers drawn so far
                start_step = load_training_state(engine, resume_path, world, cfg, choice, facts, log=log)["global_step"]
        from swiftlite.train.adalora import with_adalora
        engine = with_adalora(engine, model, cfg, start_step, resume_path)   # AdaLoRA's penalty, rank allocation
        engine = with_lisa(engine, model, cfg, start_step, steps, log=log)   # LISA's frozen and drawn layers
        if probe is not None:
            probe.start_step = start_step
        run = Run(cfg=cfg, world=world, choice=choice, run_dir=run_dir, resume_path=resume_path,
                  tokenizer=tokenizer, train_data=train_data, val_data=val_data, batches=batches,
                  total_steps=steps, model=model, engine=engine, start_step=start_step, t0=t0, facts=facts,
                  lock=lock, task=task, resolved=resolved)
        run.engine = task.setup_engine(run)   # rlhf: the reference (after the state it may read)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return run, probe
