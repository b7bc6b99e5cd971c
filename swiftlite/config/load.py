"""Loading a run configuration: config files, CLI flags and env vars into a validated `RunConfig`.

`load_config(file, overrides)` merges a YAML/JSON file with CLI flags (flags win), fills launch
options from ms-swift's launcher env vars, rejects unknown keys (naming the closest known one),
coerces each value to its field's type, and runs the generic validation rules (`rules.validate`:
ranges, required options, combinations that no backend can run). Which `--parallelism` backend a
run uses, and the combinations a backend refuses, are not decided here: they are checked by
`swiftlite.parallel.resolve.resolve_backend`, which preflight runs before any process starts.

Also here: `args.json` (`save_args`/`load_args`, used by resume and export) and the redaction of
secret-looking keys before anything is written. Import-light (no torch): the CLI imports this.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from swiftlite.config.rules import validate
from swiftlite.config.schema import SECTIONS, FieldSpec, RunConfig, field_specs, section_classes
from swiftlite.errors import UserError

#: Words a boolean flag or config value accepts as true / false (case-insensitive).
TRUE_WORDS = frozenset({"1", "true", "yes", "on", "y", "t"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", "n", "f"})


def coerce(spec: FieldSpec, value: Any, where: str) -> Any:
    """Convert a value from a file or a flag to the field's type; a UserError names `where`."""
    if value is None:
        return None
    t = spec.base_type
    try:
        if spec.is_list:
            if isinstance(value, str):
                value = [v for v in value.replace(",", " ").split() if v]
            if not isinstance(value, (list, tuple)):
                value = [value]
            return [str(v) for v in value]
        if t is str and spec.is_switch and str(value).strip().lower() in TRUE_WORDS | FALSE_WORDS:
            return "true" if str(value).strip().lower() in TRUE_WORDS else "false"
        if t is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in TRUE_WORDS:
                return True
            if s in FALSE_WORDS:
                return False
            raise ValueError
        if t is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if t is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if t is str:
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        return value
    kind = {bool: "true/false", int: "an integer", float: "a number"}.get(t, t.__name__)
    raise UserError(f"{where}: expected {kind}, got {value!r}")


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML or JSON config file into a flat dict (nested sections are flattened)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config: file not found: {path}")
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    else:
        import yaml
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            loc = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
            raise UserError(f"{path}{loc}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of option names to values")
    flat: dict[str, Any] = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key in SECTIONS and isinstance(v, dict):
            for k2, v2 in v.items():
                flat[str(k2).replace("-", "_")] = v2
        else:
            flat[key] = v
    return flat


def build_config(values: dict[str, Any], *, source: str = "config", task: str = "sft") -> RunConfig:
    """Build a RunConfig from flat values; unknown keys are an error naming the key."""
    specs = field_specs()
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for key, value in values.items():
        spec = specs.get(key)
        if spec is None:
            close = _closest(key, specs)
            hint = f" (did you mean '{close}'?)" if close else ""
            raise UserError(f"{source}: unknown option '{key}'{hint}")
        val = coerce(spec, value, f"{source}: {key}")
        if spec.choices and val is not None and val not in spec.choices:
            raise UserError(f"{source}: {key}={val!r} is not one of {', '.join(map(str, spec.choices))}")
        sections[spec.section][key] = val
    classes = section_classes()
    cfg = RunConfig(**{s: classes[s](**sections[s]) for s in SECTIONS}, task=task)
    # QLoRA means a 4-bit base unless --quant-bits 8 says otherwise (RunConfig.quant_bits).
    cfg.quant.quant_bits = cfg.quant_bits
    return cfg


def _closest(key: str, specs: dict[str, FieldSpec]) -> str | None:
    import difflib
    m = difflib.get_close_matches(key, list(specs), n=1, cutoff=0.75)
    return m[0] if m else None


def apply_env(values: dict[str, Any]) -> dict[str, Any]:
    """ms-swift's launcher env vars fill launch options the user did not set."""
    from swiftlite import env
    out = dict(values)
    for key, value in env.launcher_values().items():
        if out.get(key) is None:
            out[key] = value
    return out


def load_config(config_file: str | None, overrides: dict[str, Any], *, task: str = "sft",
                validate_paths: bool = True) -> RunConfig:
    """File values, then flags (flags win), then env defaults; then validated."""
    values: dict[str, Any] = {}
    if config_file:
        values.update(read_config_file(config_file))
        build_config(values, source=str(config_file), task=task)  # name the file for its own errors
    values.update({k: v for k, v in overrides.items() if v is not None})
    values = apply_env(values)
    cfg = build_config(values, source="flags", task=task)
    validate(cfg, check_paths=validate_paths)
    return cfg


SECRET_KEY = re.compile(r"(^|_)token$|secret|password|passwd|api_key|credential", re.IGNORECASE)


def redact_secrets(data: Any) -> Any:
    """A copy of nested dicts/lists with the value of every secret-looking key (hub_token, password,
    api_key, ...) replaced by "***" (None stays None)."""
    if isinstance(data, dict):
        return {k: ("***" if SECRET_KEY.search(str(k)) and v is not None else redact_secrets(v))
                for k, v in data.items()}
    if isinstance(data, list):
        return [redact_secrets(v) for v in data]
    return data


def save_args(cfg: RunConfig, path: str | os.PathLike) -> None:
    """Write the resolved config (nested) atomically. No secret is written: RunConfig holds none
    today, and any field named like one (hub_token, ...) is redacted should one be added."""
    p = Path(path)
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(redact_secrets(cfg.to_dict()), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, p)


def load_args(path: str | os.PathLike) -> RunConfig:
    """Read an args.json written by `save_args` (used by resume and export)."""
    data = json.loads(Path(path).read_text())
    task = data.pop("task", "sft")
    flat: dict[str, Any] = {}
    for sec in SECTIONS:
        flat.update(data.get(sec, {}))
    return build_config(flat, source=str(path), task=task)
