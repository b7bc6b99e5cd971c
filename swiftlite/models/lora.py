"""LoRA adapters through peft."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swiftlite.errors import UserError

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig


def linear_module_names(model: "torch.nn.Module") -> list[str]:
    """Distinct leaf names of linear layers (what --target-modules can name)."""
    import torch
    names = set()
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) or type(m).__name__ in ("Linear4bit", "Linear8bitLt"):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def apply_lora(model: "torch.nn.Module", cfg: "RunConfig") -> "torch.nn.Module":
    """Wrap with peft LoRA; a target list that matches nothing is an error listing what exists."""
    from peft import LoraConfig, get_peft_model

    from swiftlite.models.quant import disable_cpu_repack
    disable_cpu_repack(model)  # trap 1, whatever path loaded the quantized base (preset or folder)
    lc = cfg.lora
    linear = [n for n in linear_module_names(model) if n != "lm_head"]
    if not linear:
        raise UserError(f"--train-type {cfg.train.train_type}: model {cfg.model.model} has no linear layers to adapt")
    targets: str | list[str] = lc.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    else:
        missing = [t for t in targets if t not in linear]
        if missing:
            raise UserError(f"--target-modules {' '.join(missing)}: no such module in the model "
                            f"(linear modules: {', '.join(linear)})")
    conf = LoraConfig(r=lc.lora_rank, lora_alpha=lc.lora_alpha, lora_dropout=lc.lora_dropout,
                      target_modules=targets, modules_to_save=lc.modules_to_save or None,
                      task_type="CAUSAL_LM", bias="none")
    # The LoRA A matrices are random: draw them from --seed alone, so every rank builds the same
    # adapter (the trainer seeds each rank differently for dropout; sharded backends keep each rank's
    # own slice, so per-rank inits would mix) and a 2-process run starts where a 1-process run does.
    import torch
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        try:
            return get_peft_model(model, conf)
        except ValueError as e:
            raise UserError(f"--target-modules: {str(e).splitlines()[0]}") from None
