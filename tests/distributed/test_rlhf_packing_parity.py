"""Packed DPO pairs (--packing, rlhf/packing.py) on 2 CPU processes against 1, through the CLI: the same
global batch of 2 packs (one process: a micro-batch of 2 packs; two: a pack each) gives the same losses
and rewards per step on ddp and fsdp (the pair mean is over the pairs of both ranks' packs)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

COMMON = ["rlhf", "--rlhf_type", "dpo", "--model", "tiny-llama-2l", "--torch-dtype", "fp32", "--seed", "3",
          "--gradient_accumulation_steps", "1", "--logging-steps", "1", "--full", "--max-steps", "2",
          "--max_length", "200", "--packing", "true", "--rpo_alpha", "0.1", "--learning-rate", "1e-3",
          "--save-hf-model", "false"]


def _steps(run):
    recs = [json.loads(x) for x in (run / "logging.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if "loss" in r}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from swiftlite.rlhf.demo import write_preference_data
    train, _ = write_preference_data(tmp_path_factory.mktemp("pairs"), n_train=12, n_val=2)
    return train


def test_two_processes_match_one_on_packed_pairs(data, tmp_path):
    one = tmp_path / "one"
    proc = run_cli([*COMMON, "--dataset", data, "--parallelism", "single", "--per_device_train_batch_size", "2",
                    "--output-dir", one])
    assert "packs of whole pairs" in proc.stdout and "global batch 2," in proc.stdout
    ref = _steps(one)
    assert sorted(ref) == [1, 2] and ref[2]["rewards/margins"] != 0.0
    for backend in ("ddp", "fsdp"):
        run = tmp_path / backend
        run_cli([*COMMON, "--dataset", data, "--parallelism", backend, "--nproc_per_node", "2",
                 "--per_device_train_batch_size", "1", "--output-dir", run], timeout=900)
        got = _steps(run)
        assert sorted(got) == [1, 2]
        for k in (1, 2):
            assert got[k]["loss"] == pytest.approx(ref[k]["loss"], rel=1e-5), (backend, k)
            for name in ("rewards/margins", "rewards/chosen", "nll_loss"):
                assert got[k][name] == pytest.approx(ref[k][name], abs=1e-5), (backend, k, name)
