"""swiftlite bench / profiling pieces that need no training run: backend specs, collective byte
counting, interval overlap, the profiling hook's window and stats."""

from __future__ import annotations

import json

import pytest

from swiftlite import bench, profiling
from swiftlite.errors import UserError


def test_parse_backends():
    specs = bench.parse_backends("ddp, fsdp,fsdp+compile,zero3,fsdp1+gc")
    assert [s.label for s in specs] == ["ddp", "fsdp", "fsdp+compile", "zero3", "fsdp1+gc"]
    assert specs[2].parallelism == "fsdp" and specs[2].extra_args == ("--compile",)
    assert specs[4].extra_args == ("--gradient-checkpointing",)
    for bad in ("", "ddp,ddp", "megatron", "fsdp+turbo", "zero3+offload", "nothere.json"):
        with pytest.raises(UserError):
            bench.parse_backends(bad)


def test_parse_backends_json(tmp_path):
    p = tmp_path / "my_zero3.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    (spec,) = bench.parse_backends(str(p))
    assert spec.label == "my_zero3" and spec.parallelism == str(p.resolve())
    assert bench.planner_family(spec, 2) == "zero3"


def test_a_column_without_a_planner_family_gets_no_estimate_and_says_so():
    """A column whose family cannot be read (here a record name no registry knows) is not estimated as
    another family's (it was zero3's): its result says why it has no estimate."""
    from swiftlite.bench.runner import BackendResult, _estimates
    from swiftlite.planner import shape_from_model_arg
    spec = bench.BackendSpec(label="mine", parallelism="no-such-backend")
    assert bench.planner_family(spec, 2) is None
    res = BackendResult(label="mine", parallelism="no-such-backend")
    cfg = bench.BenchConfig(model="tiny-llama-2l")
    _estimates(cfg, spec, res, 2, "fp32", shape_from_model_arg("tiny-llama-2l"), None)
    assert res.state_bytes_estimate is None and "no memory model" in res.error


def test_config_needs_timed_steps():
    cfg = bench.BenchConfig(backends=bench.parse_backends("ddp"), steps=5, warmup_steps=1, profile_steps=2)
    with pytest.raises(UserError, match="--steps 5"):
        cfg.check()
    bench.BenchConfig(backends=bench.parse_backends("ddp"), steps=6, warmup_steps=1, profile_steps=2).check()


def _ev(name, ts, dur, tid=1, cat="cpu_op", dims=None, types=None):
    e = {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "cat": cat, "args": {}}
    if dims is not None:
        e["args"]["Input Dims"] = dims
        e["args"]["Input type"] = types or []
    return e


def test_collective_bytes_ring_convention():
    w = 4
    ag = _ev("c10d::_allgather_base_", 0, 1, dims=[[400], [100], [], [], []], types=["float", "float"])
    assert bench.collective_bytes(ag, w, 2) == ("all_gather", 0.75 * 1600)
    # FSDP1's allgather_: the output list is not recorded -> N x the input shard, default element size
    ag1 = _ev("c10d::allgather_", 0, 1, dims=[[], [[100]], [], [], []], types=["", "TensorList"])
    assert bench.collective_bytes(ag1, w, 2) == ("all_gather", 0.75 * 4 * 100 * 2)
    rs = _ev("c10d::_reduce_scatter_base_", 0, 1, dims=[[100], [400], [], []], types=["c10::BFloat16"] * 2)
    assert bench.collective_bytes(rs, w, 4) == ("reduce_scatter", 0.75 * 800)
    ar = _ev("c10d::allreduce_", 0, 1, dims=[[[10, 10]], [], []], types=["TensorList"])
    assert bench.collective_bytes(ar, w, 4) == ("all_reduce", 2 * 0.75 * 400)
    assert bench.collective_bytes(ar, 1, 4) is None
    assert bench.collective_bytes(_ev("aten::mm", 0, 1), w, 4) is None


def test_analyze_trace_overlap_and_nesting(tmp_path):
    # two profiled steps of 100 us; rank 0's main thread computes in [0,40) and [100,140);
    # a gloo thread runs collectives [30,60) and [100,120): 10 + 20 of 50 us hidden
    events = [
        _ev("swiftlite_step#3", 0, 100, cat="user_annotation"),
        _ev("swiftlite_step#4", 100, 100, cat="user_annotation"),
        _ev("aten::mm", 0, 40),
        _ev("aten::mm", 100, 40),
        _ev("aten::add", 42, 1),
        _ev("c10d::_allgather_base_", 41, 5, dims=[[200], [100]], types=["float", "float"]),
        # nested twin (e.g. a wrapper calling the op): counted once
        _ev("c10d::_allgather_base_", 42, 1, dims=[[200], [100]], types=["float", "float"]),
        _ev("c10d::allreduce_", 150, 60, dims=[[[50]]], types=["TensorList"]),
        _ev("aten::copy_", 160, 10),  # inside the blocking all-reduce call: not compute
        _ev("gloo:all_gather", 30, 30, tid=9, cat="user_annotation"),
        _ev("gloo:all_reduce", 100, 20, tid=9, cat="user_annotation"),
    ]
    p = tmp_path / "trace_rank0.json"
    p.write_text(json.dumps({"traceEvents": events}))
    a = bench.analyze_trace(p, world=2, default_elem=4)
    assert a["steps"] == 2
    assert a["comm_bytes_by_kind"] == {"all_gather": 0.5 * 800 / 2, "all_reduce": 2 * 0.5 * 200 / 2}
    assert a["overlap"] == pytest.approx(30 / 50)
    assert a["comm_time_s_per_step"] == pytest.approx(50e-6 / 2)


def test_profiling_window_parsing():
    assert profiling.parse_window("4:2") == (4, 2)
    assert profiling.parse_window("3") == (3, 1)
    assert profiling.parse_window("") is None and profiling.parse_window("0") is None
    with pytest.raises(ValueError):
        profiling.parse_window("0:2")


def test_step_hook_is_a_noop_when_off(tmp_path, monkeypatch):
    monkeypatch.delenv(profiling.ENV_PROFILE, raising=False)
    monkeypatch.delenv(profiling.ENV_STATS, raising=False)
    profiling.reset()
    for s in range(3):
        profiling.step_hook(s, tmp_path, 0)
    assert not (tmp_path / "profile").exists()
    profiling.reset()


def test_step_hook_stats_and_trace(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv(profiling.ENV_STATS, "1")
    monkeypatch.setenv(profiling.ENV_PROFILE, "2:2")
    profiling.reset()
    a = torch.randn(64, 64)
    for s in range(5):
        profiling.step_hook(s, tmp_path, 0)
        (a @ a).sum()
    profiling.finish()
    profiling.reset()
    stats = json.loads((tmp_path / "profile" / "stats_rank0.json").read_text())
    assert [s[0] for s in stats["steps"]] == [1, 2, 3, 4, 5]
    assert all(s[2] >= s[1] for s in stats["steps"][:-1]) and stats["steps"][-1][2] is None
    assert stats["profiled_steps"] == [2, 3] and stats["max_rss_mib"] > 0
    trace = json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"swiftlite_step#2", "swiftlite_step#3"} <= names and "aten::mm" in names


def test_first_step_time_is_read_from_logging_jsonl(tmp_path):
    # a fake run folder: logging.jsonl (the first optimizer step is always logged, with elapsed_s), the
    # per-rank step boundaries, and args.json; no printed output is handed to collect at all
    from swiftlite.config import build_config, save_args
    run = tmp_path / "run"
    (run / "profile").mkdir(parents=True)
    recs = [{"time": 100.0 + s, "step": s, "loss": 2.0 / s, "tokens_per_s": 64.0, "elapsed_s": 7.25 + s - 1}
            for s in range(1, 7)]
    recs.insert(3, {"time": 103.5, "step": 3, "eval_loss": 1.0})
    (run / "logging.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"cut short')
    steps = [[s, 10.0 + s, 10.5 + s if s < 6 else None] for s in range(1, 7)]
    (run / "profile" / "stats_rank0.json").write_text(json.dumps({"steps": steps, "profiled_steps": [2, 3]}))
    save_args(build_config({"parallelism": "ddp"}), run / "args.json")
    cfg = bench.BenchConfig(backends=bench.parse_backends("ddp"), steps=6, skip_steps=1, profile_steps=2)
    res = bench.BackendResult(label="ddp", parallelism="ddp")
    bench.collect(cfg, cfg.backends[0], res, run, 1, "fp32", None, None, None)
    assert res.first_step_s == 7.25
    assert res.step_times_s == [0.5, 0.5] and res.final_loss == 2.0 / 6  # steps 4, 5
    assert res.backend_resolved == "single"  # ddp on one process, as the resolver says
    assert bench.first_step_s([{"step": 1, "eval_loss": 1.0}]) is None


def test_external_plugins_are_passed_on_to_sft(tmp_path):
    plugin = tmp_path / "my_backend.py"
    plugin.write_text("")
    cfg = bench.BenchConfig(backends=bench.parse_backends("ddp"), external_plugins=(str(plugin),),
                            sft_args=("--lora-rank", "4"))
    cmd = bench.sft_command(cfg, cfg.backends[0], "data.jsonl", tmp_path / "run", 2, "fp32")
    i = cmd.index("--external-plugins")
    assert cmd[i + 1] == str(plugin.resolve()) and cmd[-2:] == ["--lora-rank", "4"]
    assert "--external-plugins" not in bench.sft_command(bench.BenchConfig(backends=cfg.backends), cfg.backends[0],
                                                         "data.jsonl", tmp_path / "run", 2, "fp32")


def test_cli_loads_plugins_before_reading_parallelism(tmp_path, capsys):
    from swiftlite.cli import main
    from swiftlite.parallel.base import unregister_backend
    plugin = tmp_path / "toy_backend.py"
    plugin.write_text("from swiftlite.parallel.base import Backend, register_backend\n"
                      "register_backend(Backend(name='toy_bench_ddp', engine='ddp', factory='swiftlite.parallel.ddp:ddp',"
                      " memory_family='ddp'))\n")
    try:
        # known once the plugin ran: the bench gets as far as its own checks (--steps 0 is refused)
        assert main(["bench", "--external_plugins", str(plugin), "--parallelism_type", "toy_bench_ddp",
                     "--steps", "0"]) == 2
        assert "--steps 0: needs at least" in capsys.readouterr().err
    finally:
        unregister_backend("toy_bench_ddp")
    assert main(["bench", "--parallelism", "toy_bench_ddp", "--steps", "0"]) == 2
    assert "unknown backend 'toy_bench_ddp'" in capsys.readouterr().err
