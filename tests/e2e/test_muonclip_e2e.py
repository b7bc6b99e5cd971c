"""--optimizer muonclip end to end: a run stopped and resumed ends with the uninterrupted run's losses
and weights (the momentum buffers go through the checkpoint), 2 DDP processes give the 1-process run's
(the logit bound is the maximum over ranks, so both clip alike), and the clip changes the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import cli_env, read_losses, run_cli

# a small tau, so that QK-Clip acts at every step of the tiny random model
BASE = ["sft", "--model", "tiny-llama-2l", "--torch_dtype", "fp32", "--train_type", "full",
        "--per_device_train_batch_size", "1", "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1",
        "--learning_rate", "1e-3", "--seed", "7", "--optimizer", "muonclip"]
CLIP = ["--optim_args", "qk_clip_tau=0.05"]   # the bound is about 0.2 at the start


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoint-4" / "model" / "model.safetensors"))


def test_resume_continues_exactly_and_the_clip_acts(demo_data, tmp_path):
    args = [*BASE, *CLIP, "--gradient_accumulation_steps", "1", "--dataset", demo_data[0]]
    run_cli([*args, "--output_dir", tmp_path / "whole"])
    cut = tmp_path / "cut"
    stopped = run_cli([*args, "--output_dir", cut], check=False, env=cli_env(SWIFTLITE_FAULT="step=3,kind=raise"))
    assert stopped.returncode != 0 and (cut / "checkpoint-2").is_dir() and not (cut / "checkpoint-4").exists()
    run_cli([*args, "--output_dir", cut, "--resume", "true"])
    assert read_losses(cut) == read_losses(tmp_path / "whole")
    a, b = _weights(tmp_path / "whole"), _weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # without the clip (ms-swift's default tau 100 is never reached here) the query weights differ
    free = tmp_path / "free"
    run_cli([*BASE, "--gradient_accumulation_steps", "1", "--dataset", demo_data[0], "--output_dir", free])
    q, v = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    assert a[q].norm() < 0.9 * _weights(free)[q].norm()
    assert a[v].norm() == pytest.approx(float(_weights(free)[v].norm()), rel=0.2)


def test_two_ddp_processes_match_one(demo_data, tmp_path):
    run_cli([*BASE, *CLIP, "--gradient_accumulation_steps", "2", "--dataset", demo_data[0],
             "--output_dir", tmp_path / "one"])
    run_cli([*BASE, *CLIP, "--gradient_accumulation_steps", "1", "--dataset", demo_data[0],
             "--output_dir", tmp_path / "two", "--nproc_per_node", "2", "--parallelism", "ddp"])
    l1, l2 = read_losses(tmp_path / "one"), read_losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4]
    for s in l1:
        assert l1[s] == pytest.approx(l2[s], rel=1e-4, abs=1e-5), (s, l1, l2)
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4)
