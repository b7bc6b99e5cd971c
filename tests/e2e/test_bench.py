"""`swiftlite bench` end to end: 2 CPU processes, the tiny 2-layer Llama, ddp / fsdp / fsdp1 / ZeRO-3.

One bench run (each backend a real `swiftlite sft` under torchrun, profiled by swiftlite/profiling.py),
then checks on what it wrote. No timing is asserted (the machine is shared): only that figures exist,
and that the communication counted from the traces matches the estimator's volume:
  ddp   2(N-1)/N x grad bytes                      (one all-reduce of the gradients)
  fsdp  3(N-1)/N x param bytes                     (all-gather forward + backward, reduce-scatter)
  zero3 3(N-1)/N x param bytes, with a ZeRO-3 config that releases parameters after use
        (stage3_max_live_parameters / max_reuse_distance 0). The shipped zero3 preset keeps DeepSpeed's
        defaults (1e9), under which a model this small stays gathered from forward to backward
        and moves 2(N-1)/N x param bytes instead (docs/benchmarks.md).
  fsdp1 3(N-1)/N x param bytes minus one all-gather of the root unit (embeddings, norm, head): FSDP1
        keeps the root unsharded from forward to backward, FSDP2 regathers it.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    backends = ["ddp", "fsdp", "fsdp1"]
    if importlib.util.find_spec("deepspeed") is not None:
        ds = json.loads((ROOT / "swiftlite" / "ds_configs" / "zero3.json").read_text())
        ds["zero_optimization"].update({"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
                                        "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0})
        path = root / "zero3_release.json"
        path.write_text(json.dumps(ds))
        backends.append(str(path))
    out = root / "out"
    proc = run_cli(["bench", "--model", "tiny-llama-2l", "--parallelism", ",".join(backends), "--steps", 6,
                    "--warmup-steps", 1, "--profile-steps", 2, "--nproc-per-node", 2, "--max-length", 32,
                    "--sft-arg=--truncation-strategy=right",
                    "--per-device-train-batch-size", 2, "--output", out, "--timeout", 300], timeout=900)
    report = json.loads((out / "bench.json").read_text())
    return out, proc, report, {r["label"]: r for r in report["results"]}


def test_writes_table_json_markdown_and_chart(bench):
    out, proc, report, res = bench
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    assert "| backend | status | ran as | step ms |" in md
    for label in res:
        assert f"| {label} | ok |" in md
        assert label in proc.stdout  # the rich table
    assert report["settings"]["nproc_per_node"] == 2 and report["settings"]["dtype"] == "fp32"
    assert report["device"]["peak_source"] == "measured" and report["device"]["peak_flops_per_device"] > 0


def test_every_backend_reports_its_figures(bench):
    _out, _proc, _report, res = bench
    for label, r in res.items():
        assert r["status"] == "ok", (label, r["error"])
        assert r["world_size"] == 2
        assert r["step_time_s"] > 0 and len(r["step_times_s"]) == 2  # steps 4 and 5 (1 warm-up, 2-3 profiled, 6 last)
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
        assert r["first_step_s"] is not None and r["wall_s"] > 0
        assert len(r["max_rss_mib"]) == 2 and len(r["state_bytes"]) == 2
        assert r["overlap"] is None or 0.0 <= r["overlap"] <= 1.0
        assert r["comm_time_s_per_step"] > 0


def test_comm_bytes_match_the_theoretical_volume(bench):
    _out, _proc, report, res = bench
    for label in ("ddp", "fsdp") + (("zero3_release",) if "zero3_release" in res else ()):
        r = res[label]
        assert r["comm_bytes_theory"] > 0
        assert abs(r["comm_bytes_per_step"] / r["comm_bytes_theory"] - 1) < 0.10, (label, r["comm_bytes_by_kind"])
    # fsdp: two all-gathers of every parameter (forward, backward), but one of lm_head (its own unit,
    # kept gathered from its forward into backward), and one reduce-scatter of the grads
    from swiftlite.planner import shape_from_model_arg
    f = res["fsdp"]["comm_bytes_by_kind"]
    tiny = shape_from_model_arg("tiny-llama-2l")
    assert abs(f["all_gather"] / f["reduce_scatter"] - (2 - tiny.vocab * tiny.hidden / tiny.n_params)) < 0.05
    # fsdp1: the root unit (lm_head, final norm) is gathered once, not twice; the embeddings, a unit
    # of their own (parallel/fsdp1.py), twice like a decoder layer
    shape = shape_from_model_arg("tiny-llama-2l")
    expected = 1 - (shape.n_nonlayer_params - shape.vocab * shape.hidden) / (3 * shape.n_params)
    assert abs(res["fsdp1"]["comm_ratio"] - expected) < 0.02, (res["fsdp1"]["comm_bytes_by_kind"], expected)


def test_memory_per_rank_matches_the_estimate(bench):
    _out, _proc, _report, res = bench
    ddp, fsdp = res["ddp"], res["fsdp"]
    # fp32 model states are counted exactly by the estimator; sharding halves them on 2 ranks
    for r in (ddp, fsdp):
        for b in r["state_bytes"]:
            assert abs(b / r["state_bytes_estimate"] - 1) < 0.02, r["label"]
    assert abs(max(fsdp["state_bytes"]) / max(ddp["state_bytes"]) - 0.5) < 0.02
