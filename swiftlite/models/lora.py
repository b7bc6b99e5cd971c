"""LoRA adapters through peft (LoRA on a 16/32-bit base, QLoRA on a bitsandbytes 4-bit base).

`apply_lora` runs after loading/quantizing and before wrapping (the order in docs/design.md). It checks the
targets against the model first, so a wrong --target-modules is a one-line error listing what the
model has, not a peft traceback, and it initialises the adapter from --seed alone so that every rank
(and every world size) starts from the same adapter.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING

from swiftlite.errors import UserError

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig

# Layer types LoRA can adapt, by class name: torch Linear, bitsandbytes' quantized Linear layers,
# and transformers' Conv1D (GPT-2 style), which peft also treats as linear.
LINEAR_TYPES = ("Linear", "Linear4bit", "Linear8bitLt", "Conv1D")
HEAD_NAMES = ("lm_head",)  # output heads: never part of all-linear (peft excludes them too)


def _is_linear(m: "torch.nn.Module") -> bool:
    import torch
    return isinstance(m, torch.nn.Linear) or type(m).__name__ in LINEAR_TYPES


def linear_module_paths(model: "torch.nn.Module") -> list[str]:
    """Full names of the linear layers (`model.layers.0.self_attn.q_proj`, ..., `lm_head`)."""
    return [name for name, m in model.named_modules() if name and _is_linear(m)]


def _matches(target: str, path: str) -> bool:
    """peft's rule for a list entry: the full module name, or a suffix of it at a dot."""
    return path == target or path.endswith("." + target)


def check_targets(model: "torch.nn.Module", cfg: "RunConfig") -> str | list[str]:
    """The target_modules value for peft, after checking it against the model."""
    lc = cfg.lora
    paths = linear_module_paths(model)
    body = [p for p in paths if p.rsplit(".", 1)[-1] not in HEAD_NAMES]
    if not body:
        raise UserError(f"--train-type {cfg.train.train_type}: model {cfg.model.model} has no linear layers to "
                        "adapt (LoRA targets torch Linear / bitsandbytes / Conv1D layers; found none besides "
                        "the output head)")
    names = sorted({p.rsplit(".", 1)[-1] for p in body})
    all_linear = lc.target_modules == ["all-linear"]
    missing = [] if all_linear else [t for t in lc.target_modules if not any(_matches(t, p) for p in paths)]
    if missing:
        raise UserError(f"--target-modules {' '.join(missing)}: no such linear module in {cfg.model.model} "
                        f"(its linear modules: {', '.join(names)}; or all-linear)")
    if lc.modules_to_save:
        all_paths = [n for n, _ in model.named_modules() if n]
        absent = [t for t in lc.modules_to_save if not any(_matches(t, p) for p in all_paths)]
        if absent:
            tops = sorted({p.rsplit(".", 1)[-1] for p in all_paths if not p.rsplit(".", 1)[-1].isdigit()})
            raise UserError(f"--modules-to-save {' '.join(absent)}: no such module in {cfg.model.model} "
                            f"(its modules: {', '.join(tops)})")
    return "all-linear" if all_linear else list(lc.target_modules)


def apply_lora(model: "torch.nn.Module", cfg: "RunConfig") -> "torch.nn.Module":
    """Wrap with peft LoRA; a target list that matches nothing is an error listing what exists."""
    from swiftlite.models.quant import peft_without_bnb
    with peft_without_bnb(quantized=cfg.quant.quant_bits is not None):
        return _wrap(model, cfg)


def _wrap(model: "torch.nn.Module", cfg: "RunConfig") -> "torch.nn.Module":
    import torch
    from peft import LoraConfig, get_peft_model

    from swiftlite.models.quant import disable_cpu_repack
    disable_cpu_repack(model)  # trap 1, whatever path loaded the quantized base (preset or folder)
    lc = cfg.lora
    targets = check_targets(model, cfg)
    if cfg.quant.quant_bits == 4 and not any(type(m).__name__ == "Linear4bit" for m in model.modules()):
        raise UserError(f"--train-type {cfg.train.train_type}: no layer of {cfg.model.model} was quantized to "
                        "4-bit (bitsandbytes replaced no linear layer); use --lora")
    conf = LoraConfig(r=lc.lora_rank, lora_alpha=lc.lora_alpha, lora_dropout=lc.lora_dropout,
                      target_modules=targets, modules_to_save=lc.modules_to_save or None,
                      task_type="CAUSAL_LM", bias="none")
    # The LoRA A matrices are random: draw them from --seed alone, so every rank builds the same
    # adapter (the trainer seeds each rank differently for dropout; sharded backends keep each rank's
    # own slice, so per-rank inits would mix) and a 2-process run starts where a 1-process run does.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing`: its warning, not the user's
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(cfg.train.seed)
        from swiftlite.models.sharded import adapters_stay_real, deferred
        try:
            with adapters_stay_real() if deferred(model) is not None else contextlib.nullcontext():
                return get_peft_model(model, conf)
        except ValueError as e:
            raise UserError(f"--target-modules: {str(e).splitlines()[0]}") from None
