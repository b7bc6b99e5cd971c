"""LLaMA-Pro block expansion (`--train_type llamapro`, arXiv 2401.02415), as ms-swift does it
(swift/tuners/llamapro.py): after every (num_hidden_layers / groups)-th decoder layer a deep copy of
that layer is inserted, and in each copy the output projections (attention o_proj, MLP down_proj:
weights and biases) are zeroed. A copy then adds nothing to the residual stream, so the expanded model
computes exactly what the base did until training moves it. The attention layer indices, the config's
num_hidden_layers and layer_types follow the new order, and only the copies train.

The result is an ordinary transformers model with more layers: a checkpoint's model/ folder and
`swiftlite export` write it with the expanded config.json, and transformers (or vLLM) loads it as is.

Group count: ms-swift inserts one copy per group, `num_groups` copies in all (its default:
`num_new_blocks`, which must divide num_hidden_layers). swiftlite inserts the same, and asks groups to
divide the layer count too (otherwise ms-swift's stride puts more than `num_groups` copies in).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from swiftlite.errors import UserError

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig

#: The leaf names of the output projections zeroed in each copy (attention, MLP; MoE experts too).
OUTPUT_PROJECTIONS = ("o_proj", "down_proj")


def groups(cfg: "RunConfig") -> int:
    """New blocks inserted: --llamapro_num_groups, else --llamapro_num_new_blocks (ms-swift's default)."""
    g = cfg.lora.llamapro_num_groups
    return cfg.lora.llamapro_num_new_blocks if g is None else g


def _layer_count(conf: Any) -> int | None:
    return getattr(conf, "num_hidden_layers", None)


def layout_problem(cfg: "RunConfig", conf: Any) -> str | None:
    """Why this model's layer count cannot be expanded as asked, in one line naming the flag; None when it can."""
    n, blocks, g = _layer_count(conf), cfg.lora.llamapro_num_new_blocks, groups(cfg)
    if n is None:
        return f"--train_type llamapro: --model {cfg.model.model} declares no num_hidden_layers"
    if n % blocks:
        return (f"--llamapro_num_new_blocks {blocks}: the model's {n} layers are not divisible by it (LLaMA-Pro "
                f"inserts a block after every {n}/{blocks} layers); pick a divisor of {n}")
    if n % g:
        return (f"--llamapro_num_groups {g}: the model's {n} layers are not divisible by it (one new block after "
                f"every {n}/{g} layers); pick a divisor of {n}")
    return None


def new_positions(n_layers: int, n_groups: int) -> list[int]:
    """Indices, in the expanded layer list, of the inserted copies: after every (n_layers / n_groups)-th
    original layer (ms-swift: idx + 1 + copies inserted so far)."""
    stride = n_layers // n_groups
    return [(i + 1) * stride + i for i in range(n_layers // stride)]


def expanded_config(conf: Any, cfg: "RunConfig") -> Any:
    """A copy of the base model's config as the expanded model has it (num_hidden_layers, layer_types);
    `conf` itself unchanged. What export and infer build a llamapro checkpoint without its model/
    folder from (export/source.model_config_for); the planner counts with ModelShape.expanded."""
    n = _layer_count(conf)
    why = layout_problem(cfg, conf)
    if why:
        raise UserError(why)
    out = copy.deepcopy(conf)
    out.num_hidden_layers = len(_order(n, groups(cfg)))
    types = getattr(conf, "layer_types", None)
    if types is not None:
        out.layer_types = [types[i] for i in _order(n, groups(cfg))]
    return out


def _order(n_layers: int, n_groups: int) -> list[int]:
    """The base layer each expanded layer is (a copy of), in order."""
    stride = n_layers // n_groups
    out: list[int] = []
    for i in range(n_layers):
        out.append(i)
        if (i + 1) % stride == 0:
            out.append(i)
    return out


def _output_projections(layer: "torch.nn.Module") -> list[tuple[str, "torch.Tensor"]]:
    """(name, parameter) of the layer's output projections: every parameter under a module named
    o_proj/down_proj, or itself named so (fused MoE experts hold down_proj as a parameter)."""
    out = []
    for name, p in layer.named_parameters():
        parts = name.split(".")
        if any(part in OUTPUT_PROJECTIONS for part in parts):
            out.append((name, p))
    return out


def _holder(model: "torch.nn.Module") -> "torch.nn.Module":
    """The module whose `layers` ModuleList holds the decoder layers (the CausalLM's inner model)."""
    import torch
    for m in model.modules():
        if isinstance(getattr(m, "layers", None), torch.nn.ModuleList):
            return m
    raise UserError(f"--train_type llamapro: cannot find the decoder layers of {type(model).__name__} "
                    "(no `layers` list)")


def architecture_problem(model: "torch.nn.Module") -> str | None:
    """Why a decoder layer of this model cannot be made an identity by zeroing (no o_proj or no
    down_proj), or None. Works on a meta-device model (preflight)."""
    layer = _holder(model).layers[0]
    names = [n for n, _ in _output_projections(layer)]
    lacking = [p for p in OUTPUT_PROJECTIONS if not any(p in n.split(".") for n in names)]
    if lacking:
        return (f"--train_type llamapro: {type(layer).__name__} has no {' or '.join(lacking)} (LLaMA-Pro zeroes "
                "the attention's o_proj and the MLP's down_proj of each new block to keep the model's output)")
    return None


def expand(model: "torch.nn.Module", cfg: "RunConfig") -> "torch.nn.Module":
    """Insert the zero-initialised copies into `model` (a causal LM, weights loaded), update the layer
    indices and the config, and leave only the copies trainable. Returns the same model."""
    import torch
    why = layout_problem(cfg, model.config) or architecture_problem(model)
    if why:
        raise UserError(why)
    holder = _holder(model)
    layers = list(holder.layers)
    n, g = len(layers), groups(cfg)
    order = _order(n, g)
    added = set(new_positions(n, g))
    new_list = torch.nn.ModuleList()
    for pos, base in enumerate(order):
        if pos in added:
            block = copy.deepcopy(layers[base])
            with torch.no_grad():
                for _, p in _output_projections(block):
                    p.zero_()
            new_list.append(block)
        else:
            new_list.append(layers[base])
    for pos, layer in enumerate(new_list):
        for m in layer.modules():   # the attention's cache slot (and any module that records its index)
            if isinstance(getattr(m, "layer_idx", None), int):
                m.layer_idx = pos
    holder.layers = new_list
    types = getattr(model.config, "layer_types", None)
    if types is not None:
        model.config.layer_types = [types[i] for i in order]
    model.config.num_hidden_layers = len(new_list)
    for p in model.parameters():
        p.requires_grad_(False)
    for pos in added:
        for p in new_list[pos].parameters():
            p.requires_grad_(True)
    return model


def describe(cfg: "RunConfig", n_layers: int) -> str:
    """One line for the run's log: how many blocks went where."""
    g = groups(cfg)
    return (f"llamapro: {g} new blocks (copies of layers {', '.join(str((i + 1) * (n_layers // g) - 1) for i in range(g))},"
            f" output projections zeroed) -> {n_layers + g} layers; only the new blocks train")


#: The backends llamapro runs on (engine keys). The blocks are inserted into the loaded model before
#: wrapping, so the FSDP2 ones load the whole model on each rank first (models/loading.sharded_weights).
BACKENDS = ("single", "ddp", "fsdp", "hsdp")


def backend_problem(cfg: "RunConfig", choice: Any = None) -> str | None:
    """Why --train_type llamapro cannot run on the chosen backend (a parallel.base.BackendChoice), or None.
    fsdp1 flattens each unit into one tensor of one dtype, and the new blocks' fp32 master weights sit
    next to a 16-bit frozen base; the DeepSpeed stages partition the model while loading (ZeRO-3) or are
    not tested with frozen layers here (ZeRO-2): refused before launch."""
    if cfg.train.train_type != "llamapro" or choice is None or choice.key in BACKENDS:
        return None
    return (f"--train_type llamapro with --parallelism {choice.name}: swiftlite inserts and trains LLaMA-Pro blocks on "
            "single, ddp, fsdp (FSDP2) and hsdp; use --parallelism fsdp (or ddp)")


def check_model(cfg: "RunConfig", source: Any) -> None:
    """Before launch: the model's layer count against the flags, and its layers' output projections
    (a meta-device model: no weights read). A hub model not downloaded yet is checked in the rank."""
    if cfg.train.train_type != "llamapro" or source.kind == "hub":
        return
    import torch

    from swiftlite.models.sharded import _empty_model
    conf = source.config(cfg.model.trust_remote_code, cfg.model.model_revision)
    why = layout_problem(cfg, conf) or architecture_problem(_empty_model(conf, torch.float32, {}))
    if why:
        raise UserError(why)
