"""--init_weights lora-ga end to end: 2 DDP processes build the 1-process run's adapter (same rows, same
seed) and train to its losses, the checkpoint's adapter (converted to a plain LoRA of the model folder)
exports merged with `--verify` passing, and ZeRO-3 (partitioned at load) is refused before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import read_losses, run_cli

BASE = ["sft", "--model", "tiny-llama-2l", "--torch_dtype", "fp32", "--init_weights", "lora-ga",
        "--lora_ga_batch_size", "2", "--lora_ga_iters", "2", "--lora_dropout", "0", "--per_device_train_batch_size",
        "1", "--max_steps", "3", "--save_steps", "3", "--logging_steps", "1", "--learning_rate", "1e-3", "--seed", "7"]


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoint-3" / "adapter" / "adapter_model.safetensors"))


def test_two_ddp_processes_match_one_and_the_merge_verifies(demo_data, tmp_path):
    run_cli([*BASE, "--gradient_accumulation_steps", "2", "--dataset", demo_data[0], "--output_dir", tmp_path / "one"])
    run_cli([*BASE, "--gradient_accumulation_steps", "1", "--dataset", demo_data[0], "--output_dir", tmp_path / "two",
             "--nproc_per_node", "2", "--parallelism", "ddp"])
    l1, l2 = read_losses(tmp_path / "one"), read_losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == [1, 2, 3]
    for s in l1:
        assert l1[s] == pytest.approx(l2[s], rel=1e-4, abs=1e-5), (s, l1, l2)
    a, b = _adapter(tmp_path / "one"), _adapter(tmp_path / "two")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4)
    conf = json.loads((tmp_path / "one" / "checkpoint-3" / "adapter" / "adapter_config.json").read_text())
    assert conf["r"] == 16 and conf["init_lora_weights"] is True         # converted: rank 2r, plain LoRA
    proc = run_cli(["export", "--ckpt", tmp_path / "one" / "checkpoint-3", "--merge_lora", "true", "--verify",
                    "--output", tmp_path / "merged"])
    assert "verify: checks: passed" in proc.stdout + proc.stderr


def test_zero3_is_refused_before_launch(demo_data, tmp_path):
    out = tmp_path / "run"
    proc = run_cli([*BASE, "--dataset", demo_data[0], "--output_dir", out, "--nproc_per_node", "2",
                    "--parallelism", "zero3"], check=False)
    assert proc.returncode == 2, proc.stderr
    assert "--init_weights lora-ga with --parallelism zero3: the gradient estimation needs" in proc.stderr
    assert not out.exists()
