"""The job's facts, resolved once: GPU memory, GPUs per node, model shape, dtype, max length, and the
backend they select.

    facts = resolve_job(cfg, world_size, gpu_memory=..., gpus_per_node=...)   # preflight (launcher)
    env[JOB_FACTS] = facts.to_json()                                          # handed to the ranks
    facts = rank_facts(cfg, world)                                            # each rank

Why one function: `--parallelism auto` on a GPU depends on the model's shape and the GPU's memory.
When the launcher and the ranks each worked that out their own way, they disagreed (a hub model
id: the launcher had no shape, so the planner refused a job the ranks would have run). Now the
launching process resolves the facts once, with `resolve_job`, and hands them to every rank it starts
(an environment variable for torchrun and forked ranks; an argument in the same process); a rank
checks the handed facts against what only it can see (the smallest GPU of the whole job, on several
nodes) and, only if they differ, resolves again with the same function and the same inputs. A rank
started by an external launcher (no facts handed) resolves them itself, the same way.

`resolve_job` also settles what `--torch-dtype auto` and an unset `--max-length` mean for this model
and machine (models/loading.resolve_model_defaults), so the facts carry concrete values and a rank
applies them without reading the model's config again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swiftlite.config import RunConfig
    from swiftlite.parallel.base import BackendChoice

#: How many times this process resolved a job's backend (a test counts them: once per process
#: boundary).
RESOLUTIONS = {"count": 0}


@dataclass(frozen=True)
class JobFacts:
    """What the launcher resolved for the whole job (JSON-serialisable)."""
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

    @property
    def choice(self) -> "BackendChoice":
        from swiftlite.parallel.base import BackendChoice
        return BackendChoice(name=self.backend, requested=self.requested, reason=self.reason,
                             deepspeed_source=self.deepspeed_source, memory_family=self.memory_family)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "JobFacts":
        return cls(**json.loads(text))

    def apply(self, cfg: "RunConfig") -> None:
        """Give a rank's config the concrete dtype and max length the launcher settled (a rank that
        parsed the command line again still has `auto` / no length), then, when the dtype changed, the
        rules again (the dtype rule), as resolve_model_defaults runs them: a length alone changes no
        rule's answer."""
        if cfg.model.torch_dtype == self.torch_dtype and cfg.data.max_length is not None:
            return
        dtype_changed = cfg.model.torch_dtype != self.torch_dtype
        cfg.model.torch_dtype = self.torch_dtype
        if cfg.data.max_length is None:
            cfg.data.max_length = self.max_length
        if dtype_changed:
            from swiftlite.config import validate
            validate(cfg, check_paths=False)


def model_shape(cfg: "RunConfig") -> Any:
    """The model's shape for the memory model (`ModelSource.shape`): presets and local folders from
    their config, a hub id from its config too (huggingface_hub's cache, downloaded if needed; never
    its weights)."""
    from swiftlite.models.source import resolve_model
    return resolve_model(cfg.model.model).shape(offline=False, trust_remote_code=cfg.model.trust_remote_code,
                                                revision=cfg.model.model_revision)


def resolve_job(cfg: "RunConfig", world_size: int, *, gpu_memory: Any, gpus_per_node: int | None) -> JobFacts:
    """The job's facts from these inputs (the same function in the launcher and in a rank).
    `gpu_memory`: bytes of the smallest GPU, None on CPU, or a function giving either."""
    from swiftlite.models.loading import resolve_model_defaults
    from swiftlite.parallel.resolve import resolve_backend
    resolve_model_defaults(cfg)
    mem = gpu_memory() if callable(gpu_memory) else gpu_memory
    shapes: list[Any] = []

    def shape() -> Any:   # read only when the answer depends on it (auto on a GPU)
        shapes.append(model_shape(cfg))
        return shapes[-1]
    RESOLUTIONS["count"] += 1
    choice = resolve_backend(cfg, world_size, mem, shape=shape, gpus_per_node=gpus_per_node)
    return JobFacts(world_size=world_size, gpu_memory=mem, gpus_per_node=gpus_per_node,
                    torch_dtype=cfg.model.torch_dtype, max_length=cfg.data.max_length,
                    # through JSON once, so the facts equal what a rank reads back (tuples -> lists)
                    shape=json.loads(json.dumps(asdict(shapes[-1]))) if shapes else None, backend=choice.name,
                    requested=choice.requested, reason=choice.reason,
                    deepspeed_source=choice.deepspeed_source, memory_family=choice.memory_family)


def handed_facts() -> JobFacts | None:
    """The facts the launcher handed this rank, if any."""
    from swiftlite import env
    text = env.get(env.JOB_FACTS)
    return JobFacts.from_json(text) if text else None


def rank_facts(cfg: "RunConfig", world: Any, handed: JobFacts | None = None,
               job_gpu_memory: Any = None) -> JobFacts:
    """The facts a rank trains with: those handed by its launcher when they hold for this job (same
    world size, same smallest GPU of the whole job), else resolved here with `resolve_job`.
    `job_gpu_memory()` gives the smallest GPU of the whole job (a collective on several ranks)."""
    handed = handed if handed is not None else handed_facts()
    mem = job_gpu_memory() if callable(job_gpu_memory) else job_gpu_memory
    if handed is not None and handed.world_size == world.world_size and handed.gpu_memory == mem:
        handed.apply(cfg)
        return handed
    return resolve_job(cfg, world.world_size, gpu_memory=mem, gpus_per_node=world.local_world_size)


__all__ = ["JobFacts", "RESOLUTIONS", "handed_facts", "model_shape", "rank_facts", "resolve_job"]
