"""--resume_only_model (ms-swift's flag): with --resume-from, a run loads the checkpoint's model
weights only; optimizer, LR schedule and data order start fresh at step 0, and a changed dataset or
batch (refused by a plain resume) is accepted.

Per backend (single, FSDP2 x 2, ZeRO-2 x 2): a 4-step run writes checkpoint-4; the run is then
rebuilt by the trainer's own `build_run` with --resume_only_model (tests/distributed/
_resume_only_model_worker.py) and stopped before its first step: every weight equals the
checkpoint's HF copy, the start step and the scheduler's step are 0, the optimizer holds no state
(ZeRO: its zero-filled states), and the lr is the schedule's first. One process: the whole command,
whose logged steps restart at 1 with the lr of a fresh run, from the loaded weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.conftest import cli_env, run_cli, run_worker

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "distributed" / "_resume_only_model_worker.py"
BASE = {"model": "tiny-llama-2l", "train_type": "full", "torch_dtype": "fp32", "per_device_train_batch_size": 2,
        "max_length": 64, "logging_steps": 1, "learning_rate": 1e-3, "lr_scheduler": "cosine", "warmup_steps": 1,
        "gradient_accumulation_steps": 1, "gradient_checkpointing": False}
KINDS = {"single": ([], {"parallelism": "single"}),
         "fsdp": (["--nproc-per-node", "2"], {"parallelism": "fsdp"}),
         "zero2": (["--nproc-per-node", "2"], {"parallelism": "zero2"})}


def flags(values: dict) -> list[str]:
    out: list[str] = []
    for k, v in values.items():
        out += [f"--{k}", str(v)]
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    from swiftlite.demo import write_demo_data
    root = tmp_path_factory.mktemp("resume_only_model")
    train, _ = write_demo_data(root / "data", n_train=64, n_val=4)
    return root, train


def _trained(root: Path, train: Path, kind: str) -> Path:
    extra, values = KINDS[kind]
    run = root / f"A_{kind}"
    if not run.exists():
        run_cli(["sft", *flags({**BASE, **values}), *extra, "--dataset", train, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max_steps", "4",
                 "--output_dir", run], env=cli_env(SWIFTLITE_CACHE=str(root / "cache")))
    return run / "checkpoint-4"


def _worker(root: Path, kind: str, values: dict) -> dict:
    cfg, out = root / f"cfg_{kind}.json", root / f"out_{kind}.json"
    cfg.write_text(json.dumps(values))
    p = run_worker(WORKER, [cfg, out], procs=2 if KINDS[kind][0] else 1, cwd=ROOT, timeout=600,
                   env=cli_env(SWIFTLITE_CACHE=str(root / "cache")))
    assert p.returncode == 0, f"{WORKER.name} {kind} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["single", "fsdp", pytest.param("zero2", marks=pytest.mark.long)])
def test_weights_only_step_zero_fresh_optimizer(data, kind):
    if kind == "zero2" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed")
    root, train = data
    ckpt = _trained(root, train, kind)
    # another batch size and another dataset spec: a plain resume refuses both
    values = {**BASE, **KINDS[kind][1], "dataset": [f"{train}#40"], "per_device_train_batch_size": 1,
              "max_steps": 3, "output_dir": str(root / f"B_{kind}"), "resume_from": str(ckpt),
              "resume_only_model": True, "compare_with": str(ckpt)}
    got = _worker(root, kind, values)
    assert got["world_size"] == (2 if KINDS[kind][0] else 1)
    assert got["start_step"] == 0 and got["scheduler_step"] == 0
    assert got["n_compared"] == got["n_weights"] > 10 and not got["missing"]
    assert got["max_diff"] == 0.0, got                     # every weight is the checkpoint's, exactly
    assert got["max_weight"] > 0
    assert got["optimizer"]["max_exp_avg"] == 0.0, got     # no moments carried over
    if got["backend"] != "deepspeed":
        assert got["optimizer"]["entries"] == 0
    # the schedule's first lr: that of a fresh engine with the same options
    fresh = _worker(root, f"{kind}", {**values, "resume_from": None, "resume_only_model": False,
                                      "output_dir": str(root / f"F_{kind}")})
    assert got["lr"] == fresh["lr"] and fresh["start_step"] == 0
    assert fresh["max_diff"] > 0                           # a fresh model is not the checkpoint's


def test_the_command_restarts_at_step_one_from_the_loaded_weights(data):
    root, train = data
    ckpt = _trained(root, train, "single")
    common = [*flags({**BASE, "parallelism": "single"}), "--dataset", f"{train}#40", "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max_steps", "3",
              "--per_device_train_batch_size", "1"]
    env = cli_env(SWIFTLITE_CACHE=str(root / "cache"))
    plain = run_cli(["sft", *common, "--output_dir", root / "P", "--resume_from_checkpoint", ckpt], check=False, env=env)
    assert plain.returncode == 2 and "was trained on other data or another run shape" in plain.stderr
    assert "--resume_only_model" in plain.stderr
    r = run_cli(["sft", *common, "--output_dir", root / "B", "--resume_from_checkpoint", ckpt,
                 "--resume_only_model", "true"], env=env)
    assert "--resume_only_model: loaded the model weights of checkpoint-4 (step 4)" in r.stdout
    assert "start fresh at step 0" in r.stdout and "check was skipped" in r.stdout
    run_cli(["sft", *common, "--output_dir", root / "C"], env=env)

    def records(d: Path) -> list[dict]:
        return [json.loads(x) for x in (d / "logging.jsonl").read_text().splitlines() if '"loss"' in x]
    b, c = records(root / "B"), records(root / "C")
    assert [x["step"] for x in b] == [1, 2, 3]
    assert [x["lr"] for x in b] == [x["lr"] for x in c]    # the schedule restarted, as a fresh run's
    # the same first batch (data order restarted) from other weights: the checkpoint's, not a fresh init
    assert b[0]["real_tokens"] == c[0]["real_tokens"] and b[0]["loss"] != c[0]["loss"]
    assert (root / "B" / "checkpoint-3").is_dir()
    assert json.loads((root / "B" / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3
    assert os.path.isdir(ckpt)
