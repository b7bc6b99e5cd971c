"""bitsandbytes quantization of the base model (4-bit nf4/fp4 or 8-bit)."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig


def compute_dtype(cfg: "RunConfig") -> "torch.dtype":
    """Matmul dtype of the 4-bit layers: the run's dtype (bf16 on GPUs, fp32 on CPU tests)."""
    from swiftlite.models.loading import torch_dtype
    return torch_dtype(cfg.model.torch_dtype)


def bnb_config(cfg: "RunConfig") -> Any:
    """transformers' BitsAndBytesConfig for the run.

    The 4-bit storage dtype is the compute dtype (not uint8): FSDP and ZeRO-3 shard parameters of
    one dtype, and a uint8 storage would make the packed weights unshardable next to bf16 ones.
    """
    from transformers import BitsAndBytesConfig
    quiet_bnb_import()
    if cfg.quant.quant_bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    dt = compute_dtype(cfg)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=cfg.quant.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=cfg.quant.bnb_4bit_use_double_quant,
                              bnb_4bit_compute_dtype=dt, bnb_4bit_quant_storage=dt)


def quiet_bnb_import() -> None:
    """bitsandbytes warns at import on AVX512-BF16 CPUs that the optional `kernels` package is missing
    (it falls back to its own CPU kernels): noise on every rank of every run, so silence that logger."""
    import logging
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def quantize_in_place(model: "torch.nn.Module", cfg: "RunConfig") -> "torch.nn.Module":
    """Quantize a model built from a config (built-in presets) through the same from_pretrained path
    a real checkpoint takes, so tests exercise exactly what users run."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM
    from swiftlite.models.loading import torch_dtype
    with tempfile.TemporaryDirectory(prefix="swiftlite-q-") as tmp:
        # Not model.save_pretrained: under an initialised process group transformers writes only on
        # rank 0, and every rank quantizes its own copy into its own temp folder.
        model.config.save_pretrained(tmp)
        save_model(model, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        from transformers.utils import logging as hf_logging
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # an internal round trip, not a user-visible load
        try:
            q = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch_dtype(cfg.model.torch_dtype),
                                                     quantization_config=bnb_config(cfg))
        finally:
            if bar:
                hf_logging.enable_progress_bar()
    q.config.use_cache = False
    # Like a preset built from its config: no source path (the temp folder is gone; peft would look
    # it up on the hub when writing the adapter).
    q.config.name_or_path = ""
    q.name_or_path = ""
    disable_cpu_repack(q)
    return q


def disable_cpu_repack(model: "torch.nn.Module") -> None:
    """Trap 1 (DESIGN.md): on CPUs with AVX512-BF16, bitsandbytes repacks 4-bit weights in place on
    an eval()+no_grad forward, which silently corrupts later sharded training steps. Turn it off."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
