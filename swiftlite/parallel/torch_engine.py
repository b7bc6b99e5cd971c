"""The Engine shared by the torch backends (single, DDP, FSDP2, FSDP1).

They differ only in how the model is wrapped and how the gradient norm is computed; state handling
goes through torch.distributed.checkpoint's state_dict API, which speaks all of them: sharded
saves (DCP) with the model's own parameter names, and full state dicts gathered to rank 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from swiftlite.optim import build_optimizer, build_scheduler
from swiftlite.parallel.base import World, tensor_bytes
from swiftlite.parallel.loss import token_loss_sum


class TorchEngine:
    """Model + AdamW + LambdaLR behind the Engine interface."""

    def __init__(self, module: torch.nn.Module, cfg: Any, world: World, total_steps: int,
                 *, inner: torch.nn.Module | None = None,
                 clip: Callable[[float], torch.Tensor] | None = None,
                 no_sync: Callable[[], Any] | None = None):
        self.module = module              # what forward runs (possibly a wrapper)
        self.inner = inner or module      # the model with HF names (for state dicts)
        self.cfg = cfg
        self.world = world
        # Trap 2: the optimizer is built right after wrapping, before any forward.
        self.optimizer = build_optimizer(self.module, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, total_steps)
        self._clip = clip
        self.max_grad_norm = cfg.optim.max_grad_norm

    # -- step loop -------------------------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return token_loss_sum(self.module, batch)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        if self._clip is not None:
            norm = self._clip(max_norm)
        else:
            params = [p for p in self.module.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    # -- state -----------------------------------------------------------------------------------
    def _opts(self, **kw: Any) -> StateDictOptions:
        return StateDictOptions(**kw)

    def save(self, path: str) -> None:
        """Sharded save with DCP: each rank writes its own shards; names are the model's own."""
        import torch.distributed.checkpoint as dcp
        state = {"model": get_model_state_dict(self.inner, options=self._opts(ignore_frozen_params=self._frozen_ok)),
                 "optim": get_optimizer_state_dict(self.inner, self.optimizer)}
        dcp.save(state, checkpoint_id=str(Path(path) / "dcp"))
        if self.world.is_main:
            (Path(path) / "scheduler.json").write_text(json.dumps(self.scheduler.state_dict()))

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from swiftlite.checkpoint import check_dcp_metadata
        check_dcp_metadata(Path(path) / "dcp")
        opts = self._opts(ignore_frozen_params=self._frozen_ok)
        state = {"model": get_model_state_dict(self.inner, options=opts),
                 "optim": get_optimizer_state_dict(self.inner, self.optimizer)}
        dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
        set_model_state_dict(self.inner, state["model"], options=self._opts(strict=False))
        set_optimizer_state_dict(self.inner, self.optimizer, state["optim"])
        sched = json.loads((Path(path) / "scheduler.json").read_text())
        self.scheduler.load_state_dict(sched)

    @property
    def _frozen_ok(self) -> bool:
        # LoRA: the frozen base comes from the base model at resume; only trainable state is saved.
        return bool(getattr(self.cfg, "is_peft", False))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer with HF names, full tensors on CPU, on rank 0 ({} elsewhere)."""
        # cpu_offload copies to CPU on rank 0 only; on a CPU run that copy is pointless, and with
        # FSDP1 on gloo it crashes (SIGSEGV in the rank-0 offload): gather plainly instead.
        offload = self.world.device != "cpu"
        sd = get_model_state_dict(self.inner, options=self._opts(full_state_dict=True, cpu_offload=offload))
        return sd if self.world.is_main else {}

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """peft adapter tensors (peft's own naming), gathered (trap 3: never peft.save on DTensors)."""
        from peft import get_peft_model_state_dict
        full = get_model_state_dict(self.inner, options=self._opts(full_state_dict=True, cpu_offload=True,
                                                                    ignore_frozen_params=True))
        if not self.world.is_main:
            return {}
        return get_peft_model_state_dict(self.inner, state_dict=full)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds, counted from the tensors themselves."""
        params = sum(tensor_bytes(p) for p in self.module.parameters())
        grads = sum(tensor_bytes(p.grad) for p in self.module.parameters() if p.grad is not None)
        optim = 0
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and k != "step":
                    optim += tensor_bytes(v)
        return {"params": params, "grads": grads, "optimizer": optim}


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
