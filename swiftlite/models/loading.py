"""Resolve --model, load the tokenizer and the model, and prepare it for training.

`prepare_model` is the one place that fixes the order (docs/design.md, "Model preparation"):
load (meta or real) -> quantize (bnb) -> LoRA (peft) -> activation checkpointing -> compile (per
decoder layer). Wrapping by the backend and building the optimizer follow immediately, in
`parallel.base.build_engine` (docs/design.md trap 2: no forward may happen in between).
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swiftlite import dtypes
from swiftlite.errors import UserError
from swiftlite.models.presets import Preset, get_preset

if TYPE_CHECKING:
    import torch

    from swiftlite.config import RunConfig

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a preset, a local folder or a hub id."""
    kind: str  # "preset" | "folder" | "hub"
    ref: str
    preset: Preset | None = None

    @property
    def tokenizer_ref(self) -> str:
        if self.preset is not None:
            return self.preset.tokenizer or self.preset.hub_id or self.ref
        return self.ref


def resolve_model(arg: str) -> ModelSource:
    """Classify --model; a missing folder or unknown preset is a UserError (no network attempt)."""
    preset = get_preset(arg)
    if preset is not None:
        if preset.builtin:
            return ModelSource("preset", arg, preset)
        return ModelSource("hub", preset.hub_id or arg, preset)
    p = Path(arg).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UserError(f"--model {arg}: folder has no config.json (not a Hugging Face model folder)")
        return ModelSource("folder", str(p))
    if p.exists():
        raise UserError(f"--model {arg}: is a file; pass the model folder that holds config.json")
    if arg.startswith((".", "/", "~")) or arg.count("/") > 1 or os.sep in arg and not _HUB_ID.match(arg):
        raise UserError(f"--model {arg}: model folder not found")
    if _HUB_ID.match(arg):
        return ModelSource("hub", arg)
    from swiftlite.models.presets import PRESETS
    raise UserError(f"--model {arg}: unknown preset (known: {', '.join(PRESETS)}), "
                    "and not a local folder or hub id (org/name)")


def torch_dtype(name: str) -> "torch.dtype":
    """torch dtype of a --torch-dtype name (swiftlite.dtypes is the one table)."""
    return dtypes.torch_dtype(name)


def load_tokenizer(cfg: "RunConfig", source: ModelSource | None = None) -> Any:
    """The model's tokenizer, with the chat template from --template when given."""
    from transformers import AutoTokenizer
    src = source or resolve_model(cfg.model.model)
    key = (src.tokenizer_ref, cfg.model.template, cfg.model.trust_remote_code, cfg.model.model_revision, cfg.task)
    if key in _TOKENIZERS:  # preflight and the trainer share one process on single-process runs
        return _TOKENIZERS[key]
    try:
        tok = AutoTokenizer.from_pretrained(src.tokenizer_ref, trust_remote_code=cfg.model.trust_remote_code,
                                            revision=cfg.model.model_revision if src.kind == "hub" else None)
    except OSError as e:
        raise UserError(f"--model {cfg.model.model}: cannot load its tokenizer ({str(e).splitlines()[0]})") from None
    if cfg.model.template:
        tok.chat_template = Path(cfg.model.template).read_text(encoding="utf-8")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if cfg.task == "sft" and not getattr(tok, "chat_template", None):
        raise UserError(f"--model {cfg.model.model}: its tokenizer has no chat template; pass --template FILE")
    _TOKENIZERS[key] = tok
    return tok


_TOKENIZERS: dict[tuple, Any] = {}


def model_config(cfg: "RunConfig", source: ModelSource | None = None) -> Any:
    """The transformers config of --model, without weights."""
    from transformers import AutoConfig
    src = source or resolve_model(cfg.model.model)
    if src.preset is not None:
        return AutoConfig.for_model(**src.preset.config)
    try:
        return AutoConfig.from_pretrained(src.ref, trust_remote_code=cfg.model.trust_remote_code,
                                          revision=cfg.model.model_revision if src.kind == "hub" else None)
    except (OSError, ValueError) as e:
        raise UserError(f"--model {cfg.model.model}: cannot read its config ({str(e).splitlines()[0]})") from None


def load_model(cfg: "RunConfig", source: ModelSource | None = None, world: Any = None, *,
               init_context: Any = None) -> "torch.nn.Module":
    """Load weights (or build a built-in preset with weights seeded by --seed), quantized if asked.

    Under ZeRO-3 a real checkpoint is loaded inside `deepspeed.zero.Init`, so no rank ever holds the
    whole model. Built-in presets are built normally (they are tiny, and their seeded weights must
    equal the other backends' for parity); quantized bases are loaded normally (bnb layers are not
    partitioned at construction).
    """
    import torch
    from transformers import AutoModelForCausalLM
    src = source or resolve_model(cfg.model.model)
    # Always --torch-dtype, for training too: with bf16 the backend then upcasts the trainable
    # parameters to fp32 master weights (optim.upcast_trainable), so every backend's masters start
    # from the same bf16 weights DeepSpeed's do (it builds its fp32 master from the bf16 module).
    # Loading in fp32 instead left the torch backends' masters off the bf16 grid and their lr-1e-5
    # curves 2% below ZeRO-3's after 8 steps (docs/backends.md, "Precision").
    dtype = torch_dtype(cfg.model.torch_dtype)
    quant = None
    if cfg.quant.quant_bits:
        from swiftlite.models.quant import bnb_config
        quant = bnb_config(cfg)
    if src.kind == "preset":
        conf = model_config(cfg, src)
        conf.use_cache = False
        # Same seed -> same initial weights on every rank and in every run (parity, resume tests).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.train.seed)
            model = AutoModelForCausalLM.from_config(conf, dtype=dtype)
        if quant is not None:
            from swiftlite.models.quant import quantize_in_place
            model = quantize_in_place(model, cfg)
        return model
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": cfg.model.trust_remote_code}
    if quant is not None:
        kwargs["quantization_config"] = quant
    if src.kind == "hub" and cfg.model.model_revision:
        kwargs["revision"] = cfg.model.model_revision
    # The backend's own loading context (ZeRO-3: zero.Init), handed in by the caller: a loader
    # never picks a backend.
    ctx: Any = init_context if init_context is not None else contextlib.nullcontext()
    if world is not None and not world.is_main:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # one "Loading weights" bar (rank 0's) is enough
    try:
        with ctx:
            model = AutoModelForCausalLM.from_pretrained(src.ref, **kwargs)
    except OSError as e:
        raise UserError(f"--model {cfg.model.model}: cannot load ({str(e).splitlines()[0]})") from None
    model.config.use_cache = False
    if quant is not None:
        from swiftlite.models.quant import disable_cpu_repack
        disable_cpu_repack(model)  # trap 1, for every quantized load (train, infer, export)
    return model


def decoder_layers(model: "torch.nn.Module") -> list["torch.nn.Module"]:
    """The transformer blocks (the unit FSDP shards and checkpointing wraps)."""
    import torch
    base = model
    for attr in ("base_model", "model"):  # peft -> LoraModel -> CausalLM
        while hasattr(base, attr) and not isinstance(getattr(base, attr), torch.nn.ModuleList):
            nxt = getattr(base, attr)
            if nxt is base:
                break
            base = nxt
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return list(layers)
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in no_split]
    if not found:
        raise UserError("cannot find the model's decoder layers to shard/checkpoint")
    return found


def prepare_model(cfg: "RunConfig", source: ModelSource | None = None, world: Any = None, *,
                  init_context: Any = None) -> "torch.nn.Module":
    """load -> quantize -> LoRA -> activation checkpointing -> compile. Wrap + optimizer come next."""
    model = load_model(cfg, source, world, init_context=init_context)  # quantization happens inside loading (bnb needs it there)
    if cfg.is_peft:
        from swiftlite.models.lora import apply_lora
        model = apply_lora(model, cfg)
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.is_peft:
            model.enable_input_require_grads()
    if cfg.parallel.compile:
        import torch
        if not hasattr(torch, "compile"):
            raise UserError("--compile needs torch >= 2.0 with torch.compile")
        for layer in decoder_layers(model):
            layer.compile()
    model.train()
    return model
