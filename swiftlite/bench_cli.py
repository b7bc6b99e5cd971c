"""`swiftlite bench`: registered by swiftlite/cli_extra.py. Light imports only (the logic is in bench.py)."""

from __future__ import annotations

from typing import List, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench_cmd(
        model: str = typer.Option("tiny-llama", "--model", help="Preset name or local HF folder."),
        parallelism: str = typer.Option(
            "ddp,fsdp,fsdp1,zero2,zero3", "--parallelism", "--parallelism-type",
            help="Comma-separated backends: ddp, fsdp, fsdp1, zero2, zero3, zero3_offload, a DeepSpeed .json; "
                 "append +compile, +gc (activation checkpointing) or +offload (FSDP CPU offload)."),
        steps: int = typer.Option(20, "--steps", "--max-steps", help="Optimizer steps per backend."),
        nproc_per_node: Optional[int] = typer.Option(
            None, "--nproc-per-node", "--nproc_per_node",
            help="Processes per run (default: the GPUs here, or 2 on CPU)."),
        max_length: int = typer.Option(128, "--max-length", "--max_length", help="Tokens per sequence."),
        batch: int = typer.Option(4, "--per-device-train-batch-size", "--per_device_train_batch_size",
                                  "--batch-size", help="Micro-batch per process."),
        dataset: Optional[str] = typer.Option(None, "--dataset",
                                              help="Training data (default: the demo task, written to OUTPUT/data)."),
        output: str = typer.Option("bench", "--output", "--output-dir", help="Folder for bench.json/md/png and runs."),
        train_type: str = typer.Option("full", "--train-type", "--train_type", help="full, lora or qlora."),
        dtype: Optional[str] = typer.Option(None, "--torch-dtype", "--dtype",
                                            help="fp32, bf16 or fp16 (default: bf16 on GPU, fp32 on CPU)."),
        gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing",
                                                    help="Activation checkpointing in every run."),
        packing: bool = typer.Option(False, "--packing", help="Pack rows into full --max-length sequences."),
        warmup_steps: int = typer.Option(3, "--warmup-steps", help="Steps left out of the timing."),
        profile_steps: int = typer.Option(2, "--profile-steps",
                                          help="Steps traced with torch.profiler (after the warm-up; 0: none)."),
        timeout: int = typer.Option(900, "--timeout", help="Seconds one backend's run may take."),
        keep_checkpoints: bool = typer.Option(False, "--keep-checkpoints",
                                              help="Keep each run's final checkpoint (default: deleted after reading)."),
        exact_rss: bool = typer.Option(False, "--exact-rss",
                                       help="CPU: MALLOC_MMAP_THRESHOLD_=65536 for true RSS (steps 2-3x slower)."),
        sft_arg: List[str] = typer.Option([], "--sft-arg",
                                          help="Extra flag(s) for every `swiftlite sft` run, e.g. --sft-arg=--lora-rank=16."),
    ) -> None:
        """Run the same job under several backends; step time, tokens/s, MFU, comm, overlap, memory."""
        import shlex

        from swiftlite.bench import BenchConfig, parse_backends, run_bench
        from swiftlite.errors import UserError
        if train_type not in ("full", "lora", "qlora"):
            raise UserError(f"--train-type {train_type!r}: choose from full, lora, qlora")
        if dtype is not None and dtype not in ("fp32", "bf16", "fp16"):
            raise UserError(f"--torch-dtype {dtype!r}: choose from fp32, bf16, fp16")
        extra: list[str] = []
        for a in sft_arg:
            extra += shlex.split(a)
        cfg = BenchConfig(model=model, backends=parse_backends(parallelism), steps=steps,
                          nproc_per_node=nproc_per_node, max_length=max_length, per_device_train_batch_size=batch,
                          dataset=dataset, output=output, train_type=train_type, torch_dtype=dtype,
                          gradient_checkpointing=gradient_checkpointing, warmup_steps=warmup_steps,
                          profile_steps=profile_steps, timeout_s=timeout, sft_args=tuple(extra), packing=packing,
                          keep_checkpoints=keep_checkpoints, exact_rss=exact_rss)
        report = run_bench(cfg)
        failed = [r["label"] for r in report["results"] if r["status"] != "ok"]
        if failed and len(failed) == len(report["results"]):
            raise typer.Exit(1)
