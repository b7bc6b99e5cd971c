"""A launched rank's stack dump on signals, kept in one leaf module because two layers touch it:
launch/diagnostics.py installs it (to name and locate a hung rank) and removes it when the rank ends
normally; train/preempt.py installs a Python SIGTERM handler over it and puts the dump back in front
(`rechain_stack_dump`). Here, train does not import launch (tests/unit/test_import_graph.py: no
package cycle).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import IO

_stack_file: IO[str] | None = None


def dump_stacks_to(path: Path) -> bool:
    """Dump every thread's stack into `path` on a crash, SIGABRT (then die) and SIGTERM (then go on to
    the handler installed after it). False when it could not be set up (the rank runs without it)."""
    global _stack_file
    import faulthandler
    if _stack_file is not None:
        return True
    try:
        _stack_file = path.open("w")
        faulthandler.enable(file=_stack_file, all_threads=True)          # SIGABRT (and crashes): dump, die
        faulthandler.register(signal.SIGTERM, file=_stack_file, all_threads=True, chain=True)
    except (OSError, RuntimeError, ValueError):
        _stack_file = None
        return False
    return True


def rechain_stack_dump() -> None:
    """Put the SIGTERM stack dump back in front after a Python handler for SIGTERM was installed
    (signal.signal replaces faulthandler's handler): the dump runs, then the Python handler."""
    if _stack_file is None:
        return
    import faulthandler
    try:
        faulthandler.register(signal.SIGTERM, file=_stack_file, all_threads=True, chain=True)
    except (OSError, RuntimeError, ValueError):
        pass


def stop_stack_dump() -> None:
    """No more dumps; the dump file (empty unless a signal came) is removed."""
    global _stack_file
    if _stack_file is None:
        return
    import faulthandler
    try:
        faulthandler.unregister(signal.SIGTERM)
        faulthandler.disable()
        path = Path(_stack_file.name)
        _stack_file.close()
        path.unlink(missing_ok=True)
    except (OSError, RuntimeError, ValueError):
        pass
    _stack_file = None


def dumping() -> bool:
    return _stack_file is not None


__all__ = ["dump_stacks_to", "dumping", "rechain_stack_dump", "stop_stack_dump"]
