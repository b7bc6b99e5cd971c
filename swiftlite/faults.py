"""Fault injection for tests: make one rank fail on purpose at a chosen step.

    SWIFTLITE_FAULT="rank=1,step=3,kind=raise"          rank 1 raises after optimizer step 3
    SWIFTLITE_FAULT="rank=1,step=3,kind=hang"           rank 1 stops answering (others time out)
    SWIFTLITE_FAULT="step=2,phase=checkpoint,kind=kill" SIGKILL in the middle of checkpoint-2's write
    SWIFTLITE_FAULT="step=4,phase=checkpoint,kind=enospc"  the disk "fills" during checkpoint-4's write
    SWIFTLITE_FAULT="step=3,phase=grads,kind=nan"       step 3's gradients become nan before the update
    SWIFTLITE_FAULT="phase=checkpoint,kind=sleep"       every save takes SLEEP_S longer (a slow disk)
    SWIFTLITE_FAULT="step=4,phase=convert,kind=kill"    SIGKILL once checkpoint-4's universal conversion is
                                                         written, before it is published

Keys: `kind` (raise | hang | kill | exit | enospc | nan | sleep; required), `step` (the optimizer step, 1-based;
any step when absent), `rank` (global rank; any rank when absent), `phase` (`step`, the default,
`checkpoint`, `grads` or `convert`). The trainer calls `maybe_inject(step, phase)` at four places: after each
optimizer step; inside `save_training_state` after the sharded state is written and before the
manifest (so a fault there leaves a half-written `.tmp-checkpoint-N`); between the last backward
and the optimizer step (`grads`, where `kind=nan` poisons the gradients: `poison_gradients`); and in
a resume's universal conversion of checkpoint-N (`convert`, checkpoint/universal.py). Unset,
it costs one dict lookup. This is the only place that interprets SWIFTLITE_FAULT.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from swiftlite import env
from swiftlite.errors import UserError

ENV = env.FAULT
KINDS = ("raise", "hang", "kill", "exit", "enospc", "nan", "sleep")
PHASES = ("step", "checkpoint", "grads", "convert")
SLEEP_S = 6.0


class InjectedFault(RuntimeError):
    """What kind=raise raises (a plain crash as far as the rest of swiftlite is concerned)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int | None = None
    rank: int | None = None
    phase: str = "step"

    def matches(self, step: int, phase: str, rank: int) -> bool:
        return (self.phase == phase and (self.step is None or self.step == step)
                and (self.rank is None or self.rank == rank))


def parse(spec: str) -> Fault:
    """`"rank=1,step=3,kind=raise"` -> Fault; a malformed spec is a UserError naming the env var."""
    fields: dict[str, str] = {}
    for part in spec.replace(";", ",").split(","):
        if not part.strip():
            continue
        key, eq, value = part.partition("=")
        if not eq:
            raise UserError(f"{ENV}={spec!r}: expected key=value pairs (rank=1,step=3,kind=raise)")
        fields[key.strip()] = value.strip()
    unknown = set(fields) - {"kind", "step", "rank", "phase"}
    if unknown:
        raise UserError(f"{ENV}={spec!r}: unknown key {sorted(unknown)[0]!r} (use kind, step, rank, phase)")
    kind = fields.get("kind")
    if kind not in KINDS:
        raise UserError(f"{ENV}={spec!r}: kind must be one of {', '.join(KINDS)}")
    phase = fields.get("phase", "step")
    if phase not in PHASES:
        raise UserError(f"{ENV}={spec!r}: phase must be one of {', '.join(PHASES)}")
    try:
        step = int(fields["step"]) if "step" in fields else None
        rank = int(fields["rank"]) if "rank" in fields else None
    except ValueError:
        raise UserError(f"{ENV}={spec!r}: step and rank must be integers") from None
    return Fault(kind=kind, step=step, rank=rank, phase=phase)


_cache: tuple[str, Fault] | None = None


def active() -> Fault | None:
    """The fault described by the environment, if any (parsed once per distinct value)."""
    global _cache
    spec = env.settings().fault
    if not spec:
        return None
    if _cache is None or _cache[0] != spec:
        _cache = (spec, parse(spec))
    return _cache[1]


def maybe_inject(step: int, phase: str = "step") -> str | None:
    """Fail here if SWIFTLITE_FAULT asks for this rank, step and phase; otherwise do nothing. A `nan`
    fault is not acted on here: its kind is returned for the caller to poison what it holds."""
    fault = active()
    if fault is None:
        return None
    rank = env.world_vars().rank
    if not fault.matches(step, phase, rank):
        return None
    where = f"rank {rank}, step {step}, phase {phase}"
    if fault.kind == "nan":
        return "nan"
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault ({where})")
    if fault.kind == "sleep":
        time.sleep(SLEEP_S)
        return None
    if fault.kind == "enospc":
        import errno
        raise OSError(errno.ENOSPC, f"No space left on device (injected, {where})")
    print(f"swiftlite: injected {fault.kind} ({where})", file=sys.stderr, flush=True)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "exit":
        os._exit(3)
    while True:  # hang: alive, silent, answering no collective
        time.sleep(3600)


def poison_gradients(module) -> None:
    """kind=nan: every gradient of `module` becomes nan (as an overflowing backward leaves them)."""
    for p in module.parameters():
        if p.grad is not None:
            p.grad.fill_(float("nan"))
