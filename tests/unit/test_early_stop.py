"""Early stopping as ms-swift does it (train/best.py: --early_stop_interval, --metric_for_best_model,
--greater_is_better) and --dataloader_drop_last (data/loader.BatchPlan). Each test fails if its flag
is ignored: the rule on a metric sequence, one short CLI run that stops, the epoch's steps and rows."""

from __future__ import annotations

import json

import pytest

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError
from swiftlite.launch.preflight import resolve_for_launch
from tests.conftest import run_cli


def cfg_of(*argv: str):
    config_file, values = parse_run_args(["--dataset", "train.jsonl", "--val_dataset", "val.jsonl",
                                          "--model", "tiny-llama-2l", *argv])
    return load_config(config_file, values, validate_paths=False)


def stops_after(cfg, losses):
    """Evaluate, then save, once per value (eval_steps = save_steps); the 1-based save that stops."""
    from swiftlite.train.best import BestMetric
    b = BestMetric(cfg)
    for i, v in enumerate(losses, 1):
        b.evaluated({"eval_loss": v}, i)
        if b.saved():
            return i, b.best, b.best_step
    return None, b.best, b.best_step


def test_msswift_rule_counts_checkpoints_without_improvement():
    cfg = cfg_of("--early_stop_interval", "2")
    # improves at 2, then not at 3 (equal is no improvement) and 4: stops at the 4th checkpoint
    assert stops_after(cfg, [3.0, 2.0, 2.0, 2.5, 1.0]) == (4, 2.0, 2)
    assert stops_after(cfg, [3.0, 2.0, 1.0, 0.5, 0.1]) == (None, 0.1, 5)   # always improving: no stop
    # loss with greater_is_better: the falling curve never improves
    assert stops_after(cfg_of("--early_stop_interval", "2", "--greater_is_better", "true"),
                       [3.0, 2.0, 1.0, 0.5]) == (3, 3.0, 1)
    assert stops_after(cfg_of("--early_stop_interval", "1"), [3.0, 3.0]) == (2, 3.0, 1)


def test_metric_names_and_defaults():
    from swiftlite.train.best import BestMetric
    b = BestMetric(cfg_of("--metric_for_best_model", "rewards/accuracies"))
    assert (b.key, b.greater) == ("eval_rewards/accuracies", True)          # ms-swift: 'loss' not in the name
    assert (BestMetric(cfg_of()).key, BestMetric(cfg_of()).greater) == ("eval_loss", False)
    with pytest.raises(UserError, match="--metric_for_best_model accuracy: validation logs eval_loss, not eval_acc"):
        BestMetric(cfg_of("--metric_for_best_model", "accuracy")).evaluated({"eval_loss": 1.0}, 1)


@pytest.mark.parametrize("argv,msg", [
    (["--early_stop_interval", "0"], "--early_stop_interval must be > 0"),
    (["--early_stop_interval", "2", "--save_strategy", "no"], "--early_stop_interval 2 counts checkpoints"),
])
def test_early_stop_refusals(argv, msg):
    with pytest.raises(UserError, match=msg):
        cfg_of(*argv)
    config_file, values = parse_run_args(["--dataset", "t.jsonl", "--early_stop_interval", "2"])
    with pytest.raises(UserError, match="give validation data"):
        load_config(config_file, values, validate_paths=False)


def test_early_stop_run_stops_and_records_best(demo_data, tmp_path):
    """lr 1e-30: the weights do not move, so eval_loss never strictly improves after the first
    evaluation: checkpoints 1 (the first best), 2 (count 1), 3 (count 2: stop), of 8 steps."""
    train, val = demo_data
    run = tmp_path / "run"
    proc = run_cli(["sft", "--model", "tiny-llama-2l", "--dataset", f"{train}#16", "--val_dataset", f"{val}#4",
                    "--max_steps", "8", "--gradient_accumulation_steps", "1", "--save_steps", "1", "--eval_steps", "1", "--early_stop_interval", "2",
                    "--learning_rate", "1e-30", "--output_dir", run])
    assert "early stop at step 3: eval_loss has not improved for 2 checkpoints" in proc.stdout
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    state = json.loads((run / "checkpoint-3" / "trainer_state.json").read_text())
    evals = [json.loads(x) for x in (run / "logging.jsonl").read_text().splitlines() if "eval_loss" in x]
    assert [e["step"] for e in evals] == [1, 2, 3]
    assert state["best_global_step"] == 1 and state["best_metric"] == pytest.approx(evals[0]["eval_loss"])


# -- --dataloader_drop_last ------------------------------------------------------------------------------

def test_drop_last_plan():
    from swiftlite.data.loader import BatchPlan
    drop = BatchPlan(10, 2, 2, 1, seed=1)                           # global batch 4
    keep = BatchPlan(10, 2, 2, 1, seed=1, drop_last=False)
    assert drop.steps_per_epoch == 2 and keep.steps_per_epoch == 3
    epoch = [i for s in range(3) for i in keep.global_order(s)]
    assert len(epoch) == 12 and set(epoch) == set(range(10))        # every row, 2 of them twice
    assert keep.global_order(2)[2:] == keep.order(0)[:2]            # filled with the epoch's first rows
    assert len({i for s in range(2) for i in drop.global_order(s)}) == 8
    assert keep.global_order(3) == keep.order(1)[:4]                # epoch 2 starts on its own order
    assert [len(mb) for r in (0, 1) for mb in keep.micro_batches(2, r)] == [2, 2]
    assert BatchPlan(3, 2, 2, 1, seed=1, drop_last=False).steps_per_epoch == 0   # < 1 global batch: refused


def test_drop_last_flag_reaches_the_plan(demo_data):
    from swiftlite.data.pipeline import prepare_datasets
    from swiftlite.models.loading import load_tokenizer
    train, _ = demo_data
    argv = ["--dataset", f"{train}#10", "--model", "tiny-llama-2l", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "1"]
    plans = {}
    for flag in ("true", "false"):
        config_file, values = parse_run_args([*argv, "--dataloader_drop_last", flag])
        cfg = load_config(config_file, values)
        plans[flag] = prepare_datasets(resolve_for_launch(cfg, 1).config, load_tokenizer(cfg), 1)[2]
    assert plans["true"].steps_per_epoch == 2 and plans["false"].steps_per_epoch == 3


def test_drop_last_false_refused_for_grpo_rounds():
    config_file, values = parse_run_args(["--dataset", "t.jsonl", "--dataloader_drop_last", "false"])
    with pytest.raises(UserError, match="--dataloader_drop_last false: GRPO generates for whole rounds"):
        load_config(config_file, {**values, "rlhf_type": "grpo"}, task="rlhf", validate_paths=False)
    assert load_config(config_file, {**values, "rlhf_type": "dpo"}, task="rlhf",
                       validate_paths=False).train.dataloader_drop_last is False
