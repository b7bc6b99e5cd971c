"""Moving a training engine's weights and optimizer state to CPU memory and back, while something
else uses the GPU (GRPO's colocated vLLM engine, rlhf/vllm_gen.py: ms-swift's offload_context for
--offload_model / --offload_optimizer). Here, in parallel/, because it reaches into the backends'
own state (a ZeRO-3 parameter's partition, the optimizer's state).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def _to(t: torch.Tensor, device: Any) -> torch.Tensor:
    return t.to(device, non_blocking=True)


@contextlib.contextmanager
def offloaded(engine: Any, *, model: bool, optim: bool, device: Any) -> Iterator[None]:
    """ms-swift's offload_context: the engine's parameters and buffers (a ZeRO-3 parameter's
    partition) and/or its optimizer's state tensors in CPU memory inside, back on `device` after.
    Not for FSDP (config/rules.py and rlhf/grpo.py refuse it): its flat or sharded parameters are
    not plain tensors to move. Under ZeRO-1/2 the module's weights move, the flat buffers the
    optimizer updates stay (DeepSpeed re-links the weights to them after each step)."""
    root, optimizer = engine.root(), getattr(engine, "optimizer", None)

    def move(dev: Any) -> None:
        with torch.no_grad():
            if model:
                for p in root.parameters():
                    if hasattr(p, "ds_tensor"):
                        p.ds_tensor.data = _to(p.ds_tensor.data, dev)
                    else:
                        p.data = _to(p.data, dev)
                for b in root.buffers():
                    b.data = _to(b.data, dev)
            if optim and optimizer is not None:
                for state in list(getattr(optimizer, "state", {}).values()):
                    for k, v in list(state.items()):
                        if isinstance(v, torch.Tensor):
                            state[k] = _to(v, dev)
        if dev == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not (model or optim):
        yield
        return
    move("cpu")
    try:
        yield
    finally:
        move(device)


__all__ = ["offloaded"]
