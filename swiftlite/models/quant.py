"""bitsandbytes quantization of the base model (4-bit nf4/fp4 or 8-bit)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig


def compute_dtype(cfg: "RunConfig") -> "torch.dtype":
    """Matmul dtype of the 4-bit layers: the run's dtype (bf16 on GPUs, fp32 on CPU tests)."""
    from swiftlite import dtypes
    return dtypes.torch_dtype(cfg.model.torch_dtype)


def bnb_config(cfg: "RunConfig") -> Any:
    """transformers' BitsAndBytesConfig for the run.

    The 4-bit storage dtype is the compute dtype (not uint8): FSDP and ZeRO-3 shard parameters of
    one dtype, and a uint8 storage would make the packed weights unshardable next to bf16 ones.
    """
    from transformers import BitsAndBytesConfig
    quiet_bnb_import()
    from swiftlite.config.tasks import reward_model
    # transformers keeps the output embedding (lm_head) unquantized; a reward model's head is `score`,
    # which must stay a trainable full-precision layer too (peft trains it as a module to save)
    skip = {"llm_int8_skip_modules": ["score"]} if reward_model(cfg) else {}
    if cfg.quant.quant_bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    dt = compute_dtype(cfg)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=cfg.quant.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=cfg.quant.bnb_4bit_use_double_quant,
                              bnb_4bit_compute_dtype=dt, bnb_4bit_quant_storage=dt, **skip)


def quiet_bnb_import() -> None:
    """bitsandbytes, at import on AVX512-BF16 CPUs, asks the `kernels` package (a dependency of
    transformers since 5.25) for a hub-built 4-bit CPU kernel and falls back to its own when it cannot
    have one. Both sides log about it on every rank of every run: bitsandbytes that the kernel is missing,
    `kernels` that it skips its publisher check offline. Neither changes what trains, so both loggers
    are silenced below ERROR."""
    import logging
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    logging.getLogger("kernels").setLevel(logging.ERROR)


@contextlib.contextmanager
def peft_without_bnb(quantized: bool) -> Iterator[None]:
    """Import and use peft without bitsandbytes unless the base is `quantized`.

    peft imports bitsandbytes whenever it is installed (at import, and again in every
    get_peft_model / PeftModel.from_pretrained to look for quantized layers). That import costs
    1-3 s (bitsandbytes builds torch.compile'd kernels, pulling in inductor) and a warning on some
    CPUs, on every rank of runs that quantize nothing. Inside this block bitsandbytes is hidden (a
    None in sys.modules makes find_spec answer "not installed"); on the way out it is visible again
    and peft's and transformers' cached "is it installed" answers are cleared, so a quantized
    model later in the same process still finds it."""
    quiet_bnb_import()
    hide = not quantized and "bitsandbytes" not in sys.modules
    if hide:
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    try:
        import peft  # noqa: F401  (imported here, while bitsandbytes is hidden)
        yield
    finally:
        if hide:
            if "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
                del sys.modules["bitsandbytes"]
            _clear_bnb_caches()


def _clear_bnb_caches() -> None:
    try:
        from peft import import_utils as peft_imports
        for fn in (peft_imports.is_bnb_available, peft_imports.is_bnb_4bit_available):
            getattr(fn, "cache_clear", lambda: None)()
        from transformers.utils import import_utils as hf_imports
        getattr(hf_imports.is_bitsandbytes_available, "cache_clear", lambda: None)()
    except ImportError:
        pass


def quantize_in_place(model: "torch.nn.Module", cfg: "RunConfig") -> "torch.nn.Module":
    """Quantize a model built from a config (built-in presets) through the same from_pretrained path
    a real checkpoint takes, so tests exercise exactly what users run."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from swiftlite.dtypes import torch_dtype
    # a reward model (rlhf rm) is reloaded as what it is, score head included
    auto = AutoModelForSequenceClassification if type(model).__name__.endswith("ForSequenceClassification") \
        else AutoModelForCausalLM
    with tempfile.TemporaryDirectory(prefix="swiftlite-q-") as tmp:
        # Not model.save_pretrained: under an initialised process group transformers writes only on
        # rank 0, and every rank quantizes its own copy into its own temp folder.
        model.config.save_pretrained(tmp)
        save_model(model, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        from transformers.utils import logging as hf_logging
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # an internal round trip, not a user-visible load
        try:
            q = auto.from_pretrained(tmp, dtype=torch_dtype(cfg.model.torch_dtype),
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
    """Trap 1 (docs/design.md): on CPUs with AVX512-BF16, bitsandbytes repacks 4-bit weights in place on
    an eval()+no_grad forward, which silently corrupts later sharded training steps. Turn it off."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
