"""Collective bytes and comm/compute overlap, read from one rank's torch.profiler Chrome trace.

  comm/step     bytes each rank moves per step in ring terms, counted from the collectives in the
                trace (their input/output sizes): all-gather (N-1)/N x output, reduce-scatter
                (N-1)/N x input, all-reduce 2(N-1)/N x buffer, broadcast (N-1)/N x buffer. The bench
                shows it next to the estimator's plan.comm_bytes_per_step (3(N-1)/N x 2Psi for
                ZeRO-3 in bf16, (N-1)/N x (2 x 2Psi + 4Psi) for FSDP, which reduces in fp32,
                2(N-1)/N x grads for DDP, ...: planner/topology.py). A count over the world:
                collectives in sub-groups are counted per group by bench/groups.py.
  overlap       share of collective time hidden under compute: |comm intervals & compute intervals|
                / |comm intervals| over the profiled steps. GPU: NCCL kernels vs the other kernels.
                CPU/gloo: gloo's worker-thread collectives vs the main thread's aten ops outside
                collective calls and waits.

The profiled steps are the ranges named `swiftlite_step#<n>` (swiftlite/profiling.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

#: Element sizes of the C++ type names a trace records in "Input type" (not swiftlite's dtype names).
_TYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
               "short int": 2, "bool": 1, "unsigned char": 1, "signed char": 1, "c10::Float8_e4m3fn": 1,
               "c10::Float8_e5m2": 1}


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


def collective_kinds(path: str | Path, world: int = 2) -> list[str]:
    """The kinds of the collectives a rank's trace counts over its profiled steps, in call order
    (the ops analyze_trace counts: c10d calls, none nested in another). bench/groups.py pairs them
    with the flight recorder's entries, which know each one's process group but not, on gloo,
    whether an all-reduce was a reduce-scatter."""
    data = json.loads(Path(path).read_text())
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if str(e.get("name", "")).startswith("swiftlite_step#")
             and e.get("cat") != "gpu_user_annotation"]
    if not steps:
        return []
    lo, hi = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    counted: dict[tuple, list[tuple[float, float]]] = {}
    kinds: list[tuple[float, str]] = []
    for e in sorted([e for e in events if lo <= e["ts"] <= hi], key=lambda e: (e["ts"], -e["dur"])):
        cb = collective_bytes(e, max(2, world), 4)
        if cb is None:
            continue
        spans = counted.setdefault((e.get("pid"), e.get("tid")), [])
        if any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in spans):
            continue
        spans.append((e["ts"], e["ts"] + e["dur"]))
        kinds.append((e["ts"], cb[0]))
    return [k for _, k in sorted(kinds)]


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
