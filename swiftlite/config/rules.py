"""The validation rules: one table of generic checks on a `RunConfig`.

Each rule (registered with `@rule(name)` into `RULES`) returns an error message or None; `validate`
runs them in order and raises the first failure as a UserError. The rules here are generic: value
ranges, required options, and combinations that no backend can run. Backend-specific combinations
(what one backend refuses) live in the backend records under `swiftlite/parallel/` and are checked
by `swiftlite.parallel.resolve.resolve_backend`, which preflight runs before any process starts.
`load_config` calls `validate`. Import-light (no torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from swiftlite.config.schema import RunConfig
from swiftlite.errors import UserError


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
    if c.train.max_skipped_steps < 0:
        return f"--max-skipped-steps must be >= 0, got {c.train.max_skipped_steps}"
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
    if c.data.dataset_num_proc < 1:
        return f"--dataset-num-proc must be >= 1, got {c.data.dataset_num_proc}"
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
    if c.checkpoint.resume != "false" and c.checkpoint.resume_from:
        return "--resume and --resume-from both given: use one of them"


def validate(cfg: RunConfig, *, check_paths: bool = True) -> None:
    """Run every rule; the first failure raises a UserError with its reason."""
    for _name, fn in RULES:
        msg = fn(cfg)
        if msg:
            raise UserError(msg)
    if check_paths and cfg.model.template and not Path(cfg.model.template).is_file():
        raise UserError(f"--template: file not found: {cfg.model.template}")
