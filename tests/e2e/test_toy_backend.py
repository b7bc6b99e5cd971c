"""A backend added from a test module alone (tests/e2e/toy_backend_plugin.py: one record, one apply
function) trains through `swiftlite sft` and `swiftlite rlhf` (DPO with a frozen reference copy laid
out from its record), skips a nan step under `--nan-policy skip`, and shows in `--dry-run`, `estimate`
and `bench`, with no edit to any swiftlite file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import cli_env, read_losses, run_cli

PLUGIN = str(Path(__file__).with_name("toy_backend_plugin.py"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from swiftlite.demo import write_demo_data
    d = tmp_path_factory.mktemp("toydata")
    write_demo_data(d, n_train=64, n_val=8)
    return str(d / "train.jsonl")


def test_toy_backend_trains_and_resumes_through_sft(data, tmp_path):
    out = tmp_path / "run"
    base = ["sft", "--external-plugins", PLUGIN, "--model", "tiny-llama", "--train-type", "full", "--dataset", data,
            "--parallelism", "toy", "--per-device-train-batch-size", "4", "--learning-rate", "2e-3",
            "--logging-steps", "1", "--output-dir", str(out), "--save-steps", "2"]
    proc = run_cli([*base, "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "3"])
    assert "swiftlite: toy x 1 process(es)" in proc.stdout
    losses = read_losses(out)
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1]
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["backend"] == "toy"
    # resume through the same record: checkpoint-2 -> step 3 reproduces the loss
    again = tmp_path / "again"
    again.mkdir()
    proc2 = run_cli([*base[:-4], "--output-dir", str(again), "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "3",
                     "--resume-from", str(out / "checkpoint-2")])
    assert "resuming from checkpoint-2" in proc2.stdout
    assert read_losses(again)[3] == pytest.approx(losses[3], rel=1e-6)


def test_toy_backend_trains_dpo_with_a_frozen_reference_copy(tmp_path):
    """A full fine-tune's DPO reference is a frozen copy; the toy record names none, so it gets the layout
    of its policy's engine (parallel/frozen_copy.py like_policy: a replica here) and the run says so. It is
    the starting weights, so step 1's loss is ln 2."""
    from swiftlite.rlhf.demo import write_preference_data
    train, _ = write_preference_data(tmp_path / "pref", n_train=32, n_val=8)
    out = tmp_path / "dpo"
    proc = run_cli(["rlhf", "--rlhf_type", "dpo", "--external-plugins", PLUGIN, "--model", "tiny-llama",
                    "--train-type", "full", "--dataset", str(train), "--parallelism", "toy",
                    "--per-device-train-batch-size", "4", "--learning-rate", "1e-3", "--logging-steps", "1",
                    "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "3", "--output-dir", str(out)])
    assert "swiftlite: toy x 1 process(es)" in proc.stdout
    assert "reference: a frozen copy" in proc.stdout
    # the record names no frozen_copy: the run says what it got instead, in one line
    assert ("reference copy: --parallelism toy names no frozen_copy (Backend.frozen_copy); laid out like its "
            "policy engine: a replica on cpu") in proc.stdout
    losses = read_losses(out)
    assert sorted(losses) == [1, 2, 3]
    assert losses[1] == pytest.approx(math.log(2), rel=1e-5)
    assert losses[3] < losses[1]


def test_toy_backend_skips_a_nan_step(data, tmp_path):
    """--nan-policy skip goes on past a nan gradient: the toy's engine says it leaves the weights alone
    on such a step (Engine.skips_nonfinite), as the torch backends' engine does."""
    out = tmp_path / "nan"
    env = cli_env(SWIFTLITE_FAULT="step=2,phase=grads,kind=nan")
    run_cli(["sft", "--external-plugins", PLUGIN, "--model", "tiny-llama", "--train-type", "full", "--dataset", data,
             "--parallelism", "toy", "--per-device-train-batch-size", "4", "--logging-steps", "1",
             "--gradient-accumulation-steps", "1", "--gradient-checkpointing", "false", "--max-steps", "4", "--nan-policy", "skip", "--output-dir", str(out)], env=env)
    recs = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    skipped = [r for r in recs if "skipped_step" in r]
    assert [r["step"] for r in skipped] == [2] and "grad norm is nan" in skipped[0]["skipped_step"]
    assert sorted(read_losses(out)) == [1, 3, 4]
    assert all(math.isfinite(v) for v in read_losses(out).values())


def test_toy_backend_in_dry_run(data, tmp_path):
    proc = run_cli(["sft", "--external-plugins", PLUGIN, "--dataset", data, "--parallelism", "toy_backend",
                    "--output-dir", str(tmp_path / "o"), "--dry-run"])
    assert proc.stdout.splitlines()[0].split() == ["backend:", "toy"]
    bad = run_cli(["sft", "--external-plugins", PLUGIN, "--dataset", data, "--parallelism", "toy",
                   "--nproc-per-node", "2", "--output-dir", str(tmp_path / "o"), "--dry-run"], check=False)
    assert bad.returncode == 2 and "--parallelism toy runs one process" in bad.stderr


def test_toy_backend_in_estimate():
    proc = run_cli(["estimate", "--external-plugins", PLUGIN, "--model", "llama-8b", "--gpus", "1",
                    "--train-type", "lora", "--json"])
    table = json.loads(proc.stdout)["table"]
    assert "toy" in table
    # its memory family is ddp's: on one GPU it is counted exactly like "single" (a full replica)
    assert table["toy"]["total"] == table["single"]["total"]


def test_toy_backend_in_bench(data, tmp_path):
    out = tmp_path / "bench"
    run_cli(["bench", "--external-plugins", PLUGIN, "--parallelism", "toy,single", "--steps", "8",
             "--nproc-per-node", "1", "--dataset", data, "--output", str(out)], timeout=900)
    labels = {r["label"]: r for r in json.loads((out / "bench.json").read_text())["results"]}
    assert set(labels) == {"toy", "single"}
    assert labels["toy"]["final_loss"] == pytest.approx(labels["single"]["final_loss"], rel=1e-5)
