"""The user's config is what the user said; the run's concrete config is one sealed copy (swiftlite/job.py).

`RunConfig` is written by config/load.py only. `--torch-dtype auto`, an unset `--max-length` and the
save/eval cadence of `--save-strategy epoch` are settled by `job.resolve_run` in a copy that is sealed
before any later stage reads it, so "who last wrote cfg.data.max_length" has one answer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from swiftlite.config import SECTIONS, build_config
from swiftlite.job import Resolved, concrete_config, resolve_run

SRC = Path(__file__).resolve().parents[2] / "swiftlite"
#: The config's writers: the loader (the user's config, with ms-swift's derived defaults) and the schema's
#: own copy/seal helpers. job.py writes only through RunConfig.with_values.
WRITERS = {"config/load.py", "config/schema.py"}


def _section_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """`<anything>.<section>.<field> = ...` (and augmented assignments) in a module."""
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute) and t.value.attr in SECTIONS:
                out.append((node.lineno, f"{t.value.attr}.{t.attr}"))
    return out


def test_no_module_but_the_loader_writes_a_config_field():
    found = []
    for p in sorted(SRC.rglob("*.py")):
        rel = p.relative_to(SRC).as_posix()
        if rel in WRITERS:
            continue
        found += [f"{rel}:{line} {what}" for line, what in _section_writes(ast.parse(p.read_text()))]
    assert found == []


def test_the_ast_check_sees_a_write():
    assert _section_writes(ast.parse("cfg.data.max_length = 5\nc.train.eval_steps += 1")) == [
        (1, "data.max_length"), (2, "train.eval_steps")]


def test_a_resolved_config_is_sealed_and_the_users_is_left_as_said():
    said = build_config({"model": "tiny-llama-2l", "dataset": ["d.jsonl"], "save_strategy": "epoch"})
    said.model.torch_dtype = "auto"   # as a GPU build of torch leaves it after config.load
    r = resolve_run(said, 1, gpu_memory=None, gpus_per_node=1)
    assert said.model.torch_dtype == "auto" and not said.sealed
    assert r.config.model.torch_dtype == "fp32" == r.torch_dtype and r.config.sealed
    with pytest.raises(AttributeError, match="read-only"):
        r.config.data.max_length = 7
    with pytest.raises(AttributeError, match="read-only"):
        r.config.task = "pt"
    assert r.cadence(5).save_steps == 5 and r.config.checkpoint.save_steps == said.checkpoint.save_steps
    # a derived config (the reference model's) is a copy, sealed as its source
    ref = r.config.with_values(train_type="full", compile=False)
    assert ref.sealed and ref.train.train_type == "full" and r.config.train.train_type == said.train.train_type
    assert ref.explicit == r.config.explicit


def test_handed_facts_bind_to_a_ranks_own_parse_without_writing_it():
    said = build_config({"model": "tiny-llama-2l", "dataset": ["d.jsonl"]})
    r = resolve_run(said, 2, gpu_memory=None, gpus_per_node=2)
    back = Resolved.from_json(r.to_json())
    assert back == r and back.config is None
    rank_cfg = build_config({"model": "tiny-llama-2l", "dataset": ["d.jsonl"]})
    bound = back.bind(rank_cfg)
    assert bound.config.sealed and not rank_cfg.sealed
    assert bound.config.to_dict() == r.config.to_dict()


def test_concrete_config_runs_the_dtype_rule_on_the_copy():
    from swiftlite.errors import UserError
    said = build_config({"model": "tiny-llama-2l", "dataset": ["d.jsonl"], "quant_bits": 4,
                         "bnb_4bit_compute_dtype": "bf16", "torch_dtype": "bf16"})
    said.model.torch_dtype = "auto"
    with pytest.raises(UserError, match="--bnb-4bit-compute-dtype bf16 differs from --torch-dtype fp32"):
        concrete_config(said, "fp32", 64)
    assert said.model.torch_dtype == "auto"
