"""ms-swift's --rope_scaling and --max_model_len: a base of schema.ModelConfig, kept here so schema.py
stays short. models/rope.py applies them to the model's config (ms-swift's `_init_rope_scaling`); the
rule below checks what can be checked without the model. Import-light (no torch, no transformers)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from swiftlite.config.access import Section, opt

#: The names ms-swift accepts for --rope_scaling (anything else is a JSON object or a .json file).
ROPE_NAMES = ("linear", "dynamic", "yarn")


@dataclass(kw_only=True)
class RopeOptions(Section):
    rope_scaling: str | None = opt(None, "Scaled RoPE for a longer context than the model was trained on, as ms-swift: "
                                   "linear, dynamic or yarn (the factor: ceil(--max_model_len / the model's "
                                   "original context)), or a JSON object / .json file such as "
                                   "'{\"type\": \"yarn\", \"factor\": 4.0}' that replaces the config's rope "
                                   "parameters. Trained with it and written into the exported config.json.")
    max_model_len: int | None = opt(None, "The context the run gives the model (ms-swift's --max_model_len): its "
                                    "max_position_embeddings, the default --max_length, and with --rope_scaling "
                                    "the factor's numerator.")


def rope_request(text: str) -> dict[str, Any]:
    """--rope_scaling's value as ms-swift reads it: a name -> {"rope_type": name}; else a JSON object,
    given inline or as a .json file. A value that is neither is a ValueError naming what is wrong."""
    text = text.strip()
    if text in ROPE_NAMES:
        return {"rope_type": text}
    if not text.startswith("{") and text.endswith(".json"):
        if not os.path.isfile(text):
            raise ValueError(f"{text}: no such file")
        with open(text, encoding="utf-8") as f:
            text = f.read()
    elif not text.startswith("{"):
        raise ValueError(f"give {', '.join(ROPE_NAMES)}, a JSON object or a .json file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON at {e.lineno}:{e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"a JSON object is needed, not {type(data).__name__}")
    data = dict(data)
    kind = data.pop("type", None) or data.get("rope_type")
    if not isinstance(kind, str):
        raise ValueError("the object names no rope type (\"type\" or \"rope_type\")")
    data["rope_type"] = kind
    factor = data.get("factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1):
        raise ValueError(f"factor {factor!r}: a number >= 1 is needed")
    return data


def rope_problem(c) -> str | None:
    """The rule (config/rules.py's table): what is wrong with --rope_scaling / --max_model_len before the
    model is read (the model's side: models/rope.py, in preflight)."""
    m = c.model
    if m.max_model_len is not None and m.max_model_len < 1:
        return f"--max_model_len {m.max_model_len}: give the context length in tokens (>= 1)"
    if m.rope_scaling is None:
        return None
    try:
        request = rope_request(m.rope_scaling)
    except ValueError as e:
        return f"--rope_scaling {m.rope_scaling}: {e}"
    if "factor" not in request and m.max_model_len is None and request["rope_type"] != "default":
        return (f"--rope_scaling {m.rope_scaling} names no factor: add --max_model_len (the factor is then "
                "ceil(max_model_len / the model's original context), as ms-swift) or give one in a JSON object")
    return None
