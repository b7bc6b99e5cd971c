"""KTO and reward-model training, full fine-tuning, on fsdp: 2 CPU processes (gloo) against 1, through
the real CLI (`swiftlite rlhf`), as test_rlhf_parity.py does for DPO.

Each run trains the tiny 2-layer Llama (fp32, seed 7) for 3 steps on the same global batch of 4: one
process as 2 micro-batches of 2 (accumulation 2), two processes as 2 micro-batches of 1 each. KTO's KL
estimate pairs each row with another row's completion across the whole global batch (other ranks'
rows included) and the reward model's pair mean is over the global batch, so the losses must agree.
Asserted per step: loss within 1e-5 (and KTO's kl, the reward model's margin, within 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_plan_job

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_lora_worker.py"


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "logging.jsonl").read_text().splitlines()) if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from swiftlite.rlhf.demo import make_pairs
    root = tmp_path_factory.mktemp("kto_rm")
    kto, rm = root / "kto.jsonl", root / "rm.jsonl"
    pairs = make_pairs(16, seed=10)
    kto.write_text("".join(json.dumps({"messages": [*p["messages"][:-1], {"role": "assistant", "content": (
        p["messages"][-1]["content"] if i % 3 else p["rejected_response"])}], "label": bool(i % 3)}) + "\n"
        for i, p in enumerate(pairs)))
    rm.write_text("".join(json.dumps({**p, "margin": 0.5 * (i % 2)}) + "\n" for i, p in enumerate(pairs)))
    out: dict[str, Path] = {}
    plans: dict[int, list] = {1: [], 2: []}
    for method, data in (("kto", kto), ("rm", rm)):
        for procs, backend in ((1, "single"), (2, "fsdp")):
            name = f"{method}_{backend}"
            out[name] = root / name
            plans[procs].append({"name": name, "args": [
                "rlhf", "--rlhf-type", method, "--model", "tiny-llama-2l", "--dataset", data, "--full",
                "--torch-dtype", "fp32", "--parallelism", backend, "--seed", 7, "--learning-rate", "1e-3",
                "--gradient-checkpointing", "false", "--max-steps", 3, "--logging-steps", 1,
                "--per-device-train-batch-size", 2 // procs, "--gradient-accumulation-steps", 2,
                "--save-hf-model", "false", "--output-dir", out[name]]})
    run_plan_job(WORKER, plans[1], root, "one_process", 1, 600)
    run_plan_job(WORKER, plans[2], root, "fsdp_x2", 2, 600)
    return out


@pytest.mark.parametrize("method,second", [("kto", "kl"), ("rm", "margin")])
def test_two_processes_match_one(runs, method, second):
    one, two = _records(runs[f"{method}_single"]), _records(runs[f"{method}_fsdp"])
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for s in one:
        assert abs(one[s]["loss"] - two[s]["loss"]) <= 1e-5, (s, one[s]["loss"], two[s]["loss"])
        assert abs(one[s][second] - two[s][second]) <= 1e-5, (s, one[s][second], two[s][second])
    assert one[3]["loss"] != one[1]["loss"]       # it trained
