"""Which rank brought a job down, and why, in one line.

Each rank writes its error to <output_dir>/logs/rank<r>.err when it raises (`record_rank_failure`)
and dumps every thread's stack to logs/rank<r>.stack when the launcher terminates it
(`install_rank_diagnostics`); the launcher then reads them (`explain_failure`). Also here: the
command line made safe to print (`redact_argv`).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from swiftlite import env
from swiftlite.checkpoint import layout
from swiftlite.config import RunConfig
from swiftlite.signals import dump_stacks_to, dumping, stop_stack_dump

SECRET_FLAG = re.compile(r"token|secret|password|passwd|api[-_]?key|credential", re.IGNORECASE)
SECRET_VALUE = re.compile(r"\b(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,})\b")
REDACTED = "***"

# Error text of a rank that failed only because another rank stopped answering.
_COLLECTIVE = re.compile(r"timed out|timeout|connection (closed|reset)|broken pipe|DistBackendError|"
                         r"gloo|nccl|ProcessGroup|peer|watchdog", re.IGNORECASE)
USER_ERROR_PREFIX = "user error:"


def redact_argv(argv: list[str]) -> list[str]:
    """A command line safe to print or log: values of token/secret/password flags and anything
    shaped like a hub token become ***."""
    out: list[str] = []
    hide_next = False
    for a in argv:
        if hide_next and not a.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if a.startswith("--") and SECRET_FLAG.search(a.partition("=")[0]):
            if "=" in a:
                a = a.partition("=")[0] + "=" + REDACTED
            else:
                hide_next = True
        out.append(SECRET_VALUE.sub(REDACTED, a))
    return out


def logs_dir(cfg: RunConfig) -> Path:
    return Path(cfg.train.output_dir).expanduser() / "logs"


def clear_rank_logs(cfg: RunConfig) -> Path:
    """Remove an earlier launch's rank errors and stack dumps; return the logs folder."""
    logs = logs_dir(cfg)
    for old in [*logs.glob(layout.rank_glob("error")), *logs.glob(layout.rank_glob("stack"))] if logs.is_dir() else []:
        old.unlink()
    return logs


# -- in the launcher: read what the ranks left ----------------------------------------------------

def _first_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[0].strip() if lines else ""


def _where_stuck(stack: str) -> str:
    """The innermost frame of the main thread in a faulthandler dump."""
    blocks = stack.split("\n\n")
    main = (next((b for b in blocks if "Current thread" in b), None)
            or next((b for b in blocks if "most recent call first" in b), ""))
    for line in main.splitlines():
        m = re.search(r'File "([^"]+)", line (\d+) in (\S+)', line)
        if m:
            return f"{Path(m.group(1)).name}:{m.group(2)} in {m.group(3)}()"
    return "an unknown place"


def _crash_site(stacks: dict[int, str], rank: int) -> str:
    """Where a rank that died from a signal was, when faulthandler dumped its stack (a crash in native
    code: the Python frame that called into it), as " (at FILE:LINE in FUNC())"; else nothing."""
    stack = stacks.get(rank)
    return f" (at {_where_stuck(stack)})" if stack else ""


def _launcher_exit_codes(tail: str) -> dict[int, int]:
    """rank -> exit code from torchrun's failure summary ("rank: 1 (local_rank: 1)" / "exitcode: -9")."""
    codes: dict[int, int] = {}
    for m in re.finditer(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", tail):
        codes[int(m.group(2))] = int(m.group(1))  # one node: local rank = rank
    for m in re.finditer(r"rank\s*:\s*(\d+)\s*\(local_rank[^)]*\)\s*exitcode\s*:\s*(-?\d+)", tail, re.IGNORECASE):
        codes[int(m.group(1))] = int(m.group(2))
    return codes


def _read_rank_files(logs: Path, kind: str) -> dict[int, str]:
    store: dict[int, str] = {}
    for f in sorted(logs.glob(layout.rank_glob(kind))) if logs.is_dir() else []:
        try:
            text = f.read_text(errors="replace").strip()
            r = layout.rank_of(kind, f)
        except (OSError, ValueError):
            continue
        if text:
            store[r] = text
    return store


def explain_failure(logs: Path, world_size: int, launcher_tail: str, ddp_timeout: int,
                    elapsed: float, codes: dict[int, int] | None = None) -> tuple[str, int]:
    """One line naming the rank that brought the job down, and the exit code (2: a user error).

    Ranks write logs/rank<r>.err when they raise, and dump their stack to logs/rank<r>.stack when
    the launcher terminates them. A rank whose error is only a failed collective (timeout, peer
    gone) is a victim: the culprit is then a rank that reported nothing (killed, or hung: its stack
    says where it was stuck)."""
    errs = _read_rank_files(logs, "error")
    stacks = _read_rank_files(logs, "stack")
    codes = {**_launcher_exit_codes(launcher_tail), **(codes or {})}
    primary = [r for r, t in sorted(errs.items()) if not _COLLECTIVE.search(_first_line(t))]
    if primary:
        r = primary[0]
        text = errs[r]
        user = text.startswith(USER_ERROR_PREFIX)
        line = _first_line(text[len(USER_ERROR_PREFIX):] if user else text)
        return f"rank{r} failed: {line}", (2 if user else 1)
    silent = [r for r in range(world_size) if r not in errs]
    victims = sorted(errs)
    if victims and silent:
        c = silent[0]
        v = victims[0]
        code = codes.get(c)
        if c in stacks and (code is None or code in (-STOP_SIGNAL, -15, 143, 1)):
            what = (f"rank{c} hung: stopped answering collectives (stuck at {_where_stuck(stacks[c])} "
                    f"when the job was stopped)")
        elif code is not None and code < 0:
            what = f"rank{c} died from signal {-code} without reporting an error{_crash_site(stacks, c)}"
        elif code is not None:
            what = f"rank{c} exited with code {code} without reporting an error"
        else:
            what = f"rank{c} stopped without reporting an error (killed or crashed in native code)"
        timed_out = re.search(r"timed out|timeout", errs[v], re.IGNORECASE)
        after = f" after --ddp-timeout {ddp_timeout}s" if timed_out else ""
        return f"{what}; rank{v} gave up{after}: {_first_line(errs[v])[:300]}", 1
    if victims:
        v = victims[0]
        return f"rank{v} failed: {_first_line(errs[v])[:300]}", 1
    if codes:
        r, code = sorted(codes.items())[0]
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        return f"rank{r} ended with {how} without reporting an error{_crash_site(stacks, r)}", 1
    return f"the launcher failed after {elapsed:.0f} s with no rank reporting an error (see the output above)", 0


# -- in a rank: leave what the launcher reads ------------------------------------------------------

def record_rank_failure(cfg: RunConfig | None, message: str, user_error: bool) -> None:
    """Called in a rank that fails: write its error where the launcher looks for it."""
    rank = env.rank()
    if rank is None or cfg is None:
        return
    logs = logs_dir(cfg)
    try:
        logs.mkdir(parents=True, exist_ok=True)
        (logs / layout.rank_file("error", rank)).write_text((USER_ERROR_PREFIX + " " if user_error else "") + message + "\n")
    except OSError:
        pass


#: What swiftlite's fork launcher sends a rank it stops because another rank failed: faulthandler
#: dumps the stack on it and the rank dies at once, even blocked in a collective. SIGTERM is left
#: to preemption (train/preempt.py), which finishes the step and saves instead of dying.
STOP_SIGNAL = signal.SIGABRT


def install_rank_diagnostics(cfg: RunConfig) -> None:
    """In a launched rank: dump every thread's stack to logs/rank<r>.stack when the launcher stops the
    rank (STOP_SIGNAL from swiftlite's fork launcher; SIGTERM from torchrun), even if it is blocked
    inside a collective, so a hung rank can be named and located. Removed again by
    `finish_rank_diagnostics` when the rank ends normally. The dump itself is swiftlite/signals.py's
    (train/preempt.py puts it back in front of its own SIGTERM handler)."""
    rank = env.rank()
    if rank is None or dumping():
        return
    logs = logs_dir(cfg)
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    dump_stacks_to(logs / layout.rank_file("stack", rank))


def finish_rank_diagnostics() -> None:
    """The rank ended normally: it was not hung, so whatever a signal (a preemption) dumped is removed."""
    stop_stack_dump()
