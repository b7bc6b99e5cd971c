"""GaLore's options (`--use_galore` and `galore_*`), with ms-swift's names and defaults
(swift/trainers/arguments.py: the dataclass values). A base of schema.OptimConfig, kept here so that
schema.py stays short; swiftlite/galore.py builds the optimizer and config/rules_galore.py says which
combinations run. Q-GaLore's options (--galore_quantization and the int8 projection settings) are
refused with their reason (config/msswift_unsupported.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt

#: The sides galore-torch's GaLoreProjector projects a gradient from (its `proj_type`).
GALORE_PROJ_TYPES = ("std", "reverse_std", "right", "left", "full")
#: The galore_* options, read only when GaLore is on (rules_galore refuses them otherwise).
GALORE_KEYS = ("galore_target_modules", "galore_rank", "galore_update_proj_gap", "galore_scale", "galore_proj_type",
               "galore_optim_per_parameter", "galore_with_embedding")


@dataclass(kw_only=True)
class GaloreOptions(Section):
    use_galore: bool = opt(False, "GaLore (galore-torch's GaLoreAdamW/GaLoreAdafactor, as ms-swift): the gradients "
                           "of the targeted weight matrices are projected to --galore_rank dimensions (an SVD of the "
                           "gradient, refreshed every --galore_update_proj_gap steps), so the optimizer state of "
                           "each is rank x width. Full training on --parallelism single/ddp (the projection needs "
                           "whole gradients); --optim adamw_torch(_fused) or adafactor. Same as --optimizer galore.")
    galore_target_modules: list[str] | None = opt(None, "GaLore: names of the modules whose weights are projected "
                                                  "(a module is taken when its name contains one, as ms-swift); "
                                                  "default: every linear layer but the output head.")
    galore_rank: int = opt(128, "GaLore: rank of the projected gradient and optimizer state.")
    galore_update_proj_gap: int = opt(50, "GaLore: optimizer steps between two projections (SVDs of the gradient).")
    galore_scale: float = opt(1.0, "GaLore: scale of the projected-back update.")
    galore_proj_type: str = opt("std", "GaLore projection: std (the smaller side), reverse_std, right, left, or full "
                                "(both sides).", choices=GALORE_PROJ_TYPES)
    galore_optim_per_parameter: bool = opt(False, "GaLore: one optimizer per parameter, as ms-swift's: every "
                                           "parameter gets --weight_decay (biases and norms too), projections are "
                                           "refreshed every 2 x --galore_update_proj_gap steps, and the schedule "
                                           "runs over 2 x the run's steps with 2 x --warmup_steps of warm-up "
                                           "(--warmup_ratio is refused with it).")
    galore_with_embedding: bool = opt(False, "GaLore: project the input embedding's gradient too.")


def uses_galore(cfg: "object") -> bool:
    """GaLore is on: --use_galore true, or ms-swift's --optimizer galore (which --use_galore sets there)."""
    o = cfg.optim  # type: ignore[attr-defined]
    return bool(o.use_galore) or o.optimizer == "galore"
