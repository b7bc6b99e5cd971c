"""HQQ quantization of the base model (`--quant_method hqq --quant_bits 1|2|3|4|8`, ms-swift's qlora/hqq.sh).

ms-swift passes transformers' `HqqConfig(nbits=--quant_bits, axis=--hqq_axis)` to from_pretrained. The
transformers this project pins (5.x) no longer loads HQQ that way ("QuantizationMethod.HQQ is not
available yet"), so the same quantization is done with the hqq package itself, after the 16-bit load:
each Linear of the decoder becomes an `hqq.core.quantize.HQQLinear` with transformers' HqqConfig
defaults (group size 64, axis 1 unless --hqq_axis, hqq's half-quadratic optimisation of the zero
points and scales, no quantized metadata). The output head (`lm_head`) and a reward model's `score`
stay 16-bit, as transformers leaves them. peft adapts HQQLinear layers with its own HQQ LoRA layer
(peft/tuners/lora/hqq.py): LoRA, DoRA and the other LoRA variants train on top, the base stays frozen.

HQQ needs no calibration data and runs on any device (its PyTorch backend dequantizes per forward),
so unlike bitsandbytes' 4-bit it works the same on a CPU. Its layers are not tensors FSDP or ZeRO-3
can shard (the packed weights and their metadata dict are separate objects), so the backends are those
that keep every parameter whole on each rank: one process, DDP, ZeRO-1/2 (with or without optimizer
offload: only the adapter's states move). `hqq_problem` refuses the others before launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swiftlite.errors import UserError

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig

from swiftlite.config.rules import HQQ_BITS as BITS  # noqa: E402,F401  (--quant_bits values HQQ takes)

#: transformers' HqqConfig default group size (weights sharing one scale and zero point).
GROUP_SIZE = 64
#: transformers' HqqConfig default axis when none is given (the axis faster backends need).
DEFAULT_AXIS = 1
#: Layers left 16-bit: the output head (transformers never quantizes it) and a reward model's head.
KEEP = ("lm_head", "score")


def available() -> bool:
    import importlib.util
    return importlib.util.find_spec("hqq") is not None


def missing_package() -> str:
    return ("--quant_method hqq needs the hqq package (pip install hqq, or swiftlite's hqq extra), as in "
            "ms-swift")


def quant_config(cfg: "RunConfig") -> dict:
    """hqq's quantization settings for the run (transformers' HqqConfig defaults, ms-swift's flags)."""
    from hqq.core.quantize import BaseQuantizeConfig
    axis = DEFAULT_AXIS if cfg.quant.hqq_axis is None else cfg.quant.hqq_axis
    return BaseQuantizeConfig(nbits=cfg.quant_bits, group_size=GROUP_SIZE, axis=axis)


def quantize(model: "torch.nn.Module", cfg: "RunConfig") -> "torch.nn.Module":
    """Replace each Linear but the heads with an HQQLinear of --quant_bits, in place; the model's
    config records it (`quantization_config`, which peft and the checkpoint read)."""
    import torch
    from hqq.core.quantize import HQQBackend, HQQLinear

    from swiftlite.dtypes import torch_dtype
    HQQLinear.set_backend(HQQBackend.PYTORCH)   # dequantize + matmul: the backend every device has
    qc = quant_config(cfg)
    dtype = torch_dtype(cfg.model.torch_dtype)
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in KEEP]
    odd = [(n, m.weight.numel()) for n, m in targets if m.weight.numel() % GROUP_SIZE]
    if odd:
        raise UserError(f"--quant_method hqq: {odd[0][0]} has {odd[0][1]} weights, not a multiple of HQQ's group "
                        f"size {GROUP_SIZE}; use --quant_method bnb")
    device = next(model.parameters()).device
    for name, lin in targets:
        owner, _, leaf = name.rpartition(".")
        parent = model.get_submodule(owner) if owner else model
        setattr(parent, leaf, HQQLinear(lin, qc, del_orig=True, compute_dtype=dtype, device=str(device)))
    model.config.quantization_config = {"quant_method": "hqq", "nbits": cfg.quant_bits, "group_size": GROUP_SIZE,
                                        "axis": qc["weight_quant_params"]["axis"]}
    return model


def is_hqq_layer(module: Any) -> bool:
    return type(module).__name__ == "HQQLinear"


def dequantized_weight(module: Any) -> "torch.Tensor":
    """The weight an HQQLinear's forward multiplies by (out x in, its compute dtype)."""
    return module.dequantize().reshape(module.out_features, module.in_features).detach().cpu()


def hqq_problem(cfg: "RunConfig", choice: Any = None) -> str | None:
    """Why this run cannot quantize its base with HQQ (the package, the backend), or None. Preflight asks
    before launch with the resolved backend (`choice`: a parallel.base.BackendChoice)."""
    if cfg.quant_method != "hqq":
        return None
    if not available():
        return missing_package()
    if choice is not None and choice.record.shards[0]:
        return (f"--quant-method hqq with --parallelism {choice.name}: HQQ layers keep their packed weights and "
                "their scales in separate objects, which FSDP and ZeRO-3 cannot shard; use --parallelism single, "
                "ddp or zero2 (whole parameters on each rank), or --quant-method bnb (which every backend shards)")
    return None
