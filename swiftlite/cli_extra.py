"""Commands that live in their own modules (export, infer, bench) join the app here.

Each module has `register(app)` adding its Typer command; it must import nothing heavy at module
level (torch/transformers inside the command), so `swiftlite --help` stays fast. A module that is
not there yet is simply absent from `--help`.
"""

from __future__ import annotations

import importlib

_MODULES = ("swiftlite.export_cli", "swiftlite.infer_cli", "swiftlite.bench_cli")
_done = False


def register_all(app) -> None:
    global _done
    if _done:
        return
    _done = True
    for mod in _MODULES:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod:
                continue
            raise
        m.register(app)
