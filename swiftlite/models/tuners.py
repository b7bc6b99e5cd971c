"""Which peft adapter a run trains: the one place that turns --train_type and its options into a peft
config (LoraConfig, with LoRA-GA's LoraGAConfig, BOFTConfig, AdaLoraConfig or MissConfig), as ms-swift's
prepare_adapter does (swift/pipelines/train/tuner.py). models/lora.py checks the targets, seeds and wraps.

--train_type bone: ms-swift builds peft's BoneConfig(target_modules, r=--reft_rank, init_weights). peft
renamed Bone to MiSS (BoneConfig is gone from peft 0.21): the same block, r rows x out_features, added to
each adapted Linear's weight tiled over its input columns (init true: zeros; false: random; bat: r x r
blocks, a non-linear update). MissConfig takes the same three values (true/false as booleans).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

from swiftlite.errors import UserError

if TYPE_CHECKING:
    from swiftlite.config import RunConfig


def peft_config(cfg: "RunConfig", targets: str | list[str], task_type: str, total_steps: int | None) -> Any:
    """The peft config of this run's adapter. `total_steps` (the run's optimizer steps) is AdaLoRA's
    budget schedule (peft total_step); the other tuners ignore it."""
    lc, t = cfg.lora, cfg.train.train_type
    shared = dict(target_modules=targets, modules_to_save=lc.modules_to_save or None, task_type=task_type)
    if t == "boft":
        from peft import BOFTConfig
        # ms-swift passes no bias: peft's default none (--lora_bias all is refused by a rule)
        return BOFTConfig(boft_block_size=lc.boft_block_size, boft_block_num=lc.boft_block_num,
                          boft_n_butterfly_factor=lc.boft_n_butterfly_factor, boft_dropout=lc.boft_dropout, **shared)
    if t == "bone":
        from peft import MissConfig
        # ms-swift passes no dropout, bias or mini_r: peft's defaults (0, none, 1); the LoRA options for them
        # are refused with bone (config/rules_tuners.py)
        return MissConfig(r=lc.reft_rank, init_weights=bone_init_weights(lc.init_weights), **shared)
    if t == "adalora":
        from peft import AdaLoraConfig
        if not total_steps:
            raise RuntimeError("AdaLoRA's budget schedule needs the run's optimizer steps (total_steps)")
        try:
            return AdaLoraConfig(target_r=lc.adalora_target_r, init_r=lc.adalora_init_r, tinit=lc.adalora_tinit,
                                 tfinal=lc.adalora_tfinal, deltaT=lc.adalora_deltaT, beta1=lc.adalora_beta1,
                                 beta2=lc.adalora_beta2, orth_reg_weight=lc.adalora_orth_reg_weight,
                                 total_step=total_steps, lora_alpha=lc.lora_alpha, lora_dropout=lc.lora_dropout,
                                 bias=lc.lora_bias, **shared)
        except ValueError as e:   # the schedule against the run's steps (preflight asks too: check_schedule)
            raise UserError(f"--adalora_tinit {lc.adalora_tinit} --adalora_tfinal {lc.adalora_tfinal} with "
                            f"{total_steps} optimizer steps: {str(e).splitlines()[0]}") from None
    from peft import LoraConfig
    ga = None
    if lc.init_weights == "lora-ga":
        from peft import LoraGAConfig
        ga = LoraGAConfig(direction=lc.lora_ga_direction, scale=lc.lora_ga_scale, stable_gamma=lc.lora_ga_stable_gamma)
    return LoraConfig(r=lc.lora_rank, lora_alpha=lc.lora_alpha, lora_dropout=lc.lora_dropout, bias=lc.lora_bias,
                      use_dora=lc.use_dora, use_rslora=lc.use_rslora, init_lora_weights=init_lora_weights(cfg),
                      lora_ga_config=ga, **shared)


def init_lora_weights(cfg: "RunConfig") -> bool | str:
    """--init_weights as peft's init_lora_weights: true/false are booleans, the rest peft's names
    (ms-swift's lora-ga is peft's lora_ga)."""
    w = cfg.lora.init_weights
    if w == "loftq":
        return True   # peft's LoftQ for a bitsandbytes base replaces these later (models/lora.apply_loftq)
    return {"true": True, "false": False, "lora-ga": "lora_ga"}.get(w, w)


def bone_init_weights(value: str) -> bool | str:
    """--init_weights as MissConfig's init_weights: true/false are booleans, bat is peft's name."""
    return {"true": True, "false": False}.get(value, value)


def check_bone_blocks(in_features: int, out_features: int, rank: int, init_weights: str) -> str | None:
    """peft's condition on a MiSS layer (tuners/miss/layer.update_layer) as the line to refuse it with, or
    None: r at most the input width (true/false pad the last column block), and with bat both widths
    split into r x r blocks."""
    if rank > in_features:
        return f"takes {in_features} inputs, fewer than the rank (peft's MiSS: r <= in_features)"
    if init_weights == "bat" and (in_features % rank or out_features % rank):
        return (f"is {out_features} x {in_features}, not a whole number of {rank} x {rank} blocks (peft's MiSS bat "
                "splits each weight into r x r blocks)")
    return None


@contextlib.contextmanager
def building(cfg: "RunConfig") -> Iterator[None]:
    """The context peft builds this run's adapter in. BOFT: peft's layers try to compile their fbd_cuda
    extension (a CUDA kernel) once per adapted layer, and fall back to block-diagonal matmuls; without
    a CUDA device it cannot load, so it is not attempted (each attempt costs seconds and a warning).
    Where it does not load, peft quietly trains butterfly factor 1: a larger --boft_n_butterfly_factor
    is refused instead."""
    if cfg.train.train_type != "boft":
        yield
        return
    with boft_layers(cfg.lora.boft_n_butterfly_factor, "--boft_n_butterfly_factor"):
        yield


@contextlib.contextmanager
def boft_layers(butterfly_factor: int, flag: str) -> Iterator[None]:
    """Where peft builds BOFT layers (training, export): its fbd_cuda extension is not attempted
    without a CUDA device, and a butterfly factor peft would silently drop is refused (`building`)."""
    import torch
    from peft.tuners.boft import layer as boft_layer
    saved = boft_layer.get_fbd_cuda
    if not torch.cuda.is_available():
        boft_layer.get_fbd_cuda = lambda: None
    try:
        if butterfly_factor > 1 and boft_layer.get_fbd_cuda() is None:
            raise UserError(f"{flag} {butterfly_factor}: peft builds butterfly factors above 1 only with its "
                            "fbd_cuda CUDA extension (a CUDA GPU, nvcc and ninja), which does not load here; peft "
                            "would silently use factor 1: use 1")
        yield
    finally:
        boft_layer.get_fbd_cuda = saved


def check_schedule(cfg: "RunConfig", total_steps: int) -> None:
    """AdaLoRA's schedule against the run's optimizer steps (known once the data is planned), before
    launch: peft's own config check, as a one-line error (`peft_config`)."""
    if cfg.train.train_type == "adalora":
        from swiftlite.models.quant import peft_without_bnb
        with peft_without_bnb(quantized=False):
            peft_config(cfg, "all-linear", "CAUSAL_LM", total_steps)


#: swiftlite's own tuners (no peft), applied to the model before the backend wraps it (`apply_own`).
OWN_TUNERS = ("llamapro", "adapter")
#: Those whose model cannot be a skeleton (models/loading.sharded_weights): --train_type -> why its model is
#: loaded whole on each rank. The adapter can: its modules are created real (drawn under --seed) next to the
#: meta base, as peft's LoRA layers are, and materialize keeps them (models/sharded.py).
WHOLE_MODEL_TUNERS = {"llamapro": "inserts copies of loaded layers, which the checkpoint does not name"}


def apply_own(model: Any, cfg: "RunConfig", world: Any = None) -> Any:
    """The loaded `model` with this run's own tuner applied: LLaMA-Pro's new blocks (models/llamapro.py) or
    Houlsby adapters (models/adapter.py), only those left trainable; each says what it did in one line
    (rank 0)."""
    log = print if world is None or world.is_main else None
    if cfg.train.train_type == "llamapro":
        from swiftlite.models.llamapro import describe, expand
        if log:
            log(describe(cfg, model.config.num_hidden_layers), flush=True)
        return expand(model, cfg)
    from swiftlite.models.adapter import attach, describe as describe_adapter
    model = attach(model, cfg)
    if log:
        log(describe_adapter(cfg, model), flush=True)
    return model
