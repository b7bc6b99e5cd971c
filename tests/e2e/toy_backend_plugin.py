"""A backend registered from outside swiftlite (loaded with --external-plugins): one record and one
apply function. It runs the model in one process with a gradient hook that counts backward calls,
which is enough to prove that this record, not a built-in one, trained the run."""

from __future__ import annotations

from swiftlite.parallel.base import Backend, register_backend

CALLS = {"backward_hooks": 0}


def apply_toy(model):
    """The toy's wrapping: a hook on the first parameter that counts backward passes."""
    p = next(q for q in model.parameters() if q.requires_grad)

    def count(grad):
        CALLS["backward_hooks"] += 1
        return grad
    p.register_hook(count)
    return model


def build_toy(model, cfg, world, total_steps, choice=None):
    from swiftlite.parallel.torch_engine import TorchEngine
    engine = TorchEngine(apply_toy(model.to(world.device)), cfg, world, total_steps)
    engine.toy_calls = CALLS
    return engine


register_backend(Backend(name="toy", engine="toy", factory=build_toy, aliases=("toy_backend",),
                         max_processes=1, memory_family="ddp", summary="a test backend from a plugin file"))
