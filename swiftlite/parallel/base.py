"""The backend interface, the Backend record and the registry.

The trainer sees one `Engine`, whatever the backend:

    engine = build_engine(model, cfg, world, total_steps, choice)
    with engine.micro_batch(last):             # gradient sync only on the window's last one
        loss = engine.forward(batch) * scale   # summed token cross-entropy, fp32 scalar
        engine.backward(loss)
    grad_norm = engine.step()                  # clip + optimizer + scheduler + zero_grad
    engine.save(dir) / engine.load(dir)        # sharded training state (model + optimizer + scheduler)
    engine.full_state_dict()                   # HF names, gathered to rank 0, CPU tensors
    engine.adapter_state_dict()                # peft names, gathered to rank 0

Gradient contract: every backend averages gradients over data-parallel ranks (DDP, FSDP and ZeRO all
do). The trainer therefore scales each rank's summed loss by world_size / global_target_tokens, so the
averaged gradient is the gradient of the global token-mean loss, equal for any world size or
accumulation. An engine must not rescale the loss again (DeepSpeed's own 1/gas is disabled).

What a `--parallelism` value means is a `Backend` record: its engine factory, the names that select
it, what it shards, how the planner counts its memory, its own config checks, the context models are
built in, its checkpoint format and DeepSpeed preset. Records are registered by the backend modules
(`BUILTIN_MODULES`, imported on first use; each is torch-free at import time) or by a user's
`--external-plugins` file. Only `parallel/resolve.py` turns a run config into a record
(`resolve_backend`); everything else asks it. Adding a backend = one module that calls
`register_backend(Backend(...))`, plus its name in `BUILTIN_MODULES` when it ships with swiftlite.
docs/design.md has the whole picture.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from swiftlite.distributed import World
from swiftlite.errors import UserError

if TYPE_CHECKING:  # keep torch out of import time for the CLI
    import torch

    from swiftlite.config import RunConfig

__all__ = ["Backend", "BackendChoice", "Engine", "World", "all_backends", "build_engine", "find_backend",
           "get_backend", "register_backend", "tensor_bytes"]


class Engine(Protocol):
    """What the trainer drives. See the module docstring for the contract."""
    module: "torch.nn.Module"

    def micro_batch(self, last: bool) -> Any: ...
    def forward(self, batch: dict[str, "torch.Tensor"]) -> "torch.Tensor": ...
    def backward(self, loss: "torch.Tensor") -> None: ...
    def step(self) -> float: ...
    def lr(self) -> float: ...
    def train(self) -> None: ...
    def eval(self) -> None: ...
    def save(self, path: str) -> None: ...
    def load(self, path: str) -> None: ...
    def full_state_dict(self) -> dict[str, "torch.Tensor"]: ...
    def adapter_state_dict(self) -> dict[str, "torch.Tensor"]: ...
    def state_bytes(self) -> dict[str, int]: ...


#: A config check of one backend: (run config, world size, the choice being made) -> an error
#: message, or None.
Check = Callable[["RunConfig", int, "BackendChoice"], "str | None"]
#: `factory(model, cfg, world, total_steps, choice) -> Engine`, or "module:function" naming one.
Factory = Callable[..., Engine]

#: Backend-only options (RunConfig.parallel fields) and the flag that sets each. A record lists those
#: it honours in `options`; setting one for a backend that ignores it is an error, not a no-op.
OPTION_FLAGS = {"mixed_precision": "--mixed-precision", "cpu_offload": "--cpu-offload",
                "hsdp_shard_size": "--hsdp-shard-size", "reshard_after_forward": "--reshard-after-forward",
                "forward_prefetch": "--forward-prefetch", "backward_prefetch": "--backward-prefetch",
                "zero_quantized_weights": "--zero-quantized-weights",
                "zero_quantized_gradients": "--zero-quantized-gradients"}


@dataclass(frozen=True)
class Backend:
    """One `--parallelism` value and everything swiftlite needs to know about it."""
    name: str                                  # what --parallelism says: fsdp, zero3_offload, ...
    engine: str                                # engine key (trainer_state.json "backend"): single, ddp, ...
    factory: Factory | str                     # see Factory
    summary: str = ""                          # one line for --help, estimate and docs
    aliases: tuple[str, ...] = ()              # other --parallelism spellings (fsdp2 -> fsdp)
    one_process: str | None = None             # the record a world of one runs instead (ddp -> single)
    max_processes: int | None = None           # single: 1
    shards: tuple[bool, bool, bool] = (False, False, False)   # (params, grads, optimizer state) over ranks
    memory_family: str | None = None           # the planner's formulas (planner/memory.py); None: not estimated
    estimate: bool = True                      # listed in `swiftlite estimate`'s table
    loss_scaling: bool = False                 # can train fp16 (dynamic loss scaling)
    options: frozenset[str] = frozenset()      # OPTION_FLAGS keys it honours
    checks: tuple[Check, ...] = ()             # its own config rules
    init_context: Callable[..., Any] | str | None = None   # (cfg, world, model_config, choice) -> context
    checkpoint_format: str = "dcp"             # "dcp" (torch.distributed.checkpoint) or "ds" (DeepSpeed)
    ds_preset: str | None = None               # DeepSpeed preset (swiftlite/ds_configs/<name>.json)
    needs: tuple[str, ...] = ()                # Python packages it imports ("deepspeed")

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def build(self, *args: Any) -> Engine:
        return _resolve_ref(self.factory)(*args)

    def model_init_context(self, cfg: "RunConfig", world: World, model_config: Callable[[], Any],
                           choice: "BackendChoice") -> Any:
        """The context the model is loaded in (ZeRO-3's partitioned init), or None. `model_config`
        gives the HF config when the context needs it (hidden size for DeepSpeed's buckets)."""
        if self.init_context is None:
            return None
        return _resolve_ref(self.init_context)(cfg, world, model_config, choice)


@dataclass(frozen=True)
class BackendChoice:
    """What a run resolved `--parallelism` to: the record to build, and why."""
    name: str                       # the record's name (single, fsdp, zero3, deepspeed, ...)
    requested: str                  # what --parallelism (or --deepspeed) said
    reason: str = ""
    deepspeed_source: str | None = None   # the DeepSpeed preset name or JSON file, for DeepSpeed records
    memory_family: str | None = None      # the planner's family (a DeepSpeed JSON's, from its stage)

    @property
    def record(self) -> Backend:
        return get_backend(self.name)

    @property
    def key(self) -> str:
        """The engine key (what checkpoints record as their backend)."""
        return self.record.engine

    @property
    def is_deepspeed(self) -> bool:
        return self.record.checkpoint_format == "ds"


_REGISTRY: dict[str, Backend] = {}
_ALIASES: dict[str, str] = {}

#: The backend modules shipped with swiftlite (each registers its records when imported).
BUILTIN_MODULES = ("swiftlite.parallel.ddp", "swiftlite.parallel.fsdp2", "swiftlite.parallel.hsdp",
                   "swiftlite.parallel.fsdp1", "swiftlite.parallel.deepspeed")
_loaded = False


def register_backend(record: Backend, *, replace: bool = False) -> Backend:
    """Add a record; its name and aliases become --parallelism values. The built-in records are
    registered first, so a plugin's record comes after them and cannot silently take a built-in
    name (`replace=True` says it means to)."""
    _load_builtins()
    for n in record.names:
        owner = _ALIASES.get(n)
        if owner is not None and not (replace and owner == record.name):
            raise UserError(f"backend name {n!r} is already registered (by {owner!r})")
    _REGISTRY[record.name] = record
    for n in record.names:
        _ALIASES[n] = record.name
    return record


def unregister_backend(name: str) -> None:
    """Remove a record (tests that register a toy backend clean up with this)."""
    rec = _REGISTRY.pop(name, None)
    if rec is not None:
        for n in rec.names:
            _ALIASES.pop(n, None)


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in BUILTIN_MODULES:
            importlib.import_module(mod)


def all_backends() -> list[Backend]:
    """Every registered record, in registration order."""
    _load_builtins()
    return list(_REGISTRY.values())


def find_backend(name: str) -> Backend | None:
    """The record a --parallelism name (or alias) selects, or None."""
    _load_builtins()
    key = _ALIASES.get(name)
    return _REGISTRY[key] if key else None


def get_backend(name: str) -> Backend:
    rec = find_backend(name)
    if rec is None:
        raise UserError(f"--parallelism: no backend {name!r} (known: {', '.join(parallelism_names())})")
    return rec


def parallelism_names() -> list[str]:
    """Every value --parallelism accepts by name (plus `auto` and DeepSpeed .json files)."""
    return ["auto", *[n for b in all_backends() for n in b.names]]


def build_engine(model: "torch.nn.Module", cfg: "RunConfig", world: World, total_steps: int,
                 choice: BackendChoice | None = None, *, backend: str | None = None) -> Engine:
    """Wrap `model` with the chosen backend and build its optimizer and scheduler immediately.
    `choice` comes from `resolve_backend`; `backend="name"` builds a record by name directly (tests
    of one engine), its DeepSpeed config then taken from the run config."""
    if choice is None:
        if backend is None:
            raise TypeError("build_engine needs the resolved choice (parallel.resolve.resolve_backend) or backend=")
        choice = BackendChoice(name=get_backend(backend).name, requested=backend)
    return choice.record.build(model, cfg, world, total_steps, choice)


def _resolve_ref(ref: Any) -> Any:
    if isinstance(ref, str):
        mod, _, attr = ref.partition(":")
        return getattr(importlib.import_module(mod), attr)
    return ref


def tensor_bytes(t: Any) -> int:
    """Bytes this rank really holds for a tensor (the local shard of a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def load_plugins(paths: list[str]) -> None:
    """Run the user's `--external-plugins` Python files (ms-swift's flag): they may register backends.
    These are files the user names on the command line, run like any script of theirs."""
    import importlib.util
    from pathlib import Path
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_file() or path.suffix != ".py":
            raise UserError(f"--external-plugins {p}: not a Python file")
        name = f"swiftlite_plugin_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        import sys
        sys.modules[name] = mod
        spec.loader.exec_module(mod)


__all__ += ["BUILTIN_MODULES", "Check", "OPTION_FLAGS", "load_plugins", "parallelism_names", "unregister_backend"]
