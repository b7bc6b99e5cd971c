"""The backend interface and registry.

The trainer sees one `Engine`, whatever the backend:

    engine = build_engine(model, cfg, world, total_steps)
    with engine.micro_batch(last):             # gradient sync only on the window's last one
        loss = engine.forward(batch) * scale   # summed token cross-entropy, fp32 scalar
        engine.backward(loss)
    grad_norm = engine.step()                  # clip + optimizer + scheduler + zero_grad
    engine.save(dir) / engine.load(dir)        # sharded training state (model + optimizer + scheduler)
    engine.full_state_dict()                   # HF names, gathered to rank 0, CPU tensors
    engine.adapter_state_dict()                # peft names, gathered to rank 0

Gradient contract: every backend averages gradients over data-parallel ranks (DDP, FSDP and ZeRO all
do). The trainer therefore scales each rank's summed loss by world_size / global_target_tokens, so the
averaged gradient is the gradient of the global token-mean loss, equal for any world size or
accumulation. An engine must not rescale the loss again (DeepSpeed's own 1/gas is disabled).

Adding a backend = one module that calls `register_backend(name)`; the trainer never changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:  # keep torch out of import time for the CLI
    import torch

    from swiftlite.config import RunConfig


@dataclass(frozen=True)
class World:
    """This process's place in the job."""
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: str = "cpu"           # "cpu" or "cuda:<local_rank>"
    dist_backend: str | None = None  # "gloo"/"nccl" when a process group exists

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.dist_backend is not None

    @staticmethod
    def from_env() -> "World":
        """World as torchrun describes it in the environment (before init)."""
        return World(rank=int(os.environ.get("RANK", 0)), local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                     world_size=int(os.environ.get("WORLD_SIZE", 1)),
                     local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


class Engine(Protocol):
    """What the trainer drives. See the module docstring for the contract."""
    module: "torch.nn.Module"

    def micro_batch(self, last: bool) -> Any: ...
    def forward(self, batch: dict[str, "torch.Tensor"]) -> "torch.Tensor": ...
    def backward(self, loss: "torch.Tensor") -> None: ...
    def step(self) -> float: ...
    def lr(self) -> float: ...
    def train(self) -> None: ...
    def eval(self) -> None: ...
    def save(self, path: str) -> None: ...
    def load(self, path: str) -> None: ...
    def full_state_dict(self) -> dict[str, "torch.Tensor"]: ...
    def adapter_state_dict(self) -> dict[str, "torch.Tensor"]: ...
    def state_bytes(self) -> dict[str, int]: ...


BackendFactory = Callable[["torch.nn.Module", "RunConfig", World, int], Engine]
BACKENDS: dict[str, BackendFactory] = {}


def register_backend(*names: str) -> Callable[[BackendFactory], BackendFactory]:
    """Register a factory `fn(model, cfg, world, total_steps) -> Engine` under `names`."""
    def deco(fn: BackendFactory) -> BackendFactory:
        for n in names:
            BACKENDS[n] = fn
        return fn
    return deco


# Modules imported on demand so that a run only imports the engine it uses (DeepSpeed is slow).
_BACKEND_MODULES = {
    "single": "swiftlite.parallel.ddp", "ddp": "swiftlite.parallel.ddp",
    "fsdp": "swiftlite.parallel.fsdp2", "fsdp1": "swiftlite.parallel.fsdp1",
    "deepspeed": "swiftlite.parallel.deepspeed",
}


def get_backend(name: str) -> BackendFactory:
    """The factory registered for backend `name` (importing its module on first use)."""
    if name not in BACKENDS and name in _BACKEND_MODULES:
        import importlib
        importlib.import_module(_BACKEND_MODULES[name])
    if name not in BACKENDS:
        from swiftlite.errors import UserError
        raise UserError(f"--parallelism: no backend {name!r} (known: {', '.join(sorted(_BACKEND_MODULES))})")
    return BACKENDS[name]


def build_engine(model: "torch.nn.Module", cfg: "RunConfig", world: World, total_steps: int,
                 backend: str | None = None) -> Engine:
    """Wrap `model` with the run's backend and build its optimizer and scheduler immediately."""
    return get_backend(backend or cfg.backend_name)(model, cfg, world, total_steps)


def tensor_bytes(t: Any) -> int:
    """Bytes this rank really holds for a tensor (the local shard of a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()
