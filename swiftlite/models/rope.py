"""--rope_scaling and --max_model_len on a model's transformers config (ms-swift's `_init_rope_scaling`
and `set_max_model_len`, on transformers 5's `rope_parameters`).

The rule, as ms-swift's:
- `--rope_scaling NAME` (linear, dynamic, yarn) or a JSON object replaces the config's rope parameters
  (its rope_theta and partial_rotary_factor are kept); with neither flag the config is untouched.
- `--max_model_len` alone keeps the config's rope type and recomputes a scaled type's factor.
- the original context is the rope's own `original_max_position_embeddings`, else the model's context
  divided by its current factor, else the model's context; a missing factor is
  max(ceil(max_model_len / original), 1).
- the model's context (every context key it has: config.load.CONTEXT_KEYS) becomes --max_model_len,
  else original * factor; so --max_length defaults to it (models/loading.context_max_length).

Only yarn, longrope and llama3 carry `original_max_position_embeddings` in transformers' rope
parameters (linear and dynamic scale from the context itself; ms-swift writes the key for them too,
which transformers then warns is unused). `model_config` applies this once, so training, preflight,
the planner's --max_length and export's config.json all see the same config.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any

from swiftlite.config.load import CONTEXT_KEYS, context_length as context
from swiftlite.config.rope_options import rope_request
from swiftlite.errors import UserError

if TYPE_CHECKING:
    from swiftlite.config.schema import ModelConfig

#: The rope types whose parameters hold `original_max_position_embeddings` (transformers' validators).
WITH_ORIGINAL = ("yarn", "longrope", "llama3")


def asked(m: "ModelConfig") -> bool:
    """Whether the run changes the config's rope or context at all."""
    return bool(m.rope_scaling) or m.max_model_len is not None


def apply(conf: Any, m: "ModelConfig") -> Any:
    """`conf` with --rope_scaling / --max_model_len applied (a copy; `conf` itself when neither is given).
    A model whose rope cannot take them is a UserError naming --model."""
    if not asked(m):
        return conf
    current = getattr(conf, "rope_parameters", None)
    if not isinstance(current, dict) and m.rope_scaling:
        raise UserError(f"--rope_scaling: --model {m.model} ({type(conf).__name__}) has no rope parameters")
    current = dict(current or {})
    if current and conf.nested_rope_parameter_keys(current):
        raise UserError(f"--rope_scaling/--max_model_len: --model {m.model} has a rope per layer type "
                        f"({', '.join(conf.nested_rope_parameter_keys(current))}); ms-swift's rule is for one rope")
    base = context(conf)
    if m.rope_scaling:
        rope = {k: current[k] for k in ("rope_theta", "partial_rotary_factor") if k in current}
        rope.update(rope_request(m.rope_scaling))
    else:
        rope = dict(current)
        rope.pop("factor", None)
    kind = rope.setdefault("rope_type", "default")
    new_len = m.max_model_len
    if kind != "default" or "factor" in rope:
        original = rope.get("original_max_position_embeddings") or current.get("original_max_position_embeddings")
        if original is None and current.get("factor") and base:
            original = int(base // current["factor"])
        original = original or base
        if original is None:
            raise UserError(f"--rope_scaling: --model {m.model}'s config declares no context length "
                            "(max_position_embeddings) to scale from")
        if "factor" not in rope:   # the rule (config/rope_options.py) made sure --max_model_len is given
            rope["factor"] = max(float(math.ceil(new_len / original)), 1.0)
        if kind in WITH_ORIGINAL:
            rope["original_max_position_embeddings"] = int(original)
        else:
            rope.pop("original_max_position_embeddings", None)
        if new_len is None:
            new_len = int(original * rope["factor"])
    conf = copy.deepcopy(conf)
    if m.rope_scaling or kind != "default":
        conf.rope_parameters = rope
        try:
            conf.validate_rope()
        except (KeyError, ValueError) as e:
            raise UserError(f"--rope_scaling {m.rope_scaling or kind}: transformers refuses it for --model "
                            f"{m.model}: {e}") from None
    if new_len is not None:
        for key in CONTEXT_KEYS:
            if isinstance(getattr(conf, key, None), int):
                setattr(conf, key, int(new_len))
    return conf


def describe(conf: Any) -> str:
    """One phrase for the dry run: the rope and context the model trains with."""
    rope = getattr(conf, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default")
    scaled = f" x{rope['factor']:g}" if "factor" in rope else ""
    original = rope.get("original_max_position_embeddings")
    reach = int(original * rope["factor"]) if original and "factor" in rope else None
    beyond = (f" (beyond the {reach} positions the rope reaches: {rope['factor']:g} x {original})"
              if reach and (context(conf) or 0) > reach else "")
    return f"rope {kind}{scaled}, context {context(conf)}{beyond}"
