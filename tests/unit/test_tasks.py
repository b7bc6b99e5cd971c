"""The pure parts of the task and backend seams: what each task class is and calls (train/tasks.py over
config/tasks.py), and DPO's frozen reference copy as a backend record lays it out (Backend.frozen_copy).
The whole runs are tests/e2e/test_rlhf_e2e.py, tests/distributed/test_rlhf_parity.py and
tests/e2e/test_toy_backend.py."""

from __future__ import annotations

import pytest
import torch

from swiftlite.config import build_config
from swiftlite.config.tasks import SPECS, task_spec
from swiftlite.distributed import World
from swiftlite.errors import UserError
from swiftlite.parallel.base import Backend, BackendChoice, all_backends, build_engine
from swiftlite.train.tasks import TASKS, PreferenceTask, TokenTask, task_of


def test_every_command_has_one_task_with_its_facts():
    assert set(TASKS) == set(SPECS) == {"sft", "pt", "rlhf"}
    for name, task in TASKS.items():
        assert task.spec is task_spec(name) and task.name == name
    assert isinstance(TASKS["sft"], TokenTask) and isinstance(TASKS["pt"], TokenTask)
    assert isinstance(TASKS["rlhf"], PreferenceTask)
    # rlhf pairs are rendered with the chat template too: only pt's plain text needs none
    assert [n for n, s in SPECS.items() if s.needs_chat_template] == ["sft", "rlhf"]
    assert (TASKS["rlhf"].unit, TASKS["rlhf"].sequences_per_sample) == ("pair", 2)
    assert (TASKS["sft"].unit, TASKS["sft"].sequences_per_sample) == ("row", 1)


def test_each_task_calls_its_own_functions():
    from swiftlite.rlhf.step import preference_step
    from swiftlite.train.step import train_step
    assert task_of(build_config({}, task="sft")).step_fn() is train_step
    assert task_of(build_config({}, task="rlhf")).step_fn() is preference_step
    run = type("Run", (), {"engine": object()})()
    assert TASKS["sft"].setup_engine(run) is run.engine          # sft/pt drive the backend's engine as built
    assert TASKS["sft"].describe(run) == "" and TASKS["pt"].dry_run_lines(build_config({})) == []


def test_pt_refuses_a_system_prompt_and_sft_refuses_rlhf_options():
    from swiftlite.config import validate
    cfg = build_config({"model": "tiny-llama", "dataset": ["x.jsonl"], "system": "Be brief."}, task="pt")
    with pytest.raises(UserError, match="--system applies to sft"):
        validate(cfg, check_paths=False)


def test_every_builtin_record_names_its_frozen_copy_next_to_its_factory():
    """Each record shipped with swiftlite states its own copy, a function of the module that holds its
    engine factory; none relies on the default a plugin's record gets (LIKE_POLICY)."""
    from swiftlite.parallel.base import BUILTIN_MODULES
    builtin = [b for b in all_backends() if getattr(b.factory, "__module__", "") in BUILTIN_MODULES]
    assert {b.name for b in builtin} >= {"single", "ddp", "fsdp", "hsdp", "fsdp1", "zero2", "zero3"}
    for b in builtin:
        assert callable(b.frozen_copy), b.name
        assert b.frozen_copy.__module__ == b.factory.__module__, (b.name, b.frozen_copy)
    names = {b.name: b.frozen_copy.__name__ for b in builtin}
    assert names["single"] == names["ddp"] == "frozen_replica"
    assert (names["fsdp"], names["hsdp"], names["fsdp1"]) == ("frozen_fsdp2", "frozen_hsdp", "frozen_fsdp1")
    assert all(names[n] == "frozen_copy" for n in names if n.startswith("zero"))
    # a record that names none (a plugin's) gets LIKE_POLICY when its copy is built
    assert Backend(name="x", engine="x", factory=lambda *a: None).frozen_copy is None


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def test_the_default_copy_of_a_plain_engine_is_a_frozen_replica():
    cfg = build_config({"train_type": "full"})
    world = World()
    choice = BackendChoice(name="single", requested="single")
    engine = build_engine(_tiny(), cfg, world, 2, choice)
    ref = _tiny()
    for p in ref.parameters():
        p.requires_grad_(False)
    frozen = Backend(name="x", engine="x", factory=lambda *a: None).frozen(ref, cfg, world, engine, choice)
    x = torch.randn(3, 4)
    with torch.no_grad(), frozen.autocast():
        assert torch.equal(frozen.module(x), engine.root()(x))   # the same starting weights, called alike
    assert not any(p.requires_grad for p in frozen.module.parameters())
    assert frozen.layout == "a replica on cpu"     # what rlhf/frozen.py prints for a record naming none


def test_a_record_with_its_own_init_context_must_name_its_copy():
    from swiftlite.parallel.frozen_copy import like_policy
    cfg = build_config({"train_type": "full"})
    world = World()
    engine = build_engine(_tiny(), cfg, world, 2, BackendChoice(name="single", requested="single"))
    record = Backend(name="part", engine="part", factory=lambda *a: None, init_context=lambda *a: None)
    choice = type("Choice", (), {"name": "part", "record": record})()
    with pytest.raises(UserError, match="--parallelism part: .* names no frozen reference copy"):
        like_policy(_tiny(), cfg, world, engine, choice)
