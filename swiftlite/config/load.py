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
import typing
from pathlib import Path
from typing import Any

from swiftlite.config.msswift import NO_MEANING, appended, check_no_meaning, check_value, logits_to_keep
from swiftlite.config.msswift_unsupported import misspelling_of, refusal
from swiftlite.config.rules import validate
from swiftlite.config.schema import (FALSE_WORDS, SECRET_KEY, SECTIONS, TRUE_WORDS, FieldSpec, RunConfig,
                                     field_reads, field_specs, section_classes)
from swiftlite.errors import Refusals, UserError, UserErrors

__all__ = ["FALSE_WORDS", "SECRET_KEY", "TRUE_WORDS", "alias_keys", "apply_env", "build_config", "canonical_key",
           "coerce", "context_length", "gpu_torch_build", "load_args", "load_config",
           "read_config_file", "redact_secrets", "resolve_accumulation", "resolve_light_defaults", "apply_add_version",
           "save_args"]


def coerce(spec: FieldSpec, value: Any, where: str) -> Any:
    """Convert a value from a file or a flag to the field's type; a UserError names `where`."""
    if value is None:
        return None
    t = spec.base_type
    if spec.is_dict:
        return _coerce_dict(value, where)
    try:
        if spec.is_list:
            if isinstance(value, str):
                value = [v for v in value.replace(",", " ").split() if v]
            if not isinstance(value, (list, tuple)):
                value = [value]
            # list[float] (--reward-weights) and list[int] elements are numbers; every other list holds words
            item = (typing.get_args(t) or (str,))[0]
            return [item(v) if item in (int, float) and not isinstance(v, bool) else str(v) for v in value]
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


def _coerce_dict(value: Any, where: str) -> dict[str, Any]:
    """A JSON object given as text (--gradient_checkpointing_kwargs '{"use_reentrant": false}') or a mapping."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno}): {value!r}") from None
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected a JSON object ({{\"key\": value}}), got {value!r}")
    return {str(k): v for k, v in value.items()}


def alias_keys() -> dict[str, str]:
    """Every other name of a field, as a config-file key (lr_scheduler_type, tuner_type,
    resume_from_checkpoint, lr, dtype, ...) -> the field's name: the flags' alias table."""
    out: dict[str, str] = {}
    for spec in field_specs().values():
        for a in spec.aliases:
            out[a.lstrip("-").replace("-", "_")] = spec.name
    return out


def canonical_key(key: str, aliases: dict[str, str] | None = None) -> str:
    """A flat key with dashes folded and aliases resolved (tuner-type -> train_type)."""
    k = str(key).replace("-", "_")
    return (alias_keys() if aliases is None else aliases).get(k, k)


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
    spelt: dict[str, str] = {}
    aliases = alias_keys()

    def put(k: Any, v: Any) -> None:
        key = canonical_key(k, aliases)
        if key in flat:
            raise UserError(f"{path}: {spelt[key]} and {k} both given (the same option): keep one")
        flat[key], spelt[key] = v, str(k)

    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key in SECTIONS and isinstance(v, dict):
            for k2, v2 in v.items():
                put(k2, v2)
        else:
            put(k, v)
    return flat


def build_config(values: dict[str, Any], *, source: str = "config", task: str = "sft") -> RunConfig:
    """Build a RunConfig from flat values; unknown keys are an error naming the key."""
    found = Refusals()
    cfg = _build(values, source, task, found)
    found.raise_all()
    return cfg


def _build(values: dict[str, Any], source: str, task: str, found: Refusals) -> RunConfig:
    """The RunConfig of the keys accepted; every refused or unknown key is added to `found`, with the
    field it names, and leaves its field at the default (which the rules that read it pass over)."""
    specs = field_specs()
    aliases = alias_keys()
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for raw, value in values.items():
        key = canonical_key(raw, aliases)
        try:
            _put(sections, specs, key, raw, value, source)
        except UserError as e:
            found.add(e, (key,))
    classes = section_classes()
    cfg = RunConfig(**{s: classes[s](**sections[s]) for s in SECTIONS}, task=task)
    # QLoRA means a 4-bit base unless --quant-bits 8 says otherwise (RunConfig.quant_bits).
    cfg.quant.quant_bits = cfg.quant_bits
    resolve_light_defaults(cfg)
    resolve_accumulation(cfg)
    # a value derived from a refused one (not given itself) is as unusable as the refused one
    for derived, sources in (("quant_bits", ("train_type",)),
                             ("gradient_accumulation_steps", ("per_device_train_batch_size", "rlhf_type",
                                                              "nproc_per_node", "nnodes"))):
        if found.blocked(sources) and derived not in sections[specs[derived].section]:
            found.fields.add(derived)
    return cfg


def apply_add_version(cfg: "RunConfig") -> None:
    """--add_version (ms-swift's `<output_dir>/v<N>-<YYYYMMDD-HHMMSS>` run folders): point
    cfg.train.output_dir at this run's version folder, chosen once by the launching process and handed to
    its ranks (env.RUN_VERSION). N is one more than the highest vN-* there, as ms-swift's
    `add_version_to_work_dir`. With --resume true/auto (and no --resume-from) the newest version folder
    is this run's again, so a requeued command resumes where it stopped; `--resume-from` starts a new
    version, as in ms-swift. Only a name is chosen here; the trainer creates the folder."""
    import time

    from swiftlite import env
    if not cfg.train.add_version:
        return
    base = Path(cfg.train.output_dir).expanduser().resolve()
    known = env.get(env.RUN_VERSION) or ""
    b, _, sub = known.partition("\t")
    if sub and b == str(base.parent) and base.name == sub:
        return                                     # already applied (a rank of this job)
    if not (sub and b == str(base)):
        if (cfg.parallel.nnodes or 1) > 1:
            raise UserError("--add_version with --nnodes > 1: the nodes cannot agree on a version folder before "
                            "they connect; give the run its own --output-dir and --add_version false")
        versions = sorted(((int(m.group(1)), p.name) for p in (base.iterdir() if base.is_dir() else [])
                           if p.is_dir() and (m := re.match(r"v(\d+)", p.name))), reverse=True)
        if versions and cfg.checkpoint.resume != "false" and not cfg.checkpoint.resume_from:
            sub = versions[0][1]
        else:
            sub = f"v{versions[0][0] + 1 if versions else 0}-{time.strftime('%Y%m%d-%H%M%S')}"
        env.update({env.RUN_VERSION: f"{base}\t{sub}"})
    cfg.train.output_dir = str(base / sub)


def config_world_size(cfg: RunConfig) -> int:
    """The job's process count as the config says it (--nproc-per-node x --nnodes, which the launcher
    variables fill); inside a rank started by a launcher, its WORLD_SIZE."""
    from swiftlite import env
    if env.inside_torchrun() and (env.get("WORLD_SIZE") or "").isdigit():
        return int(env.get("WORLD_SIZE"))
    return (cfg.parallel.nproc_per_node or 1) * (cfg.parallel.nnodes or 1)


def resolve_accumulation(cfg: RunConfig) -> None:
    """--gradient-accumulation-steps unset: ms-swift's rule (swift/trainers/arguments.py at 3602360a),
    max(1, ceil(16 / per_device_train_batch_size / world_size)), and 1 for GRPO (its rlhf_args.py),
    so a script that relies on it gets ms-swift's global batch of ~16."""
    t = cfg.train
    if t.gradient_accumulation_steps is not None:
        return
    from swiftlite.config.tasks import task_spec
    if task_spec(cfg.task).own_options == "rlhf" and cfg.rlhf.rlhf_type == "grpo":
        t.gradient_accumulation_steps = 1
        return
    import math
    if t.per_device_train_batch_size <= 0:  # the batch-size rule names the flag
        t.gradient_accumulation_steps = 1
        return
    t.gradient_accumulation_steps = max(1, math.ceil(16 / t.per_device_train_batch_size / config_world_size(cfg)))


def _put(sections: dict[str, dict[str, Any]], specs: dict[str, FieldSpec], key: str, raw: str, value: Any,
         source: str) -> None:
    """Check one key and its value and store it in its section; a UserError says what is wrong. A
    RunConfig field wins over the ms-swift tables (an option implemented later shadows its row)."""
    spec = specs.get(key)
    if spec is None:
        if key in NO_MEANING:
            check_no_meaning(key, value, source)  # accepted only when it asks for what swiftlite does
            return
        why = refusal(key)
        if why is not None:
            raise UserError(f"--{raw}: {why}" if source == "flags" else f"{source}: {raw}: {why}")
        close = misspelling_of(key, list(specs) + list(NO_MEANING))
        hint = f" (did you mean '{close}'?)" if close else ""
        raise UserError(f"{source}: unknown option '{raw}'{hint}")
    if key in sections[spec.section]:
        raise UserError(f"{source}: {key} given twice (under another name too): keep one")
    val = coerce(spec, value, f"{source}: {key}")
    if spec.normalize is not None and val is not None:
        val = spec.normalize(val)
    if not (spec.choices and val in spec.choices):  # a value implemented since shadows its refusal
        check_value(key, val, source)
    if spec.choices and val is not None and val not in spec.choices:
        also = " (or bfloat16, float16, float32)" if spec.normalize is not None and "fp32" in spec.choices else ""
        raise UserError(f"{source}: {key}={val!r} is not one of {', '.join(map(str, spec.choices))}{also}")
    sections[spec.section][key] = val


# -- defaults that come from the model (ms-swift's): max_length and torch_dtype auto -------------------

#: Config attributes that give a model's context length, in the order they are looked for.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_length(conf: Any) -> int | None:
    """The context length a model config (a transformers config or its dict) declares, or None."""
    def get(c: Any, k: str) -> Any:
        return c.get(k) if isinstance(c, dict) else getattr(c, k, None)
    for c in (conf, get(conf, "text_config")):
        if c is None:
            continue
        for k in CONTEXT_KEYS:
            v = get(c, k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def gpu_torch_build() -> bool:
    """Whether the installed torch is a CUDA or ROCm build, read from torch/version.py without
    importing torch (a CPU build can never see a GPU). Unknown: True (the safe answer)."""
    import importlib.util
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return False
    try:
        text = (Path(spec.origin).parent / "version.py").read_text(encoding="utf-8")
    except OSError:
        return True
    return bool(re.search(r"^(cuda|hip)\s*:.*=\s*['\"]", text, re.MULTILINE))


def resolve_light_defaults(cfg: RunConfig) -> None:
    """Fill what needs neither torch nor the model: --torch-dtype auto -> fp32 on a CPU build of torch
    (every backend runs fp32 on CPU). What depends on the model or the GPU (`auto` on a GPU build, an
    unset --max-length: the model's context) is settled by swiftlite/job.py `resolve_run`
    (models/loading.model_defaults) in the run's concrete copy of the config; the user's config keeps
    `auto` / no length, and config/ never asks models/ (no package cycle)."""
    if cfg.model.torch_dtype == "auto" and not gpu_torch_build():
        cfg.model.torch_dtype = "fp32"


def apply_env(values: dict[str, Any], found: Refusals | None = None) -> dict[str, Any]:
    """ms-swift's launcher env vars fill launch options the user did not set. A bad value is refused
    (raised, or added to `found` with its field, which then keeps its default)."""
    from swiftlite import env
    out = dict(values)
    specs = field_specs()
    for key, value in env.launcher_values().items():
        if out.get(key) is None:
            # checked here so that a bad value names the variable, not a flag the user never typed
            where = f"environment variable {env.launcher_var_for(key)}"
            if found is None:
                out[key] = coerce(specs[key], value, where)
            else:
                v = found.check(coerce, specs[key], value, where, about=(key,))
                if v is not None:
                    out[key] = v
    return out


def load_config(config_file: str | None, overrides: dict[str, Any], *, task: str = "sft",
                validate_paths: bool = True, refusals: Refusals | None = None) -> RunConfig:
    """File values, then flags (flags win), then env defaults; then validated. Every refusal (of a key,
    a value, a rule) is reported at once: raised here, or, given `refusals` (the run's: errors.Refusals),
    added to them and the config of what was accepted returned, for the later stages to judge what
    the refusals leave them."""
    found = refusals if refusals is not None else Refusals(watch=field_reads)
    values: dict[str, Any] = {}
    if config_file:
        file_values = found.check(read_config_file, config_file, about=("config",))
        if file_values is not None:
            file_values = appended(file_values)   # custom_register_path: more external_plugins
            file_found = Refusals()
            _build(file_values, str(config_file), task, file_found)  # name the file for its own errors
            found.add(file_found, file_found.fields)
            values.update({k: v for k, v in file_values.items() if k not in file_found.fields})
    aliases = alias_keys()
    given = {canonical_key(k, aliases): v for k, v in overrides.items() if v is not None}
    values.update(given)
    kept = found.check(logits_to_keep, values, about=("use_logits_to_keep", "loss_impl"))   # ms-swift's false: plain
    values = kept if kept is not None else {k: v for k, v in values.items() if k != "use_logits_to_keep"}
    explicit = frozenset(k for k in values if k not in NO_MEANING)
    values = apply_env(values, found)
    # ms-swift's --fsdp/--fsdp_config name a backend and its options (config/msswift_fsdp.py); its
    # refusals are reported with the others. The flags stay as said (args.json), the result beside them.
    from swiftlite.config.msswift_fsdp import apply as fsdp_settings, said_text
    fsdp_set, problems = fsdp_settings(values, explicit, coerce)
    if problems:   # what the translation set (the backend, its options) is as unusable as the file
        found.add(UserErrors(problems), ("fsdp", "fsdp_config", *fsdp_set))
    if values.get("fsdp"):
        values["fsdp"] = [said_text(values["fsdp"])]
    if isinstance(values.get("fsdp_config"), dict):
        values["fsdp_config"] = json.dumps(values["fsdp_config"])
    values.update(fsdp_set)
    cfg = _build(values, "flags", task, found)
    cfg.explicit = (explicit | frozenset(fsdp_set)) - frozenset(found.fields)   # what was given and accepted
    if not found.blocked(("config",)):   # an unreadable config file: its values are unknown
        validate(cfg, check_paths=validate_paths, refusals=found)
    # --add_version: this run's <output-dir>/vN-<time> folder, the same in every rank; the last value
    # the loader fills (after it, nothing writes the user's config: swiftlite/job.py)
    found.check(apply_add_version, cfg, about=("output_dir",))
    if refusals is None:
        found.raise_all()
    return cfg


def redact_secrets(data: Any) -> Any:
    """A copy of nested dicts/lists with the value of every secret-looking key (hub_token, password,
    api_key, ...) replaced by "***" (None stays None)."""
    if isinstance(data, dict):
        return {k: ("***" if SECRET_KEY.search(str(k)) and v is not None else redact_secrets(v))
                for k, v in data.items()}
    if isinstance(data, list):
        return [redact_secrets(v) for v in data]
    return data


def save_args(cfg: RunConfig, path: str | os.PathLike, **applied: Any) -> None:
    """Write the run's resolved config (nested) atomically, with `applied` flat values the run derived
    later (its save/eval cadence: job.Resolved.cadence), so args.json says what the run did. No secret
    is written: RunConfig holds none today, and any field named like one (hub_token, ...) is redacted
    should one be added."""
    p = Path(path)
    data = cfg.to_dict()
    specs = field_specs()
    for k, v in applied.items():
        data[specs[k].section][k] = v
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(redact_secrets(data), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, p)


def load_args(path: str | os.PathLike) -> RunConfig:
    """Read an args.json written by `save_args` (used by resume and export)."""
    data = json.loads(Path(path).read_text())
    task = data.pop("task", "sft")
    flat: dict[str, Any] = {}
    for sec in SECTIONS:
        flat.update(data.get(sec, {}))
    return build_config(flat, source=str(path), task=task)
