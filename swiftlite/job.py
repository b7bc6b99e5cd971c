"""The run, resolved once: what the user said (`RunConfig`, written by config/load.py only) plus what the
machine and the model decide (GPU memory, GPUs per node, model shape, dtype, max length, the backend)
give one frozen `Resolved`, whose `config` is the sealed, concrete config every later stage reads.

    resolved = resolve_run(cfg, world_size, gpu_memory=..., gpus_per_node=...)  # preflight (launcher)
    env[JOB_FACTS] = resolved.to_json()                                       # handed to the ranks
    resolved = rank_resolved(cfg, world)                                      # each rank
    cfg = resolved.config                                                     # read-only from here on

Why one function: `--parallelism auto` on a GPU depends on the model's shape and the GPU's memory.
When the launcher and the ranks each worked that out their own way, they disagreed (a hub model
id: the launcher had no shape, so the planner refused a job the ranks would have run). Now the
launching process resolves the run once, with `resolve_run`, and hands the result to every rank it
starts (an environment variable for torchrun and forked ranks; an argument in the same process); a
rank checks the handed facts against what only it can see (the smallest GPU of the whole job, on
several nodes) and, only if they differ, resolves again with the same function and the same inputs.
A rank started by an external launcher (nothing handed) resolves the run itself, the same way.

Why a sealed copy: `--torch-dtype auto` and an unset `--max-length` are settled here (for this model
and machine: models/loading.model_defaults), and the save/eval cadence of `--save-strategy epoch` once
the data's steps per epoch are known (`Resolved.cadence`). Each used to be written into the user's
config by whichever stage learnt it first (the model loader, the data pipeline, the job facts, the run
folder), so a reader of `cfg.data.max_length` could not tell who had last written it. Now the user's
config is never written after config.load, and the one config written afterwards is this module's
copy, sealed (config/schema.Sealable: an assignment raises) before anyone reads it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swiftlite.config import RunConfig
    from swiftlite.parallel.base import BackendChoice

#: How many times this process resolved a job's backend (a test counts them: once per process
#: boundary).
RESOLUTIONS = {"count": 0}


@dataclass(frozen=True)
class Cadence:
    """When the run saves and evaluates, in optimizer steps (None: no intermediate checkpoint; the last
    step is always saved). `--save-strategy epoch` / `--eval-strategy epoch` mean every steps-per-epoch."""
    save_steps: int | None
    eval_steps: int | None


@dataclass(frozen=True)
class Resolved:
    """The run as resolved for this job (JSON-serialisable but for `config`, which a rank rebuilds from
    its own parse of the command line with `bind`)."""
    world_size: int
    gpu_memory: int | None          # bytes of the smallest GPU; None on CPU
    gpus_per_node: int | None
    torch_dtype: str                # concrete (never "auto")
    max_length: int | None
    shape: dict | None              # planner.shape.ModelShape fields, when the memory model needed it
    backend: str                    # BackendChoice fields
    requested: str
    reason: str = ""
    deepspeed_source: str | None = None
    memory_family: str | None = None
    #: A rollout server's multi-turn scheduler the run took (launch/server_turns.py), applied by `bind`
    turns: dict | None = None
    #: The concrete, sealed config (the user's, with torch_dtype and max_length above): what every stage
    #: after the resolution reads. Not part of the JSON.
    config: Any = field(default=None, compare=False, repr=False)
    #: The user's config `config` was made from (this process's); not part of the JSON either.
    said: Any = field(default=None, compare=False, repr=False)

    @property
    def choice(self) -> "BackendChoice":
        from swiftlite.parallel.base import BackendChoice
        return BackendChoice(name=self.backend, requested=self.requested, reason=self.reason,
                             deepspeed_source=self.deepspeed_source, memory_family=self.memory_family)

    @property
    def quant_bits(self) -> int | None:
        return self.config.quant_bits

    @property
    def padding_free(self) -> bool:
        """The batch form: rows concatenated (padding-free, --packing included) or padded."""
        d = self.config.data
        return bool(d.padding_free or d.packing)

    def cadence(self, steps_per_epoch: int) -> Cadence:
        """--save-steps / --eval-steps as this run applies them, once the steps per epoch are known."""
        c, t = self.config.checkpoint, self.config.train
        save = {"epoch": steps_per_epoch, "no": None}.get(c.save_strategy, c.save_steps)
        return Cadence(save_steps=save, eval_steps=steps_per_epoch if t.eval_strategy == "epoch" else t.eval_steps)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("config", "said")},
                          sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Resolved":
        return cls(**json.loads(text))

    def bind(self, cfg: "RunConfig") -> "Resolved":
        """These facts with `cfg` (the user's config, as this process parsed it) made concrete: a rank
        that parsed the command line again still has `auto` / no length."""
        return replace(self, config=concrete_config(cfg, self.torch_dtype, self.max_length, self.turns), said=cfg)


def concrete_config(said: "RunConfig", torch_dtype: str, max_length: int | None,
                    turns: dict | None = None) -> "RunConfig":
    """The one writer of a run's config after config.load: a sealed copy of `said` with the concrete
    dtype and max length (and a rollout server's scheduler, `turns`: launch/server_turns.py). When the
    dtype was `auto` or a scheduler was taken, the rules run again on the copy (one of them compares the
    dtype: --bnb-4bit-compute-dtype; the scheduler has its own); a max length read from the model's
    context is positive by construction, so filling it alone leaves the rules' answer as config.load had it."""
    changes: dict[str, Any] = {}
    if said.model.torch_dtype != torch_dtype:
        changes["torch_dtype"] = torch_dtype
    if said.data.max_length is None and max_length is not None:
        changes["max_length"] = max_length
    if turns is not None:
        from swiftlite.config.multi_turn_options import taken_turns
        changes.update(taken_turns(said, turns))
    run = said.with_values(**changes) if changes or not said.sealed else said
    if "torch_dtype" in changes or turns is not None:
        from swiftlite.config import validate
        validate(run, check_paths=False)
    return run.seal()


def model_shape(cfg: "RunConfig") -> Any:
    """The model's shape for the memory model (`ModelSource.shape`): presets and local folders from
    their config, a hub id from its config too (huggingface_hub's cache, downloaded if needed; never
    its weights)."""
    from swiftlite.models.source import resolve_model
    return resolve_model(cfg.model.model).shape(offline=False, trust_remote_code=cfg.model.trust_remote_code,
                                                revision=cfg.model.model_revision)


def resolve_run(cfg: "RunConfig", world_size: int, *, gpu_memory: Any, gpus_per_node: int | None) -> Resolved:
    """The run resolved from these inputs (the same function in the launcher and in a rank); `cfg` is
    left as it is. `gpu_memory`: bytes of the smallest GPU, None on CPU, or a function giving either."""
    from swiftlite.models.loading import model_defaults
    from swiftlite.planner import choose_backend
    torch_dtype, max_length, _ = model_defaults(cfg)
    run = concrete_config(cfg, torch_dtype, max_length)
    mem = gpu_memory() if callable(gpu_memory) else gpu_memory
    shapes: list[Any] = []

    def shape() -> Any:   # read only when the answer depends on it (auto on a GPU)
        shapes.append(model_shape(run))
        return shapes[-1]
    RESOLUTIONS["count"] += 1
    choice = choose_backend(run, world_size, mem, shape=shape, gpus_per_node=gpus_per_node)
    return Resolved(world_size=world_size, gpu_memory=mem, gpus_per_node=gpus_per_node,
                    torch_dtype=run.model.torch_dtype, max_length=run.data.max_length,
                    # through JSON once, so the facts equal what a rank reads back (tuples -> lists)
                    shape=json.loads(json.dumps(asdict(shapes[-1]))) if shapes else None, backend=choice.name,
                    requested=choice.requested, reason=choice.reason,
                    deepspeed_source=choice.deepspeed_source, memory_family=choice.memory_family, config=run,
                    said=cfg)


def handed_facts() -> Resolved | None:
    """The resolution the launcher handed this rank, if any (not yet bound to a config)."""
    from swiftlite import env
    text = env.get(env.JOB_FACTS)
    return Resolved.from_json(text) if text else None


def rank_resolved(cfg: "RunConfig", world: Any, handed: Resolved | None = None,
                  job_gpu_memory: Any = None) -> Resolved:
    """The resolution a rank trains with: the one handed by its launcher when it holds for this job
    (same world size, same smallest GPU of the whole job), bound to this rank's config, else resolved
    here with `resolve_run`. `job_gpu_memory()` gives the smallest GPU of the whole job (a collective on
    several ranks)."""
    handed = handed if handed is not None else handed_facts()
    mem = job_gpu_memory() if callable(job_gpu_memory) else job_gpu_memory
    if handed is not None and handed.world_size == world.world_size and handed.gpu_memory == mem:
        # resolved in this very process (a single-process run) for this config: handed over as is
        return handed if handed.said is cfg else handed.bind(cfg)
    turns = handed.turns if handed is not None else None
    if turns is not None:   # a rollout server's scheduler, taken before launch: kept when resolving again
        from swiftlite.config.multi_turn_options import taken_turns
        again = resolve_run(cfg.with_values(**taken_turns(cfg, turns)), world.world_size, gpu_memory=mem,
                            gpus_per_node=world.local_world_size)
        return replace(again, turns=turns, said=cfg)
    return resolve_run(cfg, world.world_size, gpu_memory=mem, gpus_per_node=world.local_world_size)


__all__ = ["Cadence", "RESOLUTIONS", "Resolved", "concrete_config", "handed_facts", "model_shape", "rank_resolved",
           "resolve_run"]
