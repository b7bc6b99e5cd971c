"""`swiftlite sft`, `swiftlite pt` and `swiftlite rlhf`: load the config, check it, then print the plan (--dry-run),
launch the ranks, or train in this process.

These commands parse their own argv (`cli/run_flags.py`), so `cli/main.py` calls them directly,
without Typer; Typer only lists them in `swiftlite --help`. No Typer import here.
"""

from __future__ import annotations

from typing import Any

from swiftlite.cli.run_flags import parse_run_args, run_help


def run_command(task: str, args: list[str]) -> int:
    """`swiftlite sft|pt|rlhf ...`: validate, then launch or train here."""
    if any(a in ("--help", "-h") for a in args):
        print(run_help(task))
        return 0
    from swiftlite import env
    from swiftlite.config import field_reads, load_config
    from swiftlite.errors import Refusals
    # Every refusal of the run, from the flags to the preflight, is reported at once (errors.Refusals):
    # each stage judges what the earlier refusals leave it, and nothing is written before they are raised.
    refused = Refusals(watch=field_reads)
    config_file, values = parse_run_args(args, refused)
    cfg = load_config(config_file, values, task=task, refusals=refused)
    env.drop_platform_node_vars()  # read into --nnodes / --node-rank (PAI-DLC, Kubeflow); not this process's rank
    from swiftlite.parallel.base import load_plugins
    refused.check(lambda: load_plugins(cfg.parallel.external_plugins), about=("external_plugins",))
    from swiftlite.launch import plan_launch, preflight, resolve_for_launch, run_forked, run_launched, run_rank
    plan = refused.check(plan_launch, cfg, [task, *args])
    world = env.world_vars().world_size if env.inside_launcher() else plan.world_size if plan else None
    # Everything that can be checked without a process group is checked here, once, before any
    # folder is created or any rank starts: a run that fails validation leaves nothing behind.
    # The run (backend, dtype, max length: swiftlite/job.py) is resolved here once and handed to the
    # ranks this process starts; `cfg` stays what the user said.
    if not env.settings().preflight_done:
        facts = preflight(cfg, world, data=not cfg.parallel.dry_run and not env.inside_launcher(), refusals=refused)
    else:
        facts = None
    refused.raise_all()
    if cfg.parallel.dry_run:
        resolved = facts or resolve_for_launch(cfg, world)
        print_plan(resolved.config, plan, resolved.choice)
        return 0
    import time
    started = time.time()
    if plan.fork:
        rc = run_forked(plan, cfg, facts)
    elif plan.command is not None:
        rc = run_launched(plan, cfg, facts)
    else:
        run_rank(cfg, facts)
        rc = 0
    # A launcher that was itself signalled may end non-zero after its ranks saved: the marker decides.
    return preempted_exit(cfg, started) or rc


def preempted_exit(cfg, started: float) -> int:
    """75 (EX_TEMPFAIL) when this run stopped on a signal after saving (it wrote <run>/preempted), else 0:
    a batch script requeues on 75 and the job resumes with --resume auto."""
    from pathlib import Path

    from swiftlite.train.preempt import PREEMPTED_EXIT, read_marker
    if env_is_rank():
        return 0  # a rank under torchrun: the launcher's process reports it
    marker = read_marker(Path(cfg.train.output_dir).expanduser().resolve(), started)
    if marker is None:
        return 0
    print(f"preempted by {marker['signal']} at step {marker['step']}: saved {marker['checkpoint']} "
          f"(exit {PREEMPTED_EXIT}; resume with --resume auto)", flush=True)
    return PREEMPTED_EXIT


def env_is_rank() -> bool:
    from swiftlite import env
    return env.inside_torchrun()


def sft(args: list[str]) -> int:
    """Supervised fine-tuning on chat data (see `swiftlite sft --help`)."""
    return run_command("sft", args)


def pt(args: list[str]) -> int:
    """Continued pre-training on text (see `swiftlite pt --help`)."""
    return run_command("pt", args)


def rlhf(args: list[str]) -> int:
    """Preference training (--rlhf_type: DPO and its siblings on chosen/rejected pairs), or GRPO on prompts with
    reward functions (see `swiftlite rlhf --help`)."""
    return run_command("rlhf", args)


def print_plan(cfg: Any, plan: Any, choice: Any) -> None:
    """--dry-run: the resolved backend (the same `resolve_backend` answer the trainer gets), world,
    batch arithmetic and launch command."""
    import shlex

    from swiftlite.launch import redact_argv
    world = plan.world_size
    reason = f" ({choice.reason})" if choice.reason else ""
    t = cfg.train
    print(f"backend:        {choice.name}{reason}")
    if cfg.parallel.fsdp:  # ms-swift's spelling, and what it means here
        from swiftlite.config.msswift_fsdp import describe
        print(f"fsdp:           {describe(cfg.parallel.fsdp, cfg.parallel.fsdp_config)}")
    if choice.deepspeed_source:
        print(f"deepspeed:      {choice.deepspeed_source}")
    print(f"world:          {plan.nnodes} node(s) x {plan.nproc_per_node} process(es) = {world}")
    sp = cfg.parallel.sequence_parallel_size
    data = max(1, world // sp)   # a sequence-parallel group of sp ranks trains on the same rows
    if sp > 1:
        print(f"sequence:       parallel over groups of {sp} ranks (Ulysses: 1/{sp} of every sequence per rank), "
              f"{data} data-parallel group(s)")
    global_batch = t.per_device_train_batch_size * data * t.gradient_accumulation_steps
    print(f"batch:          per-device {t.per_device_train_batch_size} x {data}{' data-parallel' if sp > 1 else ''} "
          f"x accumulation {t.gradient_accumulation_steps} = global {global_batch}")
    print(f"model:          {cfg.model.model} ({cfg.train.train_type}, {cfg.model.torch_dtype})")
    if cfg.model.rope_scaling or cfg.model.max_model_len is not None:   # models/rope.py
        from swiftlite.models.loading import model_config, rope
        print(f"rope:           {rope.describe(model_config(cfg))}")
    if cfg.lora.lisa_activated_layers > 0:   # train/lisa.py
        print(f"lisa:           {cfg.lora.lisa_activated_layers} decoder layers at a time, drawn again every "
              f"{cfg.lora.lisa_step_interval} steps (and at step 2) from --seed {cfg.train.seed}")
    from swiftlite.train.tasks import task_of
    for line in task_of(cfg).dry_run_lines(cfg):   # rlhf: the method; its global batch counts pairs
        print(line)
    print(f"output:         {cfg.train.output_dir}")
    # The command each node runs, as it would run it: without this --dry-run.
    shown = [a for a in plan.command if a not in ("--dry-run", "--dry_run")] if plan.command else None
    how = (shlex.join(redact_argv(shown)) if shown
           else f"{plan.nproc_per_node} processes forked from this one" if plan.fork else "this process")
    print("launch:         " + how)
