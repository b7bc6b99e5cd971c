"""GaLore (Zhao et al. 2024, arXiv 2403.03507): `--use_galore true` (or `--optimizer galore`), as
ms-swift runs it (swift/optimizers/galore): galore-torch's GaLoreAdamW (or GaLoreAdafactor under
--optim adafactor) over every trainable parameter, with the targeted weight matrices in a group that
carries GaLore's settings. For those, each step's gradient is projected to `galore_rank` dimensions
(the top singular vectors of the gradient itself, recomputed every `galore_update_proj_gap` steps),
the Adam moments live in that small space, and the update is projected back. Everything else is
plain AdamW in the same optimizer, with the run's weight-decay split (optim.param_groups).

Which weights: `--galore_target_modules` names (default: the last name of every linear layer but
the output head, ms-swift's find_all_linears); a Linear or Embedding module is taken when its name
contains one of them (ms-swift's rule), `--galore_with_embedding` adds the input embedding.

`--galore_optim_per_parameter true` is ms-swift's one optimizer per parameter, whose effect on the
numbers this reproduces in one optimizer: the non-projected parameters all get --weight_decay (no
split), the projection gap is doubled, and optim.build_scheduler stretches the schedule over twice
the steps with twice --warmup_steps of warm-up.

Backends: the projection is an SVD of a whole gradient matrix, so only backends that keep whole
gradients on each rank run it (single, ddp: every rank computes the same SVD of the same reduced
gradient); FSDP shards and ZeRO partitions are refused before launch (optim.optim_problem).

Checkpoints: galore-torch keeps a GaLoreProjector object in each projected parameter's state. Saved
as such it would need unpickling arbitrary objects at resume (swiftlite refuses that,
checkpoint/safety.py), so the state is written with the projector's matrix as a tensor
(`galore_ortho`, or `galore_ortho_left`/`galore_ortho_right` for proj_type full) and the projector is
rebuilt from the group's settings when the state is loaded.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch

from swiftlite.errors import UserError

if TYPE_CHECKING:
    from swiftlite.config import RunConfig

#: Where the projector's matrix goes in a saved state (a list of two for proj_type full).
_ORTHO = "galore_ortho"
_ORTHO_PAIR = ("galore_ortho_left", "galore_ortho_right")
#: The group keys that make galore-torch project a parameter (and rebuild its projector).
_GROUP_KEYS = ("rank", "update_proj_gap", "scale", "proj_type")


def target_names(model: torch.nn.Module, cfg: "RunConfig") -> list[str]:
    """The --galore_target_modules strings, or ms-swift's default: the last name of every linear
    layer but the output head; with --galore_with_embedding the input embedding's too."""
    o = cfg.optim
    names = list(o.galore_target_modules or [])
    if not names:
        inner = model.module if isinstance(getattr(model, "module", None), torch.nn.Module) else model  # DDP
        head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and m is not head and n})
    if o.galore_with_embedding:
        names += sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Embedding) and n})
    return names


def projected_params(model: torch.nn.Module, cfg: "RunConfig") -> list[torch.nn.Parameter]:
    """The weights GaLore projects: of each trainable Linear/Embedding whose name contains a target."""
    targets = target_names(model, cfg)
    seen: dict[int, torch.nn.Parameter] = {}
    for name, m in model.named_modules():
        if not isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) or not any(t in name for t in targets):
            continue
        if m.weight.requires_grad:
            seen.setdefault(id(m.weight), m.weight)   # a tied weight once
    if not seen:
        raise UserError(f"--galore_target_modules {' '.join(targets) or '(none)'}: no trainable linear or embedding "
                        "layer of the model has one of these in its name")
    return list(seen.values())


def galore_groups(model: torch.nn.Module, cfg: "RunConfig", split: list[dict]) -> list[dict]:
    """The optimizer's groups: the projected weights first (GaLore's settings, --weight_decay), then the
    rest, as in `split` (optim.param_groups: the weight-decay split), or all decayed under
    --galore_optim_per_parameter."""
    o = cfg.optim
    projected = projected_params(model, cfg)
    ids = {id(p) for p in projected}
    gap = o.galore_update_proj_gap * (2 if o.galore_optim_per_parameter else 1)
    groups = [{"params": projected, "rank": o.galore_rank, "update_proj_gap": gap, "scale": o.galore_scale,
               "proj_type": o.galore_proj_type, "weight_decay": o.weight_decay}]
    if o.galore_optim_per_parameter:
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
        if rest:
            groups.append({"params": rest, "weight_decay": o.weight_decay})
        return groups
    for g in split:
        g = {**g}
        g["params"] = [p for p in g["params"] if id(p) not in ids]
        if g["params"]:
            groups.append(g)
    return groups


def build(model: torch.nn.Module, cfg: "RunConfig", name: str, split: list[dict]) -> torch.optim.Optimizer:
    """galore-torch's optimizer for --optim `name` over `galore_groups` (`split`: the run's weight-decay
    groups), with HF's arguments as optim.build_optimizer passes them (ms-swift's get_optimizer does the
    same)."""
    from swiftlite.models.quant import quiet_bnb_import
    quiet_bnb_import()   # galore_torch's package imports bitsandbytes (its 8-bit AdamW)
    try:
        import galore_torch
    except ImportError:
        raise UserError("--use_galore needs galore-torch: pip install 'swiftlite[galore]' (or galore-torch)") from None
    o, groups = cfg.optim, galore_groups(model, cfg, split)
    if name in ("adamw_torch_fused", "adamw_torch"):
        cls = _saved_plain(galore_torch.GaLoreAdamW)
        return cls(groups, lr=cfg.learning_rate, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_epsilon,
                   no_deprecation_warning=True)
    if name == "adafactor":
        cls = _saved_plain(galore_torch.GaLoreAdafactor)
        return cls(groups, lr=cfg.learning_rate, scale_parameter=False, relative_step=False)
    raise UserError(f"--use_galore with --optim {name}: GaLore runs with adamw_torch_fused, adamw_torch or adafactor")


_CLASSES: dict[type, type] = {}


def _saved_plain(base: type) -> type:
    """`base` whose state_dict holds tensors and numbers only (the projector as its matrix) and whose
    load_state_dict rebuilds the projectors: see the module docstring."""
    if base not in _CLASSES:
        _CLASSES[base] = type("GaLore" + base.__name__, (_PlainState, base), {"__module__": __name__})
    return _CLASSES[base]


class _PlainState:
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()  # type: ignore[misc]
        plain = {}
        for key, st in sd["state"].items():
            st = dict(st)
            proj = st.pop("projector", None)
            if proj is not None and proj.ortho_matrix is not None:
                if isinstance(proj.ortho_matrix, (list, tuple)):
                    st.update(zip(_ORTHO_PAIR, proj.ortho_matrix))
                else:
                    st[_ORTHO] = proj.ortho_matrix
            plain[key] = st
        return {**sd, "state": plain}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from galore_torch.galore_projector import GaLoreProjector
        # torch matches saved entries to parameters by position in the groups (keys may be indices or,
        # from torch.distributed.checkpoint, parameter names); the matrices are matched the same way
        saved_keys = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        current = itertools.chain.from_iterable(
            ((p, g) for p in g["params"]) for g in self.param_groups)  # type: ignore[attr-defined]
        where = dict(zip(saved_keys, current))
        state, matrices = {}, {}
        for key, st in state_dict["state"].items():
            st = dict(st)
            if _ORTHO in st:
                matrices[key] = st.pop(_ORTHO)
            elif _ORTHO_PAIR[0] in st:
                matrices[key] = [st.pop(k) for k in _ORTHO_PAIR]
            state[key] = st
        super().load_state_dict({**state_dict, "state": state})  # type: ignore[misc]
        for key, m in matrices.items():
            p, g = where[key]
            if "rank" not in g:
                raise UserError("--resume: the checkpoint's GaLore state does not match this run's GaLore groups "
                                "(--galore_target_modules or --galore_with_embedding changed)")
            proj = GaLoreProjector(g["rank"], update_proj_gap=g["update_proj_gap"], scale=g["scale"],
                                   proj_type=g["proj_type"])
            proj.ortho_matrix = [t.to(p.device) for t in m] if isinstance(m, list) else m.to(p.device)
            self.state[p]["projector"] = proj  # type: ignore[attr-defined]
