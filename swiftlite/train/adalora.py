"""AdaLoRA's training schedule (--train_type adalora), around the backend's engine.

peft's AdaLoRA needs two things from the training loop, which HF Trainer-based code gets from the
model's forward and a callback (ms-swift's AdaloraCallback):

* the orthogonal penalty orth_reg_weight x R, with R peft's mean over the adapted layers of
  ||A A^T - I||_F and ||B^T B - I||_F. peft adds it in AdaLoraModel.forward, to a loss the model
  computes from labels; swiftlite computes the token loss outside the model (parallel/loss.py), so the
  penalty is backpropagated here once per optimizer step, after the step's last backward and before
  clipping: the same gradient as HF's (each of the GA micro-batches adds R / GA; DDP averages equal
  values), and part of the clipped norm as there.
* the rank allocation, `update_and_allocate(global_step)`, after each optimizer update and before
  the gradients are cleared (it scores each entry by |p x grad| and masks the least important
  singular values): the engine's `after_update` hook, with the 1-based step ms-swift passes.

Both read every adapter matrix and its gradient whole on each rank, so the backends that give a rank a
slice of them (FSDP, ZeRO) are refused (`adalora_problem`); DDP's replicas hold the same averaged
gradients, so every rank masks the same entries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def adalora_problem(cfg: Any, choice: Any = None) -> str | None:
    """Why --train_type adalora cannot run on the chosen backend (a parallel.base.BackendChoice), or None."""
    if cfg.train.train_type != "adalora" or choice is None:
        return None
    if choice.is_deepspeed or any(choice.record.shards):
        return (f"--train_type adalora with --parallelism {choice.name}: peft's rank allocation reads each adapter "
                "matrix and its gradient whole after the optimizer step, and this backend gives each rank a slice "
                "(FSDP shards, ZeRO partitions); use --parallelism single or ddp")
    return None


def orth_penalty(peft_model: "torch.nn.Module") -> "torch.Tensor | float":
    """R of peft's AdaLoraModel.forward: the mean over the adapter's lora_A and lora_B of
    ||P - I||_F, P = A A^T for A and B^T B for B (0 when there is none)."""
    import torch
    name = peft_model.base_model.trainable_adapter_name
    total, count = 0, 0
    for n, p in peft_model.base_model.model.named_parameters():
        if ("lora_A" in n or "lora_B" in n) and name in n:
            cov = p @ p.T if "lora_A" in n else p.T @ p
            total = total + torch.norm(cov - torch.eye(*cov.size(), device=cov.device, dtype=cov.dtype), p="fro")
            count += 1
    return total / count if count else 0


class AdaLoraEngine:
    """The backend's engine with AdaLoRA's schedule added to `step()`; everything else is the engine's."""

    def __init__(self, engine: Any, peft_model: "torch.nn.Module", start_step: int):
        self._engine = engine
        self._peft = peft_model
        self._weight = peft_model.peft_config[peft_model.base_model.trainable_adapter_name].orth_reg_weight
        self.global_step = start_step
        self.last_penalty = 0.0
        engine.after_update(self._allocate)

    def __getattr__(self, name: str) -> Any:   # the Engine surface: the wrapped engine's
        return getattr(self._engine, name)

    def step(self) -> float:
        self.global_step += 1
        if self._weight > 0:
            penalty = self._weight * orth_penalty(self._peft)
            penalty.backward()
            self.last_penalty = float(penalty.detach())
        return self._engine.step()

    def _allocate(self) -> None:
        # after the update, before zero_grad: peft's documented order (AdaLoraModel.update_and_allocate)
        self._peft.base_model.update_and_allocate(self.global_step)


def with_adalora(engine: Any, model: Any, cfg: Any, start_step: int, resume_path: Any = None) -> Any:
    """The engine the loop drives: `engine` itself, or for --train_type adalora an AdaLoraEngine.
    A resumed run takes the rank pattern its checkpoint's adapter/ recorded (the masks themselves
    are in the resumed weights): peft re-applies it in the last --adalora_tfinal steps. The
    importance averages start again from zero, as in ms-swift (peft does not save them)."""
    if cfg.train.train_type != "adalora":
        return engine
    if resume_path is not None:
        import json
        from pathlib import Path

        from swiftlite.checkpoint import layout
        from swiftlite.hf_io import ADAPTER_CONFIG
        f = Path(resume_path) / layout.ADAPTER_DIR / ADAPTER_CONFIG
        pattern = json.loads(f.read_text()).get("rank_pattern") if f.is_file() else None
        if pattern:
            model.peft_config[model.base_model.trainable_adapter_name].rank_pattern = pattern
    return AdaLoraEngine(engine, model, start_step)
