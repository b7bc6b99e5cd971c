"""Each default is ms-swift's (its argument dataclasses at commit 3602360a, copied names and values in
tests/unit/data/msswift_args_3602360a.json), or one of the differences docs/usage.md ("Defaults")
justifies; the values ms-swift resolves in __post_init__ (gradient accumulation, eval steps) follow its rule."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from swiftlite.cli import parse_run_args
from swiftlite.config import field_specs, load_config
from swiftlite.config.load import alias_keys

ROOT = Path(__file__).resolve().parents[2]
NAMES = json.loads((Path(__file__).parent / "data" / "msswift_args_3602360a.json").read_text())

#: swiftlite field -> (ms-swift's default as its source writes it, what it resolves to there): the
#: differences the docs justify. Anything not listed here must equal ms-swift's default.
DIFFERENCES = {
    "model": "ms-swift requires --model",
    "torch_dtype": "ms-swift's None is the model's dtype: swiftlite names it auto",
    "truncation_strategy": "ms-swift's None becomes delete (sft) in __post_init__",
    "lazy_tokenize": "ms-swift's None becomes true for multimodal models only: false for text models",
    "padding_free": "padding-free where the model isolates rows by position ids: same samples and loss",
    "ddp_timeout": "1800 s: a hung collective fails the job in 30 minutes instead of 208 days",
    "output_dir": "ms-swift writes output/<model>/vN-<time>",
    "report_to": "ms-swift logs to tensorboard by default; here logging.jsonl is always written, TensorBoard on ask",
    "dataloader_num_workers": "ms-swift's None becomes 1 on Linux",
    "temperature": "a GRPO option (rlhf): ms-swift's sft default is a generation default",
    "top_p": "a GRPO option (rlhf)",
    "top_k": "a GRPO option (rlhf)",
    "dataloader_drop_last": "true keeps the step count and order of runs made before the flag (its --help)",
    "add_version": "--output-dir is the run folder --resume auto and requeues find (its --help)",
    "loss_scale": "None: each command's own ms-swift default (sft default, pt all, rlhf last_round)",
}


def _value(text: str):
    """A default as ms-swift's source writes it -> a Python value."""
    if text.startswith("factory:"):
        body = text.removeprefix("factory:").removeprefix("lambda:").strip()
        return [] if body == "list" else ast.literal_eval(body)
    return ast.literal_eval(text)


def _msswift_name(field: str, command: str) -> str | None:
    names = [field] + [a for a, f in alias_keys().items() if f == field]
    return next((n for n in names if n in NAMES[command]), None)


def test_every_default_is_msswifts_or_a_documented_difference():
    differ = {}
    for name, spec in field_specs().items():
        ms = _msswift_name(name, "sft") or _msswift_name(name, "rlhf")
        if ms is None:
            continue   # a swiftlite-only option
        theirs = _value(NAMES["sft"].get(ms, NAMES["rlhf"].get(ms)))
        ours = spec.default
        if isinstance(theirs, bool) or isinstance(ours, bool):
            same = ours is theirs or str(ours).lower() == str(theirs).lower()
        else:
            same = ours == theirs
        if not same:
            differ[name] = (ours, theirs)
    assert set(differ) == set(DIFFERENCES), {k: differ.get(k) for k in set(differ) ^ set(DIFFERENCES)}


def test_docs_defaults_table_lists_each_difference():
    text = (ROOT / "docs" / "usage.md").read_text()
    section = text.split("## Defaults", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1) for m in re.finditer(r"^\| `--(\w+)` \|", section, re.MULTILINE)}
    for name in ("num_train_epochs", "gradient_checkpointing", "gradient_accumulation_steps", "save_steps",
                 "eval_steps", "per_device_eval_batch_size", *DIFFERENCES):
        if name in ("model", "temperature", "top_p", "top_k"):
            continue
        assert name in rows, f"docs/usage.md Defaults: no row for --{name}"


def _resolved(argv, env=None, monkeypatch=None):
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", *argv])
    return load_config(config_file, values, validate_paths=False)


@pytest.mark.parametrize("argv,accumulation", [
    ([], 16),                                                            # ceil(16 / 1 / 1)
    (["--per_device_train_batch_size", "4"], 4),
    (["--per_device_train_batch_size", "3"], 6),                         # ceil(5.33)
    (["--per_device_train_batch_size", "4", "--nproc_per_node", "2"], 2),
    (["--per_device_train_batch_size", "2", "--nproc_per_node", "2", "--nnodes", "2"], 2),
    (["--per_device_train_batch_size", "32"], 1),                        # at least 1
    (["--gradient_accumulation_steps", "3"], 3),                         # given: kept
])
def test_gradient_accumulation_follows_msswifts_rule(argv, accumulation):
    assert _resolved(argv).train.gradient_accumulation_steps == accumulation


def test_gradient_accumulation_reads_the_launchers_world_size(monkeypatch):
    """Inside a rank (LOCAL_RANK set by the launcher), WORLD_SIZE is the world, as ms-swift's get_dist_setting."""
    for k, v in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(k, v)
    assert _resolved([]).train.gradient_accumulation_steps == 2


def test_grpo_accumulation_is_one():
    config_file, values = parse_run_args(["--model", "tiny-llama-2l", "--dataset", "d.jsonl", "--rlhf_type", "grpo",
                                          "--reward_funcs", "format"])
    cfg = load_config(config_file, values, task="rlhf", validate_paths=False)
    assert cfg.train.gradient_accumulation_steps == 1


def test_resolved_defaults_are_msswifts():
    cfg = _resolved([])
    t, c = cfg.train, cfg.checkpoint
    assert (t.num_train_epochs, t.gradient_checkpointing, t.per_device_eval_batch_size, c.save_steps) == (3.0, True, 1, 500)
    assert t.eval_steps is None   # validation at each --save-steps checkpoint: ms-swift's eval_steps = save_steps
