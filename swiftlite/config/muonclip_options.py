"""MuonClip's options: ms-swift's `--optimizer muonclip` reads its settings from `--optim_args`
(HF's "key=value,key=value" string), with ms-swift's keys and defaults (swift/optimizers/muonclip.py,
MuonClipOptimizerCallback). A base of schema.OptimConfig, kept here so schema.py stays short;
swiftlite/muonclip.py builds the optimizer, the rule below says which values run. Import-light (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt

#: ms-swift's --optim_args keys for MuonClip and their defaults (weight_decay: --weight_decay).
MUONCLIP_DEFAULTS = {"momentum": 0.95, "nesterov": False, "newton_schulz_steps": 5, "qk_clip_tau": 100.0,
                     "qk_clip_enabled": True, "rms_scale_factor": 0.2, "weight_decay": None}
#: Another name of a key. ms-swift's own example (examples/train/optimizer/muonclip.sh) passes
#: `qk_clip_threshold=10000`, a key ms-swift's MuonClip does not read (it then clips at its default
#: tau, 100). Here it means the threshold the script names, as its author meant: docs/usage.md says so.
MUONCLIP_ALIASES = {"qk_clip_threshold": "qk_clip_tau"}


@dataclass(kw_only=True)
class MuonClipOptions(Section):
    optim_args: str | None = opt(None, "Arguments of --optimizer muonclip, as ms-swift's 'key=value,...': momentum "
                                 "(0.95), nesterov (false), newton_schulz_steps (5), qk_clip_tau (100; also "
                                 "spelled qk_clip_threshold), qk_clip_enabled (true), rms_scale_factor (0.2), "
                                 "weight_decay (--weight_decay). No other optimizer reads it.")


def _value(text: str) -> object:
    """ms-swift's coercion of one value: true/false, else a number (an int when whole), else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        f = float(text)
    except ValueError:
        return text
    return int(f) if f.is_integer() else f


def muonclip_args(raw: str | None) -> dict:
    """--optim_args as MuonClip's settings, ms-swift's defaults filled in. Raises ValueError with a
    one-line reason for an entry without '=', an unknown key or a value of the wrong kind (ms-swift
    passes those over in silence)."""
    given: dict[str, object] = {}
    for item in (raw or "").replace(" ", "").split(","):
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"{item!r} is not key=value")
        key, text = item.split("=", 1)
        key = MUONCLIP_ALIASES.get(key, key)
        if key not in MUONCLIP_DEFAULTS:
            raise ValueError(f"{item!r}: MuonClip reads {', '.join(MUONCLIP_DEFAULTS)} "
                             f"({', '.join(f'{a} = {b}' for a, b in MUONCLIP_ALIASES.items())})")
        value = _value(text)
        kind = bool if isinstance(MUONCLIP_DEFAULTS[key], bool) else (int if key == "newton_schulz_steps" else float)
        if kind is bool and not isinstance(value, bool) or kind is not bool and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or
                kind is int and not isinstance(value, int) or value < 0 or key == "newton_schulz_steps" and value < 1):
            want = {bool: "true or false", int: "an integer >= 1", float: "a number >= 0"}[kind]
            raise ValueError(f"{item!r}: {key} takes {want}")
        given[key] = value
    return {**MUONCLIP_DEFAULTS, **given}
