"""`swiftlite estimate` (memory per GPU for each backend -> swiftlite.planner) and `swiftlite models`
(the built-in presets). Light imports only: the planner is imported when the command runs."""

from __future__ import annotations

from typing import Optional

import typer

from swiftlite.errors import UserError


def models_cmd() -> None:
    """List the built-in model presets."""
    from swiftlite.models.presets import PRESETS, param_count
    for p in PRESETS.values():
        n = param_count(p.config)
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        src = "built-in (random init, shipped tokenizer)" if p.builtin else p.hub_id
        print(f"{p.name:<16} {size:>8}  {p.config['model_type']:<8} {src}  {p.description}".rstrip())


def estimate_cmd(
    model: str = typer.Option("tiny-llama", "--model", help="Preset name or local HF folder (config.json only)."),
    train_type: Optional[str] = typer.Option(None, "--train-type", "--train_type",
                                             help="full, lora, qlora, longlora (as lora), boft, adalora, bone, "
                                                  "llamapro or adapter (default full; boft, adalora, bone, "
                                                  "llamapro and adapter with ms-swift's default blocks, ranks and "
                                                  "widths: llamapro adds 4 layers and trains them, adapter trains "
                                                  "a 128-wide Houlsby adapter after each MLP)."),
    lora: bool = typer.Option(False, "--lora", help="Shorthand for --train-type lora."),
    qlora: bool = typer.Option(False, "--qlora", help="Shorthand for --train-type qlora (a 4-bit base)."),
    gpus: int = typer.Option(1, "--gpus", "--gpus-per-node", "--gpus_per_node", "--nproc-per-node", "--nproc_per_node",
                             help="GPUs per node."),
    nodes: int = typer.Option(1, "--nodes", "--nnodes", help="Number of nodes."),
    gpu_memory: str = typer.Option("80GB", "--gpu-memory", "--gpu_memory",
                                   help="Memory per GPU: 80GB (10^9 bytes), 24GiB (2^30); a bare number is GB."),
    cpu_memory: Optional[str] = typer.Option(None, "--cpu-memory", "--cpu_memory",
                                             help="CPU memory per node (same units); checks the offload rows "
                                                  "(default: reported, not checked)."),
    max_length: int = typer.Option(2048, "--max-length", "--max_length", help="Sequence length."),
    micro_batch: int = typer.Option(1, "--per-device-train-batch-size", "--per_device_train_batch_size",
                                    "--batch-size", help="Micro-batch per GPU."),
    sequence_parallel_size: int = typer.Option(1, "--sequence-parallel-size", "--sequence_parallel_size",
                                               help="Ulysses sequence parallelism (sft, pt, grpo): each GPU computes 1/N "
                                                    "of every sequence's tokens; N divides the GPUs."),
    gradient_checkpointing: bool = typer.Option(True, "--gradient-checkpointing/--no-gradient-checkpointing",
                                                help="Activation checkpointing."),
    dtype: str = typer.Option("bf16", "--torch-dtype", "--torch_dtype", "--dtype", help="bf16, fp16 or fp32."),
    lora_rank: int = typer.Option(8, "--lora-rank", "--lora_rank", help="LoRA rank (all-linear targets)."),
    quant_bits: Optional[int] = typer.Option(None, "--quant-bits", "--quant_bits",
                                             help="Quantized base for LoRA: 4 or 8 (bitsandbytes; --qlora implies "
                                                  "4), or 1, 2, 3, 4, 8 with --quant-method hqq."),
    quant_method: str = typer.Option("bnb", "--quant-method", "--quant_method",
                                     help="Who quantizes the base: bnb (bitsandbytes) or hqq (packed bits plus a "
                                          "scale and zero point per 64 weights; single, ddp and ZeRO-1/2 only)."),
    loss_impl: str = typer.Option("chunked", "--loss-impl", "--loss_impl",
                                  help="chunked (the default: no full logits), plain, liger or cce."),
    pure_bf16: bool = typer.Option(False, "--pure-bf16", "--pure_bf16",
                                   help="bf16 parameters and optimizer state, no fp32 master (torch backends)."),
    external_plugins: Optional[list[str]] = typer.Option(
        None, "--external-plugins", "--external_plugins", metavar="FILE",
        help="Python file run first; it may register backends, which then get a row. Repeat for several."),
    hsdp_shard_size: Optional[int] = typer.Option(
        None, "--hsdp-shard-size", "--hsdp_shard_size",
        help="GPUs per hsdp shard group (default: the GPUs per node); it must divide the GPUs."),
    rlhf_type: Optional[str] = typer.Option(None, "--rlhf-type", "--rlhf_type",
                                            help="Preference training (dpo, orpo, simpo, cpo, kto, rm): 2 sequences "
                                                 "per sample, and DPO's and KTO's frozen reference copy on a full "
                                                 "fine-tune. grpo: --batch-size counts completions, --max-length "
                                                 "is the prompt's, the generation KV cache and gathered weights "
                                                 "are counted, and the reference copy on a full fine-tune "
                                                 "unless --beta 0. gkd: a row of --max-length plus a sampled "
                                                 "completion, the generation round, both models' full logits."),
    max_completion_length: int = typer.Option(512, "--max-completion-length", "--max_completion_length",
                                              help="GRPO, GKD: tokens generated per completion (ms-swift's default "
                                                   "512)."),
    beta: float = typer.Option(0.04, "--beta", help="GRPO: the KL weight; 0: no reference copy (ms-swift's "
                                                   "default 0.04)."),
    teacher_model: Optional[str] = typer.Option(None, "--teacher-model", "--teacher_model",
                                                help="GRPO (on-policy distillation), GKD: a frozen teacher (preset or "
                                                     "local folder) whose weights are counted with the reference copy."),
    precompute_ref_log_probs: bool = typer.Option(False, "--precompute-ref-log-probs", "--precompute_ref_log_probs",
                                                  help="DPO with precomputed reference log-probs: no copy."),
    sharded_loading: bool = typer.Option(True, "--sharded-loading/--no-sharded-loading",
                                         help="fsdp/hsdp/fsdp1 fill each rank's shards from the files (the "
                                              "default); off: every rank loads the whole model first."),
    parallelism: Optional[str] = typer.Option(
        None, "--parallelism", "--parallelism_type", metavar="NAME",
        help="Estimate this backend only (a --parallelism value, e.g. zero2_offload, or a DeepSpeed .json "
             "file) and say whether it fits, instead of recommending one."),
    as_json: bool = typer.Option(False, "--json", help="Print the decision and every estimate as JSON "
                                 "(comm_intra_node_bytes / comm_inter_node_bytes: the split by link)."),
) -> None:
    """Memory per GPU for each backend, what fits, and the recommended backend."""
    shorthands = [t for t, on in (("lora", lora), ("qlora", qlora)) if on]
    if len(shorthands) > 1 or (shorthands and train_type not in (None, shorthands[0])):
        given = [f"--{t}" for t in shorthands] + ([f"--train-type {train_type}"] if train_type else [])
        raise UserError(f"{' and '.join(given)}: pick one train type")
    from swiftlite.parallel.base import load_plugins
    load_plugins(external_plugins or [])
    from swiftlite.planner.render import render, run_estimate, to_json
    decision = run_estimate(model=model, train_type=(shorthands or [train_type or "full"])[0], gpus=gpus,
                            nodes=nodes, gpu_memory=gpu_memory, cpu_memory=cpu_memory, max_length=max_length,
                            micro_batch=micro_batch, gradient_checkpointing=gradient_checkpointing, dtype=dtype,
                            lora_rank=lora_rank, quant_bits=quant_bits, loss_impl=loss_impl, pure_bf16=pure_bf16,
                            hsdp_shard_size=hsdp_shard_size, rlhf_type=rlhf_type,
                            precompute_ref_log_probs=precompute_ref_log_probs, parallelism=parallelism,
                            sharded_loading=sharded_loading, max_completion_length=max_completion_length,
                            beta=beta, quant_method=quant_method, teacher_model=teacher_model,
                            sequence_parallel_size=sequence_parallel_size)
    if as_json:
        print(to_json(decision))
    else:
        render(decision)
