"""Typed run configuration.

`RunConfig` groups kw_only dataclasses, one per concern. Every field is addressable by a flat name
(ms-swift style: ``max_length``, ``lora_rank``), which is what CLI flags and config files use; the
flat names are unique across sections. `load_config(file, overrides)` merges a YAML/JSON file with
CLI flags (flags win), rejects unknown keys, coerces types, and runs the validation rules: every
incompatible combination is rejected here, before any process starts or any file is written.

This module must stay import-light (no torch): the CLI imports it to build `--help`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from swiftlite.errors import UserError


def opt(default: Any = None, help: str = "", *, aliases: tuple[str, ...] = (), choices: tuple = (),
        factory: Callable | None = None, cli: bool = True) -> Any:
    """A dataclass field with its CLI metadata (help text, extra flag names, allowed values)."""
    meta = {"help": help, "aliases": aliases, "choices": choices, "cli": cli}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


TRAIN_TYPES = ("full", "lora", "qlora")
DTYPES = ("bf16", "fp16", "fp32")
SCHEDULERS = ("cosine", "linear", "constant", "constant_with_warmup")


@dataclass(kw_only=True)
class ModelConfig:
    model: str = opt("tiny-llama", "Preset name (see `swiftlite models`), local HF folder or hub id.")
    torch_dtype: str = opt("fp32", "Parameter dtype for training.", aliases=("--dtype",),
                           choices=DTYPES)
    template: str | None = opt(None, "Chat template: a Jinja file, or empty for the tokenizer's own.")
    trust_remote_code: bool = opt(False, "Allow the model folder's own Python code (off by default).")
    model_revision: str | None = opt(None, "Hub revision (branch, tag or commit) for hub ids.")


@dataclass(kw_only=True)
class LoraConfig:
    lora_rank: int = opt(8, "LoRA rank r.", aliases=("--lora-r",))
    lora_alpha: int = opt(32, "LoRA alpha.")
    lora_dropout: float = opt(0.05, "LoRA dropout.")
    target_modules: list[str] = opt(help="Modules to adapt: all-linear or names (q_proj v_proj ...).",
                                    factory=lambda: ["all-linear"])
    modules_to_save: list[str] = opt(help="Extra modules trained in full and saved with the adapter.",
                                     factory=list)


@dataclass(kw_only=True)
class QuantConfig:
    quant_bits: int | None = opt(None, "Quantize the base with bitsandbytes (4 or 8). --qlora implies 4.")
    bnb_4bit_quant_type: str = opt("nf4", "4-bit quantization type.", choices=("nf4", "fp4"))
    bnb_4bit_use_double_quant: bool = opt(True, "Double quantization of the 4-bit constants.")


@dataclass(kw_only=True)
class DataConfig:
    dataset: list[str] = opt(help="Training data: files or HF dataset folders; `path#N` takes N rows.",
                             factory=list)
    val_dataset: list[str] = opt(help="Validation data (same forms as --dataset).", factory=list)
    split_dataset_ratio: float = opt(0.0, "Hold out this share of --dataset for validation.")
    max_length: int = opt(512, "Truncate tokenized rows to this many tokens.")
    packing: bool = opt(False, "Pack several rows into each sequence of --max-length tokens.")
    skip_bad_rows: bool = opt(False, "Skip (and count) rows that are not valid instead of stopping.")
    dataset_num_proc: int = opt(1, "Processes for dataset preprocessing.")


@dataclass(kw_only=True)
class ParallelConfig:
    parallelism: str = opt("auto", "How to spread the model: auto, single, ddp, fsdp (FSDP2), fsdp1, "
                           "zero2, zero2_offload, zero3, zero3_offload, zero3_offload_nvme, or a DeepSpeed "
                           "JSON file (parallel/resolve.py decides; --dry-run shows the choice).",
                           aliases=("--parallelism_type", "--parallelism-type"))
    deepspeed: str | None = opt(None, "DeepSpeed JSON file or preset name (zero2, zero3, ...).")
    nproc_per_node: int | None = opt(None, "Processes per node (env NPROC_PER_NODE); >1 starts ranks (see --launcher).")
    nnodes: int | None = opt(None, "Number of nodes (env NNODES).")
    node_rank: int | None = opt(None, "This node's rank (env NODE_RANK).")
    master_addr: str | None = opt(None, "Rendezvous address (env MASTER_ADDR).")
    master_port: int | None = opt(None, "Rendezvous port (env MASTER_PORT); a free one when single-node.")
    rdzv_backend: str | None = opt(None, "torchrun rendezvous backend for elastic runs (e.g. c10d).")
    rdzv_endpoint: str | None = opt(None, "torchrun rendezvous endpoint host:port.")
    rdzv_id: str | None = opt(None, "torchrun rendezvous id.")
    launcher: str = opt("auto", "Launcher for multi-process runs: auto (fork one node's ranks on a CPU build "
                        "of torch, else torchrun), fork, torchrun or deepspeed.",
                        choices=("auto", "fork", "torchrun", "deepspeed"))
    hostfile: str | None = opt(None, "DeepSpeed launcher hostfile (with --launcher deepspeed).")
    mixed_precision: str | None = opt(None, "FSDP mixed precision: bf16 (params bf16, reduce fp32), fp16, "
                                      "or none. Default: bf16 when --torch-dtype is bf16.",
                                      choices=("bf16", "fp16", "none"))
    reshard_after_forward: bool = opt(True, "FSDP: free gathered params after forward (ZeRO-3 style).")
    cpu_offload: bool = opt(False, "FSDP: keep params, grads and optimizer state on CPU.")
    compile: bool = opt(False, "torch.compile each decoder layer before wrapping.")
    offload_dir: str | None = opt(None, "NVMe folder for DeepSpeed parameter/optimizer offload.")
    ddp_timeout: int = opt(1800, "Seconds a collective may wait before the job fails (names the rank).")
    dry_run: bool = opt(False, "Print the resolved plan (backend, world, batch, launch command) and exit.")
    external_plugins: list[str] = opt(help="Python files run before anything else (ms-swift's flag); they may "
                                      "register backends (swiftlite.parallel.base.register_backend).",
                                      factory=list)


@dataclass(kw_only=True)
class OptimConfig:
    learning_rate: float | None = opt(None, "Peak learning rate (default 1e-4 for LoRA, 1e-5 for full).",
                                      aliases=("--lr",))
    weight_decay: float = opt(0.1, "AdamW weight decay.")
    adam_beta1: float = opt(0.9, "AdamW beta1.")
    adam_beta2: float = opt(0.95, "AdamW beta2.")
    adam_epsilon: float = opt(1e-8, "AdamW epsilon.")
    max_grad_norm: float = opt(1.0, "Clip the global gradient norm to this (0 disables).")
    lr_scheduler: str = opt("cosine", "Learning-rate schedule.", aliases=("--lr_scheduler_type",
                            "--lr-scheduler-type"), choices=SCHEDULERS)
    warmup_ratio: float = opt(0.0, "Share of steps spent warming up linearly.")
    warmup_steps: int = opt(0, "Warm-up steps (overrides --warmup-ratio when > 0).")


@dataclass(kw_only=True)
class TrainConfig:
    train_type: str = opt("full", "full, lora or qlora (--lora / --qlora are shorthands).",
                          aliases=("--tuner_type", "--tuner-type"), choices=TRAIN_TYPES)
    per_device_train_batch_size: int = opt(1, "Micro-batch size per process.", aliases=("--batch-size",))
    per_device_eval_batch_size: int = opt(8, "Batch size per process for validation.")
    gradient_accumulation_steps: int = opt(1, "Micro-batches per optimizer step.")
    num_train_epochs: float = opt(1.0, "Epochs to train (ignored when --max-steps > 0).")
    max_steps: int = opt(-1, "Optimizer steps to train; -1 means from --num-train-epochs.")
    gradient_checkpointing: bool = opt(False, "Activation checkpointing per decoder layer.")
    seed: int = opt(42, "Seed for weights of built-in models, data order, dropout.")
    output_dir: str = opt("output", "Run folder (args.json, logs, checkpoints).")
    logging_steps: int = opt(5, "Log every N optimizer steps.")
    eval_steps: int | None = opt(None, "Validate every N steps (default: at --save-steps and the end).")
    report_to: list[str] = opt(help="Extra loggers: tensorboard, all or none (jsonl is always written).",
                               factory=list)
    ignore_data_skip: bool = opt(False, "On resume, restart the data order instead of skipping seen batches.")
    overwrite_output_dir: bool = opt(False, "Allow a non-empty --output-dir without --resume.")


@dataclass(kw_only=True)
class CheckpointConfig:
    save_steps: int | None = opt(None, "Save a checkpoint every N steps (always at the end).")
    save_total_limit: int | None = opt(None, "Keep at most N checkpoints (the newest; never the last good).")
    save_hf_model: bool = opt(True, "Also write an HF model folder (full) or peft adapter in each checkpoint.")
    resume: bool = opt(False, "Resume from the latest checkpoint in --output-dir.")
    resume_from: str | None = opt(None, "Resume from this checkpoint folder.",
                                  aliases=("--resume_from_checkpoint", "--resume-from-checkpoint"))


@dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # Where the run came from ("sft" or "pt"); set by the command, not a flag.
    task: str = "sft"

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (what args.json holds)."""
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Flat name -> value, the form flags and config files use."""
        out: dict[str, Any] = {}
        for sec in SECTIONS:
            for f in dataclasses.fields(getattr(self, sec)):
                out[f.name] = getattr(getattr(self, sec), f.name)
        return out

    @property
    def is_peft(self) -> bool:
        return self.train.train_type in ("lora", "qlora")

    @property
    def quant_bits(self) -> int | None:
        """Bits of the bitsandbytes base: --quant-bits, else 4 for --train-type qlora, else None
        (the one place that says "qlora means 4 bits")."""
        if self.quant.quant_bits is not None:
            return self.quant.quant_bits
        return 4 if self.train.train_type == "qlora" else None

    @property
    def learning_rate(self) -> float:
        if self.optim.learning_rate is not None:
            return self.optim.learning_rate
        return 1e-4 if self.is_peft else 1e-5


SECTIONS = ("model", "lora", "quant", "data", "parallel", "optim", "train", "checkpoint")


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {s: hints[s] for s in SECTIONS}


@dataclass(frozen=True)
class FieldSpec:
    """One flat config key: its section, type and CLI metadata."""
    name: str
    section: str
    type: Any
    default: Any
    help: str
    aliases: tuple[str, ...]
    choices: tuple
    cli: bool

    @property
    def base_type(self) -> Any:
        """The type without Optional (int | None -> int)."""
        t = self.type
        if typing.get_origin(t) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(t) if a is not type(None)]
            return args[0]
        return t

    @property
    def is_list(self) -> bool:
        return typing.get_origin(self.base_type) is list

    @property
    def flags(self) -> list[str]:
        """Both spellings (``--max-length`` and ``--max_length``) plus aliases."""
        names = [f"--{self.name.replace('_', '-')}", f"--{self.name}"]
        for a in self.aliases:
            if a not in names:
                names.append(a)
        return list(dict.fromkeys(names))


def field_specs() -> dict[str, FieldSpec]:
    """Every flat config key, in section order."""
    specs: dict[str, FieldSpec] = {}
    for sec, cls in _section_classes().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            specs[f.name] = FieldSpec(
                name=f.name, section=sec, type=hints[f.name], default=default,
                help=f.metadata.get("help", ""), aliases=tuple(f.metadata.get("aliases", ())),
                choices=tuple(f.metadata.get("choices", ())), cli=f.metadata.get("cli", True))
    return specs


_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}


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
        if t is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in _TRUE:
                return True
            if s in _FALSE:
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
    classes = _section_classes()
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


# --------------------------------------------------------------------------------------------------
# Validation rules: one table. Each rule returns an error message or None.

Rule = Callable[[RunConfig], "str | None"]
RULES: list[tuple[str, Rule]] = []


def rule(name: str):
    def deco(fn: Rule) -> Rule:
        RULES.append((name, fn))
        return fn
    return deco


@rule("learning rate positive")
def _lr(c: RunConfig):
    if c.optim.learning_rate is not None and not c.optim.learning_rate > 0:
        return f"--learning-rate must be > 0, got {c.optim.learning_rate}"


@rule("max length positive")
def _max_len(c: RunConfig):
    if c.data.max_length <= 0:
        return f"--max-length must be > 0, got {c.data.max_length}"


@rule("batch sizes positive")
def _batch(c: RunConfig):
    for k in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        v = getattr(c.train, k)
        if v <= 0:
            return f"--{k.replace('_', '-')} must be > 0, got {v}"


@rule("steps and epochs")
def _steps(c: RunConfig):
    if c.train.max_steps == 0 or c.train.max_steps < -1:
        return f"--max-steps must be > 0 (or -1 for epochs), got {c.train.max_steps}"
    if c.train.max_steps == -1 and not c.train.num_train_epochs > 0:
        return f"--num-train-epochs must be > 0, got {c.train.num_train_epochs}"
    for k in ("logging_steps", "eval_steps"):
        v = getattr(c.train, k)
        if v is not None and v <= 0:
            return f"--{k.replace('_', '-')} must be > 0, got {v}"
    for k in ("save_steps", "save_total_limit"):
        v = getattr(c.checkpoint, k)
        if v is not None and v <= 0:
            return f"--{k.replace('_', '-')} must be > 0, got {v}"


@rule("optimizer ranges")
def _optim(c: RunConfig):
    o = c.optim
    if not 0 <= o.warmup_ratio < 1:
        return f"--warmup-ratio must be in [0, 1), got {o.warmup_ratio}"
    if o.warmup_steps < 0:
        return f"--warmup-steps must be >= 0, got {o.warmup_steps}"
    if o.weight_decay < 0:
        return f"--weight-decay must be >= 0, got {o.weight_decay}"
    if o.max_grad_norm < 0:
        return f"--max-grad-norm must be >= 0, got {o.max_grad_norm}"
    for k in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(o, k) < 1:
            return f"--{k.replace('_', '-')} must be in [0, 1), got {getattr(o, k)}"


@rule("dataset given")
def _dataset(c: RunConfig):
    if not c.data.dataset:
        return "--dataset is required (a .jsonl/.json/.csv/.parquet file or a saved HF dataset folder)"
    if not 0 <= c.data.split_dataset_ratio < 1:
        return f"--split-dataset-ratio must be in [0, 1), got {c.data.split_dataset_ratio}"
    if c.data.val_dataset and c.data.split_dataset_ratio > 0:
        return "--val-dataset and --split-dataset-ratio both given: use one of them"


@rule("world size")
def _world(c: RunConfig):
    pr = c.parallel
    for k in ("nproc_per_node", "nnodes"):
        v = getattr(pr, k)
        if v is not None and v <= 0:
            return f"--{k.replace('_', '-')} must be > 0, got {v}"
    if pr.node_rank is not None and pr.nnodes is not None and not 0 <= pr.node_rank < pr.nnodes:
        return f"--node-rank {pr.node_rank} is out of range for --nnodes {pr.nnodes}"
    if pr.master_port is not None and not 0 < pr.master_port < 65536:
        return f"--master-port must be in 1..65535, got {pr.master_port}"
    if pr.ddp_timeout <= 0:
        return f"--ddp-timeout must be > 0 seconds, got {pr.ddp_timeout}"


@rule("quantization")
def _quant(c: RunConfig):
    q = c.quant.quant_bits
    if q is not None and q not in (4, 8):
        return f"--quant-bits must be 4 or 8 (bitsandbytes 4-bit nf4/fp4 or 8-bit LLM.int8), got {q}"
    if c.train.train_type == "full" and q is not None:
        return "--quant-bits needs --train-type lora/qlora (a quantized base cannot be trained in full)"


@rule("quantized base and offload")
def _quant_offload(c: RunConfig):
    if c.quant_bits is None:
        return None
    if c.parallel.cpu_offload:
        return ("--cpu-offload with a bitsandbytes-quantized base (--qlora/--quant-bits) is not supported: FSDP "
                "offload moves parameters only, and each quantized layer's quantization state (absmax, codebook) "
                "would stay on the CPU; drop --cpu-offload (the 4-bit base is already a quarter of the size)")
    if c.parallel.compile:
        return ("--compile with a bitsandbytes-quantized base: dynamo recompiles every decoder layer around the "
                "4/8-bit matmuls until its recompile limit, then runs them eagerly (minutes of compiling, no "
                "speed-up); drop --compile with --qlora/--quant-bits")


@rule("lora options")
def _lora(c: RunConfig):
    if c.is_peft:
        lc = c.lora
        if lc.lora_rank <= 0:
            return f"--lora-rank must be > 0, got {lc.lora_rank}"
        if not lc.lora_alpha > 0:
            return f"--lora-alpha must be > 0, got {lc.lora_alpha}"
        if not 0 <= lc.lora_dropout < 1:
            return f"--lora-dropout must be in [0, 1), got {lc.lora_dropout}"
        if not lc.target_modules:
            return "--target-modules is empty: give all-linear or module names (q_proj v_proj ...)"
        if "all-linear" in lc.target_modules and len(lc.target_modules) > 1:
            return (f"--target-modules {' '.join(lc.target_modules)}: all-linear already selects every linear "
                    "layer; give either all-linear or a list of names")


@rule("resume")
def _resume(c: RunConfig):
    if c.checkpoint.resume and c.checkpoint.resume_from:
        return "--resume and --resume-from both given: use one of them"


def validate(cfg: RunConfig, *, check_paths: bool = True) -> None:
    """Run every rule; the first failure raises a UserError with its reason."""
    for _name, fn in RULES:
        msg = fn(cfg)
        if msg:
            raise UserError(msg)
    if check_paths and cfg.model.template and not Path(cfg.model.template).is_file():
        raise UserError(f"--template: file not found: {cfg.model.template}")


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
