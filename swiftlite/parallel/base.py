"""The backend interface, the Backend record and the registry.

The trainer sees one `Engine`, whatever the backend:

    engine = build_engine(model, cfg, world, total_steps, choice)
    with engine.micro_batch(last):             # gradient sync only on the window's last one
        loss = engine.forward(batch) * scale   # summed token cross-entropy, fp32 scalar
        engine.backward(loss)
    grad_norm = engine.step()                  # clip + optimizer + scheduler + zero_grad
    engine.save(dir) / engine.load(dir)        # sharded training state (model + optimizer + scheduler)
    engine.load_universal(folder)              # a checkpoint of another format or world size, converted
    engine.full_state_dict()                   # HF names, gathered to rank 0, CPU tensors
    engine.adapter_state_dict()                # peft names, gathered to rank 0
    with engine.autocast(): engine.root()(...) # a plain forward (DPO log-probs) as the engine runs it

The `Engine` Protocol below is the whole surface that code outside `parallel/` uses (checkpoint/,
train/, rlhf/; tests/unit/test_seams.py checks it from the source): a backend of an
`--external-plugins` file that implements it gets the same resume, `--nan-policy` and rlhf behaviour
as a built-in one. The simplest way there is the torch backends' own engine,
`parallel.torch_engine.TorchEngine`, around the plugin's wrapped model.

Gradient contract: every backend averages gradients over data-parallel ranks (DDP, FSDP and ZeRO all
do). The trainer therefore scales each rank's summed loss by world_size / global_target_tokens, so the
averaged gradient is the gradient of the global token-mean loss, equal for any world size or
accumulation. An engine must not rescale the loss again (DeepSpeed's own 1/gas is disabled).

What a `--parallelism` value means is a `Backend` record: its engine factory, the names that select
it, what it shards, how the planner counts its memory, its own config checks, the context models are
built in, its checkpoint format, DeepSpeed preset and DPO's frozen reference copy. Records are
registered by the backend modules (`BUILTIN_MODULES`, imported on first use; each is torch-free at
import time) or by a user's `--external-plugins` file. Only `parallel/resolve.py` turns a run config into a record
(`resolve_backend`); everything else asks it. Adding a backend = one module that calls
`register_backend(Backend(...))`, plus its name in `BUILTIN_MODULES` when it ships with swiftlite.
docs/design.md has the whole picture.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

from swiftlite.checkpoint.layout import CheckpointFormat
from swiftlite.distributed import World
from swiftlite.errors import UserError

if TYPE_CHECKING:  # keep torch out of import time for the CLI
    import torch

    from swiftlite.config import RunConfig

__all__ = ["Backend", "BackendChoice", "ENGINE_SURFACE", "Engine", "FrozenModel", "World", "all_backends",
           "build_engine", "find_backend", "get_backend", "register_backend", "tensor_bytes"]


class Engine(Protocol):
    """What the trainer, the checkpoints and rlhf drive. See the module docstring for the contract."""
    module: "torch.nn.Module"     # the (possibly wrapped) model: its parameters are this rank's shards
    #: Whether `step()` leaves the weights unchanged on a nan/inf gradient norm (torch backends), so
    #: that `--nan-policy skip` can go on; False where the update is applied before the norm is known
    #: (DeepSpeed), and such a step always stops the run (train/guard.py).
    skips_nonfinite: bool

    def micro_batch(self, last: bool) -> Any: ...
    def forward(self, batch: dict[str, "torch.Tensor"]) -> "torch.Tensor": ...
    def backward(self, loss: "torch.Tensor") -> None: ...
    def step(self) -> float: ...
    def lr(self) -> float: ...
    def train(self) -> None: ...
    def eval(self) -> None: ...
    def save(self, path: str, *, model_only: bool = False) -> None: ...

    def load(self, path: str, *, model_only: bool = False) -> bool:
        """Restore what `save` wrote (model_only, --resume_only_model: the weights alone, optimizer and
        schedule fresh). Returns True when it went through the checkpoint's universal conversion
        (another world size or ZeRO stage), so the resume says what carried over."""
        ...

    def load_universal(self, folder: Path, *, model_only: bool = False) -> None:
        """Load a checkpoint converted to DeepSpeed's universal format (checkpoint/universal.py:
        `ensure_universal`): how a checkpoint of the other format (DCP <-> ZeRO) resumes. An engine
        that cannot raises UserError saying which backend resumes it."""
        ...

    def autocast(self) -> ContextManager[Any]:
        """The context `forward` runs the model in (torch.autocast under fp32 master weights on
        single/DDP; a null context elsewhere): callers of `root()` enter it too."""
        ...

    def root(self) -> "torch.nn.Module":
        """What to call for a plain forward that is not the training loss (DPO's log-probs): the
        wrapper whose root pre-forward gathers the weights (DDP/FSDP), or the DeepSpeed engine."""
        ...

    def after_update(self, fn: Callable[[], None]) -> None:
        """Call `fn()` after every applied optimizer update, before the gradients are cleared (AdaLoRA's
        rank allocation reads them there: train/adalora.py). An engine that cannot raises UserError."""
        ...

    def full_state_dict(self) -> dict[str, "torch.Tensor"]: ...
    def adapter_state_dict(self) -> dict[str, "torch.Tensor"]: ...
    def state_bytes(self) -> dict[str, int]: ...


#: The Protocol's members: all that code outside parallel/ may use of an engine (tests/unit/test_seams.py).
ENGINE_SURFACE = frozenset({*Engine.__annotations__, *(n for n in vars(Engine) if not n.startswith("_"))})


@dataclass(frozen=True)
class FrozenModel:
    """DPO's frozen reference copy as a backend lays it out (`Backend.frozen_copy`): what to call,
    the context its forward runs in, and its layout in words ("a replica on cuda:0")."""
    module: Any
    autocast: Callable[[], ContextManager[Any]]
    layout: str = ""


#: `frozen_copy(model, cfg, world, policy_engine, choice) -> FrozenModel`: lay out a frozen, eval-mode
#: copy of the model (no optimizer, no gradients, no gradient all-reduce) the way the backend lays out
#: the policy; or "module:function" naming one. Every built-in record names its own, next to its
#: engine factory (tests/unit/test_tasks.py).
FrozenCopy = Callable[..., FrozenModel]
#: What a record that names none gets (a plugin's; `Backend.frozen_copy` None): the copy laid out like
#: the policy's torch engine (FSDP2 on the policy's mesh, FSDP1 as the policy, else a replica). The run
#: says so in one line (rlhf/frozen.py).
LIKE_POLICY = "swiftlite.parallel.frozen_copy:like_policy"


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
    checkpoint_format: CheckpointFormat = CheckpointFormat.DCP   # its checkpoints' sharded state (dcp/ or ds/)
    # How the model reaches the ranks (docs/backends.md, "Loading at size"): "whole" (every rank
    # loads all of it), "sharded" (a meta skeleton the factory shards, then fills each rank's rows:
    # models/sharded.py), "partitioned" (built inside init_context, ZeRO-3's zero.Init).
    loading: str = "whole"
    ds_preset: str | None = None               # DeepSpeed preset (swiftlite/ds_configs/<name>.json)
    frozen_copy: FrozenCopy | str | None = None  # DPO's frozen reference copy (FrozenCopy); None: LIKE_POLICY
    # Activation checkpointing's default form (--gradient_checkpointing_kwargs sets it): reentrant, as
    # ms-swift (trainers/mixin.py) everywhere but multi-process DDP. Reentrant runs a layer's first
    # forward without autograd, so nothing the layer computes outlives it; non-reentrant keeps what an
    # autograd Function stores on its ctx, and bitsandbytes' 4-bit matmul stores its weight there: under
    # ZeRO-3 that is the gathered weight of every layer until backward (the whole 4-bit base on each
    # rank, measured). DDP keeps non-reentrant: its reducer expects each parameter's gradient once.
    reentrant_checkpointing: bool = True
    needs: tuple[str, ...] = ()                # Python packages it imports ("deepspeed")

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def build(self, *args: Any) -> Engine:
        return _resolve_ref(self.factory)(*args)

    def frozen(self, model: Any, cfg: "RunConfig", world: World, engine: Engine,
               choice: "BackendChoice", **own: Any) -> FrozenModel:
        """DPO's frozen reference copy of `model` laid out as this backend lays out the policy `engine`
        (a record that names none: `LIKE_POLICY`). `own`: a layout of the copy's own that only its
        backend knows (DeepSpeed's `own_config`: GRPO's --teacher_deepspeed), passed on when given."""
        return _resolve_ref(self.frozen_copy or LIKE_POLICY)(model, cfg, world, engine, choice, **own)

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
        return self.record.checkpoint_format is CheckpointFormat.DS


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


#: the plugin files this process ran (resolved paths): load_missing_plugins runs only the others
_LOADED: set[str] = set()


def load_missing_plugins(paths: list[str]) -> None:
    """The files of `paths` this process has not run yet (a rollout server's plugin files, which a run takes
    with its scheduler: launch/server_turns.py, once before launch and again in a rank)."""
    load_plugins([p for p in paths if str(Path(p).expanduser().resolve()) not in _LOADED])


def load_plugins(paths: list[str]) -> None:
    """Run the user's `--external-plugins` Python files (ms-swift's flag): they may register backends.
    These are files the user names on the command line, run like any script of theirs."""
    import importlib.util
    import sys

    from swiftlite.plugin_imports import deferred_import_error, msswift_aliases, plugin_import_error
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_file() or path.suffix != ".py":
            raise UserError(f"--external-plugins {p}: not a Python file")
        # ms-swift's import_external_file puts the file's folder on sys.path, so a plugin imports the modules
        # next to it (treepo's tree_rollout_plugin.py: `from tree_rollout import ...`); appended, not put
        # first as ms-swift does, so that a file there cannot shadow an installed module of the same name
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.append(folder)
        name = f"swiftlite_plugin_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            with msswift_aliases():  # ms-swift's `from swift.rewards import ORM, orms` is swiftlite.plugin's
                spec.loader.exec_module(mod)
        except ImportError as e:  # before any process starts: one line naming the import, not a traceback
            del sys.modules[name]
            raise UserError(plugin_import_error(p, path, e)) from None
        except SyntaxError as e:
            del sys.modules[name]
            raise UserError(f"--external_plugins {p}:{e.lineno}: syntax error ({e.msg})") from None
        except UserError:
            del sys.modules[name]
            raise
        except Exception as e:   # the file's own error (ms-swift's register_dataset of a name twice): its line
            del sys.modules[name]
            import traceback
            line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__))
                         if Path(f.filename).resolve() == path.resolve()), None)
            raise UserError(f"--external_plugins {p}" + (f":{line}" if line else "") +
                            f": {type(e).__name__}: {e}") from None
        deferred = deferred_import_error(p, path)
        if deferred:
            del sys.modules[name]
            raise UserError(deferred)
        _LOADED.add(str(path.resolve()))   # only a file that ran: a refused one is tried again, and refused again


__all__ += ["BUILTIN_MODULES", "Check", "LIKE_POLICY", "OPTION_FLAGS", "load_missing_plugins", "load_plugins",
            "parallelism_names",
            "unregister_backend"]
