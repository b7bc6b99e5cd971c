"""Moved to swiftlite/planner/ (shape.py, memory.py, backends.py, recommend.py, render.py).

This shim keeps `from swiftlite.parallel import plan` / `swiftlite.parallel.plan.X` working for the
modules and tests that still use it (bench, trainer, tests/distributed); import from
`swiftlite.planner` in new code.
"""

from __future__ import annotations

from swiftlite.planner import *  # noqa: F401,F403
from swiftlite.planner import __all__  # noqa: F401
