"""Learning-rate schedules are transformers' own: the lr of every optimizer step equals what HF's
Trainer uses for the same arguments (TrainingArguments.get_warmup_steps + get_scheduler), in
swiftlite's scheduler and in a run's logging.jsonl; the schedule resumes exactly from its JSON state;
schedules that step on a metric and bad --lr-scheduler-kwargs are refused with one line."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from swiftlite.config import load_config
from swiftlite.errors import UserError
from tests.conftest import run_cli

PEAK = 1e-3
TOTAL = 20

#: (name, --lr-scheduler-kwargs): the acceptance list (linear, cosine, cosine_with_min_lr both ways,
#: constant_with_warmup, polynomial), then the other step-driven transformers schedules.
CASES = [("linear", None), ("cosine", None), ("cosine_with_min_lr", {"min_lr": 1e-4}),
         ("cosine_with_min_lr", {"min_lr_rate": 0.1}), ("constant_with_warmup", None),
         ("polynomial", None), ("polynomial", {"lr_end": 1e-5, "power": 2.0}),
         ("cosine", {"num_cycles": 1.5}), ("cosine_with_restarts", {"num_cycles": 3}), ("constant", None),
         ("inverse_sqrt", None), ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.05}),
         ("warmup_stable_decay", {"num_decay_steps": 6, "min_lr_ratio": 0.1})]
#: (--warmup-steps, --warmup-ratio): none, steps, a ratio HF rounds up (ceil(20 * 0.12) = 3).
WARMUPS = [(0, 0.0), (3, 0.0), (0, 0.12)]


def cfg_for(name: str, kwargs: dict | None, warmup_steps: int = 0, warmup_ratio: float = 0.0, **more):
    values = {"dataset": ["x.jsonl"], "lr_scheduler": name, "learning_rate": PEAK,
              "warmup_steps": warmup_steps, "warmup_ratio": warmup_ratio, **more}
    if kwargs is not None:
        values["lr_scheduler_kwargs"] = json.dumps(kwargs)  # as the flag gives it
    return load_config(None, values)


def hf_lrs(name: str, kwargs: dict | None, warmup_steps: int, warmup_ratio: float, total: int,
           peak: float = PEAK) -> list[float]:
    """The lr of each optimizer step of HF's Trainer (Trainer.create_scheduler's arguments)."""
    from transformers import TrainingArguments, get_scheduler
    # transformers 5: warmup_steps >= 1 is a count, < 1 a ratio (the old --warmup_ratio)
    args = TrainingArguments(output_dir="unused", warmup_steps=warmup_steps or warmup_ratio,
                             lr_scheduler_type=name, lr_scheduler_kwargs=kwargs or {}, report_to="none")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=args.get_warmup_steps(total),
                          num_training_steps=total, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    return _run(opt, sched, total)


def _run(opt, sched, steps: int) -> list[float]:
    """The learning rate each step is taken with (read before the step, as HF logs it)."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            out.append([g["lr"] for g in opt.param_groups])
            opt.step()
            sched.step()
    return out


def swiftlite_lrs(cfg, total: int) -> list[list[float]]:
    from swiftlite.optim import build_optimizer, build_scheduler
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))  # two parameter groups
    opt = build_optimizer(model, cfg)
    return _run(opt, build_scheduler(opt, cfg, total), total)


@pytest.mark.parametrize("warm", WARMUPS, ids=lambda w: f"warmup{w[0]}-ratio{w[1]}")
@pytest.mark.parametrize("name,kwargs", CASES, ids=lambda v: v if isinstance(v, str) else json.dumps(v))
def test_every_step_lr_equals_transformers(name, kwargs, warm):
    ref = hf_lrs(name, kwargs, *warm, TOTAL)
    got = swiftlite_lrs(cfg_for(name, kwargs, *warm), TOTAL)
    for step, (r, g) in enumerate(zip(ref, got), 1):
        for lr in g:  # every parameter group
            assert lr == pytest.approx(r[0], abs=1e-12, rel=0), (name, warm, step, ref, got)


def test_warmup_starts_at_zero_as_hf():
    # the review's case: warm-up 3 of 10 steps; swiftlite used to be one step ahead (1/3, 2/3, 1, ...)
    got = [g[0] / PEAK for g in swiftlite_lrs(cfg_for("linear", None, warmup_steps=3), 10)]
    assert got[:4] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0], abs=1e-12)
    # constant has no warm-up in transformers, constant_with_warmup has
    assert [g[0] for g in swiftlite_lrs(cfg_for("constant", None, warmup_steps=3), 5)] == [PEAK] * 5
    assert swiftlite_lrs(cfg_for("constant_with_warmup", None, warmup_steps=3), 5)[0][0] == 0.0


def test_warmup_ratio_rounds_up_as_hf():
    from swiftlite.optim import warmup_steps
    from transformers import TrainingArguments
    for ratio, total in ((0.1, 30), (0.05, 7), (0.12, 20), (0.3, 7)):
        hf = TrainingArguments(output_dir="unused", warmup_steps=ratio, report_to="none").get_warmup_steps(total)
        assert warmup_steps(cfg_for("linear", None, warmup_ratio=ratio), total) == hf, (ratio, total)
    assert warmup_steps(cfg_for("linear", None, warmup_steps=4, warmup_ratio=0.5), 10) == 4


@pytest.mark.parametrize("name,kwargs", [("cosine_with_min_lr", {"min_lr": 1e-4}), ("polynomial", None),
                                         ("warmup_stable_decay", {"num_decay_steps": 6})])
def test_resume_from_json_state_is_exact(name, kwargs):
    """What torch_engine does: scheduler.state_dict() -> scheduler.json -> load_state_dict into the
    schedule rebuilt from the config (the optimizer's state, its param groups' lr included, comes
    back from DCP)."""
    from swiftlite.optim import build_optimizer, build_scheduler
    cfg = cfg_for(name, kwargs, warmup_steps=3)
    full = swiftlite_lrs(cfg, TOTAL)

    def fresh():
        model = torch.nn.Linear(4, 4)
        opt = build_optimizer(model, cfg)
        return opt, build_scheduler(opt, cfg, TOTAL)
    opt, sched = fresh()
    first = _run(opt, sched, 7)
    saved = json.dumps(sched.state_dict())  # must be plain JSON
    opt2, sched2 = fresh()
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(json.loads(saved))
    rest = _run(opt2, sched2, TOTAL - 7)
    assert [x[0] for x in first + rest] == [x[0] for x in full]


def test_every_transformers_scheduler_name_is_a_choice():
    from transformers.trainer_utils import SchedulerType

    from swiftlite.config.schema import SCHEDULERS
    assert {s.value for s in SchedulerType} == set(SCHEDULERS)


@pytest.mark.parametrize("name,kwargs,message", [
    ("reduce_lr_on_plateau", None, "--lr-scheduler reduce_lr_on_plateau is not supported: it lowers the "
                                   "learning rate when an evaluation metric stops improving"),
    ("greedy", None, "--lr-scheduler greedy is not supported"),
    ("cosine_with_min_lr", None, "--lr-scheduler cosine_with_min_lr: One of min_lr or min_lr_rate should be set "
                                 "through the --lr-scheduler-kwargs"),
    ("cosine", {"min_lr": 1e-6}, "--lr-scheduler-kwargs: cosine takes no argument 'min_lr' (it takes num_cycles)"),
    ("constant_with_warmup", {"num_cycles": 1}, "constant_with_warmup takes no argument 'num_cycles' (it takes none)"),
    ("polynomial", {"lr_end": 1.0}, "--lr-scheduler polynomial: lr_end (1.0) must be smaller than initial lr"),
])
def test_refusals_are_one_line(name, kwargs, message):
    from swiftlite.optim import check_scheduler
    with pytest.raises(UserError) as e:
        check_scheduler(cfg_for(name, kwargs))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_scheduler_kwargs_forms():
    from swiftlite.optim import check_scheduler, scheduler_kwargs
    cfg = load_config(None, {"dataset": ["x.jsonl"], "lr_scheduler": "cosine_with_min_lr",
                             "lr_scheduler_kwargs": {"min_lr_rate": 0.1}})  # a mapping in a YAML file
    assert scheduler_kwargs(cfg) == {"min_lr_rate": 0.1}
    check_scheduler(cfg)
    for bad, why in (("{min_lr: 1}", "not valid JSON"), ("[0.1]", "must be a JSON object")):
        cfg.optim.lr_scheduler_kwargs = bad
        with pytest.raises(UserError, match=why):
            scheduler_kwargs(cfg)


def test_logged_lr_of_a_run_equals_hf_trainer(tmp_path, demo_data):
    """`swiftlite sft` with ms-swift's spellings: each logging.jsonl record's lr is the lr HF's
    Trainer takes (and logs for) that step: peak x lambda(step - 1)."""
    train, _ = demo_data
    steps, kwargs = 7, {"min_lr": 1e-4}
    run_cli(["sft", "--model", "tiny-llama", "--dataset", train, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max_steps", steps, "--logging_steps", 1,
             "--learning_rate", PEAK, "--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs",
             json.dumps(kwargs), "--warmup_ratio", 0.3, "--output_dir", tmp_path / "run"], timeout=300)
    recs = [json.loads(x) for x in (tmp_path / "run" / "logging.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in recs if "lr" in r}
    ref = hf_lrs("cosine_with_min_lr", kwargs, 0, 0.3, steps)
    assert sorted(logged) == list(range(1, steps + 1))
    for step in logged:
        assert logged[step] == pytest.approx(ref[step - 1][0], abs=1e-12, rel=0), (step, logged, ref)
    assert logged[1] == 0.0  # ceil(0.3 x 7) = 3 warm-up steps, from 0 as in HF
