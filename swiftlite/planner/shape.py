"""The model's shape, as the planner reads it. The shape is one of --model's facts: ModelSource
(models/source.py) owns it and models/shape.py counts it; this module names them for the planner.

    shape = shape_from_model_arg("llama-8b")   # == resolve_model("llama-8b").shape(): offline, configs only
"""

from __future__ import annotations

from swiftlite.models.shape import Linear, ModelShape, shape_from_config


def shape_from_model_arg(model: str) -> ModelShape:
    """ModelShape of `--model` without the network: `resolve_model(model).shape()` (a preset, or a local
    folder's config; a hub id is refused, since estimate never downloads)."""
    from swiftlite.models.source import resolve_model
    return resolve_model(model).shape()


__all__ = ["Linear", "ModelShape", "shape_from_config", "shape_from_model_arg"]
