"""How a run config is read and written, apart from what it holds (schema.py).

- `field_reads()`: the config fields a check read while a block ran, so that a refusal of one field
  passes over the judgements that read it (errors.Refusals).
- `Sealable`: the base of `RunConfig` and its sections; a sealed one is read-only. The user's config
  is written by config/load.py only, and the run's concrete copy (swiftlite/job.py) is sealed before
  any later stage reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator


class Sealable:
    """A config object that can be made read-only. `RunConfig` is what the user said (written by
    config/load.py only); the concrete config a rank trains with is a sealed copy made by
    swiftlite/job.py `resolve_run`, its one writer, so that no later stage can change a value behind
    another's back (who wrote `cfg.data.max_length` has one answer)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_sealed"):
            raise AttributeError(f"{type(self).__name__}.{name}: a resolved run config is read-only "
                                 "(swiftlite/job.py resolve_run writes it; derive a copy with RunConfig.with_values)")
        object.__setattr__(self, name, value)


class Section(Sealable):
    """The base of RunConfig's sections (ModelConfig, LoraConfig, ...): the classes whose field reads
    `field_reads` watches."""


def opt(default: Any = None, help: str = "", *, aliases: tuple[str, ...] = (), choices: tuple = (),
        factory: Callable | None = None, cli: bool = True, normalize: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass field with its CLI metadata (help text, extra flag names, allowed values, and a
    `normalize` that folds other accepted spellings of a value: bfloat16 -> bf16). Schema.py's
    sections and config/vllm_options.py declare their fields with it."""
    meta = {"help": help, "aliases": aliases, "choices": choices, "cli": cli, "normalize": normalize}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


_READS: list[set[str]] = []   # the open field_reads() sets, innermost last


@contextlib.contextmanager
def field_reads() -> Iterator[set[str]]:
    """The set of RunConfig field names read (any section of any config) while the block runs: what a
    rule or a preflight check judged, so that a refusal of one field passes over the judgements that
    read it (errors.Refusals). The section classes watch their reads only while a block is open."""
    read: set[str] = set()
    if not _READS:
        names = {f.name for c in Section.__subclasses__() for f in dataclasses.fields(c)}

        def watched(self: Any, name: str) -> Any:
            if name in names:
                for r in _READS:
                    r.add(name)
            return object.__getattribute__(self, name)
        for c in Section.__subclasses__():
            c.__getattribute__ = watched
    _READS.append(read)
    try:
        yield read
    finally:
        _READS.remove(read)
        if not _READS:
            for c in Section.__subclasses__():
                del c.__getattribute__


__all__ = ["Sealable", "Section", "field_reads", "opt"]
