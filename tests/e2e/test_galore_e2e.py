"""--use_galore end to end: a run stopped and resumed ends with the uninterrupted run's weights (the
optimizer state, projections included, goes through a checkpoint), 2 DDP processes give the 1-process
run's losses and weights, and the sharding backends are refused before launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import cli_env, read_losses, run_cli

# projections refreshed every 2 steps, so the resumed steps 3-4 use a projector read back from checkpoint-2
PLAIN = ["sft", "--model", "tiny-llama-2l", "--torch_dtype", "fp32", "--train_type", "full",
         "--per_device_train_batch_size", "1", "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1",
         "--learning_rate", "1e-3", "--seed", "7"]
BASE = [*PLAIN, "--use_galore", "true", "--galore_rank", "4", "--galore_update_proj_gap", "2"]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoint-4" / "model" / "model.safetensors"))


def test_resume_continues_exactly(demo_data, tmp_path):
    args = [*BASE, "--gradient_accumulation_steps", "1", "--dataset", demo_data[0]]
    run_cli([*args, "--output_dir", tmp_path / "whole"])
    cut = tmp_path / "cut"
    stopped = run_cli([*args, "--output_dir", cut], check=False, env=cli_env(SWIFTLITE_FAULT="step=3,kind=raise"))
    assert stopped.returncode != 0 and (cut / "checkpoint-2").is_dir() and not (cut / "checkpoint-4").exists()
    run_cli([*args, "--output_dir", cut, "--resume", "true"])
    assert read_losses(cut) == read_losses(tmp_path / "whole")
    a, b = _weights(tmp_path / "whole"), _weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and GaLore ran (its low-rank updates: tests/unit/test_galore.py): the weights are not plain AdamW's
    plain = tmp_path / "plain"
    run_cli([*PLAIN, "--gradient_accumulation_steps", "1", "--dataset", demo_data[0], "--output_dir", plain])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(_weights(plain)[q], a[q])


def test_two_ddp_processes_match_one(demo_data, tmp_path):
    run_cli([*BASE, "--gradient_accumulation_steps", "2", "--dataset", demo_data[0], "--output_dir", tmp_path / "one"])
    run_cli([*BASE, "--gradient_accumulation_steps", "1", "--dataset", demo_data[0], "--output_dir", tmp_path / "two",
             "--nproc_per_node", "2", "--parallelism", "ddp"])
    l1, l2 = read_losses(tmp_path / "one"), read_losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4]
    for s in l1:
        assert l1[s] == pytest.approx(l2[s], rel=1e-4, abs=1e-5), (s, l1, l2)
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("parallelism", ["fsdp", pytest.param("zero2", marks=pytest.mark.long)])
def test_refused_on_sharding_backends(parallelism, demo_data, tmp_path):
    out = tmp_path / "run"
    proc = run_cli([*BASE, "--dataset", demo_data[0], "--output_dir", out, "--nproc_per_node", "2",
                    "--parallelism", parallelism], check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"--use_galore: GaLore projects each weight's whole gradient (an SVD of the matrix), and --parallelism " \
           f"{parallelism}" in proc.stderr
    assert not out.exists()
