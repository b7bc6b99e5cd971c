"""LISA end to end (`swiftlite sft --train_type full --lisa_activated_layers N`): each step changes exactly
the decoder layers drawn for its window and the parameters outside the layers, every other layer stays bit
for bit what it was; the draws switch at ms-swift's steps and differ between windows; a run stopped and
resumed trains the same layers and ends with the uninterrupted run's weights; the refusals before launch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import cli_env, run_cli
from swiftlite.train.lisa import sample, window_start

SEED = 4   # draws of 1 layer of 4 at steps done 0, 1, 2, 4: layers 0, 2, 3, 1 (each window another one)
FULL = ["sft", "--model", "tiny-llama", "--train_type", "full", "--torch_dtype", "fp32", "--max_steps", "6",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--learning_rate", "1e-3",
        "--seed", str(SEED), "--logging_steps", "1"]
ARGS = [*FULL, "--lisa_activated_layers", "1", "--lisa_step_interval", "2"]


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next((ckpt / "model").glob("*.safetensors"))))


def _base() -> dict[str, torch.Tensor]:
    """tiny-llama's starting weights (a built-in preset: seeded by --seed)."""
    from swiftlite.cli import parse_run_args
    from swiftlite.config import load_config
    from swiftlite.models.loading import load_model
    cf, values = parse_run_args(["--model", "tiny-llama", "--dataset", "x.jsonl", "--torch_dtype", "fp32",
                                 "--seed", str(SEED), "--train_type", "full"])
    return {k: v.detach().clone() for k, v in load_model(load_config(cf, values, validate_paths=False)).state_dict().items()}


def _changed_layers(a: dict, b: dict) -> tuple[set[int], set[str]]:
    """(decoder layers with a changed tensor, changed tensors outside the layers)."""
    changed = [k for k in b if not torch.equal(a[k], b[k])]
    layers = {int(m.group(1)) for k in changed if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    return layers, {k for k in changed if not k.startswith("model.layers.")}


def _draws(output: str) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for m in re.finditer(r"lisa: from step (\d+), training decoder layers ([\d, ]+) of", output)]


def test_each_step_changes_exactly_the_drawn_layers(demo_data, tmp_path):
    expected = [sample(SEED, window_start(g, 2), 4, 1) for g in range(6)]
    assert expected == [[0], [2], [3], [3], [1], [1]]   # the draws switch at steps 1, 2, 3, 5 and differ
    out = tmp_path / "run"
    proc = run_cli([*ARGS, "--dataset", demo_data[0], "--output_dir", out, "--save_steps", "1"])
    assert _draws(proc.stdout) == [(1, "0"), (2, "2"), (3, "3"), (5, "1")]
    prev = _base()
    outside = {k for k in prev if not k.startswith("model.layers.")}
    for step in range(1, 7):
        now = _weights(out / f"checkpoint-{step}")
        layers, rest = _changed_layers(prev, now)
        assert layers == set(expected[step - 1]), (step, layers)
        assert rest == outside   # embeddings, final norm, lm_head train at every step
        prev = now


@pytest.mark.parametrize("optim", [pytest.param([], id="adamw"),
                                   pytest.param(["--use_galore", "true", "--galore_rank", "8", "--galore_update_proj_gap", "2"],
                                                id="galore", marks=pytest.mark.long)])
def test_a_resumed_run_draws_the_same_layers_and_ends_with_the_same_weights(optim, demo_data, tmp_path):
    """Stopped after step 4 with checkpoint-3 (optimizer state for layers 0, 2, 3 only), resumed: the layer
    drawn at step 5 (1) gets its first state then, as in the run that was never stopped. GaLore too (its
    projectors are saved as tensors and rebuilt at the load)."""
    if optim:
        pytest.importorskip("galore_torch")
    data = ["--dataset", demo_data[0], "--save_steps", "3", *optim]
    whole = run_cli([*ARGS, *data, "--output_dir", tmp_path / "whole"])
    stopped = run_cli([*ARGS, *data, "--output_dir", tmp_path / "cut"], check=False,
                      env=cli_env(SWIFTLITE_FAULT="step=4,kind=raise"))
    assert stopped.returncode != 0 and (tmp_path / "cut" / "checkpoint-3").is_dir()
    resumed = run_cli([*ARGS, *data, "--output_dir", tmp_path / "cut", "--resume", "true"])
    # the whole run drew layer 3 before step 3 (its window goes on at step 4) and layer 1 before step 5
    assert _draws(whole.stdout)[2:] == [(3, "3"), (5, "1")]
    assert _draws(resumed.stdout) == [(4, "3"), (5, "1")]
    a, b = _weights(tmp_path / "whole" / "checkpoint-6"), _weights(tmp_path / "cut" / "checkpoint-6")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if optim:
        return

    # a full run without LISA goes on from the LISA checkpoint (other run facts: --ignore_data_skip) and
    # trains every layer, the one without optimizer state in the checkpoint (1) too
    run_cli([*FULL, *data, "--output_dir", tmp_path / "full", "--ignore_data_skip", "true",
             "--resume_from_checkpoint", tmp_path / "whole" / "checkpoint-3"])
    layers, _ = _changed_layers(_weights(tmp_path / "whole" / "checkpoint-3"),
                                _weights(tmp_path / "full" / "checkpoint-6"))
    assert layers == {0, 1, 2, 3}


@pytest.mark.parametrize("extra,expect", [
    (["--parallelism", "ddp", "--nproc_per_node", "2"], "--lisa_activated_layers with --parallelism ddp: "),
    (["--parallelism", "zero2", "--nproc_per_node", "2"], "--lisa_activated_layers with --parallelism zero2: "),
    (["--lisa_activated_layers", "9"], "--lisa_activated_layers 9: the model has 4 decoder layers"),
])
def test_refused_before_launch(extra, expect, demo_data, tmp_path):
    out = tmp_path / "run"
    proc = run_cli([*ARGS, "--dataset", demo_data[0], "--output_dir", out, *extra], check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and expect in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists()


def test_dry_run_shows_the_plan_on_auto(demo_data, tmp_path):
    """--parallelism auto on one CPU process picks single, which runs LISA; --dry-run says what will run."""
    proc = run_cli([*ARGS, "--dataset", demo_data[0], "--output_dir", tmp_path / "run", "--dry-run"])
    assert "backend:        single" in proc.stdout
    assert "lisa:           1 decoder layers at a time, drawn again every 2 steps (and at step 2) from --seed 4" \
        in proc.stdout
