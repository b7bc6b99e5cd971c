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
