"""`swiftlite estimate`: memory per GPU for every backend, and which one to use.

Reads the model's config only (a preset, or a local folder's config.json): no weights, no network,
no GPU. The memory model and the decision rules live in swiftlite/parallel/plan.py; formulas and
limits in docs/estimate.md.

CLI flags (each maps to the run_estimate parameter in brackets; spellings follow `sft`):
  --model TEXT                  preset name or local HF folder with config.json        [model]
  --train-type full|lora|qlora  (--lora / --qlora shorthands; default full)            [train_type]
  --gpus, --nproc-per-node INT  GPUs per node (default 1)                              [gpus]
  --nodes, --nnodes INT         nodes (default 1)                                      [nodes]
  --gpu-memory TEXT             memory of one GPU: 80GB (10^9), 24GiB (2^30); a bare
                                number means GB (default 80GB)                         [gpu_memory]
  --cpu-memory TEXT             CPU memory per node; checks offload (default: unchecked)
                                                                                       [cpu_memory]
  --max-length INT              tokens per sequence (default 2048)                     [max_length]
  --per-device-train-batch-size, --batch-size INT  micro-batch per GPU (default 1)     [micro_batch]
  --gradient-checkpointing / --no-gradient-checkpointing (default on)
                                                                                       [gradient_checkpointing]
  --torch-dtype, --dtype bf16|fp16|fp32  parameter dtype (default bf16: GPU training)   [dtype]
  --lora-rank INT               LoRA rank, all-linear targets (default 8)              [lora_rank]
  --quant-bits 4|8              quantized base for LoRA (--qlora implies 4)            [quant_bits]
  --json                        print Decision.to_dict() as JSON instead of the table (CLI only)

    decision = run_estimate("llama-8b", train_type="lora", gpus=2, gpu_memory="24GB")
    render(decision)
"""

from __future__ import annotations

import math
import re

from swiftlite.errors import UserError
from swiftlite.parallel.plan import Decision, GiB, Workload, recommend, shape_from_model_arg, trainable_params

_UNITS = {
    "": 10**9,  # a bare number is GB, the unit GPU vendors quote
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int | float, flag: str = "--gpu-memory") -> int:
    """Bytes from a size: "80GB" (GB = 10^9), "24GiB" (GiB = 2^30), "80" (GB), "512MiB", "2TB".

    Anything else, or a size that is not positive, is a UserError naming `flag` and the value.
    """
    if isinstance(text, bool):
        raise UserError(f"{flag}: expected a size like 80GB or 24GiB, got {text!r}")
    if isinstance(text, (int, float)):
        text = str(text)
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UserError(f"{flag}: cannot read {text!r} as a size (use e.g. 80GB, 24GiB, or 80 for GB)")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise UserError(f"{flag}: size must be positive, got {text!r}")
    return int(value)


def run_estimate(model: str, train_type: str = "full", gpus: int = 1, nodes: int = 1,
                 gpu_memory: str = "80GB", max_length: int = 2048, micro_batch: int = 1,
                 gradient_checkpointing: bool = True, dtype: str = "bf16", lora_rank: int = 8,
                 quant_bits: int | None = None, cpu_memory: str | None = None) -> Decision:
    """Estimate every backend for `model` on `nodes` x `gpus` GPUs and recommend one.

    `gpus` is per node. Bad values raise a UserError naming the flag.
    """
    for flag, v in (("--gpus", gpus), ("--nnodes", nodes)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise UserError(f"{flag} must be a positive integer, got {v!r}")
    shape = shape_from_model_arg(model)
    workload = Workload(
        train_type=train_type, dtype=dtype, lora_rank=lora_rank, quant_bits=quant_bits,
        max_length=max_length, micro_batch=micro_batch, gradient_checkpointing=gradient_checkpointing,
        world_size=gpus * nodes, gpus_per_node=gpus, gpu_memory_bytes=parse_size(gpu_memory, "--gpu-memory"),
        cpu_memory_bytes=parse_size(cpu_memory, "--cpu-memory") if cpu_memory is not None else None)
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
        lora = f", LoRA r={w.lora_rank}" if w.peft else ""
        nodes = w.world_size // (w.gpus_per_node or w.world_size)
        gpu = w.gpu_memory_bytes or 0
        console.print(
            f"[bold]{shape.name or shape.model_type}[/bold]: {_count(shape.n_params)} params, "
            f"{_count(trainable_params(shape, w))} trainable ({w.train_type}{lora}{quant}, {w.dtype})\n"
            f"{w.world_size} GPU(s) = {nodes} node(s) x {w.gpus_per_node}, {gpu / 1e9:.4g} GB = "
            f"{gpu / GiB:.1f} GiB each ({w.usable_fraction:.0%} usable); max_length {w.max_length} x "
            f"batch {w.micro_batch}, gradient checkpointing {'on' if w.gradient_checkpointing else 'off'}")
    overhead = next(iter(decision.table.values())).overhead if decision.table else 0
    # A long title would widen the table past 80 columns and squeeze the numbers: print it apart.
    console.print(f"GiB per GPU (totals include {_gib(overhead)} GiB CUDA context/allocator overhead)")
    table = Table(box=box.SIMPLE_HEAD, padding=0, pad_edge=False, show_edge=False)
    table.add_column("backend", no_wrap=True)
    for col in ("params", "grads", "optim", "acts", "buffers", "total"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("fits", no_wrap=True)
    table.add_column("CPU/node", justify="right", no_wrap=True)
    table.add_column("comm/step", justify="right", no_wrap=True)
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
        table.add_row(f"* {name}" if chosen else f"  {name}", _gib(est.params), _gib(est.grads),
                      _gib(est.optimizer), _gib(est.activations), _gib(est.temp_buffers), _gib(est.total), fits,
                      _gib(est.cpu_per_node) if est.cpu_per_node else "-", _gib(est.comm_bytes_per_step),
                      style="bold" if chosen else None)
    console.print(table)
    for note in notes:
        console.print(f"[dim]n/a {note}[/dim]")
    if decision.backend == "none":
        console.print(f"[bold red]No backend fits[/bold red]: {decision.reason}")
    else:
        console.print(f"[bold]Recommendation[/bold] {decision.reason}")
    console.print("[dim]Estimates, not measurements: see docs/estimate.md for the formulas and limits.[/dim]")
