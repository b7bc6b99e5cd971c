"""The training-side model, rebuilt from a checkpoint (not from an export): what `--verify` compares
an export with, and what `swiftlite infer --model RUN_OR_CHECKPOINT` runs."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from swiftlite.checkpoint.readers import SafetensorsReader
from swiftlite.export.adapter import load_adapter
from swiftlite.export.base_model import tied_names, tokenizer_for
from swiftlite.export.source import Source, inspect_source, model_config_for, resolve_base
from swiftlite.hf_io import ADAPTER_CONFIG, write_adapter_config, write_adapter_weights


class VerifyError(Exception):
    """--verify found a problem (or the training-side model cannot be rebuilt): the export is not
    published (exit 1)."""


def reference_model(src: Source) -> tuple[torch.nn.Module, str]:
    """The training-side model, rebuilt from the checkpoint (not from the export): the checkpoint's
    own HF folder (full), else its fp32 weights; Houlsby adapters: the base as trained with the adapters
    attached and loaded from the checkpoint (_adapter_model); LoRA: the base exactly as trained
    (quantized for QLoRA) + the checkpoint's adapter, through peft."""
    from swiftlite.export.base_model import auto_class, folder_class
    if src.train_type == "adapter":
        return _adapter_model(src)
    if not src.is_peft:
        if src.hf_dir is not None:
            m = folder_class(src.hf_dir).from_pretrained(str(src.hf_dir), dtype=torch.float32)
            return m.eval(), f"{src.hf_dir} (the checkpoint's own HF folder), fp32"
        ms = resolve_base(src) if src.form != "hf" else None
        conf = model_config_for(src, ms) if ms is not None else None
        if conf is None:
            from transformers import AutoConfig
            conf = AutoConfig.from_pretrained(str(src.path))
        m = auto_class(conf).from_config(conf, dtype=torch.float32)
        reader = src.sharded_reader(exclude_frozen=False)
        if reader is None:
            reader = SafetensorsReader(src.path)
        sd = {k: v.float() if v.is_floating_point() else v for k, v in reader.read(reader.names()).items()}
        missing, unexpected = m.load_state_dict(sd, strict=False)
        if unexpected or [k for k in missing if k not in tied_names(m)]:
            raise VerifyError(f"reference model: cannot load the checkpoint weights ({missing[:2]}, {unexpected[:2]})")
        return m.eval(), f"{src.weights} weights of {src.path.name}, fp32"
    from peft import PeftModel

    from swiftlite.models.loading import load_model
    ms = resolve_base(src)
    base = load_model(src.cfg, ms)
    from swiftlite.models.quant import disable_cpu_repack
    disable_cpu_repack(base)
    adir = src.adapter_dir
    tmpdir = None
    if adir is None:
        import tempfile
        adapter = load_adapter(src, lambda _m: None)
        tmpdir = tempfile.mkdtemp(prefix="swiftlite-ref-adapter-")
        adir = Path(tmpdir)
        write_adapter_config(adapter.config, adir)
        write_adapter_weights(adapter.tensors, adir)
    try:
        from swiftlite.models.tuners import boft_layers
        factor = json.loads((adir / ADAPTER_CONFIG).read_text()).get("boft_n_butterfly_factor") or 1
        with boft_layers(factor, "adapter boft_n_butterfly_factor"):   # a no-op for other adapters
            m = PeftModel.from_pretrained(base, str(adir))
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
    q = src.cfg.quant.quant_bits
    return m.eval(), (f"base {src.cfg.model.model}{f' ({q}-bit, as trained)' if q else ''} + adapter from "
                      f"{src.path.name}, {src.cfg.model.torch_dtype}")


def _adapter_model(src: Source) -> tuple[torch.nn.Module, str]:
    """A --train_type adapter checkpoint's model: the base as the run loaded it, the adapters attached as the
    run attached them (models/adapter.py), their trained weights read from dcp/ (where they are the only
    tensors) or ds/ (its trainable tensors)."""
    from swiftlite.models.adapter import ATTR, attach
    from swiftlite.models.loading import load_model
    model = attach(load_model(src.cfg, resolve_base(src)), src.cfg)
    reader = src.sharded_reader(exclude_frozen=True)
    if reader is None:
        raise VerifyError(f"{src.path}: no dcp/ or ds/ holding the adapters' weights")
    names = [n for n in reader.names() if f".{ATTR}." in n]
    want = {n for n, _ in model.named_parameters() if f".{ATTR}." in n}
    if set(names) != want:
        raise VerifyError(f"{src.path}: its adapter weights do not fit the model (checkpoint {len(names)} tensors, "
                          f"model {len(want)}: another --adapter_length or base?)")
    model.load_state_dict(reader.read(names), strict=False)
    return model.eval(), (f"base {src.cfg.model.model} + Houlsby adapters from {src.path.name} ({src.weights}), "
                          f"{src.cfg.model.torch_dtype}")


def reference_tokenizer(src: Source) -> Any:
    """The tokenizer the run trained with (the checkpoint's model/ copy, else its base's)."""
    needs_base = src.form != "hf" and (src.is_peft or src.hf_dir is None)
    return tokenizer_for(src, resolve_base(src) if needs_base else None)


@dataclass
class Reference:
    model: torch.nn.Module
    tokenizer: Any
    desc: str
    source: Source


def load_reference(arg: str, log: Callable[[str], None]) -> Reference:
    """A run folder, checkpoint or adapter folder -> its training-side model (eval mode, fp32 or as
    trained for quantized bases), its tokenizer and a description."""
    src = inspect_source(arg, None, log)
    model, desc = reference_model(src)
    return Reference(model, reference_tokenizer(src), f"{src.path} ({desc})", src)
