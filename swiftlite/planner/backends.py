"""The backend registry as the planner sees it: which records are estimated, with which formulas.

A `Backend` record (parallel/base.py) names its planner formulas in `memory_family` (one of
FAMILIES; None: not estimated), what it shards in `shards`, and whether `swiftlite estimate` lists it
in `estimate`. Everything here reads the registry when called, so records registered at run time
(an `--external-plugins` file) count like the built-in ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from swiftlite.errors import UserError
from swiftlite.parallel.base import Backend, all_backends, find_backend

#: The formula families planner/memory.py implements.
FAMILIES = ("single", "ddp", "fsdp", "hsdp", "fsdp1", "zero2", "zero3", "zero3pp", "zero3_offload")


def backend_record(backend: str | Backend) -> Backend:
    """The record `backend` names (a --parallelism name or alias), or the record itself, checked to
    have a memory family these formulas implement."""
    rec = backend if isinstance(backend, Backend) else find_backend(backend)
    if rec is None or rec.memory_family is None:
        known = ", ".join(b.name for b in all_backends() if b.memory_family)
        name = backend.name if isinstance(backend, Backend) else backend
        raise UserError(f"--parallelism {name!r}: the estimator knows {known}")
    if rec.memory_family not in FAMILIES:
        raise UserError(f"backend {rec.name!r}: memory_family {rec.memory_family!r} is not one of "
                        f"{', '.join(FAMILIES)}")
    return rec


def table_backends(world_size: int) -> list[Backend]:
    """The rows of `swiftlite estimate`'s table, in registration order: every record with `estimate`
    set and a memory family. A record limited to fewer processes than the world (single) is left
    out. On one GPU a record whose `one_process` fallback holds the same states is shown as that
    fallback, which is what runs (ddp -> single); the sharding records keep their own row."""
    rows: dict[str, Backend] = {}
    for rec in all_backends():
        if not (rec.estimate and rec.memory_family):
            continue
        if rec.max_processes is not None and world_size > rec.max_processes:
            continue
        if world_size == 1 and rec.one_process:
            fallback = find_backend(rec.one_process)
            if fallback is not None and fallback.memory_family and fallback.shards == rec.shards:
                rec = fallback
        rows.setdefault(rec.name, rec)
    return list(rows.values())


class _Sharding(Mapping):
    """record name (or alias) -> its `shards` (params, grads, optimizer), for every record with a
    memory family; read from the registry on each use."""

    def __getitem__(self, name: str) -> tuple[bool, bool, bool]:
        rec = find_backend(name)
        if rec is None or rec.memory_family is None:
            raise KeyError(name)
        return rec.shards

    def __iter__(self) -> Iterator[str]:
        return iter([b.name for b in all_backends() if b.memory_family])

    def __len__(self) -> int:
        return sum(1 for _ in self)


#: Which model states each estimated backend shards over the ranks: (params, grads, optimizer).
SHARDING: Mapping[str, tuple[bool, bool, bool]] = _Sharding()


__all__ = ["FAMILIES", "SHARDING", "backend_record", "table_backends"]
