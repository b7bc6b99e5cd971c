"""What a bench runs: the backend columns (`--parallelism`) and the settings shared by every run.

The backend names and their aliases come from the registry (swiftlite/parallel/base.py), so a backend
registered by an `--external-plugins` file is a column like any other; the bench keeps no table of
its own. A `+modifier` adds `swiftlite sft` flags to one column.
"""

from __future__ import annotations

import re
from dataclasses import InitVar, dataclass, field
from pathlib import Path

from swiftlite.errors import UserError

#: `+name` after a backend -> the `swiftlite sft` flags it adds to that column.
MODIFIERS = {"compile": ["--compile"], "gc": ["--gradient-checkpointing"], "ac": ["--gradient-checkpointing"],
             "offload": ["--cpu-offload"]}


@dataclass(frozen=True)
class BackendSpec:
    """One column of the bench: `fsdp`, `fsdp+compile`, `zero3`, or a DeepSpeed JSON file."""
    label: str
    parallelism: str
    extra_args: tuple[str, ...] = ()

    @property
    def dirname(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.+-]", "_", self.label)


def parse_backends(text: str) -> list[BackendSpec]:
    """"ddp,fsdp,fsdp+compile,zero3,my_ds.json" -> specs. `+compile`, `+gc` (activation
    checkpointing) and `+offload` (FSDP CPU offload) add flags; a .json item is a DeepSpeed config.
    Plugins (`--external-plugins`) must be loaded before this is called, so their names are known."""
    from swiftlite.parallel.base import find_backend, parallelism_names
    specs: list[BackendSpec] = []
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        if item.endswith(".json"):
            if not Path(item).is_file():
                raise UserError(f"--parallelism {item}: no such DeepSpeed JSON file")
            specs.append(BackendSpec(Path(item).stem, str(Path(item).resolve())))
            continue
        base, *mods = item.split("+")
        rec = find_backend(base)
        if rec is None:
            names = [n for n in parallelism_names() if n not in ("auto", "deepspeed")]
            raise UserError(f"--parallelism {item}: unknown backend {base!r} "
                            f"(choose from {', '.join(names)}, or a DeepSpeed .json)")
        extra: list[str] = []
        for m in mods:
            if m not in MODIFIERS:
                raise UserError(f"--parallelism {item}: unknown modifier +{m} (known: {', '.join(MODIFIERS)})")
            if m == "offload" and "cpu_offload" not in rec.options:
                raise UserError(f"--parallelism {item}: +offload is FSDP's CPU offload; "
                                "use zero3_offload for DeepSpeed")
            extra += MODIFIERS[m]
        specs.append(BackendSpec(item, base, tuple(extra)))
    if not specs:
        raise UserError("--parallelism: name at least one backend (e.g. ddp,fsdp,zero3)")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise UserError(f"--parallelism: a backend is named twice ({text})")
    return specs


@dataclass(kw_only=True)
class BenchConfig:
    """Settings of one bench: the workload every column runs, and how the steps are timed.

    `skip_steps` are the first steps left out of the timing (start-up, allocator and cache warm-up);
    they have nothing to do with the learning-rate warm-up of `swiftlite sft --warmup-steps`.
    `warmup_steps=` is accepted as its former, deprecated name."""
    model: str = "tiny-llama"
    backends: list[BackendSpec] = field(default_factory=list)
    steps: int = 20
    nproc_per_node: int | None = None       # None: the GPUs on this machine, else 2 CPU processes
    nnodes: int = 1                          # > 1: each column runs as this many local nodes (bench/nodes.py)
    max_length: int = 128
    per_device_train_batch_size: int = 4
    dataset: str | None = None               # None: the demo task, written under <output>/data
    output: str = "bench"
    train_type: str = "full"
    torch_dtype: str | None = None           # None: bf16 on GPU, fp32 on CPU
    gradient_checkpointing: bool = False
    skip_steps: int = 3                      # first steps left out of the timing (not the LR warm-up)
    profile_steps: int = 2
    timeout_s: int = 900                     # per backend run
    sft_args: tuple[str, ...] = ()           # extra flags for every `swiftlite sft`
    external_plugins: tuple[str, ...] = ()   # --external-plugins files, passed on to every `swiftlite sft`
    packing: bool = False
    keep_checkpoints: bool = False           # False: delete each run's checkpoint-* after reading it
    exact_rss: bool = False                  # CPU: MALLOC_MMAP_THRESHOLD_=65536 (true RSS, slower steps)
    warmup_steps: InitVar[int | None] = None  # deprecated name of skip_steps

    def __post_init__(self, warmup_steps: int | None) -> None:
        if warmup_steps is not None:
            self.skip_steps = warmup_steps

    def check(self) -> None:
        if self.steps < self.skip_steps + self.profile_steps + 3:
            raise UserError(f"--steps {self.steps}: needs at least skipped ({self.skip_steps}) + profiled "
                            f"({self.profile_steps}) + 3 steps, so that two steps are timed")
        for flag, v in (("--max-length", self.max_length), ("--per-device-train-batch-size",
                        self.per_device_train_batch_size), ("--timeout", self.timeout_s)):
            if v < 1:
                raise UserError(f"{flag} must be positive, got {v}")
        if self.skip_steps < 0 or self.profile_steps < 0:
            raise UserError("--skip-steps and --profile-steps must be >= 0")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise UserError(f"--nproc-per-node must be positive, got {self.nproc_per_node}")
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise UserError(f"--nnodes must be a positive integer, got {self.nnodes!r}")
        if self.dataset and not Path(self.dataset.split("#")[0]).exists():
            raise UserError(f"--dataset {self.dataset}: not found")
