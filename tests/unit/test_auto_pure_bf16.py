"""`--parallelism auto` never runs another job than asked: a one-GPU bf16 full fine-tune that fits only with
CPU offload because of fp32 master weights, but fits with --pure-bf16, is one line naming both choices."""

from __future__ import annotations

import pytest

from swiftlite.cli import parse_run_args
from swiftlite.config import load_config
from swiftlite.errors import UserError
from swiftlite.planner.recommend import resolve_auto

GPU_80 = 80 * 2**30
BASE = ["--model", "qwen2.5-7b", "--dataset", "d.jsonl", "--torch-dtype", "bf16", "--max-length", "2048"]


def _cfg(*argv):
    return load_config(*parse_run_args([*BASE, *argv]), validate_paths=False)


def test_offload_only_for_master_weights_is_refused_with_both_choices():
    with pytest.raises(UserError) as e:
        resolve_auto(_cfg("--train-type", "full"), 1, GPU_80)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--parallelism auto: this bf16 run fits only with CPU offload "
                                              "(zero3_offload)")
    assert "it runs on single (" in msg and msg.endswith(
        "pass --pure-bf16, or --parallelism zero3_offload to keep fp32 master weights")


def test_pure_bf16_runs_on_one_gpu_and_lora_is_untouched():
    assert resolve_auto(_cfg("--train-type", "full", "--pure-bf16"), 1, GPU_80).backend == "single"
    assert resolve_auto(_cfg("--train-type", "lora"), 1, GPU_80).backend == "single"


def test_offload_stays_when_pure_bf16_does_not_fit_either():
    """A GPU too small even for bf16 states: offload is the only way, and auto still picks it."""
    d = resolve_auto(_cfg("--train-type", "full"), 1, 40 * 2**30)
    assert "offload" in d.backend
