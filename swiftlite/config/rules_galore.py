"""The rules of GaLore (--use_galore, --optimizer galore; swiftlite/galore.py): which options apply and
the combinations it cannot run, each with its reason. Rules of config/rules.py's table, kept here so
that module stays short; the backend check (whole gradients: single/ddp) is optim.optim_problem's,
which needs the resolved backend. Import-light (no torch)."""

from __future__ import annotations

from swiftlite.config.galore_options import GALORE_KEYS, uses_galore
from swiftlite.config.rule_table import rule
from swiftlite.config.schema import RunConfig

#: --optim values galore-torch has an optimizer for (GaLoreAdamW, GaLoreAdafactor).
GALORE_OPTIMS = ("adamw_torch_fused", "adamw_torch", "adafactor")


@rule("galore")
def _galore(c: RunConfig):
    o = c.optim
    if not uses_galore(c):
        given = [k for k in GALORE_KEYS if k in c.explicit]
        if given:
            return f"--{given[0]} is an option of GaLore: add --use_galore true, or drop it"
        return None
    if o.use_galore and o.optimizer not in (None, "galore"):
        return f"--use_galore with --optimizer {o.optimizer}: one optimizer plugin at a time; drop one"
    if c.is_peft:
        return (f"--use_galore with --train_type {c.train.train_type}: GaLore projects the gradients of whole "
                "weight matrices, which an adapter run does not train; use --train_type full")
    if o.optim not in GALORE_OPTIMS:
        return (f"--use_galore with --optim {o.optim}: galore-torch projects for AdamW and Adafactor only; use "
                f"--optim {' or '.join(GALORE_OPTIMS)}")
    if o.galore_rank < 1 or o.galore_update_proj_gap < 1:
        return (f"--galore_rank {o.galore_rank} --galore_update_proj_gap {o.galore_update_proj_gap}: both must "
                "be >= 1")
    if o.galore_optim_per_parameter and o.warmup_ratio > 0 and o.warmup_steps == 0:
        return (f"--warmup_ratio {o.warmup_ratio} with --galore_optim_per_parameter true: ms-swift's per-parameter "
                "schedules warm up over 2 x --warmup_steps and ignore the ratio; give --warmup_steps")
    return None
