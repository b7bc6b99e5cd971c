"""`swiftlite bench`: its flags -> `swiftlite.bench.BenchConfig`. Light imports only (the logic is in
bench/, imported when the command runs).

Every flag takes both spellings (`--torch-dtype`, `--torch_dtype`), as `swiftlite sft` does.
"""

from __future__ import annotations

from typing import List, Optional

import typer

_SETTINGS = {"allow_extra_args": True}  # `--external-plugins a.py b.py`: the files after the first


def bench_cmd(
    ctx: typer.Context,
    model: str = typer.Option("tiny-llama", "--model", help="Preset name or local HF folder."),
    parallelism: str = typer.Option(
        "ddp,fsdp,fsdp1,zero2,zero3", "--parallelism", "--parallelism-type", "--parallelism_type",
        help="Comma-separated backends: ddp, fsdp, hsdp, fsdp1, zero2, zero3, zero3pp, zero3_offload, a DeepSpeed "
             ".json, or "
             "one an --external-plugins file registers; append +compile, +gc (activation checkpointing) or "
             "+offload (FSDP CPU offload)."),
    steps: int = typer.Option(20, "--steps", "--max-steps", "--max_steps", help="Optimizer steps per backend."),
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", "--nproc_per_node",
        help="Processes per run, per node with --nnodes (default: the GPUs here, or 2 on CPU)."),
    nnodes: int = typer.Option(
        1, "--nnodes", help="Run each backend as this many local nodes of --nproc-per-node processes (torchrun "
                            "--nnodes on 127.0.0.1) and report the bytes that crossed the node boundary."),
    max_length: int = typer.Option(128, "--max-length", "--max_length", help="Tokens per sequence."),
    batch: int = typer.Option(4, "--per-device-train-batch-size", "--per_device_train_batch_size",
                              "--batch-size", "--batch_size", help="Micro-batch per process."),
    dataset: Optional[str] = typer.Option(None, "--dataset",
                                          help="Training data (default: the demo task, written to OUTPUT/data)."),
    output: str = typer.Option("bench", "--output", "--output-dir", "--output_dir",
                               help="Folder for bench.json/md/png and runs."),
    train_type: str = typer.Option("full", "--train-type", "--train_type", help="full, lora or qlora."),
    dtype: Optional[str] = typer.Option(None, "--torch-dtype", "--torch_dtype", "--dtype",
                                        help="fp32, bf16 or fp16 (default: bf16 on GPU, fp32 on CPU)."),
    gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing", "--gradient_checkpointing",
                                                help="Activation checkpointing in every run."),
    packing: bool = typer.Option(False, "--packing", help="Pack rows into full --max-length sequences."),
    skip_steps: Optional[int] = typer.Option(None, "--skip-steps", "--skip_steps",
                                             help="First steps left out of the timing [default: 3]."),
    warmup_steps: Optional[int] = typer.Option(
        None, "--warmup-steps", "--warmup_steps",
        help="Deprecated: the old name of --skip-steps (steps left out of the timing). It is not the "
             "learning-rate warm-up: for that, pass --sft-arg=--warmup-steps=N."),
    profile_steps: int = typer.Option(2, "--profile-steps", "--profile_steps",
                                      help="Steps traced with torch.profiler (after the skipped ones; 0: none)."),
    timeout: int = typer.Option(900, "--timeout", help="Seconds one backend's run may take."),
    keep_checkpoints: bool = typer.Option(False, "--keep-checkpoints", "--keep_checkpoints",
                                          help="Keep each run's final checkpoint (default: deleted after reading)."),
    exact_rss: bool = typer.Option(False, "--exact-rss", "--exact_rss",
                                   help="CPU: MALLOC_MMAP_THRESHOLD_=65536 for true RSS (steps 2-3x slower)."),
    sft_arg: List[str] = typer.Option([], "--sft-arg", "--sft_arg",
                                      help="Extra flag(s) for every `swiftlite sft` run, e.g. --sft-arg=--lora-rank=16."),
    external_plugins: List[str] = typer.Option(
        [], "--external-plugins", "--external_plugins",
        help="Python files run before --parallelism is read (ms-swift's flag); they may register backends. "
             "Passed on to every `swiftlite sft` run."),
) -> None:
    """Run the same job under several backends; step time, tokens/s, MFU, comm, overlap, memory."""
    import shlex

    from swiftlite.errors import UserError
    plugins = list(external_plugins)
    if ctx.args:  # only `--external-plugins a.py b.py` leaves words over: bench takes no arguments
        if not plugins or not all(a.endswith(".py") for a in ctx.args):
            raise UserError(f"unexpected argument {ctx.args[0]!r}")
        plugins += ctx.args
    if train_type not in ("full", "lora", "qlora"):
        raise UserError(f"--train-type {train_type!r}: choose from full, lora, qlora")
    if dtype is not None and dtype not in ("fp32", "bf16", "fp16"):
        raise UserError(f"--torch-dtype {dtype!r}: choose from fp32, bf16, fp16")
    if warmup_steps is not None:
        if skip_steps is not None:
            raise UserError("--warmup-steps is the old name of --skip-steps: give only --skip-steps")
        typer.echo("bench: --warmup-steps is deprecated, use --skip-steps (steps left out of the timing; "
                   "not the learning-rate warm-up)", err=True)
        skip_steps = warmup_steps
    extra: list[str] = []
    for a in sft_arg:
        extra += shlex.split(a)
    from swiftlite.parallel.base import load_plugins
    load_plugins(plugins)  # before --parallelism is read: a plugin's backend is a valid column
    from swiftlite.bench import BenchConfig, parse_backends, run_bench
    cfg = BenchConfig(model=model, backends=parse_backends(parallelism), steps=steps,
                      nproc_per_node=nproc_per_node, nnodes=nnodes, max_length=max_length,
                      per_device_train_batch_size=batch,
                      dataset=dataset, output=output, train_type=train_type, torch_dtype=dtype,
                      gradient_checkpointing=gradient_checkpointing,
                      skip_steps=3 if skip_steps is None else skip_steps, profile_steps=profile_steps,
                      timeout_s=timeout, sft_args=tuple(extra), external_plugins=tuple(plugins),
                      packing=packing, keep_checkpoints=keep_checkpoints, exact_rss=exact_rss)
    report = run_bench(cfg)
    failed = [r["label"] for r in report["results"] if r["status"] != "ok"]
    if failed and len(failed) == len(report["results"]):
        raise typer.Exit(1)


bench_cmd.command_settings = {"context_settings": _SETTINGS}


def register(app: typer.Typer) -> None:
    """Add `bench` to an app of your own (swiftlite's app takes it from COMMANDS in cli/main.py)."""
    app.command("bench", **bench_cmd.command_settings)(bench_cmd)
