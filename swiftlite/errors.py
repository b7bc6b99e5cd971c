"""User-facing errors.

A `UserError` is a mistake the user can fix (a bad flag, a missing file, a malformed row). The CLI
prints its message as one line on stderr and exits with code 2, never a traceback. Anything else is
a bug in swiftlite or an environment problem and keeps its traceback.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input; the message names the culprit (flag, file, line, value)."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, message: str):
        # One line, always: the CLI contract is a single readable line per error.
        super().__init__(" ".join(str(message).split("\n")).strip())


class UserErrors(UserError):
    """Several mistakes found in one pass (every refused or unknown flag of a command line): the CLI
    prints one line per mistake, each its own `error: ...` line, and exits with code 2."""

    def __init__(self, messages: list[str]):
        self.lines = [" ".join(str(m).split("\n")).strip() for m in messages]
        Exception.__init__(self, "\n".join(self.lines))


def raise_all(messages: list[str]) -> None:
    """Raise the mistakes found, if any: one as a UserError, several as a UserErrors."""
    if len(messages) == 1:
        raise UserError(messages[0])
    if messages:
        raise UserErrors(messages)


class Refusals:
    """Every refusal one run finds, across its stages (the flags, the value rules, the plugins, the
    preflight), reported together by `raise_all`: one line each, exit 2, before anything is written.

    A stage goes on after an earlier one refused, and passes over exactly what it cannot judge: each
    refusal is recorded with the config fields it read (`fields`), and a rule or check that reads one
    of them (or `needs` one) is passed over, as is one that fails otherwise once something is refused
    (it could not judge a config already refused). `watch()` is a context manager yielding the set
    of field names read while it is open (config.schema.field_reads); without it nothing is recorded
    and only `needs` passes a check over."""

    def __init__(self, watch: Callable[[], ContextManager[set[str]]] | None = None):
        self.lines: list[str] = []
        self.fields: set[str] = set()
        self.watch = watch

    def __bool__(self) -> bool:
        return bool(self.lines)

    def add(self, error: Any, fields: Any = ()) -> None:
        """A refusal (a message, a UserError or a UserErrors) and the fields it is about."""
        lines = error.lines if isinstance(getattr(error, "lines", None), list) else [str(error)]
        for line in (" ".join(str(m).split("\n")).strip() for m in lines):
            if line and line not in self.lines:
                self.lines.append(line)
        self.fields |= set(fields)

    def blocked(self, fields: Any) -> bool:
        """Whether any of `fields` was refused (what reads them cannot be judged)."""
        return not self.fields.isdisjoint(fields)

    def check(self, fn: Callable[..., Any], *args: Any, needs: tuple[str, ...] = (), about: tuple[str, ...] = (),
              **kwargs: Any) -> Any:
        """Run one check; a UserError it raises is added with the fields it read (and `about`: what its
        refusal makes unusable to later checks). Returns what `fn` returns, or None when it refused or
        was passed over (see the class)."""
        if self.blocked(needs):
            return None
        refused_before = bool(self.lines)
        with (self.watch() if self.watch else contextlib.nullcontext(set())) as read:
            try:
                return fn(*args, **kwargs)
            except UserError as e:
                if not self.blocked(read):
                    self.add(e, set(read) | set(about))
                return None
            except Exception:
                if refused_before:
                    return None
                raise

    def raise_all(self) -> None:
        raise_all(self.lines)
