"""Opt-in per-step instrumentation for `swiftlite bench` (and anyone chasing a slow step).

Off unless an environment variable asks for it; when off, `step_hook` costs one dict lookup.
The trainer calls one line at the top of each optimizer step:

    profiling.step_hook(step, run_dir, world.rank)      # step: 0-based index of the step starting

Environment:
  SWIFTLITE_PROFILE=K:N     torch.profiler over optimizer steps K..K+N-1 (1-based, as logged; "K"
                            alone means N=1). Each rank writes a Chrome trace
                            <run>/profile/trace_rank<r>.json (shapes recorded, so collective sizes
                            can be counted) once step K+N-1 has finished.
  SWIFTLITE_PROFILE_MEMORY=1  record every allocation and free in the trace ([memory] events with
                            the running "Total Allocated"): where a step's memory peak comes from.
  SWIFTLITE_PROFILE_DIR=D   write traces and stats to D instead of <run>/profile.
  SWIFTLITE_BENCH_STATS=1   each rank writes <run>/profile/stats_rank<r>.json when it exits: the
                            [step, start, end] of every step (perf_counter seconds since the first
                            hook call; profiler start/stop falls between steps; the last step's
                            end is null: nothing marks it), peak memory (CUDA allocator peak on GPU; max RSS and the
                            model-state bytes on CPU) and the profiled step window.
  TORCH_FR_BUFFER_SIZE=N    (torch's flight recorder, which `swiftlite bench` turns on) each rank
                            also writes <run>/profile/collectives_rank<r>.json with the profiled
                            window: every collective torch.distributed ran in it (name, sizes,
                            dtypes, process group) and the global ranks of each process group, so
                            that the bench can tell which collectives crossed a node boundary
                            (bench/groups.py). The profiler trace does not record process groups.

`maybe_profile(step, run_dir, rank)` is the same thing as a context manager around one step, for
loops that prefer `with`. Nothing here imports torch until a profile is asked for.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from swiftlite.checkpoint import layout
from swiftlite import env

ENV_PROFILE = env.PROFILE
ENV_STATS = env.BENCH_STATS


def parse_window(text: str | None) -> tuple[int, int] | None:
    """"K:N" or "K" -> (first 1-based step, number of steps); None when empty/0. Bad text raises."""
    if not text or text.strip() in ("", "0"):
        return None
    head, _, count = text.strip().partition(":")
    first, n = int(head), int(count) if count else 1
    if first < 1 or n < 1:
        raise ValueError(f"{ENV_PROFILE}={text!r}: expected K:N with K >= 1 and N >= 1")
    return first, n


class _State:
    """What one process records; created on the first hook call when an env var asks for it."""

    def __init__(self, run_dir: Path, rank: int):
        self.rank = rank
        st = env.settings()
        self.out = Path(st.profile_dir or Path(run_dir) / layout.PROFILE_DIR)
        self.window = parse_window(st.profile)
        self.stats = st.bench_stats
        self.t0 = time.perf_counter()
        self.steps: list[list] = []    # [1-based step, start, end] in seconds since t0
        self.prof: Any = None
        self.step_ctx: Any = None
        self.profiled: list[int] = []
        self.trace: str | None = None
        self.window_ns: list = [None, None]
        self.finished = False
        self.out.mkdir(parents=True, exist_ok=True)
        atexit.register(self.finish)

    # -- profiler ---------------------------------------------------------------------------------
    def _sync(self) -> None:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        self._sync()
        self.prof = profile(activities=acts, record_shapes=True, with_stack=False,
                            profile_memory=env.settings().profile_memory)
        self.prof.__enter__()
        self.window_ns = [time.time_ns(), None]   # the flight recorder stamps collectives in wall-clock ns

    def _mark(self, done_step: int | None) -> None:
        """Close the previous step's range and open the next one (ProfilerStep-like ranges)."""
        from torch.autograd.profiler import record_function
        if self.step_ctx is not None:
            self.step_ctx.__exit__(None, None, None)
            self.step_ctx = None
        if done_step is not None:
            self.step_ctx = record_function(f"swiftlite_step#{done_step}")
            self.step_ctx.__enter__()
            self.profiled.append(done_step)

    def _stop(self) -> None:
        if self.prof is None:
            return
        self._mark(None)
        self._sync()
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.window_ns[1] = time.time_ns()
        path = self.out / layout.rank_file("trace", self.rank)
        prof.export_chrome_trace(str(path))
        self.trace = str(path)
        self._dump_collectives()

    def _dump_collectives(self) -> None:
        """The flight recorder's collectives of the profiled window, with each process group's global
        ranks (see the module docstring); nothing when the recorder is off or there is no group."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return
        import torch._C._distributed_c10d as c10d
        from torch.distributed.distributed_c10d import _world
        recorded: list = []
        # gloo's recorder, then NCCL's (CUDA builds only; same entry format)
        for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
            dump_fn = getattr(c10d, name, None)
            if dump_fn is None:
                continue
            try:
                recorded += json.loads(dump_fn(True, False)).get("entries") or []
            except (RuntimeError, ValueError, TypeError):
                continue
        lo, hi = self.window_ns
        seen: set = set()
        entries = []
        for e in recorded:  # once each, should both dumps list a collective
            key = (e.get("pg_id"), e.get("collective_seq_id"), e.get("profiling_name"), e.get("time_created_ns"))
            if lo <= int(e.get("time_created_ns", 0)) <= hi and key not in seen:
                seen.add(key)
                entries.append(e)
        if not entries:
            return
        groups = {name: dist.get_process_group_ranks(pg) for pg, name in _world.pg_names.items()}
        rec = {"rank": self.rank, "window_ns": [lo, hi], "groups": groups, "entries": entries}
        (self.out / layout.rank_file("collectives", self.rank)).write_text(json.dumps(rec) + "\n")

    # -- hook ---------------------------------------------------------------------------------------
    def on_step(self, step: int) -> None:
        """Called before optimizer step `step` (0-based) starts."""
        now = time.perf_counter() - self.t0
        if self.steps and self.steps[-1][2] is None:
            self.steps[-1][2] = round(now, 6)    # the previous step ends here
        done = step + 1                           # the 1-based number of the step about to run
        if self.window is not None:
            first, n = self.window
            last = first + n - 1
            if first <= done <= last:
                if self.prof is None:
                    self._start()
                self._mark(done)
            elif self.prof is not None and done > last:
                self._stop()
        # taken after the profiler work, so starting/stopping a trace is in no step's time
        self.steps.append([done, round(time.perf_counter() - self.t0, 6), None])

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        end = time.perf_counter() - self.t0
        try:
            self._stop()
        except Exception as e:  # a trace we cannot write must not fail the run's exit
            print(f"swiftlite.profiling: rank {self.rank}: could not write the trace: {e}")
        if self.stats:
            # the last step's end is unknown (the hook is not called after it): left as None
            rec = {"rank": self.rank, "steps": self.steps, "end_s": round(end, 6),
                   "profiled_steps": self.profiled, "trace": self.trace, **peak_memory()}
            (self.out / layout.rank_file("stats", self.rank)).write_text(json.dumps(rec) + "\n")


_STATE: _State | None = None
_ENABLED: bool | None = None


def enabled() -> bool:
    return env.settings().profiling


def step_hook(step: int, run_dir: str | Path, rank: int = 0) -> None:
    """The trainer's one line: mark the start of 0-based optimizer step `step`. No-op unless enabled."""
    global _STATE, _ENABLED
    if _ENABLED is None:
        _ENABLED = enabled()
    if not _ENABLED:
        return
    if _STATE is None:
        _STATE = _State(Path(run_dir), rank)
    _STATE.on_step(step)


def finish() -> None:
    """Stop a running profile and write the stats now (also runs at interpreter exit)."""
    if _STATE is not None:
        _STATE.finish()


@contextlib.contextmanager
def maybe_profile(step: int, run_dir: str | Path, rank: int = 0) -> Iterator[None]:
    """`with maybe_profile(step, run_dir, rank): <one optimizer step>` (same as step_hook)."""
    step_hook(step, run_dir, rank)
    yield


def peak_memory() -> dict[str, Any]:
    """Peak memory of this process: CUDA allocator peak (GiB) on GPU, max RSS (MiB) always."""
    out: dict[str, Any] = {}
    try:
        import resource
        out["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    except (ImportError, OSError):
        pass
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 4)
            out["cuda_max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 4)
    except Exception:
        pass
    return out


# -- training memory on CPU: the kernel's RSS high-water mark, reset when the model is built ----------

def rss_status() -> dict[str, int] | None:
    """Current and peak resident set size of this process in bytes (Linux /proc), or None."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss" if key == "VmRSS" else "peak_rss"] = int(value.split()[0]) * 1024
    return out if len(out) == 2 else None


def start_memory_window() -> dict[str, Any] | None:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0: /proc/self/clear_refs "5")
    and return the baseline. Called just before the model is built, so that the peak read later by
    `end_memory_window` is the training memory (model states, activations, buffers) on top of the
    interpreter, libraries and data already loaded. None where the mark cannot be reset.

    Library code imported after this point would be counted as training memory: the backend's
    libraries are loaded before it (train/run.py makes the backend's init context first; DeepSpeed's
    records import deepspeed and the modules its engine imports lazily there, ~70 MiB of host memory
    that a GPU's allocator peak never sees). The modules first imported inside the window are listed
    in the record (`imported_in_window`), so that this stays checked."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    st = rss_status()
    if st is None:
        return None
    # glibc keeps freed blocks below its (adaptive) mmap threshold, so RSS then overstates live
    # memory; with MALLOC_MMAP_THRESHOLD_ set, large tensors are unmapped when freed.
    return {"rss_before_model": st["rss"], "exact": env.has("MALLOC_MMAP_THRESHOLD_"),
            "_modules": frozenset(sys.modules)}


def cuda_max_allocated() -> int | None:
    """`torch.cuda.max_memory_allocated()` of this process's GPU (bytes), or None without CUDA."""
    import torch
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return int(torch.cuda.max_memory_allocated())


def record_cuda_memory(run_dir: str | Path, rank: int, at_load: int, after_first_step: int | None) -> None:
    """logs/cuda_memory_rank<r>.json: the CUDA allocator's peak when the model was built (before the
    first step) and after the first step: what a GPU holds at load, next to the training peak."""
    logs = Path(run_dir) / layout.LOGS_DIR
    logs.mkdir(parents=True, exist_ok=True)
    (logs / layout.rank_file("cuda_memory", rank)).write_text(
        json.dumps({"max_allocated_at_load": at_load, "max_allocated_after_first_step": after_first_step}) + "\n")


def window_peak(start: dict[str, Any]) -> int | None:
    """Peak RSS since `start_memory_window`, above the RSS it started from (bytes), or None."""
    st = rss_status()
    return None if st is None else st["peak_rss"] - start["rss_before_model"]


def end_memory_window(run_dir: str | Path, rank: int, start: dict[str, Any] | None, steps: int) -> None:
    """logs/memory_rank<r>.json: the baseline RSS, the peak RSS since `start_memory_window` and the
    difference (the measured training memory the estimator predicts), after `steps` steps, and
    `imported_in_window`: the modules first imported inside the window (their code is in the peak),
    and `load_peak` when the trainer marked it: the same peak just before the first step (loading,
    sharding and building the optimizer: the load phase the estimator predicts)."""
    st = rss_status()
    if start is None or st is None:
        return
    imported = sorted(set(sys.modules) - start.get("_modules", frozenset()))
    rec = {**{k: v for k, v in start.items() if not k.startswith("_")}, "peak_rss": st["peak_rss"],
           "steps": steps, "training_peak": st["peak_rss"] - start["rss_before_model"],
           "imported_in_window": imported}
    logs = Path(run_dir) / layout.LOGS_DIR
    logs.mkdir(parents=True, exist_ok=True)
    (logs / layout.rank_file("memory", rank)).write_text(json.dumps(rec) + "\n")


def reset() -> None:
    """Forget this process's recorder and re-read the environment: each run in a process starts its
    own (the trainer's bench probe calls this when a run starts)."""
    global _STATE, _ENABLED
    _STATE, _ENABLED = None, None
