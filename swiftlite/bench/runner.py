"""Running a bench: one `swiftlite sft` per backend, each in its own process group, then its figures
collected from the files the run wrote (never from what it printed). Per backend:

  step time     median over the timed steps of the slowest rank's step (perf_counter boundaries in
                profile/stats_rank<r>.json); the skipped first steps (--skip-steps), the profiled steps
                (the profiler slows them) and the last step (nothing marks its end) are left out.
  tokens/s      non-padding tokens of the global batch per step (from logging.jsonl) / step time.
  MFU           k x params x tokens/s / (peak x processes), k = 6 for a full fine-tune (forward 2,
                backward 4 FLOPs per parameter and token; attention FLOPs ignored), 4 for LoRA
                (no weight gradients for the frozen base); peak from bench/device.py.
  comm, overlap from the traces (bench/trace.py).
  peak memory   per rank: GPU allocator peak (torch.cuda.max_memory_allocated); on CPU the model-state
                bytes the run counted (logs/state_rank<r>.json) and max RSS (an upper bound: glibc keeps
                freed buffers; --exact-rss sets MALLOC_MMAP_THRESHOLD_=65536 so it returns them, which
                makes CPU steps 2-3x slower); next to the estimator's (plan.estimate, model_state_bytes).
  first step s  `elapsed_s` of the run's first logging.jsonl record (the first optimizer step is
                always logged): seconds from the trainer's start to the end of that step.
  ran as        the backend the run resolved to: its args.json through parallel/resolve.py.
  intra/inter   with --nnodes N each column runs as N local nodes (bench/nodes.py): bytes per step
                inside one node / across nodes, counted per process group from the recorded
                collectives (bench/groups.py), next to the planner's (planner/topology.py).
CPU runs get OMP_NUM_THREADS=1 unless it is set (the peak is measured on one thread per process).
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from swiftlite import dtypes, env
from swiftlite.bench.device import child_pythonpath, datasheet_peak, loadavg, machine_info, probe_device
from swiftlite.bench.nodes import FR_BUFFER_ENV, FR_BUFFER_SIZE, collect_links, node_commands, run_nodes
from swiftlite.bench.nodes import kill_group as _kill_group  # one process group per run, launcher and ranks
from swiftlite.bench.report import render_markdown, render_table, write_chart
from swiftlite.bench.spec import BackendSpec, BenchConfig
from swiftlite.bench.trace import analyze_trace
from swiftlite.checkpoint import layout
from swiftlite.errors import UserError


@dataclass
class BackendResult:
    label: str
    parallelism: str
    status: str = "ok"                 # ok, failed, timeout
    error: str = ""
    backend_resolved: str = ""
    world_size: int = 1
    wall_s: float | None = None
    first_step_s: float | None = None  # elapsed_s of the first logging.jsonl record
    step_time_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    tokens_per_step: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    comm_bytes_per_step: float | None = None
    comm_bytes_theory: int | None = None
    comm_ratio: float | None = None
    comm_bytes_by_kind: dict[str, float] = field(default_factory=dict)
    comm_time_s_per_step: float | None = None
    exposed_comm_s_per_step: float | None = None
    overlap: float | None = None
    overlap_source: str = ""
    peak_gpu_gib: list[float] = field(default_factory=list)       # per rank
    max_rss_mib: list[float] = field(default_factory=list)        # per rank
    state_bytes: list[int] = field(default_factory=list)          # per rank: params + grads + optimizer
    state_bytes_estimate: int | None = None
    memory_estimate_gib: float | None = None                      # GPU: estimate without CUDA overhead
    final_loss: float | None = None
    run_dir: str = ""
    command: str = ""
    nnodes: int = 1
    intra_node_bytes: float | None = None          # per rank per step, counted by process group
    inter_node_bytes: float | None = None
    intra_node_bytes_theory: int | None = None      # planner/topology.py
    inter_node_bytes_theory: int | None = None
    inter_node_ratio: float | None = None
    comm_groups: dict[str, Any] = field(default_factory=dict)  # group -> ranks, crosses_nodes, bytes/step
    link_kinds_from: str = ""                       # "trace" or "flight recorder" (bench/groups.py)


def planner_family(spec: BackendSpec, world: int) -> str | None:
    """The planner family of a column (the registry and the resolver decide, as for the run itself);
    None when it cannot be read (a plugin record without one, an unreadable DeepSpeed JSON): the
    column then has no estimate, and says so, rather than another family's."""
    from swiftlite.parallel.resolve import memory_family_for
    return memory_family_for(spec.parallelism, world)


def _workload(cfg: BenchConfig, world: int, dtype: str, gpu_memory: int | None):
    from swiftlite.planner import Workload
    return Workload(train_type=cfg.train_type, dtype=dtype, max_length=cfg.max_length,
                    micro_batch=cfg.per_device_train_batch_size, gradient_checkpointing=cfg.gradient_checkpointing,
                    world_size=world, gpus_per_node=world // cfg.nnodes, gpu_memory_bytes=gpu_memory,
                    overhead_bytes=0)


def sft_command(cfg: BenchConfig, spec: BackendSpec, dataset: str, run_dir: Path, nproc: int, dtype: str) -> list[str]:
    """The `swiftlite sft` command line of one column."""
    cmd = [sys.executable, "-m", "swiftlite", "sft", "--model", cfg.model, "--dataset", dataset,
           "--parallelism", spec.parallelism, "--max-steps", str(cfg.steps), "--logging-steps", "1",
           "--per-device-train-batch-size", str(cfg.per_device_train_batch_size),
           "--max-length", str(cfg.max_length), "--torch-dtype", dtype, "--train-type", cfg.train_type,
           "--output-dir", str(run_dir), "--overwrite-output-dir", "--save-hf-model", "false",
           "--report-to", "none", "--gradient-accumulation-steps", "1"]   # one micro-batch per step measured
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    if "--gradient-checkpointing" not in spec.extra_args:   # said either way: the run's default is on
        cmd += ["--gradient-checkpointing", "true" if cfg.gradient_checkpointing else "false"]
    if cfg.packing:
        cmd += ["--packing"]
    if cfg.external_plugins:  # a backend a plugin registers must be known to the run too
        cmd += ["--external-plugins", *(str(Path(p).expanduser().resolve()) for p in cfg.external_plugins)]
    cmd += list(spec.extra_args) + list(cfg.sft_args)
    return cmd


def _read_jsonl(p: Path) -> list[dict]:
    """The records of a jsonl file; a line cut short (a run killed mid-write) is skipped."""
    out = []
    for line in (p.read_text().splitlines() if p.is_file() else []):
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _last_error(text: str) -> str:
    """The run's error line (for the report's error column; no figure is read from the output)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:") or "Error" in ln.split(":")[0]:
            return ln[:300]
    return (lines[-1][:300] if lines else "no output")


def first_step_s(records: list[dict]) -> float | None:
    """Seconds from the trainer's start to the end of the first optimizer step: `elapsed_s` of the
    first record of logging.jsonl (that step is always logged)."""
    for rec in records:
        if "elapsed_s" in rec:
            return float(rec["elapsed_s"])
    return None


def ran_as(run_dir: Path, world: int, gpu_memory: int | None) -> str:
    """The backend the run resolved to: its args.json through the resolver the trainer uses."""
    from swiftlite.config import load_args
    from swiftlite.planner import choose_backend
    args = run_dir / layout.ARGS
    if not args.is_file():
        return ""
    try:
        return choose_backend(load_args(args), world, gpu_memory).name
    except (UserError, OSError, ValueError, KeyError, TypeError):
        return ""


def _step_times(cfg: BenchConfig, res: BackendResult, stats: list[dict], by_step: dict[int, dict]) -> None:
    profiled = set()
    for s in stats:
        profiled.update(s.get("profiled_steps", []))
    skip = set(range(1, cfg.skip_steps + 1)) | profiled | {cfg.steps}
    durations: dict[int, float] = {}
    if stats:
        for s in stats:
            for st, start, end in s.get("steps", []):
                if end is None or st in skip:
                    continue
                durations[st] = max(durations.get(st, 0.0), end - start)
    else:  # no profiling hook in the trainer: fall back to the log's wall-clock stamps
        for st, rec in by_step.items():
            prev = by_step.get(st - 1)
            if prev is not None and st not in skip:
                durations[st] = rec["time"] - prev["time"]
    if durations:
        res.step_times_s = [round(durations[k], 5) for k in sorted(durations)]
        res.step_time_s = statistics.median(durations.values())
    # tokens per step: tokens/s of the step's window x that window (stamps of consecutive records)
    toks = []
    for st in durations:
        rec, prev = by_step.get(st), by_step.get(st - 1)
        if rec and prev and "tokens_per_s" in rec:
            toks.append(rec["tokens_per_s"] * (rec["time"] - prev["time"]))
    if toks:
        res.tokens_per_step = statistics.median(toks)


def _estimates(cfg: BenchConfig, spec: BackendSpec, res: BackendResult, world: int, dtype: str, shape: Any,
               gpu_memory: int | None) -> None:
    from swiftlite import planner as plan
    if shape is None:
        return
    key = planner_family(spec, world)
    if key is None:
        res.error = res.error or f"estimate: --parallelism {spec.parallelism} has no memory model (no planner family)"
        return
    try:
        w = _workload(cfg, world, dtype, gpu_memory)
        if key in plan.SHARDING:
            res.state_bytes_estimate = sum(plan.model_state_bytes(shape, w, key).values())
            res.comm_bytes_theory = plan.comm_bytes_per_step(shape, w, key)
            if gpu_memory:
                est = plan.estimate(shape, w, key)
                res.memory_estimate_gib = round((est.total - est.overhead) / 2**30, 3)
    except UserError as e:
        res.error = res.error or f"estimate: {e}"


def _comm(res: BackendResult, prof_dir: Path, world: int, dtype: str) -> None:
    analyses = []
    for t in sorted(prof_dir.glob(layout.rank_glob("trace"))):
        try:
            analyses.append(analyze_trace(t, world, dtypes.BYTES.get(dtype, 4)))
        except (OSError, ValueError, KeyError) as e:
            res.error = res.error or f"trace {t.name}: {e}"
    if not analyses:
        return
    res.comm_bytes_per_step = statistics.mean(a["comm_bytes_per_step"] for a in analyses)
    kinds: dict[str, float] = {}
    for a in analyses:
        for k, v in a["comm_bytes_by_kind"].items():
            kinds[k] = kinds.get(k, 0.0) + v / len(analyses)
    res.comm_bytes_by_kind = kinds
    res.comm_time_s_per_step = statistics.mean(a["comm_time_s_per_step"] for a in analyses)
    res.exposed_comm_s_per_step = statistics.mean(a["exposed_comm_s_per_step"] for a in analyses)
    ovs = [a["overlap"] for a in analyses if a["overlap"] is not None]
    res.overlap = statistics.mean(ovs) if ovs else None
    res.overlap_source = analyses[0]["interval_source"]
    if res.comm_bytes_theory:
        res.comm_ratio = res.comm_bytes_per_step / res.comm_bytes_theory


def collect(cfg: BenchConfig, spec: BackendSpec, res: BackendResult, run_dir: Path, world: int, dtype: str,
            peak_flops: float | None, shape: Any, gpu_memory: int | None) -> None:
    """Fill `res` from the run folder (args.json, logging.jsonl, profile/, logs/state_rank*.json)."""
    res.backend_resolved = ran_as(run_dir, world, gpu_memory)
    log = _read_jsonl(run_dir / layout.LOGGING)
    res.first_step_s = first_step_s(log)
    records = [r for r in log if "loss" in r and "step" in r]
    if records:
        res.final_loss = records[-1]["loss"]
    prof_dir = run_dir / layout.PROFILE_DIR
    stats = [json.loads(p.read_text()) for p in sorted(prof_dir.glob(layout.rank_glob("stats")))]
    _step_times(cfg, res, stats, {r["step"]: r for r in records})
    if res.tokens_per_step and res.step_time_s:
        res.tokens_per_s = res.tokens_per_step / res.step_time_s
        if peak_flops and shape is not None:
            k = 6 if cfg.train_type == "full" else 4
            res.mfu = k * shape.n_params * res.tokens_per_s / (peak_flops * world)
    res.peak_gpu_gib = [s["cuda_max_allocated_gib"] for s in stats if "cuda_max_allocated_gib" in s]
    res.max_rss_mib = [s["max_rss_mib"] for s in stats if "max_rss_mib" in s]
    for p in sorted((run_dir / layout.LOGS_DIR).glob(layout.rank_glob("state"))):
        rec = json.loads(p.read_text())
        res.state_bytes.append(int(rec.get("params", 0)) + int(rec.get("grads", 0)) + int(rec.get("optimizer", 0)))
    _estimates(cfg, spec, res, world, dtype, shape, gpu_memory)
    _comm(res, prof_dir, world, dtype)
    profiled = {st for s in stats for st in s.get("profiled_steps", [])}
    collect_links(cfg, planner_family(spec, world), res, prof_dir, world // cfg.nnodes, dtype, shape,
                  len(profiled) or cfg.profile_steps)
    if res.intra_node_bytes is not None and (cfg.nnodes > 1 or res.link_kinds_from == "trace"):
        # the per-group count knows each collective's own group size (the trace's count assumes the world)
        res.comm_bytes_per_step = res.intra_node_bytes + res.inter_node_bytes
        if res.comm_bytes_theory:
            res.comm_ratio = res.comm_bytes_per_step / res.comm_bytes_theory


def child_env(cfg: BenchConfig, gpu_memory: int | None) -> dict[str, str]:
    """The environment of one run: this one without torchrun's rank variables, plus the bench hooks."""
    extra = {env.BENCH_STATS: "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
             "PYTHONPATH": child_pythonpath()}  # the children import this same swiftlite
    if gpu_memory is None:
        # CPU: one thread per process, as the peak was measured (torchrun does the same for several
        # processes); two threads per process on a shared 2-core machine ran 15x slower here.
        if not env.has("OMP_NUM_THREADS"):
            extra["OMP_NUM_THREADS"] = "1"
        if cfg.exact_rss:  # glibc then returns freed buffers at once: honest RSS, but steps 2-3x slower
            extra["MALLOC_MMAP_THRESHOLD_"] = "65536"
    if cfg.profile_steps > 0:
        extra[env.PROFILE] = f"{cfg.skip_steps + 1}:{cfg.profile_steps}"
        extra[FR_BUFFER_ENV] = str(FR_BUFFER_SIZE)  # collectives with their process groups (bench/groups.py)
    out = env.child_env(extra, drop_rank_vars=True)
    if cfg.profile_steps <= 0:
        out.pop(env.PROFILE, None)
    out.pop(env.PROFILE_DIR, None)
    return out


def run_backend(cfg: BenchConfig, spec: BackendSpec, dataset: str, out: Path, nproc: int, dtype: str,
                peak_flops: float | None, shape: Any, gpu_memory: int | None, echo=print) -> BackendResult:
    """Run one column to the end (or its timeout) and collect its figures."""
    run_dir = out / "runs" / spec.dirname
    cmd = sft_command(cfg, spec, dataset, run_dir, nproc, dtype)
    world = nproc * cfg.nnodes
    if cfg.nnodes > 1:
        from swiftlite.distributed import free_port
        cmds = node_commands(cmd + ([] if nproc > 1 else ["--nproc-per-node", "1"]), cfg.nnodes, free_port())
    res = BackendResult(label=spec.label, parallelism=spec.parallelism, world_size=world, nnodes=cfg.nnodes,
                        run_dir=str(run_dir),
                        command=shlex.join((cmds[0] if cfg.nnodes > 1 else cmd)[1:]).replace("-m swiftlite",
                                                                                             "swiftlite", 1))
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = out / "runs" / f"{spec.dirname}.log"
    echo(f"bench: {spec.label}: {res.command}")
    t = time.perf_counter()
    if cfg.nnodes > 1:
        rc = run_nodes(cmds, log_path, child_env(cfg, gpu_memory), cfg.timeout_s,
                       gpus_per_node=nproc if gpu_memory else None)
    else:
        rc = _run_one(cmd, log_path, child_env(cfg, gpu_memory), cfg.timeout_s)
    res.wall_s = round(time.perf_counter() - t, 2)
    if rc is None:
        res.status, res.error = "timeout", f"no result within {cfg.timeout_s} s (see {log_path})"
    elif rc != 0:
        res.status, res.error = "failed", f"exit {rc}: {_last_error(log_path.read_text(errors='replace'))}"
    try:
        collect(cfg, spec, res, run_dir, world, dtype, peak_flops, shape, gpu_memory)
    except (OSError, ValueError, KeyError, TypeError) as e:
        res.error = res.error or f"collect: {type(e).__name__}: {e}"
    if res.status == "ok" and res.step_time_s is None:
        res.status, res.error = "failed", res.error or "no timed steps recorded"
    if not cfg.keep_checkpoints:  # a 1B model's checkpoints are ~10-20 GB each: keep only the figures
        import shutil
        for ck in run_dir.glob("checkpoint-*"):
            shutil.rmtree(ck, ignore_errors=True)
    echo(f"bench: {spec.label}: {res.status}" + (f" ({res.error})" if res.error else "")
         + (f", step {res.step_time_s:.4f} s" if res.step_time_s else "") + f", wall {res.wall_s} s")
    return res


def _run_one(cmd: list[str], log_path: Path, run_env: dict[str, str], timeout_s: float) -> int | None:
    """Run one command to its end; its exit code, or None on timeout."""
    with log_path.open("w") as log:
        # its own session, so a timeout can end the launcher and every rank together
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None
        except BaseException:  # Ctrl-C, or SIGTERM from an outer timeout: take the run down with us
            _kill_group(proc)
            raise


def _exit_on_sigterm() -> None:
    """SIGTERM (e.g. `timeout` around the bench) unwinds like Ctrl-C, so the running backend is killed too."""
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def run_bench(cfg: BenchConfig, echo=print, console=None) -> dict[str, Any]:
    """Run every backend of `cfg`, write bench.json/md/png under cfg.output, print the table.
    Plugins (`cfg.external_plugins`) are loaded by the caller before `cfg.backends` is parsed."""
    from swiftlite.models.source import resolve_model
    cfg.check()
    source = resolve_model(cfg.model)  # an unknown preset or missing folder: one error before any run
    _exit_on_sigterm()
    out = Path(cfg.output).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    try:
        shape = source.shape()   # offline: a hub id has no parameter count here
    except UserError as e:
        echo(f"bench: no parameter count for {cfg.model} ({e}); MFU and estimates left out")
        shape = None
    device = probe_device(cfg.torch_dtype or "fp32")
    if device.get("cuda") and cfg.torch_dtype is None:
        device = probe_device("bf16")
    cuda = bool(device.get("cuda"))
    dtype = cfg.torch_dtype or ("bf16" if cuda else "fp32")
    nproc = cfg.nproc_per_node or (device.get("gpus", 1) if cuda else 2)
    sheet = datasheet_peak(device.get("device_name"), dtype) if cuda else None
    per_device_peak = sheet or device.get("measured_peak_flops")
    peak_source = ("datasheet" if sheet else "measured") if per_device_peak else "none"
    gpu_memory = device.get("gpu_memory_bytes") if cuda else None
    if cuda and nproc * cfg.nnodes > device.get("gpus", 1):
        raise UserError(f"--nproc-per-node {nproc}" + (f" x --nnodes {cfg.nnodes}" if cfg.nnodes > 1 else "")
                        + f": this machine has {device.get('gpus')} GPU(s)")

    dataset = cfg.dataset
    if not dataset:
        from swiftlite.demo import write_demo_data
        need = cfg.steps * cfg.per_device_train_batch_size * nproc * cfg.nnodes
        dataset = str(write_demo_data(out / "data", n_train=max(2000, need), n_val=8)[0])
    nodes = f"{cfg.nnodes} local nodes x " if cfg.nnodes > 1 else ""
    echo(f"bench: {cfg.model}, {len(cfg.backends)} backend(s) x {nodes}{nproc} process(es), {cfg.steps} steps, "
         f"batch {cfg.per_device_train_batch_size}/process, max length {cfg.max_length}, {dtype}, "
         f"{cfg.train_type}; peak {per_device_peak / 1e12 if per_device_peak else 0:.3g} TFLOP/s per "
         f"{'GPU' if cuda else 'process'} ({peak_source})")
    settings = {"model": cfg.model, "params": shape.n_params if shape else None, "steps": cfg.steps,
                "nproc_per_node": nproc, "nnodes": cfg.nnodes, "max_length": cfg.max_length,
                "per_device_train_batch_size": cfg.per_device_train_batch_size, "dtype": dtype,
                "train_type": cfg.train_type, "gradient_checkpointing": cfg.gradient_checkpointing,
                "dataset": dataset, "skip_steps": cfg.skip_steps, "profile_steps": cfg.profile_steps,
                "sft_args": list(cfg.sft_args), "external_plugins": list(cfg.external_plugins)}
    device_report = {**device, "peak_flops_per_device": per_device_peak, "peak_source": peak_source,
                     "datasheet_peak_flops": sheet}
    results: list[BackendResult] = []
    report: dict[str, Any] = {}
    for spec in cfg.backends:
        results.append(run_backend(cfg, spec, dataset, out, nproc, dtype, per_device_peak, shape, gpu_memory,
                                   echo=echo))
        # written after every backend: a bench killed half-way still leaves the figures it has
        info["loadavg_end"] = loadavg()
        report = {"complete": len(results) == len(cfg.backends), "date": time.strftime("%Y-%m-%d"),
                  "settings": settings, "machine": info, "device": device_report,
                  "results": [asdict(r) for r in results]}
        (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "bench.md").write_text(render_markdown(report))
    try:
        write_chart(report, out / "bench.png")
    except Exception as e:  # a chart must never lose the figures
        echo(f"bench: chart not written: {type(e).__name__}: {e}")
    render_table(report, console=console)
    echo(f"bench: wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return report
