"""LoRA adapters through peft (LoRA on a 16/32-bit base, QLoRA on a bitsandbytes 4-bit base).

`apply_lora` runs after loading/quantizing and before wrapping (the order in docs/design.md). It checks the
targets against the model first, so a wrong --target-modules is a one-line error listing what the
model has, not a peft traceback, and it initialises the adapter from --seed alone so that every rank
(and every world size) starts from the same adapter.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any, Iterator

from swiftlite.errors import UserError

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig

# Layer types LoRA can adapt, by class name: torch Linear, bitsandbytes' quantized Linear layers,
# and transformers' Conv1D (GPT-2 style), which peft also treats as linear.
LINEAR_TYPES = ("Linear", "Linear4bit", "Linear8bitLt", "Conv1D", "HQQLinear")
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


#: Layer types peft's LoRA adapts besides the linear ones, by class name (peft/tuners/lora/layer.py:
#: an Embedding gets lora_embedding_A/B; convolutions their own LoRA layers).
OTHER_ADAPTABLE = ("Embedding", "Conv1d", "Conv2d", "Conv3d", "MultiheadAttention")


def check_targets(model: "torch.nn.Module", cfg: "RunConfig") -> str | list[str]:
    """The target_modules value for peft, after checking it against the model. `all-linear` is peft's
    (every linear layer but the output head); names next to it (`all-linear embed_tokens lm_head`, as
    in ms-swift) add those modules: peft adapts an Embedding (embed_tokens) with an embedding LoRA
    and lm_head as a Linear. A name that is not in the model, or names a layer peft cannot adapt, is
    a one-line error saying which and what the model has."""
    lc = cfg.lora
    paths = linear_module_paths(model)
    body = [p for p in paths if p.rsplit(".", 1)[-1] not in HEAD_NAMES]
    if not body:
        raise UserError(f"--train-type {cfg.train.train_type}: model {cfg.model.model} has no linear layers to "
                        "adapt (LoRA targets torch Linear / bitsandbytes / Conv1D layers; found none besides "
                        "the output head)")
    names = sorted({p.rsplit(".", 1)[-1] for p in body})
    named = [t for t in lc.target_modules if t != "all-linear"]
    all_linear = "all-linear" in lc.target_modules
    modules = {n: m for n, m in model.named_modules() if n}
    problems = []
    for t in named:
        hits = [m for p, m in modules.items() if _matches(t, p)]
        if not hits:
            problems.append(f"{t} is not a module of {cfg.model.model}")
            continue
        kinds = sorted({type(m).__name__ for m in hits if not (_is_linear(m) or type(m).__name__ in OTHER_ADAPTABLE)})
        if kinds:
            problems.append(f"{t} is a {'/'.join(kinds)}, which LoRA cannot adapt (peft adapts Linear, Embedding "
                            f"and Conv layers; train it in full with --modules-to-save {t})")
    if problems:
        adaptable = sorted({p.rsplit(".", 1)[-1] for p, m in modules.items()
                            if _is_linear(m) or type(m).__name__ in OTHER_ADAPTABLE})
        raise UserError(f"--target-modules {' '.join(lc.target_modules)}: {'; '.join(problems)} (its adaptable "
                        f"modules: {', '.join(adaptable)}; or all-linear)")
    if lc.modules_to_save:
        all_paths = list(modules)
        absent = [t for t in lc.modules_to_save if not any(_matches(t, p) for p in all_paths)]
        if absent:
            tops = sorted({p.rsplit(".", 1)[-1] for p in all_paths if not p.rsplit(".", 1)[-1].isdigit()})
            raise UserError(f"--modules-to-save {' '.join(absent)}: no such module in {cfg.model.model} "
                            f"(its modules: {', '.join(tops)})")
    from swiftlite.models.source import is_moe
    moe = is_moe(getattr(model, "config", None))
    # peft's own all-linear finds torch and bitsandbytes Linear layers, not HQQ's: list them by name
    hqq = any(type(m).__name__ == "HQQLinear" for m in modules.values())
    if not named and not moe and not hqq:
        return "all-linear"
    if not named:
        return sorted(names)
    # peft takes "all-linear" only as the whole value: with extra names, all-linear's layer names are
    # listed. So they are for a mixture of experts, whose fused expert weights (3-D parameters, not
    # Linear layers) peft's all-linear would also wrap, without dropout: ms-swift's all-linear is the
    # Linear layers (attention, the router, shared experts), and so is this one.
    return sorted(set(names) | set(named)) if all_linear else list(named)


def _adapted_linears(model: Any, targets: str | list[str]) -> Iterator[tuple[str, Any]]:
    """(name, module) of each Linear the adapter will wrap (`check_targets`' resolved targets)."""
    for name, m in model.named_modules():
        if not name or not _is_linear(m) or not hasattr(m, "in_features"):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if (leaf not in HEAD_NAMES) if targets == "all-linear" else any(_matches(t, name) for t in targets):
            yield name, m


def check_boft_blocks(model: Any, cfg: "RunConfig", targets: str | list[str]) -> None:
    """peft's condition on BOFT's blocks (tuners/boft/layer.update_layer), checked before launch on the
    meta model: each adapted Linear's input width is a multiple of --boft_block_size (or of
    --boft_block_num). A one-line error naming the first layer that is not."""
    lc = cfg.lora
    for name, m in _adapted_linears(model, targets):
        size, num, width = lc.boft_block_size, lc.boft_block_num, m.in_features
        if (size and width % size) or (num and width % num):
            flag = f"--boft_block_size {size}" if size else f"--boft_block_num {num}"
            raise UserError(f"{flag}: {name} takes {width} inputs, not a multiple of it (peft's BOFT splits each "
                            f"adapted layer's inputs into equal blocks)")


def check_bone_blocks(model: Any, cfg: "RunConfig", targets: str | list[str]) -> None:
    """peft MiSS's condition on each adapted Linear against --reft_rank (models/tuners.check_bone_blocks),
    before launch on the meta model: a one-line error naming the first layer that fails it."""
    from swiftlite.models.tuners import check_bone_blocks as problem
    lc = cfg.lora
    for name, m in _adapted_linears(model, targets):
        why = problem(m.in_features, m.out_features, lc.reft_rank, lc.init_weights)
        if why:
            raise UserError(f"--reft_rank {lc.reft_rank}" + (" --init_weights bat" if lc.init_weights == "bat" else "")
                            + f": {name} {why}")


def check_tuner(model: Any, cfg: "RunConfig", targets: str | list[str]) -> None:
    """What the tuner needs of the model and this machine, before launch (launch/preflight.py)."""
    if cfg.train.train_type == "bone":
        check_bone_blocks(model, cfg, targets)
    if cfg.train.train_type == "boft":
        check_boft_blocks(model, cfg, targets)
        from swiftlite.models.quant import peft_without_bnb
        from swiftlite.models.tuners import boft_layers
        with peft_without_bnb(quantized=False), boft_layers(cfg.lora.boft_n_butterfly_factor,
                                                            "--boft_n_butterfly_factor"):
            pass   # a BOFT base is never quantized (config/rules_tuners.py)


def apply_lora(model: "torch.nn.Module", cfg: "RunConfig", total_steps: int | None = None,
               grad_rows: list[dict] | None = None) -> "torch.nn.Module":
    """Wrap with the run's peft adapter (LoRA, BOFT, AdaLoRA or Bone: models/tuners.peft_config); a target
    list that matches nothing is an error listing what exists. `total_steps`: AdaLoRA's schedule;
    `grad_rows`: the training rows LoRA-GA estimates its gradients on (models/lora_ga.py)."""
    from swiftlite.models.quant import peft_without_bnb
    with peft_without_bnb(quantized=cfg.quant.quant_bits is not None):
        return _wrap(model, cfg, total_steps, grad_rows)


def _task_type(cfg: "RunConfig") -> str:
    """peft's task type: SEQ_CLS for a reward model (peft then trains its `score` head in full, as a
    module to save, beside the adapter), CAUSAL_LM otherwise."""
    from swiftlite.config.tasks import reward_model
    return "SEQ_CLS" if reward_model(cfg) else "CAUSAL_LM"


def _wrap(model: "torch.nn.Module", cfg: "RunConfig", total_steps: int | None,
          grad_rows: list[dict] | None = None) -> "torch.nn.Module":
    import torch
    from peft import get_peft_model

    from swiftlite.models.tuners import building, peft_config

    from swiftlite.models.quant import disable_cpu_repack
    disable_cpu_repack(model)  # trap 1, whatever path loaded the quantized base (preset or folder)
    lc = cfg.lora
    targets = check_targets(model, cfg)
    if cfg.quant_method == "bnb" and cfg.quant.quant_bits == 4 and \
            not any(type(m).__name__ == "Linear4bit" for m in model.modules()):
        raise UserError(f"--train-type {cfg.train.train_type}: no layer of {cfg.model.model} was quantized to "
                        "4-bit (bitsandbytes replaced no linear layer); use --lora")
    from swiftlite.models.lora_ga import preprocess, uses_lora_ga
    if uses_lora_ga(cfg) and targets == "all-linear":   # peft's preprocess_loraga reads names, not all-linear
        targets = sorted({p.rsplit(".", 1)[-1] for p in linear_module_paths(model)
                          if p.rsplit(".", 1)[-1] not in HEAD_NAMES})
    conf = peft_config(cfg, targets, _task_type(cfg), total_steps)
    # The LoRA A matrices are random: draw them from --seed alone, so every rank builds the same
    # adapter (the trainer seeds each rank differently for dropout; sharded backends keep each rank's
    # own slice, so per-rank inits would mix) and a 2-process run starts where a 1-process run does.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing`: its warning, not the user's
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(cfg.train.seed)
        from swiftlite.models.sharded import adapters_stay_real, deferred
        if uses_lora_ga(cfg):   # the gradients get_peft_model initialises A and B from (same seed: same SVD)
            preprocess(model, conf, cfg, grad_rows)
        try:
            with adapters_stay_real() if deferred(model) is not None else contextlib.nullcontext(), building(cfg):
                peft_model = get_peft_model(model, conf)
        except ValueError as e:
            flag = ("--boft_block_size/--boft_block_num" if cfg.train.train_type == "boft" and "boft" in str(e)
                    else f"--reft_rank {cfg.lora.reft_rank}" if cfg.train.train_type == "bone"
                    and ("`r`" in str(e) or "blocks" in str(e)) else "--target-modules")
            raise UserError(f"{flag}: {str(e).splitlines()[0]}") from None
    if mutates_base(cfg):
        keep_initial_adapter(peft_model)
    return peft_model


# -- LoRA variants (--use_dora, --use_rslora, --init_weights, --lora_bias) ----------------------------

def mutates_base(cfg: "RunConfig") -> bool:
    """PiSSA and OLoRA move the principal part of each adapted base weight into A0, B0, LoRA-GA a
    part made of the gradient's singular vectors, and each leaves the residual W - s * B0 @ A0 in the
    base (peft), so the base in the model folder is no longer the one the adapter is trained against."""
    from swiftlite.config.tuner_options import moves_base
    return cfg.is_lora and moves_base(cfg.lora.init_weights)


def reads_base(cfg: "RunConfig") -> str | None:
    """The flag whose adapter peft computes from the base weights when it builds it (DoRA's magnitude
    is the norm of each weight row; PiSSA/OLoRA decompose the weight), or None."""
    if not cfg.is_lora:
        return None
    if cfg.lora.use_dora:
        return "--use_dora"
    if mutates_base(cfg) or cfg.lora.init_weights == "loftq":
        return f"--init_weights {cfg.lora.init_weights}"
    return None


def check_skeleton(cfg: "RunConfig", skeleton: str | None) -> None:
    """A skeleton (models/sharded.py) has meta weights when peft builds the adapter: an adapter peft
    computes from the base would be computed from nothing. Refused before launch with the way out."""
    flag = reads_base(cfg)
    if skeleton is None or flag is None:
        return
    if skeleton == "fill" and cfg.lora.init_weights == "loftq" and not cfg.lora.use_dora:
        return   # LoftQ runs after the 4-bit base is filled (models/loading.prepare_model)
    if cfg.quant_bits is not None and cfg.lora.use_dora and skeleton == "fill":
        raise UserError("--use_dora with a 4-bit base: peft builds DoRA's magnitudes from the base weights, and "
                        "this backend fills the 4-bit base layer by layer after the adapter is built; use "
                        "--parallelism fsdp --sharded_loading false on 2+ processes (the whole 4-bit model loads first), or "
                        "--train-type lora")
    if skeleton == "shard" and cfg.quant_bits is None:
        way = "add --sharded_loading false (each rank loads the whole model, then shards it)"
    else:
        way = "train it on --parallelism single/ddp with --train-type lora (a 16-bit base), or drop the flag"
    raise UserError(f"{flag}: peft computes this adapter from the base weights, which "
                    f"{'sharded loading' if skeleton == 'shard' else 'layer-by-layer 4-bit loading'} has not "
                    f"loaded yet when the adapter is built; {way}")


def apply_loftq(model: "torch.nn.Module", cfg: "RunConfig", folder: str | None) -> None:
    """--init_weights loftq, as peft's `replace_lora_weights_loftq` (one LoftQ iteration on a
    bitsandbytes 4-bit base): each 4-bit layer's A and B become the best rank-r fit (SVD, peft's
    `_low_rank_decomposition`) of W - dequant(quant(W)), W read from the model's safetensors files
    (peft's loader: one file or a sharded index), so the quantized base plus the adapter starts as
    close to the 16-bit model as rank r allows. The base stays the plain 4-bit quantization of the
    folder's weights: checkpoints, adapters and export work as for any QLoRA run. Two differences
    from peft's function, which computes on CUDA or XPU only and sets B A to the fit: this runs on
    the weights' own device, and A and B are divided by sqrt(lora_alpha / r), so that the adapter's
    output, scale included, is the fit (peft's equals it only when lora_alpha = r)."""
    if folder is None:
        raise UserError(f"--init_weights loftq reads the 16-bit weights from the model's safetensors files; "
                        f"--model {cfg.model.model} is a built-in preset (weights drawn from --seed, no files): "
                        "give a model folder or hub id")
    import math

    import bitsandbytes.functional as bnbf
    import torch
    from peft.tuners.lora.bnb import Linear4bit
    from peft.utils.loftq_utils import _low_rank_decomposition, _SafetensorLoader
    try:
        loader = _SafetensorLoader(model, folder)
    except (ValueError, OSError) as e:
        raise UserError(f"--init_weights loftq: {str(e).splitlines()[0]}") from None
    prefix, found = "base_model.model.", False
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, Linear4bit):
                continue
            found = True
            base = module.get_base_layer().weight
            deq = bnbf.dequantize_4bit(base.data, base.quant_state).float()
            w = loader.get_tensor(name.removeprefix(prefix) + ".weight").to(deq.device, torch.float32)
            fit = _low_rank_decomposition(w - deq, reduced_rank=module.r["default"])
            root = math.sqrt(module.scaling["default"])
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            a.data = (fit["R"] / root).to(a.dtype)
            b.data = (fit["L"] / root).to(b.dtype)
    if not found:
        raise UserError("--init_weights loftq: no 4-bit LoRA layer to initialise (bitsandbytes replaced none)")


#: peft's saved names of an adapter's initial A0/B0, kept on the peft model by `apply_lora`.
INITIAL_ADAPTER = "swiftlite_initial_adapter"


def keep_initial_adapter(peft_model: "torch.nn.Module") -> None:
    """Keep a CPU copy of PiSSA's/OLoRA's initial A0, B0 (peft's saved names) on the model: every
    adapter written later is converted with it into a plain LoRA on the original base (`as_plain_lora`)."""
    from peft import get_peft_model_state_dict
    sd = get_peft_model_state_dict(peft_model)
    setattr(peft_model, INITIAL_ADAPTER,
            {k: v.detach().float().cpu().clone() for k, v in sd.items() if ".lora_A." in k or ".lora_B." in k})


def as_plain_lora(config: dict, sd: dict, initial: dict) -> tuple[dict, dict]:
    """A PiSSA/OLoRA adapter (trained A, B against the residual base) as a plain LoRA adapter of the
    original base, as peft's `save_pretrained(path_initial_model_for_weight_conversion=...)` writes it
    (peft LoraModel.subtract_mutated_init): delta W = s (B A - B0 A0) = s [B | -B0] [A ; A0], so rank 2r,
    and lora_alpha doubled (x sqrt 2 under rsLoRA) to keep the scale; init_lora_weights becomes true.
    Returns (config, tensors)."""
    import torch
    out = dict(sd)
    for k, a0 in initial.items():
        if k not in sd:
            raise RuntimeError(f"adapter tensor {k} missing from the saved adapter")
        t = sd[k]
        if ".lora_A." in k:
            out[k] = torch.cat([t.float(), a0], dim=0).to(t.dtype)
        else:
            out[k] = torch.cat([t.float(), -a0], dim=1).to(t.dtype)
    conf = dict(config)
    conf["r"] = conf["r"] * 2
    conf["lora_alpha"] = conf["lora_alpha"] * (2 ** 0.5 if conf.get("use_rslora") else 2)
    conf["init_lora_weights"] = True
    return conf, out
