"""`swiftlite bench`: the same training job under several backends, side by side.

Each backend runs as its own `swiftlite sft` in a subprocess, through the real CLI (so each gets its
own launcher and process group), with `--logging-steps 1` and two environment hooks read by
swiftlite/profiling.py: SWIFTLITE_BENCH_STATS=1 (per-rank step boundaries and peak memory) and
SWIFTLITE_PROFILE=K:N (a torch.profiler Chrome trace per rank over steps K..K+N-1). From those the
bench reports, per backend:

  step time     median over the timed steps of the slowest rank's step (perf_counter boundaries);
                warm-up steps, the profiled steps (the profiler slows them) and the last step
                (nothing marks its end) are left out.
  tokens/s      non-padding tokens of the global batch per step (from logging.jsonl) / step time.
  MFU           k x params x tokens/s / (peak x processes), k = 6 for a full fine-tune (forward 2,
                backward 4 FLOPs per parameter and token; attention FLOPs ignored), 4 for LoRA
                (no weight gradients for the frozen base). Peak: the datasheet dense rate of a known
                GPU in the run's dtype, else a matmul loop measured once per bench in a subprocess
                (CPU: 2048x2048 in the run's dtype on one thread, times the processes).
  comm/step     bytes each rank moves per step in ring terms, counted from the collectives in the
                trace (their input/output sizes): all-gather (N-1)/N x output, reduce-scatter
                (N-1)/N x input, all-reduce 2(N-1)/N x buffer, broadcast (N-1)/N x buffer. Shown
                next to the estimator's plan.comm_bytes_per_step (3(N-1)/N x 2Psi for ZeRO-3/FSDP
                in bf16, 2(N-1)/N x grads for DDP, ...).
  overlap       share of collective time hidden under compute: |comm intervals & compute intervals|
                / |comm intervals| over the profiled steps. GPU: NCCL kernels vs the other kernels.
                CPU/gloo: gloo's worker-thread collectives vs the main thread's aten ops outside
                collective calls and waits.
  peak memory   per rank: GPU allocator peak (torch.cuda.max_memory_allocated); on CPU the
                model-state bytes the run counted (logs/state_rank<r>.json) and max RSS (an upper bound:
                glibc keeps freed buffers; --exact-rss sets MALLOC_MMAP_THRESHOLD_=65536 so it returns
                them, which makes CPU steps 2-3x slower), next to the estimator's figure
                (plan.estimate / plan.model_state_bytes).
CPU runs get OMP_NUM_THREADS=1 unless it is set (the peak is measured on one thread per process).

Writes <output>/bench.json, bench.md, bench.png and prints a rich table. Run folders and logs stay
in <output>/runs/<backend>/ (with their traces under profile/).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from swiftlite.errors import UserError

#: Dense tensor-core / FP32 peaks from vendor datasheets (FLOP/s per GPU, SXM parts, no sparsity).
DATASHEET_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
    "H100": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
}

MODIFIERS = {"compile": ["--compile"], "gc": ["--gradient-checkpointing"], "ac": ["--gradient-checkpointing"],
             "offload": ["--cpu-offload"]}

_TYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
               "short int": 2, "bool": 1, "unsigned char": 1, "signed char": 1, "c10::Float8_e4m3fn": 1,
               "c10::Float8_e5m2": 1}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# --------------------------------------------------------------------------------------------------
# What to run


@dataclass(frozen=True)
class BackendSpec:
    """One column of the bench: `fsdp`, `fsdp+compile`, `zero3`, or a DeepSpeed JSON file."""
    label: str
    parallelism: str
    extra_args: tuple[str, ...] = ()

    @property
    def dirname(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.+-]", "_", self.label)


def parse_backends(text: str) -> list[BackendSpec]:
    """"ddp,fsdp,fsdp+compile,zero3,my_ds.json" -> specs. `+compile`, `+gc` (activation
    checkpointing) and `+offload` (FSDP CPU offload) add flags; a .json item is a DeepSpeed config."""
    specs: list[BackendSpec] = []
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        if item.endswith(".json"):
            if not Path(item).is_file():
                raise UserError(f"--parallelism {item}: no such DeepSpeed JSON file")
            specs.append(BackendSpec(Path(item).stem, str(Path(item).resolve())))
            continue
        base, *mods = item.split("+")
        from swiftlite.parallel.base import find_backend, parallelism_names
        rec = find_backend(base)
        if rec is None:
            names = [n for n in parallelism_names() if n not in ("auto", "deepspeed")]
            raise UserError(f"--parallelism {item}: unknown backend {base!r} "
                            f"(choose from {', '.join(names)}, or a DeepSpeed .json)")
        extra: list[str] = []
        for m in mods:
            if m not in MODIFIERS:
                raise UserError(f"--parallelism {item}: unknown modifier +{m} (known: {', '.join(MODIFIERS)})")
            if m == "offload" and "cpu_offload" not in rec.options:
                raise UserError(f"--parallelism {item}: +offload is FSDP's CPU offload; use zero3_offload for DeepSpeed")
            extra += MODIFIERS[m]
        specs.append(BackendSpec(item, base, tuple(extra)))
    if not specs:
        raise UserError("--parallelism: name at least one backend (e.g. ddp,fsdp,zero3)")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise UserError(f"--parallelism: a backend is named twice ({text})")
    return specs


@dataclass(kw_only=True)
class BenchConfig:
    model: str = "tiny-llama"
    backends: list[BackendSpec] = field(default_factory=list)
    steps: int = 20
    nproc_per_node: int | None = None       # None: the GPUs on this machine, else 2 CPU processes
    max_length: int = 128
    per_device_train_batch_size: int = 4
    dataset: str | None = None               # None: the demo task, written under <output>/data
    output: str = "bench"
    train_type: str = "full"
    torch_dtype: str | None = None           # None: bf16 on GPU, fp32 on CPU
    gradient_checkpointing: bool = False
    warmup_steps: int = 3
    profile_steps: int = 2
    timeout_s: int = 900                     # per backend run
    sft_args: tuple[str, ...] = ()           # extra flags for every `swiftlite sft`
    packing: bool = False
    keep_checkpoints: bool = False           # False: delete each run's checkpoint-* after reading it
    exact_rss: bool = False                  # CPU: MALLOC_MMAP_THRESHOLD_=65536 (true RSS, slower steps)

    def check(self) -> None:
        if self.steps < self.warmup_steps + self.profile_steps + 3:
            raise UserError(f"--steps {self.steps}: needs at least warm-up ({self.warmup_steps}) + profiled "
                            f"({self.profile_steps}) + 3 steps, so that two steps are timed")
        for flag, v in (("--max-length", self.max_length), ("--per-device-train-batch-size",
                        self.per_device_train_batch_size), ("--timeout", self.timeout_s)):
            if v < 1:
                raise UserError(f"{flag} must be positive, got {v}")
        if self.warmup_steps < 0 or self.profile_steps < 0:
            raise UserError("--warmup-steps and --profile-steps must be >= 0")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise UserError(f"--nproc-per-node must be positive, got {self.nproc_per_node}")
        if self.dataset and not Path(self.dataset.split("#")[0]).exists():
            raise UserError(f"--dataset {self.dataset}: not found")


# --------------------------------------------------------------------------------------------------
# Device and peak


_PEAK_PROBE = r"""
import json, os, sys, time
import torch
dtype_name = sys.argv[1]
out = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
if out["cuda"]:
    out["gpus"] = torch.cuda.device_count()
    out["device_name"] = torch.cuda.get_device_name(0)
    out["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dt[dtype_name]); b = torch.randn_like(a)
    for _ in range(3): a @ b
    torch.cuda.synchronize()
    iters = 20
    t = time.perf_counter()
    for _ in range(iters): a @ b
    torch.cuda.synchronize()
    out["measured_peak_flops"] = 2 * n**3 * iters / (time.perf_counter() - t)
    out["probe"] = f"{n}x{n} {dtype_name} matmul x{iters} on cuda:0"
else:
    torch.set_num_threads(1)
    n = 2048
    a = torch.randn(n, n, dtype=dt[dtype_name]); b = torch.randn_like(a)
    for _ in range(2): a @ b
    iters, t = 0, time.perf_counter()
    while True:
        a @ b
        iters += 1
        el = time.perf_counter() - t
        if el > 1.5 and iters >= 3:
            break
    out["measured_peak_flops"] = 2 * n**3 * iters / el
    out["probe"] = f"{n}x{n} {dtype_name} matmul x{iters} on 1 CPU thread"
print("PEAK_JSON " + json.dumps(out))
"""


def probe_device(dtype: str, timeout_s: int = 300) -> dict[str, Any]:
    """Device facts and a measured matmul peak (one subprocess; torch stays out of this process)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        proc = subprocess.run([sys.executable, "-c", _PEAK_PROBE, dtype], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"cuda": False, "error": f"peak probe timed out after {timeout_s} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("PEAK_JSON "):
            return json.loads(line[len("PEAK_JSON "):])
    return {"cuda": False, "error": (proc.stderr.strip().splitlines() or ["peak probe failed"])[-1]}


def datasheet_peak(device_name: str | None, dtype: str) -> float | None:
    if not device_name:
        return None
    for key, peaks in DATASHEET_PEAKS.items():
        if key in device_name.upper():
            return peaks.get(dtype)
    return None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


# --------------------------------------------------------------------------------------------------
# Trace analysis


def _numel(dims: Any) -> int:
    """Elements of a trace "Input Dims" entry: [a, b] a tensor, [[..], [..]] a tensor list, [] a scalar."""
    if not isinstance(dims, list):
        return 0
    if not dims:
        return 1
    if all(isinstance(d, int) for d in dims):
        return math.prod(dims)
    return sum(_numel(d) for d in dims if isinstance(d, list) and d != [])


def _arg(ev: dict, key: str, i: int) -> Any:
    vals = ev.get("args", {}).get(key) or []
    return vals[i] if i < len(vals) else None


def _elem_bytes(ev: dict, i: int, default: int) -> int:
    return _TYPE_BYTES.get(_arg(ev, "Input type", i) or "", default)


def collective_bytes(ev: dict, world: int, default_elem: int) -> tuple[str, float] | None:
    """(kind, ring bytes this rank moves) for a c10d collective op of a trace, else None."""
    name = ev["name"]
    if not name.startswith("c10d::") or world < 2:
        return None
    op = name[len("c10d::"):].rstrip("_")
    ring = (world - 1) / world
    if op in ("_allgather_base", "allgather_into_tensor_coalesced", "allgather", "allgather_coalesced"):
        out_dims = _arg(ev, "Input Dims", 0)
        full = 0
        if out_dims and any(d not in ([], None) for d in out_dims):
            full = _numel(out_dims) * _elem_bytes(ev, 0, default_elem)
        if not full:  # outputs not recorded (a list of lists, as FSDP1 passes): N x the input shard
            full = world * _numel(_arg(ev, "Input Dims", 1)) * _elem_bytes(ev, 1, default_elem)
        return "all_gather", ring * full
    if op in ("_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce_scatter"):
        full = _numel(_arg(ev, "Input Dims", 1)) * _elem_bytes(ev, 1, default_elem)
        if not full:
            full = world * _numel(_arg(ev, "Input Dims", 0)) * _elem_bytes(ev, 0, default_elem)
        return "reduce_scatter", ring * full
    if op in ("allreduce", "allreduce_coalesced"):
        return "all_reduce", 2 * ring * _numel(_arg(ev, "Input Dims", 0)) * _elem_bytes(ev, 0, default_elem)
    if op == "broadcast":
        return "broadcast", ring * _numel(_arg(ev, "Input Dims", 0)) * _elem_bytes(ev, 0, default_elem)
    if op in ("alltoall_base", "alltoall"):
        return "all_to_all", ring * _numel(_arg(ev, "Input Dims", 1)) * _elem_bytes(ev, 1, default_elem)
    if op in ("reduce", "gather", "scatter"):
        return op, ring * _numel(_arg(ev, "Input Dims", 0)) * _elem_bytes(ev, 0, default_elem)
    return None


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in iv)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            total += b - a
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


_COMMISH = ("c10d", "wait", "all_gather", "allgather", "reduce_scatter", "allreduce", "all_reduce", "gloo",
            "nccl", "record_param_comms", "broadcast")


def analyze_trace(path: str | Path, world: int, default_elem: int = 4) -> dict[str, Any]:
    """Comm bytes and time per profiled step and the comm/compute overlap of one rank's trace."""
    data = json.loads(Path(path).read_text())
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    # the CPU-side step ranges (on GPU the same ranges also appear as "gpu_user_annotation")
    steps = sorted([e for e in events if str(e.get("name", "")).startswith("swiftlite_step#")
                    and e.get("cat") != "gpu_user_annotation"], key=lambda e: e["ts"])
    if steps:
        lo, hi = steps[0]["ts"], max(e["ts"] + e["dur"] for e in steps)
        main = (steps[0]["pid"], steps[0]["tid"])
    else:
        lo = min(e["ts"] for e in events)
        hi = max(e["ts"] + e["dur"] for e in events)
        main = None
    n_steps = max(1, len(steps))
    inside = [e for e in events if lo <= e["ts"] <= hi]

    # bytes: c10d ops, skipping any nested inside another counted op of the same thread
    by_kind: dict[str, float] = {}
    counted: dict[tuple, list[tuple[float, float]]] = {}
    n_ops = 0
    for e in sorted(inside, key=lambda e: (e["ts"], -e["dur"])):
        cb = collective_bytes(e, world, default_elem)
        if cb is None:
            continue
        key = (e.get("pid"), e.get("tid"))
        spans = counted.setdefault(key, [])
        if any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in spans):
            continue
        spans.append((e["ts"], e["ts"] + e["dur"]))
        by_kind[cb[0]] = by_kind.get(cb[0], 0.0) + cb[1]
        n_ops += 1

    # intervals: GPU kernels when the trace has them, else gloo worker threads vs the main thread
    kernels = [e for e in inside if e.get("cat") == "kernel"]
    if kernels:
        comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()])
        compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()])
        source = "gpu kernels (nccl vs others)"
    else:
        comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in inside if str(e["name"]).startswith("gloo:")])
        source = "gloo worker threads vs main-thread aten ops"
        if not comm:  # collectives ran synchronously in the caller
            comm = _union([s for spans in counted.values() for s in spans])
            source = "synchronous c10d calls vs main-thread aten ops"
        if main is None:
            main_events = inside
        else:
            main_events = [e for e in inside if (e.get("pid"), e.get("tid")) == main]
        blockers = _union([(e["ts"], e["ts"] + e["dur"]) for e in main_events
                           if any(k in str(e["name"]).lower() for k in _COMMISH)])
        cand = [(e["ts"], e["ts"] + e["dur"]) for e in main_events
                if e.get("cat") == "cpu_op" and str(e["name"]).startswith("aten::")]
        compute = _union([iv for iv in cand if not any(a <= iv[0] and iv[1] <= b for a, b in blockers)])
    comm_len = _length(comm)
    hidden = _intersect(comm, compute) if comm else 0.0
    return {
        "steps": len(steps),
        "comm_bytes_per_step": sum(by_kind.values()) / n_steps,
        "comm_bytes_by_kind": {k: v / n_steps for k, v in sorted(by_kind.items())},
        "collectives_per_step": n_ops / n_steps,
        "comm_time_s_per_step": comm_len / 1e6 / n_steps,
        "compute_time_s_per_step": _length(compute) / 1e6 / n_steps,
        "overlap": (hidden / comm_len) if comm_len > 0 else None,
        "exposed_comm_s_per_step": (comm_len - hidden) / 1e6 / n_steps,
        "interval_source": source,
    }


# --------------------------------------------------------------------------------------------------
# One backend


@dataclass
class BackendResult:
    label: str
    parallelism: str
    status: str = "ok"                 # ok, failed, timeout
    error: str = ""
    backend_resolved: str = ""
    world_size: int = 1
    wall_s: float | None = None
    first_step_s: float | None = None  # "first step done" as the run printed it
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


def _theory_key(spec: BackendSpec, world: int) -> str:
    """The planner family of a column (the registry and the resolver decide, as for the run itself)."""
    from swiftlite.parallel.resolve import memory_family_for
    return memory_family_for(spec.parallelism, world) or "zero3"


def _workload(cfg: BenchConfig, world: int, dtype: str, gpu_memory: int | None):
    from swiftlite.parallel.plan import Workload
    gc = cfg.gradient_checkpointing
    return Workload(train_type=cfg.train_type, dtype=dtype, max_length=cfg.max_length,
                    micro_batch=cfg.per_device_train_batch_size, gradient_checkpointing=gc, world_size=world,
                    gpu_memory_bytes=gpu_memory, overhead_bytes=0)


def sft_command(cfg: BenchConfig, spec: BackendSpec, dataset: str, run_dir: Path, nproc: int, dtype: str) -> list[str]:
    cmd = [sys.executable, "-m", "swiftlite", "sft", "--model", cfg.model, "--dataset", dataset,
           "--parallelism", spec.parallelism, "--max-steps", str(cfg.steps), "--logging-steps", "1",
           "--per-device-train-batch-size", str(cfg.per_device_train_batch_size),
           "--max-length", str(cfg.max_length), "--torch-dtype", dtype, "--train-type", cfg.train_type,
           "--output-dir", str(run_dir), "--overwrite-output-dir", "--save-hf-model", "false",
           "--report-to", "none"]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    if cfg.gradient_checkpointing and "--gradient-checkpointing" not in spec.extra_args:
        cmd += ["--gradient-checkpointing"]
    if cfg.packing:
        cmd += ["--packing"]
    cmd += list(spec.extra_args) + list(cfg.sft_args)
    return cmd


def _read_jsonl(p: Path) -> list[dict]:
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:") or "Error" in ln.split(":")[0]:
            return ln[:300]
    return (lines[-1][:300] if lines else "no output")


def collect(cfg: BenchConfig, spec: BackendSpec, res: BackendResult, run_dir: Path, log_text: str,
            world: int, dtype: str, peak_flops: float | None, shape: Any, gpu_memory: int | None) -> None:
    """Fill `res` from the run folder (logging.jsonl, profile/, logs/state_rank*.json)."""
    from swiftlite.parallel import plan
    m = re.search(r"first step done ([0-9.]+) s", log_text)
    res.first_step_s = float(m.group(1)) if m else None
    m = re.search(r"swiftlite: (\S+) x (\d+) process", log_text)
    if m:
        res.backend_resolved = m.group(1)
    records = [r for r in _read_jsonl(run_dir / "logging.jsonl") if "loss" in r and "step" in r]
    by_step = {r["step"]: r for r in records}
    if records:
        res.final_loss = records[-1]["loss"]
    prof_dir = run_dir / "profile"
    stats = [json.loads(p.read_text()) for p in sorted(prof_dir.glob("stats_rank*.json"))]
    profiled = set()
    for s in stats:
        profiled.update(s.get("profiled_steps", []))
    skip = set(range(1, cfg.warmup_steps + 1)) | profiled | {cfg.steps}
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
    if res.tokens_per_step and res.step_time_s:
        res.tokens_per_s = res.tokens_per_step / res.step_time_s
        if peak_flops and shape is not None:
            k = 6 if cfg.train_type == "full" else 4
            res.mfu = k * shape.n_params * res.tokens_per_s / (peak_flops * world)
    # memory
    res.peak_gpu_gib = [s["cuda_max_allocated_gib"] for s in stats if "cuda_max_allocated_gib" in s]
    res.max_rss_mib = [s["max_rss_mib"] for s in stats if "max_rss_mib" in s]
    for p in sorted((run_dir / "logs").glob("state_rank*.json")):
        rec = json.loads(p.read_text())
        res.state_bytes.append(int(rec.get("params", 0)) + int(rec.get("grads", 0)) + int(rec.get("optimizer", 0)))
    key = _theory_key(spec, world)
    if shape is not None:
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
    # comm bytes and overlap from the traces
    traces = sorted(prof_dir.glob("trace_rank*.json"))
    analyses = []
    for t in traces:
        try:
            analyses.append(analyze_trace(t, world, _DTYPE_BYTES.get(dtype, 4)))
        except (OSError, ValueError, KeyError) as e:
            res.error = res.error or f"trace {t.name}: {e}"
    if analyses:
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


def run_backend(cfg: BenchConfig, spec: BackendSpec, dataset: str, out: Path, nproc: int, dtype: str,
                peak_flops: float | None, shape: Any, gpu_memory: int | None, echo=print) -> BackendResult:
    run_dir = out / "runs" / spec.dirname
    cmd = sft_command(cfg, spec, dataset, run_dir, nproc, dtype)
    res = BackendResult(label=spec.label, parallelism=spec.parallelism, world_size=nproc, run_dir=str(run_dir),
                        command=shlex.join(cmd[1:]).replace("-m swiftlite", "swiftlite", 1))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")}
    first_profiled = cfg.warmup_steps + 1
    env.update({"SWIFTLITE_BENCH_STATS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    if gpu_memory is None:
        # CPU: one thread per process, as the peak was measured (torchrun does the same for several
        # processes); two threads per process on a shared 2-core machine ran 15x slower here.
        env.setdefault("OMP_NUM_THREADS", "1")
        if cfg.exact_rss:  # glibc then returns freed buffers at once: honest RSS, but steps 2-3x slower
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    if cfg.profile_steps > 0:
        env["SWIFTLITE_PROFILE"] = f"{first_profiled}:{cfg.profile_steps}"
    else:
        env.pop("SWIFTLITE_PROFILE", None)
    env.pop("SWIFTLITE_PROFILE_DIR", None)
    # The package may run from a checkout: make sure the children import this same swiftlite.
    pkg_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = out / "runs" / f"{spec.dirname}.log"
    echo(f"bench: {spec.label}: {res.command}")
    t = time.perf_counter()
    with log_path.open("w") as log:
        # its own session, so a timeout can end the launcher and every rank together
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
        except BaseException:  # Ctrl-C, or SIGTERM from an outer timeout: take the run down with us
            _kill_group(proc)
            raise
    res.wall_s = round(time.perf_counter() - t, 2)
    text = log_path.read_text(errors="replace")
    if rc is None:
        res.status, res.error = "timeout", f"no result within {cfg.timeout_s} s (see {log_path})"
    elif rc != 0:
        res.status, res.error = "failed", f"exit {rc}: {_last_error(text)}"
    try:
        collect(cfg, spec, res, run_dir, text, nproc, dtype, peak_flops, shape, gpu_memory)
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


def _exit_on_sigterm() -> None:
    """SIGTERM (e.g. `timeout` around the bench) unwinds like Ctrl-C, so the running backend is killed too."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def _kill_group(proc: subprocess.Popen) -> None:
    import signal
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


# --------------------------------------------------------------------------------------------------
# The bench


def run_bench(cfg: BenchConfig, echo=print, console=None) -> dict[str, Any]:
    """Run every backend of `cfg`, write bench.json/md/png under cfg.output, print the table."""
    from swiftlite.models.loading import resolve_model
    from swiftlite.parallel.plan import shape_from_model_arg
    cfg.check()
    resolve_model(cfg.model)  # an unknown preset or missing folder: one error before any run
    _exit_on_sigterm()
    out = Path(cfg.output).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    try:
        shape = shape_from_model_arg(cfg.model)
    except UserError as e:
        echo(f"bench: no parameter count for {cfg.model} ({e}); MFU and estimates left out")
        shape = None
    probe_dtype = cfg.torch_dtype or "fp32"
    device = probe_device(probe_dtype)
    if device.get("cuda") and cfg.torch_dtype is None:
        device = probe_device("bf16")
    dtype = cfg.torch_dtype or ("bf16" if device.get("cuda") else "fp32")
    nproc = cfg.nproc_per_node or (device.get("gpus", 1) if device.get("cuda") else 2)
    sheet = datasheet_peak(device.get("device_name"), dtype) if device.get("cuda") else None
    measured = device.get("measured_peak_flops")
    per_device_peak = sheet or measured
    peak_source = ("datasheet" if sheet else "measured") if per_device_peak else "none"
    gpu_memory = device.get("gpu_memory_bytes") if device.get("cuda") else None
    if device.get("cuda") and nproc > device.get("gpus", 1):
        raise UserError(f"--nproc-per-node {nproc}: this machine has {device.get('gpus')} GPU(s)")

    dataset = cfg.dataset
    if not dataset:
        from swiftlite.demo import write_demo_data
        need = cfg.steps * cfg.per_device_train_batch_size * nproc
        dataset = str(write_demo_data(out / "data", n_train=max(2000, need), n_val=8)[0])
    echo(f"bench: {cfg.model}, {len(cfg.backends)} backend(s) x {nproc} process(es), {cfg.steps} steps, "
         f"batch {cfg.per_device_train_batch_size}/process, max length {cfg.max_length}, {dtype}, "
         f"{cfg.train_type}; peak {per_device_peak / 1e12 if per_device_peak else 0:.3g} TFLOP/s per "
         f"{'GPU' if device.get('cuda') else 'process'} ({peak_source})")
    results: list[BackendResult] = []
    report: dict[str, Any] = {}

    def build_report(done: bool) -> dict[str, Any]:
        try:
            info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        except OSError:
            pass
        return {
            "complete": done,
            "date": time.strftime("%Y-%m-%d"),
            "settings": {"model": cfg.model, "params": shape.n_params if shape else None, "steps": cfg.steps,
                         "nproc_per_node": nproc, "max_length": cfg.max_length,
                         "per_device_train_batch_size": cfg.per_device_train_batch_size, "dtype": dtype,
                         "train_type": cfg.train_type, "gradient_checkpointing": cfg.gradient_checkpointing,
                         "dataset": dataset, "warmup_steps": cfg.warmup_steps, "profile_steps": cfg.profile_steps,
                         "sft_args": list(cfg.sft_args)},
            "machine": info,
            "device": {**device, "peak_flops_per_device": per_device_peak, "peak_source": peak_source,
                       "datasheet_peak_flops": sheet},
            "results": [asdict(r) for r in results],
        }

    for spec in cfg.backends:
        results.append(run_backend(cfg, spec, dataset, out, nproc, dtype, per_device_peak, shape, gpu_memory,
                                   echo=echo))
        # written after every backend: a bench killed half-way still leaves the figures it has
        report = build_report(done=len(results) == len(cfg.backends))
        (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "bench.md").write_text(render_markdown(report))
    try:
        write_chart(report, out / "bench.png")
    except Exception as e:  # a chart must never lose the figures
        echo(f"bench: chart not written: {type(e).__name__}: {e}")
    render_table(report, console=console)
    echo(f"bench: wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return report


# --------------------------------------------------------------------------------------------------
# Output


def _fmt(v: Any, spec: str = ".3g", scale: float = 1.0, suffix: str = "") -> str:
    if v is None:
        return "-"
    return f"{v * scale:{spec}}{suffix}"


def _count(n: int | None) -> str:
    if not n:
        return "?"
    for div, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def _per_rank(vals: list, fmt: str) -> str:
    return "/".join(format(v, fmt) for v in vals) if vals else "-"


def columns(report: dict) -> list[tuple[str, Any]]:
    """(header, cell function) for each column; memory columns depend on the device."""
    gpu = bool(report["device"].get("cuda"))
    cols: list[tuple[str, Any]] = [
        ("backend", lambda r: r["label"]),
        ("status", lambda r: r["status"]),
        ("ran as", lambda r: r["backend_resolved"] or "-"),
        ("step ms", lambda r: _fmt(r["step_time_s"], ".1f", 1000)),
        ("tokens/s", lambda r: _fmt(r["tokens_per_s"], ",.0f")),
        ("MFU", lambda r: _fmt(r["mfu"], ".2f", 100, "%")),
        ("overlap", lambda r: _fmt(r["overlap"], ".0f", 100, "%")),
        ("comm MB/step", lambda r: _fmt(r["comm_bytes_per_step"], ".4g", 1e-6)),
        ("theory MB", lambda r: _fmt(r["comm_bytes_theory"], ".4g", 1e-6)),
        ("meas/theory", lambda r: _fmt(r["comm_ratio"], ".2f", 1, "x")),
    ]
    if gpu:
        cols += [("peak GiB/rank", lambda r: _per_rank(r["peak_gpu_gib"], ".2f")),
                 ("estimate GiB", lambda r: _fmt(r["memory_estimate_gib"], ".2f"))]
    else:
        cols += [("state MiB/rank", lambda r: "/".join(_mib(x) for x in r["state_bytes"]) or "-"),
                 ("estimate MiB", lambda r: _mib(r["state_bytes_estimate"])),
                 ("max RSS MiB/rank", lambda r: _per_rank(r["max_rss_mib"], ".0f"))]
    cols += [("first step s", lambda r: _fmt(r["first_step_s"], ".1f")),
             ("wall s", lambda r: _fmt(r["wall_s"], ".1f"))]
    return cols


def render_table(report: dict, console=None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 160))
    s, d = report["settings"], report["device"]
    table = Table(box=box.SIMPLE_HEAD, title=f"swiftlite bench: {s['model']} x {s['nproc_per_node']} process(es), "
                  f"{s['dtype']}, seq {s['max_length']} x batch {s['per_device_train_batch_size']}")
    cols = columns(report)
    for name, _ in cols:
        table.add_column(name, justify="left" if name in ("backend", "status") else "right")
    for r in report["results"]:
        table.add_row(*[fn(r) for _, fn in cols], style=None if r["status"] == "ok" else "red")
    console.print(table)
    for r in report["results"]:
        if r["error"]:
            console.print(f"[dim]{r['label']}: {r['error']}[/dim]")
    peak = d.get("peak_flops_per_device")
    console.print(f"[dim]MFU against {peak / 1e12 if peak else 0:.3g} TFLOP/s per "
                  f"{'GPU' if d.get('cuda') else 'process'} ({d.get('peak_source')}); comm = ring bytes per rank "
                  "per step counted from the profiled collectives, theory = swiftlite's estimator.[/dim]")


def render_markdown(report: dict) -> str:
    s, d, m = report["settings"], report["device"], report["machine"]
    dev = (f"{d.get('gpus')} x {d.get('device_name')}" if d.get("cuda")
           else f"CPU, {m.get('cpus')} cores, {m.get('memory_gib')} GiB")
    peak = d.get("peak_flops_per_device")
    lines = [
        f"### swiftlite bench, {report['date']}",
        "",
        f"{s['model']} ({_count(s['params'])} params), {s['train_type']}, {s['dtype']}, "
        f"{s['nproc_per_node']} process(es), per-device batch {s['per_device_train_batch_size']} x "
        f"max length {s['max_length']}, {s['steps']} steps (median of the steps after {s['warmup_steps']} "
        f"warm-up, profiled steps excluded); {dev}; torch {d.get('torch', '?')}; load average "
        f"{m.get('loadavg_start')} -> {m.get('loadavg_end')}. MFU against {peak / 1e12 if peak else 0:.3g} "
        f"TFLOP/s per {'GPU' if d.get('cuda') else 'process'} ({d.get('peak_source')}"
        f"{': ' + d['probe'] if d.get('peak_source') == 'measured' and d.get('probe') else ''}).",
        "",
    ]
    cols = columns(report)
    lines += ["| " + " | ".join(name for name, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in report["results"]:
        lines.append("| " + " | ".join(str(fn(r)).replace("|", "/") for _, fn in cols) + " |")
    errs = [f"- {r['label']}: {r['error']}" for r in report["results"] if r["error"]]
    if errs:
        lines += ["", *errs]
    lines += ["", "comm = bytes each rank moves per step in ring terms, counted from the collectives of the "
              "profiled steps (torch.profiler) / swiftlite's estimate (parallel/plan.py). overlap = share of "
              "collective time that ran under compute.", ""]
    return "\n".join(lines)


def write_chart(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rs = [r for r in report["results"]]
    labels = [r["label"] for r in rs]
    gpu = bool(report["device"].get("cuda"))
    x = list(range(len(rs)))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=100)

    def bars(ax, vals, title, ylabel, color="tab:blue"):
        ax.bar(x, [v if v is not None else 0 for v in vals], color=color)
        ax.set_xticks(x, labels, rotation=20, ha="right")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)

    bars(axes[0][0], [r["step_time_s"] for r in rs], "median step time", "s")
    bars(axes[0][1], [r["tokens_per_s"] for r in rs], "throughput", "tokens/s", "tab:green")
    ax = axes[1][0]
    w = 0.38
    ax.bar([i - w / 2 for i in x], [(r["comm_bytes_per_step"] or 0) / 1e6 for r in rs], w, label="measured")
    ax.bar([i + w / 2 for i in x], [(r["comm_bytes_theory"] or 0) / 1e6 for r in rs], w, label="theory")
    ax.set_xticks(x, labels, rotation=20, ha="right")
    ax.set_title("communication per rank per step")
    ax.set_ylabel("MB")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    ax = axes[1][1]
    if gpu:
        meas = [max(r["peak_gpu_gib"]) if r["peak_gpu_gib"] else 0 for r in rs]
        est = [r["memory_estimate_gib"] or 0 for r in rs]
        unit, title = "GiB", "peak GPU memory per rank"
    else:
        meas = [max(r["state_bytes"]) / 2**20 if r["state_bytes"] else 0 for r in rs]
        est = [(r["state_bytes_estimate"] or 0) / 2**20 for r in rs]
        unit, title = "MiB", "model-state memory per rank"
    ax.bar([i - w / 2 for i in x], meas, w, label="measured")
    ax.bar([i + w / 2 for i in x], est, w, label="estimate")
    ax.set_xticks(x, labels, rotation=20, ha="right")
    ax.set_title(title)
    ax.set_ylabel(unit)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    s = report["settings"]
    fig.suptitle(f"swiftlite bench: {s['model']}, {s['nproc_per_node']} process(es), {s['dtype']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
