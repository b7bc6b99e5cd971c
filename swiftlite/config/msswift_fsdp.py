"""ms-swift's `--fsdp` (and HF's `--fsdp_config`) -> swiftlite's FSDP settings, in one place.

ms-swift (swift/arguments/sft_args.py `_init_fsdp`, at 3602360a) takes `--fsdp` as the preset name
`fsdp2` (swift/config/fsdp2.json), a JSON file or JSON text holding `"fsdp"` (HF's option words,
default "full_shard auto_wrap") and `"fsdp_config"`, and hands both to transformers'
TrainingArguments, which strips an `fsdp_` prefix from the keys (so accelerate's config files, whose
keys carry it, read the same) and lets a `fsdp_config` key win over the words (`setdefault`).
HF's option words may also be given directly (`--fsdp 'shard_grad_op offload'`), with `--fsdp_config`
holding the options as HF's Trainer takes them. The version defaults to 2 (FSDP2), as in both.

    --fsdp words / keys                        swiftlite
    version 2, full_shard                      --parallelism fsdp
    hybrid_shard / hybrid_shard_zero2          --parallelism hsdp (/ --reshard-after-forward false)
    shard_grad_op, reshard_after_forward false --reshard-after-forward false
    version 1 (full_shard, shard_grad_op)      --parallelism fsdp1
    offload, cpu_offload, offload_params       --cpu-offload true
    activation_checkpointing true              --gradient-checkpointing true
    forward_prefetch true (v2)                 --forward-prefetch 1
    backward_prefetch BACKWARD_PRE             what runs (FSDP2's own one-layer prefetch; FSDP1's default)
    cpu_ram_efficient_loading true / false     --sharded-loading true (the default) / false

`settings(values, launch)` returns the fields to set and the refusals, one line each, which
config/load.py reports together with every other refusal. What cannot be honoured is refused with
key and value. A flag or config key given explicitly that disagrees with the translation is a
conflict, refused, because ms-swift's own flags never override the `--fsdp` file either (its
`--fsdp_config` is replaced by the file's, and FSDP's activation checkpointing runs whatever
`--gradient_checkpointing` says). Import-light (no torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

#: swift/config/fsdp2.json at 3602360a, less its "_description"/"_note"/"_param_docs" comments.
PRESETS: dict[str, dict[str, Any]] = {
    "fsdp2": {"fsdp": "full_shard auto_wrap",
              "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True,
                              "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "cpu_ram_efficient_loading": True,
                              "state_dict_type": "SHARDED_STATE_DICT", "activation_checkpointing": True}},
}

#: HF's sharding words (accelerate's FSDP_SHARDING_STRATEGY, also as fsdp_sharding_strategy 1..5).
_STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")
#: The top-level keys of an accelerate config file: `accelerate launch`'s settings. ms-swift's --fsdp
#: reads only "fsdp" and "fsdp_config" from such a file; so does swiftlite, which checks the process
#: counts against the run's and leaves the rest (precision comes from --torch_dtype, as in ms-swift).
_ACCELERATE_KEYS = frozenset({
    "compute_environment", "debug", "distributed_type", "downcast_bf16", "machine_rank", "main_training_function",
    "mixed_precision", "num_machines", "num_processes", "rdzv_backend", "same_network", "tpu_env",
    "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "main_process_ip", "main_process_port", "gpu_ids"})
#: The settings that only a sharded run uses (parallel/base.py OPTION_FLAGS, less the precision).
OPTION_KNOBS = ("reshard_after_forward", "cpu_offload", "forward_prefetch", "backward_prefetch")
_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else _BOOL.get(str(v).strip().lower())


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _read_json(text: str, where: str, problems: list[str]) -> dict[str, Any] | None:
    """A JSON file or JSON text (ms-swift's json_parse_to_dict, without its repair of bad JSON)."""
    p = Path(text).expanduser()
    try:
        data = json.loads(p.read_text(encoding="utf-8")) if p.is_file() else json.loads(text)
    except OSError as e:
        problems.append(f"{where} {text}: cannot read it ({e.strerror})")
        return None
    except json.JSONDecodeError as e:
        problems.append(f"{where} {text}: " + (f"invalid JSON: {e.msg} (line {e.lineno})" if p.is_file() else
                                              "not a preset (fsdp2), an HF option (full_shard, shard_grad_op, "
                                              "hybrid_shard, offload, auto_wrap), a JSON file or JSON text"))
        return None
    if not isinstance(data, dict):
        problems.append(f"{where} {text}: expected a JSON object, got {type(data).__name__}")
        return None
    return data


def said_text(fsdp: Any) -> str:
    """--fsdp as one text: a file, a preset, JSON text or option words (typed quoted or not)."""
    return fsdp.strip() if isinstance(fsdp, str) else " ".join(str(w) for w in (fsdp or [])).strip()


def read_fsdp(fsdp: Any, fsdp_config: Any, problems: list[str]) -> tuple[list[str], dict[str, Any], str] | None:
    """(option words, fsdp_config keys without the fsdp_ prefix, what was said) from the two flags."""
    said = said_text(fsdp)
    words = said.split()
    config: dict[str, Any] = {}
    if said.lstrip().startswith("{") or said in PRESETS or Path(said).expanduser().is_file() or \
            (len(words) == 1 and words[0].lower() not in _STRATEGIES + ("offload", "auto_wrap")):
        data = PRESETS.get(said) or _read_json(said, "--fsdp", problems)
        if data is None:
            return None
        if fsdp_config is not None:
            problems.append(f"--fsdp_config with --fsdp {said}: ms-swift replaces it with the file's fsdp_config; "
                            "put its keys into that file")
        for k in data:
            if k not in ("fsdp", "fsdp_config") and not str(k).startswith("_") and k not in _ACCELERATE_KEYS:
                problems.append(f"--fsdp {said}: key {k!r} is not read (the file holds \"fsdp\" and "
                                "\"fsdp_config\", or is an accelerate config)")
        if "distributed_type" in data and str(data["distributed_type"]).upper() != "FSDP":
            problems.append(f"--fsdp {said}: distributed_type {data['distributed_type']!r} is not FSDP")
        words = str(data.get("fsdp", "full_shard auto_wrap")).split()
        config = data.get("fsdp_config") or {}
        launch = {k: data[k] for k in ("num_processes", "num_machines") if k in data}
    else:
        launch = {}
        if fsdp_config is not None:
            config = fsdp_config if isinstance(fsdp_config, dict) else \
                _read_json(str(fsdp_config), "--fsdp_config", problems)
            if config is None:
                return None
    if not isinstance(config, dict):
        problems.append(f"--fsdp {said}: fsdp_config must be a JSON object, got {config!r}")
        return None
    out = {}
    for k, v in config.items():
        out[k[5:] if k.startswith("fsdp_") else k] = v
    out["_launch"] = launch
    return [w.lower() for w in words], out, said


def _strategy(words: list[str], conf: dict[str, Any], version: int, said: str, problems: list[str]) -> str | None:
    """The sharding strategy: a fsdp_config key wins over the words, as in transformers."""
    strategy = next((w for w in words if w in _STRATEGIES), "full_shard")
    if "sharding_strategy" in conf:  # accelerate's key: a name or 1..5
        v = str(conf["sharding_strategy"]).strip().lower()
        v = _STRATEGIES[int(v) - 1] if v.isdigit() and 1 <= int(v) <= 5 else v
        if v not in _STRATEGIES:
            problems.append(f"--fsdp {said}: sharding_strategy {conf['sharding_strategy']!r} is not one of "
                            f"{', '.join(s.upper() for s in _STRATEGIES)}")
            return None
        strategy = v
    if "reshard_after_forward" in conf:
        r = conf["reshard_after_forward"]
        b = _bool(r)
        if b is not None:
            hybrid = strategy.startswith("hybrid")
            strategy = ("hybrid_shard" if b else "hybrid_shard_zero2") if hybrid else \
                ("full_shard" if b else "shard_grad_op")
        elif str(r).strip().lower() in _STRATEGIES:
            strategy = str(r).strip().lower()
        else:
            problems.append(f"--fsdp {said}: reshard_after_forward {r!r} is not true/false or a sharding strategy")
            return None
    return strategy


def settings(fsdp: Any, fsdp_config: Any) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(swiftlite fields to set, the accelerate file's process counts, refusals) for --fsdp/--fsdp_config."""
    problems: list[str] = []
    read = read_fsdp(fsdp, fsdp_config, problems)
    if read is None:
        return {}, {}, problems
    words, conf, said = read
    launch = conf.pop("_launch")
    where = f"--fsdp {said}"
    for w in words:
        if w not in _STRATEGIES + ("offload", "auto_wrap"):
            problems.append(f"{where}: unknown option {w!r} (HF's are full_shard, shard_grad_op, hybrid_shard, "
                            "hybrid_shard_zero2, no_shard, offload, auto_wrap)")
    try:
        version = int(conf.pop("version", 2))
    except (TypeError, ValueError):
        version = 0
    if version not in (1, 2):
        problems.append(f"{where}: fsdp_version must be 1 or 2")
        return {}, launch, problems
    strategy = _strategy(words, conf, version, said, problems)
    conf.pop("sharding_strategy", None)
    conf.pop("reshard_after_forward", None)
    out: dict[str, Any] = {}
    if strategy == "no_shard":
        problems.append(f"{where}: no_shard replicates the model on every rank: use --parallelism ddp")
    elif strategy and strategy.startswith("hybrid"):
        if version == 1:
            problems.append(f"{where}: {strategy} with fsdp_version 1: swiftlite's hybrid sharding is FSDP2's "
                            "(--parallelism hsdp): set fsdp_version 2")
        out["parallelism"] = "hsdp"
    elif strategy:
        out["parallelism"] = "fsdp" if version == 2 else "fsdp1"
    if strategy in ("shard_grad_op", "hybrid_shard_zero2"):
        out["reshard_after_forward"] = "false"
    offload = "offload" in words  # a fsdp_config key wins over the word, as in transformers
    given = {k: _bool(conf.pop(k)) for k in ("cpu_offload", "offload_params") if k in conf}
    for k, b in given.items():
        if b is None:
            problems.append(f"{where}: {k} must be true or false")
    if None not in given.values() and len(set(given.values())) > 1:
        problems.append(f"{where}: cpu_offload and offload_params disagree: keep one")
    elif given and None not in given.values():
        offload = next(iter(given.values()))
    if offload:
        out["cpu_offload"] = True
    for key, value in conf.items():
        line = _option(key, value, version)
        if isinstance(line, str):
            problems.append(f"{where}: {key} {value!r}: {line}")
        elif line:
            out.update(line)
    return out, launch, problems


def _option(key: str, value: Any, version: int) -> dict[str, Any] | str | None:
    """One remaining fsdp_config key: the fields it sets (None: fits as it is), or why it is refused."""
    v = str(value).strip().upper()
    b = _bool(value)
    if key == "auto_wrap_policy":
        if v == "TRANSFORMER_BASED_WRAP":
            return None
        return ("swiftlite wraps each decoder layer (TRANSFORMER_BASED_WRAP); size-based or no wrapping is not "
                "available: drop the key")
    if key == "min_num_params":
        return None if str(value).strip() == "0" else "size-based wrapping is not available (each decoder layer " \
                                                      "is one FSDP unit): drop the key"
    if key == "transformer_layer_cls_to_wrap":
        return ("swiftlite wraps the model's decoder layers (its _no_split_modules), whatever their class: drop "
                "the key")
    if key == "cpu_ram_efficient_loading":
        if b is None:
            return "must be true or false"
        return None if b else {"sharded_loading": False}
    if key == "state_dict_type":
        if v in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
            return None  # swiftlite writes both: sharded DCP state and a full model/ or adapter/ folder
        return "checkpoints are sharded (dcp/) with a full model/ or adapter/ folder: use SHARDED_STATE_DICT or " \
               "FULL_STATE_DICT"
    if key == "activation_checkpointing":
        if b is None:
            return "must be true or false"
        # false: ms-swift leaves --gradient_checkpointing (default on) as it is
        return {"gradient_checkpointing": True} if b else None
    if key == "activation_cpu_offload":
        return None if b is False else "offloading activations to CPU is not available: drop the key"
    if key == "forward_prefetch":
        if b is None:
            return "must be true or false"
        if not b:
            return None
        return {"forward_prefetch": 1} if version == 2 else \
            "swiftlite's fsdp1 does not prefetch forward: use fsdp_version 2 (--forward-prefetch)"
    if key == "backward_prefetch":
        if v == "BACKWARD_PRE":
            return None  # what runs: FSDP2's own one-layer backward prefetch; FSDP1's default in torch
        return ("FSDP2 always prefetches the previous layer in backward (BACKWARD_PRE); " if version == 2 else
                "swiftlite's fsdp1 prefetches with BACKWARD_PRE; ") + "other values are not available"
    if key in ("use_orig_params", "sync_module_states", "limit_all_gathers"):
        if b is None:
            return "must be true or false"
        if version == 2:
            return None  # FSDP1 settings that FSDP2 has no use for (transformers ignores them too)
        if key == "sync_module_states":
            return None  # every rank reads the same weights from the model's files
        return None if b else f"swiftlite's fsdp1 runs with {key}=true: drop the key"
    if key in ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt"):
        return None if b is False else "XLA FSDP is not available"
    return "not an FSDP option swiftlite honours (docs/backends.md, \"ms-swift's --fsdp\")"


def apply(values: dict[str, Any], explicit: frozenset[str],
          coerce: Callable[[Any, Any, str], Any]) -> tuple[dict[str, Any], list[str]]:
    """The swiftlite fields that --fsdp/--fsdp_config set in `values` (merged flags, file, launcher
    env), with the refusals: anything not honoured, --deepspeed, and an explicit value that disagrees.
    `coerce` is config/load.py's (field spec, value, where) -> typed value, to compare like with like."""
    fsdp, fsdp_config = values.get("fsdp"), values.get("fsdp_config")
    if not fsdp:
        if fsdp_config is not None:
            return {}, ["--fsdp_config needs --fsdp (the FSDP options apply to an FSDP run): add --fsdp "
                        "'full_shard auto_wrap', or use --parallelism fsdp"]
        return {}, []
    out, launch, problems = settings(fsdp, fsdp_config)
    said = said_text(fsdp)
    if values.get("deepspeed"):
        problems.append(f"--fsdp {said} with --deepspeed {values['deepspeed']}: ms-swift refuses FSDP with "
                        "DeepSpeed too: keep one")
    from swiftlite.config.schema import field_specs
    from swiftlite.errors import UserError
    specs = field_specs()

    def norm(key: str, v: Any) -> Any:
        try:
            val = coerce(specs[key], v, key)
        except UserError:
            return v
        return specs[key].normalize(val) if specs[key].normalize and val is not None else val

    for key, want in out.items():
        if key not in explicit or values.get(key) is None:
            continue
        got = norm(key, values[key])
        if key == "parallelism" and got == "auto":
            continue
        if key == "parallelism" and got == "fsdp2":
            got = "fsdp"
        if got != norm(key, want):
            problems.append(f"--fsdp {said} means {_flag(key)} {str(norm(key, want)).lower()}, but "
                            f"{_flag(key)} {str(got).lower()} is given: drop one")
    nproc, nnodes = values.get("nproc_per_node") or 1, values.get("nnodes") or 1
    from swiftlite import env
    knobs = [k for k in out if k in OPTION_KNOBS]
    if knobs and int(nproc) * int(nnodes) == 1 and not env.inside_torchrun():
        problems.append(f"--fsdp {said} sets {', '.join(f'{_flag(k)} {str(out[k]).lower()}' for k in knobs)}, "
                        "which one process does not use (FSDP on one process runs as single: nothing to shard): "
                        "start 2 or more processes (--nproc-per-node, NPROC_PER_NODE)")
    if "num_machines" in launch and str(launch["num_machines"]) != str(nnodes):
        problems.append(f"--fsdp {said}: num_machines {launch['num_machines']} but this run has {nnodes} node(s) "
                        "(--nnodes / NNODES): make them agree")
    if "num_processes" in launch and str(launch["num_processes"]) != str(int(nproc) * int(nnodes)):
        problems.append(f"--fsdp {said}: num_processes {launch['num_processes']} but this run starts "
                        f"{int(nproc) * int(nnodes)} (--nproc-per-node / NPROC_PER_NODE x nodes): make them agree")
    return out, problems


def describe(fsdp: Any, fsdp_config: Any) -> str:
    """`--dry-run`'s line: what --fsdp (with --fsdp_config) was translated to."""
    out, _, _ = settings(fsdp, fsdp_config)
    shown = " ".join(f"{_flag(k)} {str(v).lower()}" for k, v in out.items())
    return f"--fsdp {said_text(fsdp)}" + (" --fsdp_config ..." if fsdp_config else "") + f" -> {shown}"


__all__ = ["PRESETS", "apply", "describe", "read_fsdp", "said_text", "settings"]
