"""swift.utils' two helpers that plugin files use: a logger and `to_device`."""

from __future__ import annotations

import logging
from typing import Any


def get_logger(name: str = "swiftlite.plugin") -> logging.Logger:
    """The plugin's logger: swiftlite's log (warnings reach the console as the run's own do)."""
    return logging.getLogger(name)


def to_device(inputs: Any, device: Any) -> Any:
    """Tensors in `inputs` (nested in dicts, lists, tuples) moved to `device`; anything else as is."""
    if hasattr(inputs, "to") and callable(inputs.to) and type(inputs).__module__.startswith("torch"):
        return inputs.to(device)
    if isinstance(inputs, dict):
        return {k: to_device(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(to_device(v, device) for v in inputs)
    return inputs


__all__ = ["get_logger", "to_device"]
