"""`swiftlite estimate`: the memory each backend needs per GPU, as a table, and the recommendation.

    decision = run_estimate("llama-8b", train_type="lora", gpus=2, gpu_memory="24GB")
    render(decision)                  # the table (rich), or: print(to_json(decision))

Reads the model's config only (a preset, or a local folder's config.json): no weights, no network,
no GPU. One row per registered backend record with `estimate` set and a memory family
(planner/backends.py), computed by planner/memory.py; the choice is planner/recommend.py's. The
command's flags (cli/estimate.py `estimate_cmd`) map onto run_estimate's parameters; docs/estimate.md
lists them with the formulas and their limits.
"""

from __future__ import annotations

import json

from swiftlite.errors import UserError
from swiftlite.models.source import resolve_model
from swiftlite.planner.activations import GKD_LOGIT_BYTES
from swiftlite.planner.memory import GiB, Workload, trainable_params
from swiftlite.planner.load import largest_shard_file
from swiftlite.planner.recommend import Decision, assess, recommend
from swiftlite.sizes import parse_size


def run_estimate(model: str, train_type: str = "full", gpus: int = 1, nodes: int = 1,
                 gpu_memory: str = "80GB", max_length: int = 2048, micro_batch: int = 1,
                 gradient_checkpointing: bool = True, dtype: str = "bf16", lora_rank: int = 8,
                 quant_bits: int | None = None, cpu_memory: str | None = None, loss_impl: str = "chunked",
                 pure_bf16: bool = False, hsdp_shard_size: int | None = None, rlhf_type: str | None = None,
                 precompute_ref_log_probs: bool = False, parallelism: str | None = None,
                 sharded_loading: bool = True, max_completion_length: int = 512, beta: float = 0.04,
                 quant_method: str = "bnb", teacher_model: str | None = None,
                 sequence_parallel_size: int = 1) -> Decision:
    """Estimate every backend for `model` on `nodes` x `gpus` GPUs and recommend one; with
    `parallelism` (a backend name or a DeepSpeed .json file), estimate that one and say whether it
    fits (recommend.assess).

    `gpus` is per node; sizes are parse_size's (a bare number is GB); `cpu_memory` is per node and,
    when given, makes the offload rows check CPU memory too. `quant_bits` None with "qlora" means 4.
    `hsdp_shard_size` None: the hsdp row shards over one node's GPUs. Bad values raise a UserError
    naming the flag. GRPO (`rlhf_type` "grpo"): `micro_batch` counts completions, `max_length` is the
    prompt's, and the generation round (KV cache of prompt + `max_completion_length` tokens, the
    weights the backend gathers) is counted; `beta` 0 means no reference copy; `teacher_model` (GRPO's
    on-policy distillation, and GKD's teacher) adds the teacher's weights to the reference. GKD (`rlhf_type`
    "gkd"): a row of `max_length` plus a sampled completion (on-policy steps), both models' full logits. `quant_method` hqq counts HQQ's
    packed bits (`quant_bits` 1, 2, 3, 4 or 8; the sharding backends, which cannot hold it, are n/a).
    `sequence_parallel_size` N: each GPU computes 1/N of every sequence (Ulysses; sft, pt and grpo).
    """
    if quant_method not in ("bnb", "hqq"):
        raise UserError(f"--quant-method {quant_method!r}: choose bnb or hqq")
    if quant_method == "hqq" and quant_bits is None:
        raise UserError("--quant-method hqq needs --quant-bits (1, 2, 3, 4 or 8)")
    if teacher_model is not None and rlhf_type not in ("grpo", "gkd"):
        raise UserError("--teacher-model needs --rlhf-type grpo (on-policy distillation) or gkd")
    if hsdp_shard_size is not None and (not isinstance(hsdp_shard_size, int) or hsdp_shard_size <= 0
                                        or (gpus * nodes) % hsdp_shard_size):
        raise UserError(f"--hsdp-shard-size {hsdp_shard_size}: it must divide the {gpus * nodes} GPUs")
    for flag, v in (("--gpus", gpus), ("--nnodes", nodes)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise UserError(f"{flag} must be a positive integer, got {v!r}")
    if sequence_parallel_size != 1 and rlhf_type not in (None, "grpo"):
        raise UserError(f"--sequence-parallel-size {sequence_parallel_size} with --rlhf-type {rlhf_type}: sequence "
                        "parallelism is built for sft, pt and grpo")
    if rlhf_type not in (None, "dpo", "orpo", "simpo", "cpo", "kto", "rm", "grpo", "gkd"):
        raise UserError(f"--rlhf-type {rlhf_type!r}: choose from dpo, orpo, simpo, cpo, kto, rm, grpo, gkd")
    if precompute_ref_log_probs and rlhf_type != "dpo":
        raise UserError("--precompute-ref-log-probs needs --rlhf-type dpo")
    if not isinstance(max_completion_length, int) or max_completion_length <= 0:
        raise UserError(f"--max-completion-length must be a positive integer, got {max_completion_length!r}")
    copy = rlhf_type in ("dpo", "kto") and train_type == "full" and not precompute_ref_log_probs
    generation_length = 0
    if rlhf_type == "grpo":   # a sample is one completion: prompt + completion, its logits at the completion
        copy = train_type == "full" and beta != 0
        generation_length = max_length + max_completion_length
        max_length, loss_impl = generation_length, "plain"
    elif rlhf_type == "gkd":   # a row, or its prompt with a completion sampled as GRPO's (--lmbda > 0 assumed)
        generation_length = max_length + max_completion_length
        max_length, loss_impl = generation_length, "plain"
    elif rlhf_type:  # a pair is 2 sequences; the log-probs take the logits at the answer tokens
        micro_batch, loss_impl = micro_batch * 2, "plain"
    shape = resolve_model(model).shape()   # offline: a preset or a local folder's config
    workload = Workload(shard_file_bytes=largest_shard_file(model), sharded_loading=sharded_loading,reference="copy" if copy else "none",
        train_type=train_type, dtype=dtype, lora_rank=lora_rank, quant_bits=quant_bits,
        max_length=max_length, micro_batch=micro_batch, gradient_checkpointing=gradient_checkpointing,
        sequence_parallel=sequence_parallel_size,
        world_size=gpus * nodes, gpus_per_node=gpus, gpu_memory_bytes=parse_size(gpu_memory, "--gpu-memory"),
        cpu_memory_bytes=parse_size(cpu_memory, "--cpu-memory") if cpu_memory is not None else None,
        loss_impl=loss_impl, pure_bf16=pure_bf16, hsdp_shard_size=hsdp_shard_size,
        generation_length=generation_length, quant_method=quant_method,
        teacher_params=resolve_model(teacher_model).shape().n_params if teacher_model else 0,
        plain_logit_bytes=GKD_LOGIT_BYTES if rlhf_type == "gkd" else 0)
    shape = workload.trained_shape(shape)   # llamapro: with its inserted layers (ms-swift's default 4)
    if parallelism not in (None, "auto"):
        return assess(shape, workload, parallelism)
    return recommend(shape, workload)


def _gib(nbytes: int) -> str:
    if nbytes == 0:
        return "0"
    if nbytes < 10 * GiB:
        return f"{nbytes / GiB:.2f}"
    return f"{nbytes / GiB:.1f}" if nbytes < 1000 * GiB else f"{nbytes / GiB:.0f}"


def _count(n: int) -> str:
    for div, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def render(decision: Decision, console=None) -> None:
    """Print the per-backend table (GiB per GPU by component, fits, comm/step) and the recommendation.

    `console` is a rich Console (tests pass one that writes to a buffer); default: stdout.
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    w, shape = decision.workload, decision.shape
    if w is not None and shape is not None:
        quant = f", {w.quant_bits}-bit base" if w.quant_bits else ""
        size, num, _ = w.boft_block   # each adapter by its own size option
        adapter = {"boft": f"BOFT block size {size}" if size else f"BOFT {num} blocks",
                   "adalora": f"AdaLoRA init_r={w.adalora_init_r}",
                   "bone": f"Bone (MiSS) r={w.bone_rank}"}.get(w.train_type, f"LoRA r={w.lora_rank}")
        lora = f", {adapter}" if w.peft else ""
        nodes = w.world_size // (w.gpus_per_node or w.world_size)
        gpu = w.gpu_memory_bytes or 0
        console.print(
            f"[bold]{shape.name or shape.model_type}[/bold]: {_count(shape.n_params)} params, "
            f"{_count(trainable_params(shape, w))} trainable ({w.train_type}{lora}{quant}, {w.dtype})\n"
            f"{w.world_size} GPU(s) = {nodes} node(s) x {w.gpus_per_node}, {gpu / 1e9:.4g} GB = "
            f"{gpu / GiB:.1f} GiB each ({w.usable_fraction:.0%} usable); max_length {w.max_length} x "
            f"batch {w.micro_batch}"
            + (f" over sequence-parallel groups of {w.sequence_parallel} ({-(-w.max_length // w.sequence_parallel)} "
               "tokens a GPU)" if w.sequence_parallel > 1 else "")
            + f", gradient checkpointing {'on' if w.gradient_checkpointing else 'off'}")
    overhead = next(iter(decision.table.values())).overhead if decision.table else 0
    # A long title would widen the table past 80 columns and squeeze the numbers: print it apart.
    console.print(f"GiB per GPU (totals include {_gib(overhead)} GiB CUDA context/allocator overhead)")
    table = Table(box=box.SIMPLE_HEAD, padding=0, pad_edge=False, show_edge=False)
    table.add_column("backend", no_wrap=True)
    for col in ("params", "grads", "optim", "acts", "buffers", "total"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("fits", no_wrap=True)
    table.add_column("CPU/node", justify="right", no_wrap=True)
    # Across nodes the communication splits by link (planner/topology.py): within a node / across.
    multi = w is not None and w.nnodes > 1
    comm_cols = ("intra", "inter") if multi else ("comm/step",)
    for col in comm_cols:
        table.add_column(col, justify="right", no_wrap=True)
    notes = []
    for name, est in decision.table.items():
        if not est.available:
            fits = "[dim]n/a[/dim]"
            notes.append(f"{name}: {est.note}")
        elif est.fits is None:
            fits = "?"
        else:
            fits = "[green]yes[/green]" if est.fits else "[red]no[/red]"
        chosen = name == decision.backend
        comm = ((_gib(est.comm_intra_node_bytes), _gib(est.comm_inter_node_bytes)) if multi
                else (_gib(est.comm_bytes_per_step),))
        table.add_row(f"* {name}" if chosen else f"  {name}", _gib(est.params), _gib(est.grads),
                      _gib(est.optimizer), _gib(est.activations), _gib(est.temp_buffers), _gib(est.total), fits,
                      _gib(est.cpu_per_node) if est.cpu_per_node else "-", *comm,
                      style="bold" if chosen else None)
    console.print(table)
    _render_phases(decision, console)
    if w is not None and w.reference == "copy" and decision.backend in decision.table:
        console.print(f"[dim]totals include the frozen reference copy (DPO, KTO, GRPO): "
                      f"{_gib(decision.table[decision.backend].reference)} GiB per GPU on {decision.backend}[/dim]")
    if w is not None and w.generation_length and decision.backend in decision.table:
        from swiftlite.planner.memory import kv_cache_bytes
        gen = decision.table[decision.backend].generation
        console.print(f"[dim]totals include the generation round (GRPO, GKD's on-policy steps) on {decision.backend}: "
                      f"{_gib(gen)} GiB per GPU (KV cache {_gib(kv_cache_bytes(decision.shape, w))} GiB for "
                      f"{w.micro_batch} sequences of {w.generation_length} tokens, the rest the weights gathered "
                      "for the round), a phase of its own next to the backward's activations[/dim]")
    if multi:
        console.print("[dim]intra/inter: comm GiB per GPU per step, collectives inside one node / across "
                      "nodes (ring terms; docs/backends.md \"Across nodes\")[/dim]")
    for note in notes:
        console.print(f"[dim]n/a {note}[/dim]")
    if decision.named:
        verdict = "[bold]Fits[/bold]" if decision.backend != "none" else "[bold red]Does not fit[/bold red]"
        console.print(f"{verdict}: {decision.reason}")
    elif decision.backend == "none":
        console.print(f"[bold red]No backend fits[/bold red]: {decision.reason}")
    else:
        console.print(f"[bold]Recommendation[/bold] {decision.reason}")
    console.print("[dim]Estimates, not measurements: see docs/estimate.md for the formulas and limits.[/dim]")


def _render_phases(decision: Decision, console) -> None:
    """The second table: per backend, the load phase (GPU, host RAM per node, how the weights are
    read), DeepSpeed's optimizer-step transient and the peak that decides `fits`."""
    from rich import box
    from rich.table import Table

    console.print("Load phase and optimizer step (GiB; peak = max(training total, load) per GPU)")
    table = Table(box=box.SIMPLE_HEAD, padding=0, pad_edge=False, show_edge=False)
    table.add_column("backend", no_wrap=True)
    for col in ("load/GPU", "host/node", "step", "peak"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column(" loading", no_wrap=True)
    for name, est in decision.table.items():
        chosen = name == decision.backend
        table.add_row(f"* {name}" if chosen else f"  {name}", _gib(est.load_gpu), _gib(est.load_host_per_node),
                      _gib(est.step_transient) if est.step_transient else "-", _gib(est.peak),
                      f" {est.load_method}", style="bold" if chosen else None)
    console.print(table)
    console.print("[dim]load/GPU: weights held + the largest piece in flight; host/node: RAM the processes of one "
                  "node stage while loading; step: DeepSpeed's gradient conversion in step(), which replaces "
                  "the activations at that moment[/dim]")


def to_json(decision: Decision) -> str:
    """The decision as JSON (`estimate --json`): Decision.to_dict(), bytes as integers."""
    return json.dumps(decision.to_dict(), indent=2)


__all__ = ["render", "run_estimate", "to_json"]
