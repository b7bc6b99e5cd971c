"""Merging a BOFT, AdaLoRA or MiSS (Bone) adapter into its base weights, one adapted Linear at a time (export's
streaming merge, export/model.py). The merge is peft's own: each module is rebuilt as peft's layer
around its base weight, given the adapter's tensors, and merged with the layer's `merge()`; nothing of
BOFT's rotation, AdaLoRA's SVD form or MiSS's blocks is recomputed here.
"""

from __future__ import annotations

import re
from typing import Any

import torch

#: peft's saved tensor names of each tuner's adapted layer (no adapter name, no `.weight`).
PARTS = {"BOFT": ("boft_R", "boft_s"), "ADALORA": ("lora_A", "lora_B", "lora_E"), "MISS": ("miss_block",)}


def tuner_modules(peft_type: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """module path (HF names) -> its adapter tensors by part name, for a BOFT, AdaLoRA or MiSS adapter."""
    parts = PARTS.get(peft_type, ())
    out: dict[str, dict[str, torch.Tensor]] = {}
    alt = '|'.join(parts)
    for k, v in tensors.items():
        m = re.match(rf"^(?:base_model\.model\.)?(.+)\.({alt})$", k) if parts else None
        if m:
            out.setdefault(m.group(1), {})[m.group(2)] = v
    return out


def _config(conf: dict[str, Any]) -> Any:
    from peft import PeftConfig
    return PeftConfig.from_peft_type(**{k: v for k, v in conf.items() if k != "peft_version"})


def merge_tuner(conf: dict[str, Any], parts: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """The merged weight (fp32) of one Linear whose base weight is `w` [out, in]."""
    config = _config(conf)
    base = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        base.weight.copy_(w.float())
    if conf["peft_type"] == "BOFT":
        from peft.tuners.boft.layer import Linear

        from swiftlite.models.tuners import boft_layers
        with boft_layers(config.boft_n_butterfly_factor, "adapter boft_n_butterfly_factor"):
            layer = Linear(base, "default", config=config)
        params = {"boft_R": layer.boft_R, "boft_s": layer.boft_s}
    elif conf["peft_type"] == "MISS":
        from peft.tuners.miss.layer import MissLinear
        layer = MissLinear(base, "default", config=config, r=config.r)   # bat: r x r blocks, else r x out
        params = {"miss_block": layer.miss_block}
    else:
        from peft.tuners.adalora.layer import SVDLinear
        layer = SVDLinear(base, "default", config=config, r=parts["lora_A"].shape[0], lora_alpha=config.lora_alpha)
        # peft's reload keeps the rank count of the layer as trained (init_r) when the saved rank
        # pattern shrinks it (AdaLoraModel.resize_modules_by_rank_pattern): the scale is alpha / init_r
        layer.ranknum["default"].data.fill_(float(config.init_r))
        params = {"lora_A": layer.lora_A, "lora_B": layer.lora_B, "lora_E": layer.lora_E}
    with torch.no_grad():
        for name, holder in params.items():
            holder["default"].data = parts[name].float().reshape(holder["default"].shape).clone()
        layer.merge()
    return layer.get_base_layer().weight.detach()
