"""checkpoint/state.load_training_state with --resume_only_model: what is loaded, what is checked,
what is said (the end-to-end behaviour per backend is tests/e2e/test_resume_only_model.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from swiftlite.checkpoint.state import load_training_state
from swiftlite.config import build_config
from swiftlite.errors import UserError


class FakeEngine:
    def __init__(self):
        self.calls = []

    def load(self, path, model_only=False):
        self.calls.append((Path(path).name, model_only))


WORLD = SimpleNamespace(world_size=1, rank=0)
TORCH = SimpleNamespace(key="torch")


def checkpoint(tmp_path: Path, **shape) -> Path:
    c = tmp_path / "checkpoint-7"
    c.mkdir()
    facts = {"data": {"rows": 10, "tokens": 100, "sha256": "a"},
             "shape": {"global_batch": 4, "seed": 42, "max_length": 64, "dataset": ["a.jsonl"], "packing": False,
                       "train_type": "lora", "lora_rank": 8, "lora_alpha": 32, "target_modules": ["all-linear"],
                       "quant_bits": None, **shape}}
    (c / "trainer_state.json").write_text(json.dumps({"global_step": 7, "backend": "single", "world_size": 1,
                                                      "train_type": "lora", **facts}))
    return c


def facts(**shape) -> dict:
    return {"data": {"rows": 12, "tokens": 130, "sha256": "b"},
            "shape": {"global_batch": 8, "seed": 42, "max_length": 128, "dataset": ["b.jsonl#5"], "packing": False,
                      "train_type": "lora", "lora_rank": 8, "lora_alpha": 16, "target_modules": ["all-linear"],
                      "quant_bits": None, **shape}}


def cfg(**values):
    return build_config({"train_type": "lora", **values})


def test_model_only_skips_the_run_facts_check_and_restarts_at_step_zero(tmp_path):
    c = checkpoint(tmp_path)
    eng, said = FakeEngine(), []
    with pytest.raises(UserError, match="was trained on other data or another run shape.*--resume_only_model"):
        load_training_state(eng, c, WORLD, cfg(), TORCH, facts())
    assert eng.calls == []
    state = load_training_state(eng, c, WORLD, cfg(resume_only_model=True), TORCH, facts(), log=said.append)
    assert eng.calls == [("checkpoint-7", True)]
    assert state["global_step"] == 0 and state["resumed_from_step"] == 7
    assert len(said) == 1 and "--resume_only_model: loaded the model weights of checkpoint-7 (step 7)" in said[0]
    assert "optimizer, LR schedule and data order start fresh at step 0" in said[0]


def test_model_only_still_needs_weights_of_the_same_shape(tmp_path):
    c = checkpoint(tmp_path)
    for change, name in (({"lora_rank": 16}, "shape.lora_rank (8 -> 16)"),
                         ({"target_modules": ["q_proj"]}, "shape.target_modules"),
                         ({"quant_bits": 4}, "shape.quant_bits")):
        with pytest.raises(UserError, match=r"--resume_only_model: the weights of checkpoint-7 have another shape") as e:
            load_training_state(FakeEngine(), c, WORLD, cfg(resume_only_model=True), TORCH, facts(**change))
        assert name in str(e.value)
    with pytest.raises(UserError, match=r"another shape.*shape.train_type \('lora' -> 'full'\)"):
        load_training_state(FakeEngine(), c, WORLD, build_config({"train_type": "full", "resume_only_model": True}),
                            TORCH, facts(train_type="full"))


def test_the_flag_in_both_spellings_and_yaml(tmp_path):
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    for argv in (["--resume_only_model", "true"], ["--resume-only-model"]):
        config_file, values = parse_run_args(["--dataset", "d.jsonl", "--resume-from", "ckpt", *argv])
        assert load_config(config_file, values).checkpoint.resume_only_model is True
    y = tmp_path / "c.yaml"
    y.write_text("dataset: [d.jsonl]\nresume_from: ckpt\nresume_only_model: true\n")
    assert load_config(str(y), {}).checkpoint.resume_only_model is True
    assert build_config({}).checkpoint.resume_only_model is False
    with pytest.raises(UserError, match="--resume-only-model needs --resume or --resume-from"):
        load_config(None, {"dataset": ["d.jsonl"], "resume_only_model": True})


def test_an_engine_without_model_only_is_refused_in_one_line(tmp_path):
    class PluginEngine:
        def load(self, path):
            raise AssertionError("not called")
    with pytest.raises(UserError, match="the toy backend's engine cannot load the model weights alone"):
        load_training_state(PluginEngine(), checkpoint(tmp_path), WORLD, cfg(resume_only_model=True),
                            SimpleNamespace(key="torch", name="toy"), facts())
