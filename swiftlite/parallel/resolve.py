"""`--parallelism` -> the backend a run uses: the only reader of that flag.

    choice = resolve_backend(cfg, world_size, gpu_memory=None, auto=decide)   # BackendChoice(name, reason, ...)

Dry-run, preflight, the trainer, model loading, the planner and bench all call this one function
(through `planner.choose_backend`, which hands it the planner's decision for `auto`), so what
`--dry-run` prints is what runs. The steps, in order:

1. `auto` asks `auto(cfg, world_size, gpu_memory, shape=, gpus_per_node=)`, the planner's
   `resolve_auto` (memory per GPU on CUDA, simple rules on CPU), handed in by the caller: the planner
   reads the backend records, so parallel/ does not import the planner (no package cycle).
   `--deepspeed FILE` alone means DeepSpeed; a `.json` value is a DeepSpeed config file.
2. The named record (or alias) is looked up in the registry (parallel/base.py).
3. Its checks run: the options it honours (`--mixed-precision`, `--cpu-offload`), fp16 without loss
   scaling, its process limit, then its own rules (`Backend.checks`).
4. On one process a record with a `one_process` fallback (ddp, fsdp, fsdp1) runs that instead: there
   is nothing to replicate or shard; the reason says so.

Any failure is a one-line UserError naming the flag, raised before a process starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swiftlite.checkpoint.layout import CheckpointFormat
from swiftlite.errors import UserError
from swiftlite.parallel.base import OPTION_FLAGS, Backend, BackendChoice, get_backend, parallelism_names

if TYPE_CHECKING:
    from swiftlite.config import RunConfig

#: gpu_memory: bytes of the smallest GPU, None on CPU, or a function giving either (called only when
#: the answer depends on it: `auto`).
GpuMemory = "int | None | Callable[[], int | None]"


def requested(cfg: "RunConfig") -> str:
    """What the user asked for, as one name (`--deepspeed FILE` alone counts as that file)."""
    p = cfg.parallel.parallelism
    if p == "auto" and cfg.parallel.deepspeed:
        return cfg.parallel.deepspeed
    return p


def _lookup(name: str, cfg: "RunConfig") -> tuple[Backend, str | None]:
    """The record for a --parallelism name, and its DeepSpeed source (preset or file) if any."""
    from swiftlite.parallel.base import find_backend
    ds = cfg.parallel.deepspeed
    if ds and cfg.parallel.parallelism == "auto":   # --deepspeed FILE|PRESET alone means DeepSpeed
        preset = find_backend(ds)
        if preset is not None and preset.ds_preset == ds:
            return preset, ds
        return get_backend("deepspeed"), ds
    if name.endswith(".json"):
        return get_backend("deepspeed"), name
    rec = find_backend(name)
    if rec is None:
        raise UserError(f"--parallelism: unknown value {name!r} (choose from {', '.join(parallelism_names())}, "
                        "or a DeepSpeed .json file)")
    if ds:
        if rec.checkpoint_format is not CheckpointFormat.DS:
            raise UserError(f"--deepspeed given with --parallelism {cfg.parallel.parallelism}: use one of them")
        return rec, ds
    return rec, rec.ds_preset


def _memory_family(rec: Backend, ds_source: str | None) -> str | None:
    if rec.memory_family is not None or ds_source is None:
        return rec.memory_family
    # A DeepSpeed JSON of the user's: its stage and offload blocks decide which formulas apply
    # (optimizer-only offload included; hpZ makes ZeRO-3 ZeRO++).
    from swiftlite.parallel.ds_config import ds_config_family, load_ds_config
    return ds_config_family(load_ds_config(ds_source))


def check_backend(rec: Backend, cfg: "RunConfig", world_size: int, ds_source: str | None = None) -> None:
    """The rules every record shares, then its own; the first failure is a UserError."""
    shown = cfg.parallel.parallelism if cfg.parallel.parallelism != "auto" else rec.name
    for opt, flag in OPTION_FLAGS.items():
        value = getattr(cfg.parallel, opt)
        if value not in (None, False, "none") and opt not in rec.options:
            honoured = "/".join(sorted(b.name for b in _all() if opt in b.options))
            if opt == "cpu_offload":
                raise UserError(f"{flag} applies to {honoured}; for DeepSpeed use --parallelism zero3_offload "
                                f"(got --parallelism {shown})")
            if opt == "mixed_precision":
                raise UserError(f"{flag} applies to {honoured}; with --parallelism {shown} set --torch-dtype instead")
            raise UserError(f"{flag} applies to {honoured}, not to --parallelism {shown}: drop it")
    if not cfg.parallel.sharded_loading and rec.loading != "sharded":
        sharded = "/".join(b.name for b in _all() if b.loading == "sharded")
        raise UserError(f"--sharded-loading false applies to {sharded} (they load the model sharded); "
                        f"--parallelism {shown} loads it {rec.loading}: drop it")
    if cfg.model.torch_dtype == "fp16" and not rec.loss_scaling:
        raise UserError("--torch-dtype fp16 needs loss scaling, which only the DeepSpeed backends provide; use bf16"
                        + (f" (--parallelism {shown})" if shown != cfg.parallel.parallelism else ""))
    if rec.max_processes is not None and world_size > rec.max_processes:
        raise UserError(f"--parallelism {shown} runs one process: drop --nproc-per-node/--nnodes or pick ddp/fsdp")
    choice = BackendChoice(name=rec.name, requested=requested(cfg), deepspeed_source=ds_source)
    for check in rec.checks:
        msg = check(cfg, world_size, choice)
        if msg:
            raise UserError(msg)


def _all() -> list[Backend]:
    from swiftlite.parallel.base import all_backends
    return all_backends()


def resolve_backend(cfg: "RunConfig", world_size: int, gpu_memory: Any = None, *, shape: Any = None,
                    gpus_per_node: int | None = None, auto: Any = None) -> BackendChoice:
    """The backend this run uses on `world_size` processes (see the module docstring). `auto`: the
    decision for `--parallelism auto` (planner.recommend.resolve_auto; planner.choose_backend passes it)."""
    name = requested(cfg)
    reason = ""
    if name == "auto":
        if auto is None:
            raise TypeError("--parallelism auto needs the planner's decision: call planner.choose_backend")
        mem = gpu_memory() if callable(gpu_memory) else gpu_memory
        if callable(shape):  # the model's shape matters only to the memory model, on GPUs
            shape = shape() if mem is not None else None
        decision = auto(cfg, world_size, mem, shape=shape, gpus_per_node=gpus_per_node)
        name, reason = decision.backend, decision.reason
    rec, ds_source = _lookup(name, cfg)
    try:
        check_backend(rec, cfg, world_size, ds_source)
    except UserError as e:
        if requested(cfg) == "auto":
            raise UserError(f"--parallelism auto chose {rec.name} ({reason}), but {e}") from None
        raise
    if world_size == 1 and rec.one_process:
        fallback = get_backend(rec.one_process)
        reason = reason or f"{rec.name} on one process: nothing to replicate or shard, runs as {fallback.name}"
        rec, ds_source = fallback, fallback.ds_preset
    return BackendChoice(name=rec.name, requested=requested(cfg), reason=reason, deepspeed_source=ds_source,
                         memory_family=_memory_family(rec, ds_source))


def memory_family_for(name: str, world_size: int) -> str | None:
    """The planner family a --parallelism name runs as on `world_size` processes, without a run
    config (bench columns, estimate rows): aliases folded, one-process fallbacks applied, a DeepSpeed
    JSON read for its stage."""
    from swiftlite.parallel.base import find_backend
    if name.endswith(".json"):
        try:
            return _memory_family(get_backend("deepspeed"), name)
        except UserError:
            return None
    rec = find_backend(name)
    if rec is None:
        return None
    if world_size == 1 and rec.one_process:
        rec = get_backend(rec.one_process)
    return rec.memory_family


def ds_source(cfg: "RunConfig", choice: Any = None) -> str:
    """The DeepSpeed preset or JSON file of this run (from the resolved choice when there is one)."""
    if choice is not None and choice.deepspeed_source:
        return choice.deepspeed_source
    name = requested(cfg)
    if name.endswith(".json"):
        return name
    rec = get_backend(name)
    if not rec.ds_preset:
        raise UserError(f"--parallelism {name}: not a DeepSpeed backend")
    return rec.ds_preset


def local_gpu_memory() -> int | None:
    """Total memory of the smallest GPU this process sees, or None without CUDA (imports torch: called
    lazily, only when the answer matters)."""
    import torch
    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


__all__ = ["GpuMemory", "check_backend", "local_gpu_memory", "ds_source", "memory_family_for", "requested", "resolve_backend"]
