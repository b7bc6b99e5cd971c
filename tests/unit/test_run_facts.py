"""checkpoint/state.run_facts and compare_run_facts: what a checkpoint records about the run that wrote
it, and which difference refuses a resume (a whole one, and a --resume_only_model one). The resume
itself around them is tests/unit/test_resume_only_model.py and tests/faults/test_run_reliability.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from swiftlite.checkpoint.state import WEIGHT_SHAPE, compare_run_facts, load_training_state, run_facts
from swiftlite.config import build_config
from swiftlite.errors import UserError
from tests.unit.test_resume_only_model import TORCH, WORLD, FakeEngine   # the same stand-ins


def rows(*seqs: list[int], labels: list[list[int]] | None = None) -> SimpleNamespace:
    """Training data as run_facts reads it: `.rows` of token ids and labels."""
    labels = labels or [list(s) for s in seqs]
    return SimpleNamespace(rows=[{"input_ids": list(s), "labels": list(lab)} for s, lab in zip(seqs, labels)])


DATA = rows([1, 2, 3], [4, 5])


def test_a_full_run_records_its_data_and_run_shape():
    cfg = build_config({"train_type": "full", "dataset": ["a.jsonl"], "max_length": 64, "seed": 7})
    facts = run_facts(cfg, DATA, global_batch=8)
    assert set(facts) == {"data", "shape"}
    assert facts["data"]["rows"] == 2 and facts["data"]["tokens"] == 5
    assert len(facts["data"]["sha256"]) == 32 and int(facts["data"]["sha256"], 16) >= 0
    assert facts["shape"] == {"global_batch": 8, "seed": 7, "max_length": 64, "dataset": ["a.jsonl"],
                              "packing": False, "train_type": "full"}   # no LoRA keys, defaults unrecorded
    assert json.loads(json.dumps(facts)) == facts                       # as trainer_state.json holds it


def test_the_data_hash_follows_every_token_and_label():
    cfg = build_config({"train_type": "full"})
    base = run_facts(cfg, DATA, 8)["data"]["sha256"]
    assert run_facts(cfg, rows([1, 2, 3], [4, 5]), 8)["data"]["sha256"] == base          # deterministic
    assert run_facts(cfg, rows([1, 2, 3], [4, 6]), 8)["data"]["sha256"] != base          # one token
    assert run_facts(cfg, rows([1, 2, 3], [4, 5], labels=[[-100, 2, 3], [4, 5]]), 8)["data"]["sha256"] != base
    assert run_facts(cfg, rows([4, 5], [1, 2, 3]), 8)["data"]["sha256"] != base          # row order


def test_a_lora_run_records_the_adapters_shape_and_options_off_their_default():
    cfg = build_config({"train_type": "lora", "lora_rank": 4, "lora_alpha": 16, "dataset": ["a.jsonl"]})
    shape = run_facts(cfg, DATA, 8)["shape"]
    assert {k: shape[k] for k in ("lora_rank", "lora_alpha", "target_modules", "quant_bits")} == {
        "lora_rank": 4, "lora_alpha": 16, "target_modules": ["all-linear"], "quant_bits": None}
    assert not {"optim", "use_dora", "lora_bias", "init_weights"} & set(shape)   # defaults: not recorded
    changed = build_config({"train_type": "lora", "use_dora": True, "lora_bias": "all", "init_weights": "pissa",
                            "optim": "sgd"})
    got = run_facts(changed, DATA, 8)["shape"]
    assert {k: got[k] for k in ("optim", "use_dora", "lora_bias", "init_weights")} == {
        "optim": "sgd", "use_dora": True, "lora_bias": "all", "init_weights": "pissa"}
    # a full run records a non-default optimizer, never the LoRA-only options
    full = run_facts(build_config({"train_type": "full", "optim": "sgd"}), DATA, 8)["shape"]
    assert full["optim"] == "sgd" and "use_dora" not in full


def test_boft_and_adalora_runs_record_their_options_off_their_default():
    boft = run_facts(build_config({"train_type": "boft", "boft_block_size": 8}), DATA, 8)["shape"]
    assert boft["boft_block_size"] == 8 and "boft_dropout" not in boft and "adalora_init_r" not in boft
    ada = run_facts(build_config({"train_type": "adalora", "adalora_tfinal": 3}), DATA, 8)["shape"]
    assert ada["adalora_tfinal"] == 3 and "adalora_init_r" not in ada and "boft_block_size" not in ada
    bone = run_facts(build_config({"train_type": "bone", "reft_rank": 8, "init_weights": "bat"}), DATA, 8)["shape"]
    assert bone["reft_rank"] == 8 and bone["init_weights"] == "bat" and "boft_block_size" not in bone
    assert "reft_rank" not in run_facts(build_config({"train_type": "bone"}), DATA, 8)["shape"]


def test_a_lisa_run_records_its_options_off_their_default():
    """Which layers each step trains (and which have optimizer state) follows them: another value is
    another run."""
    lisa = run_facts(build_config({"train_type": "full", "lisa_activated_layers": 2}), DATA, 8)["shape"]
    assert lisa["lisa_activated_layers"] == 2 and "lisa_step_interval" not in lisa
    assert "lisa_activated_layers" not in run_facts(build_config({"train_type": "full"}), DATA, 8)["shape"]


def test_compare_names_each_difference_data_without_values_shape_with_them():
    cfg = build_config({"train_type": "full", "max_length": 64})
    saved = run_facts(cfg, DATA, 8)
    assert compare_run_facts(saved, saved) == []
    now = run_facts(build_config({"train_type": "full", "max_length": 128}), rows([1, 2, 3]), 8)
    assert compare_run_facts(saved, now) == ["data.rows", "data.sha256", "data.tokens",
                                             "shape.max_length (64 -> 128)"]
    # a key only one side has (a checkpoint written before an option was recorded) differs as None
    assert compare_run_facts(saved, {**saved, "shape": {**saved["shape"], "optim": "sgd"}}) == [
        "shape.optim (None -> 'sgd')"]
    # only data and shape count: the rest of trainer_state.json is not a run fact
    assert compare_run_facts({**saved, "global_step": 3, "backend": "fsdp"}, saved) == []
    assert compare_run_facts({"shape": saved["shape"]}, saved) == ["data.rows", "data.sha256", "data.tokens"]


# -- which difference refuses which resume ---------------------------------------------------------

LORA = {"train_type": "lora", "dataset": ["a.jsonl"], "max_length": 64}
#: One change per recorded fact: (config values, training data, global batch).
CHANGES = {
    "data.rows": ({}, rows([1, 2, 3], [4, 5], [6]), 8),
    "data.sha256": ({}, rows([1, 2, 3], [4, 6]), 8),
    "shape.global_batch": ({}, DATA, 16),
    "shape.seed": ({"seed": 1}, DATA, 8),
    "shape.max_length": ({"max_length": 32}, DATA, 8),
    "shape.dataset": ({"dataset": ["b.jsonl"]}, DATA, 8),
    "shape.packing": ({"packing": True}, DATA, 8),
    "shape.lora_rank": ({"lora_rank": 16}, DATA, 8),
    "shape.lora_alpha": ({"lora_alpha": 8}, DATA, 8),
    "shape.target_modules": ({"target_modules": ["q_proj"]}, DATA, 8),
    "shape.optim": ({"optim": "sgd"}, DATA, 8),
    "shape.use_dora": ({"use_dora": True}, DATA, 8),
}


def _checkpoint(tmp_path: Path) -> Path:
    c = tmp_path / "checkpoint-7"
    c.mkdir()
    state = {"global_step": 7, "backend": "single", "world_size": 1, "train_type": "lora",
             **run_facts(build_config(LORA), DATA, 8)}
    (c / "trainer_state.json").write_text(json.dumps(state))
    return c


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_each_difference_refuses_a_whole_resume_naming_it(tmp_path, name):
    values, data, batch = CHANGES[name]
    cfg = build_config({**LORA, **values})
    now = run_facts(cfg, data, batch)
    saved = json.loads((_checkpoint(tmp_path) / "trainer_state.json").read_text())
    names = [d.split(" ")[0] for d in compare_run_facts(saved, now)]
    assert name in names and all(n == name or n.startswith("data.") for n in names), names   # that change only
    eng = FakeEngine()
    with pytest.raises(UserError, match=r"--resume: checkpoint-7 was trained on other data or another run shape") as e:
        load_training_state(eng, tmp_path / "checkpoint-7", WORLD, cfg, TORCH, now)
    assert name in str(e.value) and "--ignore-data-skip" in str(e.value)
    assert eng.calls == []                      # refused before anything was loaded


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_a_model_only_resume_refuses_only_a_change_of_the_weights_shape(tmp_path, name):
    values, data, batch = CHANGES[name]
    cfg = build_config({**LORA, **values, "resume_only_model": True})
    c, eng = _checkpoint(tmp_path), FakeEngine()
    key = name.partition(".")[2]
    if key in WEIGHT_SHAPE:
        with pytest.raises(UserError, match=f"--resume_only_model: the weights of checkpoint-7 have another shape.*"
                                            f"{name}"):
            load_training_state(eng, c, WORLD, cfg, TORCH, run_facts(cfg, data, batch))
        assert eng.calls == []
    else:
        state = load_training_state(eng, c, WORLD, cfg, TORCH, run_facts(cfg, data, batch), log=lambda *_: None)
        assert eng.calls == [("checkpoint-7", True)] and state["global_step"] == 0


def test_the_weights_shape_facts_are_recorded_ones():
    """Every name a model-only resume compares is one run_facts records (for a LoRA run, or for a
    llamapro run off its default blocks and groups, or an adapter run off its default width)."""
    lora = set(run_facts(build_config(LORA), DATA, 8)["shape"])
    llamapro = build_config({"train_type": "llamapro", "llamapro_num_new_blocks": 2, "llamapro_num_groups": 1})
    assert {"llamapro_num_new_blocks", "llamapro_num_groups"} <= set(run_facts(llamapro, DATA, 8)["shape"])
    adapter = set(run_facts(build_config({"train_type": "adapter", "adapter_length": 8}), DATA, 8)["shape"])
    assert set(WEIGHT_SHAPE) <= lora | set(run_facts(llamapro, DATA, 8)["shape"]) | adapter
    assert "adapter_length" in adapter
