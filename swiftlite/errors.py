"""User-facing errors.

A `UserError` is a mistake the user can fix (a bad flag, a missing file, a malformed row). The CLI
prints its message as one line on stderr and exits with code 2, never a traceback. Anything else is
a bug in swiftlite or an environment problem and keeps its traceback.
"""

from __future__ import annotations

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
