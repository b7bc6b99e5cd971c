"""What --model is, and the model's facts: the one place that answers both.

    src = resolve_model(arg)                  # ModelSource: a preset, a local folder or a hub id
    src.config_dict()                         # its config as a dict (preset, config.json; None for a hub id)
    src.config(trust_remote_code, revision)   # its transformers config (no weights)
    src.shape(offline=True)                   # what the memory model needs (models/shape.py counts it)
    src.check_folder(trust_remote_code)       # a local folder is one swiftlite can load (preflight)
    src.snapshot(revision, patterns)          # a hub model's files in huggingface_hub's cache, as a folder
    src.hub_id                                # its hub id, when it has one (model cards)

Every caller that needs one of these goes through `resolve_model(arg).<method>`, so the precedence
(documented once, on `resolve_model`) and the error messages are the same in train, estimate, bench,
infer and export; tests/unit/test_model_source.py fails when another module reads a preset or a
config.json to answer what --model is. No torch or transformers at import time (config/ and the CLI
import this); transformers and huggingface_hub are imported by the methods that need them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from swiftlite.errors import UserError
from swiftlite.models.presets import Preset, get_preset
from swiftlite.models.shape import ModelShape, shape_from_config

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: The file of a Hugging Face model folder that holds its config (the owner of reading it is here).
CONFIG_FILE = "config.json"
#: What sharded loading reads of a hub model: its config and safetensors files.
WEIGHT_PATTERNS = ("*.json", "*.safetensors")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a preset, a local folder or a hub id, with the model's facts.

    `arg` is --model as given (error messages name it); `repo` is the hub id a folder was downloaded
    from (`snapshot`), so it keeps its hub id once it is a folder."""
    kind: str  # "preset" | "folder" | "hub"
    ref: str
    preset: Preset | None = None
    arg: str = ""
    repo: str | None = None

    @property
    def name(self) -> str:
        """--model as given (the reference when it was built without one)."""
        return self.arg or self.ref

    @property
    def tokenizer_ref(self) -> str:
        if self.preset is not None:
            return self.preset.tokenizer or self.preset.hub_id or self.ref
        return self.ref

    @property
    def hub_id(self) -> str | None:
        """The model's hub id: a hub model's (a preset's hub_id included), a snapshot folder's origin;
        None for a built-in preset and a local folder (model cards name only hub models as base_model)."""
        return self.ref if self.kind == "hub" else self.repo

    def config_dict(self) -> dict[str, Any] | None:
        """The model's config as a dict, read without transformers: a preset's, or a folder's config.json
        (a UserError when that is not a JSON object). None for a hub id: its config comes with the hub
        (`config`)."""
        if self.preset is not None:
            return dict(self.preset.config)
        if self.kind != "folder":
            return None
        f = Path(self.ref) / CONFIG_FILE
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"--model {self.name}: folder has no config.json "
                            "(not a Hugging Face model folder)") from None
        except json.JSONDecodeError as e:
            raise UserError(f"--model {self.name}: {f}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--model {self.name}: cannot read {f} ({e})") from None
        if not isinstance(data, dict):
            raise UserError(f"--model {self.name}: {f} must hold a JSON object, not {type(data).__name__}")
        return data

    def config(self, trust_remote_code: bool = False, revision: str | None = None) -> Any:
        """The transformers config of the model, without weights (`revision` applies to a hub id only)."""
        from transformers import AutoConfig
        if self.preset is not None:
            return AutoConfig.for_model(**self.preset.config)
        try:
            return AutoConfig.from_pretrained(self.ref, trust_remote_code=trust_remote_code,
                                              revision=revision if self.kind == "hub" else None)
        except (OSError, ValueError) as e:
            raise UserError(f"--model {self.name}: cannot read its config ({str(e).splitlines()[0]})") from None

    def shape(self, offline: bool = True, trust_remote_code: bool = False, revision: str | None = None) -> ModelShape:
        """What the memory model needs (models/shape.py), from the config alone, never the weights.
        offline: a preset or a folder only (estimate never downloads); else a hub id's config is read
        through huggingface_hub's cache (downloaded if needed)."""
        conf = self.config_dict()
        if conf is None:
            if offline:
                raise UserError(f"--model {self.name}: a hub id; estimate reads configs only and never downloads: "
                                "pass a preset or a local folder with config.json")
            conf = self.config(trust_remote_code, revision).to_dict()
        return shape_from_config(conf, self.preset.name if self.preset is not None else self.name)

    def check_folder(self, trust_remote_code: bool = False) -> None:
        """A local model folder has weights, is not pre-quantized by another method, and needs no code
        of its own unless --trust-remote-code (one-line UserErrors, before any process starts).
        Nothing to check for a preset or a hub id."""
        if self.kind != "folder":
            return
        conf = self.config_dict() or {}
        if not trust_remote_code:
            from transformers import CONFIG_MAPPING
            mtype = conf.get("model_type")
            if mtype not in CONFIG_MAPPING:
                extra = " and ships its own Python code (auto_map)" if conf.get("auto_map") else ""
                raise UserError(f"--model {self.name}: model_type {mtype!r} is not built into transformers{extra}; "
                                "swiftlite runs no code from a model folder unless you pass --trust-remote-code")
        quant = conf.get("quantization_config")
        method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
        if method and method != "bitsandbytes":
            # transformers would need that method's kernels, and the weights are not the 16-bit ones
            # swiftlite trains or quantizes itself: say so here, not as an ImportError in every rank
            raise UserError(f"--model {self.name}: a pre-quantized {method.upper()} model (config.json "
                            "quantization_config); swiftlite trains 16/32-bit weights (full, lora) or quantizes "
                            "them itself at load time with bitsandbytes (--train-type qlora, or lora with "
                            "--quant-bits 4|8) or HQQ (--quant-method hqq --quant-bits 1|2|3|4|8): pass the "
                            "original 16-bit model")
        folder = Path(self.ref)
        weights = [p for p in folder.iterdir()
                   if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")]
        if not weights:
            raise UserError(f"--model {self.name}: folder has config.json but no weights "
                            "(*.safetensors, pytorch_model.bin)")

    def snapshot(self, revision: str | None = None, patterns: Sequence[str] = WEIGHT_PATTERNS) -> "ModelSource":
        """A hub model's files matching `patterns`, from huggingface_hub's cache (downloaded once when
        online; every rank of a node may ask at once: the files are locked), as a folder source that
        keeps its hub id. A preset or a folder is returned as it is. Raises what huggingface_hub
        raises (offline, gated, unknown id): the caller says what it needed the files for."""
        if self.kind != "hub":
            return self
        from huggingface_hub import snapshot_download
        folder = snapshot_download(self.ref, revision=revision, allow_patterns=list(patterns))
        return ModelSource("folder", str(folder), self.preset, arg=self.name, repo=self.ref)


#: Config attributes that make a transformers model a mixture of experts (their expert count).
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def is_moe(config: Any) -> bool:
    """Whether a transformers config describes a mixture of experts."""
    return any(getattr(config, k, None) for k in MOE_KEYS)


def resolve_model(arg: str) -> ModelSource:
    """Classify --model; a missing folder or unknown preset is a UserError (no network attempt).

    The precedence, the same for every command (train, estimate, bench, infer, export):
      1. a preset name (case-insensitive): a built-in one is "preset"; one with a hub id is "hub"
         (its preset kept: config and tokenizer); a preset wins over a folder of the same name;
      2. an existing folder: "folder", which must hold config.json;
      3. an existing file: refused (pass its folder);
      4. a path-like name (./, /, ~, more than one /): "model folder not found";
      5. org/name: "hub" (nothing is downloaded here);
      6. anything else: an unknown preset, with the closest preset name when one is close.
    infer adds its own cases before step 2's refusal: a run folder and an adapter folder."""
    preset = get_preset(arg)
    if preset is not None:
        if preset.builtin:
            return ModelSource("preset", arg, preset, arg=arg)
        return ModelSource("hub", preset.hub_id or arg, preset, arg=arg)
    p = Path(arg).expanduser()
    if p.is_dir():
        if not (p / CONFIG_FILE).is_file():
            raise UserError(f"--model {arg}: folder has no config.json (not a Hugging Face model folder)")
        return ModelSource("folder", str(p), arg=arg)
    if p.exists():
        raise UserError(f"--model {arg}: is a file; pass the model folder that holds config.json")
    if arg.startswith((".", "/", "~")) or arg.count("/") > 1 or os.sep in arg and not _HUB_ID.match(arg):
        raise UserError(f"--model {arg}: model folder not found")
    if _HUB_ID.match(arg):
        return ModelSource("hub", arg, arg=arg)
    from swiftlite.models.presets import PRESETS, suggest_preset
    close = suggest_preset(arg)
    hint = f"did you mean {close}? " if close else ""
    raise UserError(f"--model {arg}: unknown preset ({hint}known: {', '.join(PRESETS)}), "
                    "and not a local folder or hub id (org/name)")


__all__ = ["CONFIG_FILE", "ModelSource", "WEIGHT_PATTERNS", "resolve_model"]
