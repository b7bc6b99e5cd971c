"""Optimizer, learning-rate schedule and what the optimizer updates, shared by every backend (so their
numerics agree).

What AdamW updates (docs/backends.md, "Precision"): with `--torch-dtype bf16` (or fp16 on DeepSpeed)
the optimizer holds fp32 master weights and fp32 state and the forward/backward compute in 16-bit
(`master_weights`); `--pure-bf16` trains the bf16 parameters themselves. torch is imported inside the
functions: the backend records' checks (`precision_problem`) run at `--dry-run` time.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from swiftlite import dtypes
from swiftlite.config.galore_options import uses_galore

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig


def master_weights(cfg: "RunConfig") -> bool:
    """True when a 16-bit run keeps fp32 parameters and optimizer state and computes in 16-bit
    (the default for --torch-dtype bf16/fp16); False for fp32 runs (nothing to master) and
    --pure-bf16 (the bf16 parameters are trained directly)."""
    return cfg.model.torch_dtype in dtypes.HALF and not getattr(cfg.parallel, "pure_bf16", False)


def trainable_dtype(cfg: "RunConfig") -> str:
    """The dtype of the parameters the optimizer updates: fp32 under master weights, else the run's."""
    return "fp32" if master_weights(cfg) else cfg.model.torch_dtype


def precision_problem(cfg: "RunConfig") -> str | None:
    """--pure-bf16 means bf16 parameters: it needs --torch-dtype bf16."""
    if getattr(cfg.parallel, "pure_bf16", False) and cfg.model.torch_dtype != "bf16":
        return (f"--pure-bf16 trains bf16 parameters directly; this run has --torch-dtype "
                f"{cfg.model.torch_dtype}: add --torch-dtype bf16, or drop --pure-bf16")
    return None


def upcast_trainable(model: "torch.nn.Module") -> list[str]:
    """Cast every trainable 16-bit floating parameter to fp32 (master weights): LoRA adapters (peft
    already keeps them fp32 under a 16-bit base), `--modules-to-save` copies (peft copies them in the
    base's dtype), and a full fine-tune's weights when the loader gave 16-bit ones. Frozen weights
    (a LoRA base, packed 4-bit bytes) are left alone. Returns the names cast."""
    import torch
    cast = []
    for name, p in model.named_parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype in (torch.bfloat16, torch.float16):
            p.data = p.data.float()
            cast.append(name)
    return cast


#: The attribute recording a parameter's number of dimensions before a wrapper replaced its data by a
#: flat shard (FSDP1 with use_orig_params keeps the Parameter objects and gives them 1-D views).
ORIG_NDIM = "_swiftlite_ndim"


def remember_ranks(wrapped: torch.nn.Module, ranks: dict[str, int]) -> None:
    """Give each parameter of a wrapped model the rank it had before wrapping (`ranks`, by name: FSDP1's
    named_parameters gives the original names). A parameter missing from `ranks` would be decayed by its
    shard's rank, silently wrong: an error."""
    for name, p in wrapped.named_parameters():
        clean = name.replace("_fsdp_wrapped_module.", "")
        if clean not in ranks:
            raise RuntimeError(f"parameter {name} of the wrapped model has no recorded rank (known: "
                               f"{next(iter(ranks), None)}, ...)")
        setattr(p, ORIG_NDIM, ranks[clean])


def _ndim(p: torch.Tensor) -> int:
    """The parameter's logical rank: FSDP2's DTensors and unsharded tensors say it themselves; FSDP1's
    flat views carry ORIG_NDIM, DeepSpeed ZeRO-3's partitions their ds_shape."""
    if hasattr(p, ORIG_NDIM):
        return getattr(p, ORIG_NDIM)
    if hasattr(p, "ds_shape"):
        return len(p.ds_shape)
    return p.ndim


def param_groups(model: torch.nn.Module, weight_decay: float, *, lr: float | None = None,
                 lorap_lr_ratio: float | None = None) -> list[dict]:
    """Decay matrices only: biases, norms and 1-D params get no weight decay (the usual LLM recipe).

    LoRA+ (--lorap_lr_ratio, ms-swift's `lorap` optimizer groups, swift/tuners/lora.py): the lora_B
    matrices and the 1-D trainable tensors (biases, DoRA magnitudes) train at lr x ratio, everything
    else at lr. Those groups carry their own "lr", which the schedule scales like the first group's
    (each group's initial lr times the same lambda). The first group is always at the base lr (what
    the engines log as the run's lr). LoRA on embeddings, which ms-swift gives 1e-6, does not occur
    here (--target-modules adapts linear layers only)."""
    buckets: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        fast = lorap_lr_ratio is not None and ("lora_B" in name or _ndim(p) < 2)
        buckets.setdefault((_ndim(p) >= 2, fast), []).append(p)
    groups = []
    for decay, fast in ((True, False), (False, False), (True, True), (False, True)):
        if buckets.get((decay, fast)):
            g = {"params": buckets[(decay, fast)], "weight_decay": weight_decay if decay else 0.0}
            if fast:
                g["lr"] = lr * lorap_lr_ratio
            groups.append(g)
    return groups


#: --optim values (config/schema.OPTIMIZERS): transformers' OptimizerNames spellings (what ms-swift
#: passes on to HF Trainer) of the optimizers torch and transformers ship, plus torch's Muon.
#: Elementwise ones give the same update on a whole tensor, an FSDP shard or a ZeRO flat partition,
#: so they run on every backend; the others need each matrix whole (WHOLE_MATRIX).
WHOLE_MATRIX = {
    "adafactor": "it factors each matrix's second moment into row and column means",
    "muon": "it orthogonalises each matrix's update (Newton-Schulz iterations)",
    "muonclip": "it orthogonalises each matrix's update (Newton-Schulz iterations)",
}


def optim_name(cfg: "RunConfig") -> str:
    """The optimizer the run trains with: ms-swift's --optimizer plugins muon and muonclip win over
    --optim; its galore plugin is GaLore around --optim (galore.build)."""
    plugin = cfg.optim.optimizer
    return plugin if plugin and plugin != "galore" else cfg.optim.optim


def optim_problem(cfg: "RunConfig", choice: "object | None" = None) -> str | None:
    """Why --optim cannot run on this run's backend (`choice`: a parallel.base.BackendChoice), or
    None. Preflight asks before launch; `build_optimizer` asks again in the rank."""
    name = optim_name(cfg)
    if uses_galore(cfg) and choice is not None and any(choice.record.shards):
        return (f"--use_galore: GaLore projects each weight's whole gradient (an SVD of the matrix), and "
                f"--parallelism {choice.name} gives each rank a slice (an FSDP shard or a ZeRO flat partition); "
                "use --parallelism single or ddp")
    if name in WHOLE_MATRIX and choice is not None and any(choice.record.shards):
        flag = "--optimizer" if cfg.optim.optimizer == name else "--optim"
        return (f"{flag} {name}: {WHOLE_MATRIX[name]}, and --parallelism {choice.name} gives each rank a slice "
                "(an FSDP shard or a ZeRO flat partition); use --parallelism ddp/single, or an elementwise "
                "optimizer (adamw_torch_fused, adamw_torch, sgd, adagrad, rmsprop), which runs on every backend")
    if name == "muonclip" and cfg.is_lora and cfg.lora.lorap_lr_ratio is not None:
        return ("--lorap_lr_ratio with --optimizer muonclip: MuonClip's parameter groups are ms-swift's (query/key "
                "matrices, other matrices, the rest) at one learning rate; drop one")
    if name == "muon":
        import torch
        if not hasattr(torch.optim, "Muon"):
            return f"--optim muon needs torch.optim.Muon (torch >= 2.9; this is torch {torch.__version__})"
        l = cfg.lora
        if cfg.is_peft and not cfg.is_lora:
            return (f"--optim muon with --train_type {cfg.train.train_type}: torch.optim.Muon updates 2-D matrices "
                    "only, and this adapter trains other tensors (BOFT's 3-D blocks and scales, AdaLoRA's singular "
                    "values, Bone's block shared by every input block, 3-D with bat); use --optim adamw_torch_fused")
        if not cfg.is_peft or l.use_dora or l.lora_bias != "none" or l.modules_to_save:
            return ("--optim muon: torch.optim.Muon updates 2-D matrices only, and this run also trains "
                    f"{_muon_other_tensors(cfg)}; "
                    "use it for a plain LoRA (every trainable tensor a matrix), or --optim adamw_torch_fused")
    return None


def _muon_other_tensors(cfg: "RunConfig") -> str:
    """What besides 2-D matrices a run that Muon refuses trains, in a phrase."""
    if cfg.train.train_type == "llamapro":
        return "the new blocks' norms (and biases, where the model has them)"
    if cfg.train.train_type == "adapter":
        return "the Houlsby adapters' biases"
    if not cfg.is_peft:
        return "norms, biases and embeddings (a full fine-tune)"
    return "1-D tensors or whole modules (DoRA magnitudes, --lora_bias all, --modules-to-save)"


def build_optimizer(model: torch.nn.Module, cfg: "RunConfig") -> torch.optim.Optimizer:
    """--optim over the trainable parameters (param_groups: weight decay, LoRA+), with HF Trainer's
    arguments for each (`Trainer.get_optimizer_cls_and_kwargs`): AdamW with --adam-beta1/2 and
    --adam-epsilon; sgd, adagrad, rmsprop with the lr alone; adafactor as transformers' Adafactor
    with scale_parameter=False, relative_step=False (the schedule drives its lr); muon as
    torch.optim.Muon with adjust_lr_fn="match_rms_adamw" (the update scaled to AdamW's RMS, 0.2 x
    sqrt(max(rows, cols)), as Moonlight's Muon that ms-swift's `--optimizer muon` runs, so
    --learning-rate means what it means for AdamW), the weight decay of the groups, momentum 0.95,
    Nesterov, 5 Newton-Schulz steps (torch's and Moonlight's defaults).

    adamw_torch_fused (the default, as HF's and ms-swift's) uses torch's fused kernel wherever it
    runs: it updates each tensor in one vectorised pass; the default on CPU is the per-tensor Python
    loop (about ten elementwise passes per parameter: 20 ms of a 100 ms full fine-tuning step of the
    demo model, measured with torch.profiler). Every backend uses the same choice, so their numerics
    still agree with each other; plain tensors, DTensors (FSDP2) and ZeRO's flat partitions all take
    it. It falls back to the loop for devices or dtypes the kernel lacks (HF would fail there).
    adamw_torch is torch's AdamW with its own default implementation (foreach)."""
    import torch

    from swiftlite.errors import UserError
    o = cfg.optim
    why = optim_problem(cfg)
    if why:
        raise UserError(why)
    name = optim_name(cfg)
    if uses_galore(cfg):
        from swiftlite import galore
        return galore.build(model, cfg, name, param_groups(model, o.weight_decay))
    if name == "muonclip":
        from swiftlite import muonclip
        return muonclip.build(model, cfg)
    ratio = cfg.lora.lorap_lr_ratio if cfg.is_lora else None
    lr = cfg.learning_rate
    groups = param_groups(model, o.weight_decay, lr=lr, lorap_lr_ratio=ratio)
    if name == "adamw_torch_fused":
        fused = _fused_supported([p for g in groups for p in g["params"]])
        return torch.optim.AdamW(groups, lr=lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_epsilon,
                                 foreach=False if not fused else None, fused=fused or None)
    if name == "adamw_torch":
        return torch.optim.AdamW(groups, lr=lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_epsilon)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr)
    if name == "adafactor":
        from transformers.optimization import Adafactor
        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False)
    if name == "muon":
        return torch.optim.Muon(groups, lr=lr, adjust_lr_fn="match_rms_adamw")
    from swiftlite.config.schema import OPTIMIZERS
    raise UserError(f"--optim {name}: not one of {', '.join(OPTIMIZERS)}")


def _fused_supported(params: "list[torch.nn.Parameter]") -> bool:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    devices = set(_get_fused_kernels_supported_devices())
    return bool(params) and all(p.device.type in devices and p.is_floating_point() for p in params)


#: transformers' scheduler names (`SchedulerType`) that step on a metric instead of the step count.
#: swiftlite's schedule is a function of the optimizer step (the same on every rank, restored exactly
#: from a checkpoint), so these are refused before launch.
METRIC_SCHEDULERS = {
    "reduce_lr_on_plateau": "it lowers the learning rate when an evaluation metric stops improving",
    "greedy": "it adapts the learning rate to the training loss of each step",
}
#: Arguments `transformers.get_scheduler` fills itself (not --lr-scheduler-kwargs).
_FILLED = {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"}


def warmup_steps(cfg: "RunConfig", total_steps: int) -> int:
    """Warm-up steps as HF computes them (`TrainingArguments.get_warmup_steps`): --warmup-steps when
    > 0, else ceil(total_steps * --warmup-ratio)."""
    o = cfg.optim
    return o.warmup_steps if o.warmup_steps > 0 else math.ceil(total_steps * o.warmup_ratio)


def scheduler_kwargs(cfg: "RunConfig") -> dict:
    """--lr-scheduler-kwargs as a dict: a JSON object given as a flag, or a mapping in a config file
    (HF's `lr_scheduler_kwargs`, e.g. '{"min_lr": 1e-6}' or '{"min_lr_rate": 0.1}')."""
    import json

    from swiftlite.errors import UserError
    raw = cfg.optim.lr_scheduler_kwargs
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UserError(f"--lr-scheduler-kwargs: not valid JSON ({e.msg}): {cfg.optim.lr_scheduler_kwargs}") from None
    if not isinstance(raw, dict):
        raise UserError(f"--lr-scheduler-kwargs must be a JSON object such as '{{\"min_lr\": 1e-6}}', got {raw!r}")
    return dict(raw)


def _hf_optimization(cfg: "RunConfig"):
    """transformers.optimization, imported without bitsandbytes unless the base is quantized: it
    imports transformers.trainer_utils, which imports peft, which imports bitsandbytes (1-3 s and a
    warning on some CPUs, for runs that quantize nothing: models/quant.peft_without_bnb)."""
    from swiftlite.models.quant import peft_without_bnb
    with peft_without_bnb(cfg.quant_bits is not None):
        import transformers.optimization as hf_optimization
    return hf_optimization


def _schedule_function(cfg: "RunConfig"):
    hf = _hf_optimization(cfg)
    return hf.TYPE_TO_SCHEDULER_FUNCTION[hf.SchedulerType(cfg.optim.lr_scheduler)]


def check_scheduler(cfg: "RunConfig", total_steps: int | None = None) -> None:
    """The schedule can be built: a step-driven transformers schedule, --lr-scheduler-kwargs it takes,
    values it accepts (e.g. cosine_with_min_lr needs min_lr or min_lr_rate). Raises a one-line
    UserError. Preflight calls it before any process starts (the total step count is not known
    there yet: --max-steps, else a stand-in); `build_scheduler` checks again with the real one."""
    kwargs = _checked_kwargs(cfg)
    if total_steps is None:
        total_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else 1000
    import torch
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.learning_rate)
    _hf_scheduler(probe, cfg, total_steps, kwargs)


def _checked_kwargs(cfg: "RunConfig") -> dict:
    """--lr-scheduler-kwargs, checked against the arguments of the named schedule."""
    import inspect

    from swiftlite.errors import UserError
    name = cfg.optim.lr_scheduler
    if name in METRIC_SCHEDULERS:
        raise UserError(f"--lr-scheduler {name} is not supported: {METRIC_SCHEDULERS[name]}, and swiftlite's "
                        "schedule is a function of the optimizer step (identical on every rank, resumed "
                        "exactly); use cosine, cosine_with_min_lr, linear, constant_with_warmup, ...")
    kwargs = scheduler_kwargs(cfg)
    try:
        func = _schedule_function(cfg)
    except (ValueError, KeyError):
        raise UserError(f"--lr-scheduler {name}: not a scheduler of the installed transformers") from None
    takes = [p for p in inspect.signature(func).parameters if p not in _FILLED]
    if name in ("constant", "constant_with_warmup"):
        takes = []  # transformers.get_scheduler passes these no extra arguments
    unknown = sorted(set(kwargs) - set(takes))
    if unknown:
        what = f"it takes {', '.join(takes)}" if takes else "it takes none"
        raise UserError(f"--lr-scheduler-kwargs: {name} takes no argument {', '.join(map(repr, unknown))} ({what})")
    return kwargs


def _hf_scheduler(optimizer: torch.optim.Optimizer, cfg: "RunConfig", total_steps: int, kwargs: dict):
    from swiftlite.errors import UserError
    get_scheduler = _hf_optimization(cfg).get_scheduler
    name = cfg.optim.lr_scheduler
    try:
        return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps(cfg, total_steps),
                             num_training_steps=total_steps, scheduler_specific_kwargs=kwargs)
    except (ValueError, TypeError) as e:
        msg = str(e).replace("`lr_scheduler_kwargs`", "--lr-scheduler-kwargs").splitlines()[0]
        raise UserError(f"--lr-scheduler {name}: {msg}") from None


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: "RunConfig", total_steps: int):
    """transformers' schedule (`get_scheduler`) with HF's warm-up count: the learning rate of optimizer
    step k (1-based) is the same as HF Trainer's for the same arguments, peak x lambda(k - 1).

    Every step-driven transformers schedule is a `LambdaLR` over a `functools.partial`, whose
    state_dict is plain data (`last_epoch`, `base_lrs`, `_last_lr`, the partial's empty __dict__):
    the torch engines save it as JSON (scheduler.json) and DeepSpeed, which gets it as a client
    object, in its own checkpoint; the schedule itself is rebuilt from the config at resume."""
    if uses_galore(cfg) and cfg.optim.galore_optim_per_parameter:
        # ms-swift's per-parameter GaLore builds each parameter's schedule over 2 x the run's steps with
        # 2 x --warmup_steps (swift/optimizers/galore/utils.py); the rule refuses --warmup_ratio with it
        return _hf_scheduler(optimizer, cfg.with_values(warmup_steps=2 * cfg.optim.warmup_steps), 2 * total_steps,
                             _checked_kwargs(cfg))
    return _hf_scheduler(optimizer, cfg, total_steps, _checked_kwargs(cfg))
