"""Bytes that crossed the node boundary, counted per process group from a run's recorded collectives.

The profiler's Chrome trace (trace.py) records each collective's sizes but not its process group,
and hsdp / zero3pp run their collectives in sub-groups (the shard group inside a node, the replica
group across nodes, hpZ's node group). So the bench also turns on torch's flight recorder
(TORCH_FR_BUFFER_SIZE), and each rank writes profile/collectives_rank<r>.json at the end of the
profiled window (swiftlite/profiling.py): every collective of the window -- name, input/output
sizes and dtypes, process group -- and the global ranks of each group. Here, per rank:

  ring bytes    over the G ranks of the collective's own group: all-gather (G-1)/G x the output,
                reduce-scatter (G-1)/G x the input, all-reduce 2(G-1)/G x the buffer, broadcast
                (G-1)/G x the buffer (planner/topology.py uses the same terms)
  inter-node    the bytes of collectives whose group holds ranks of more than one node (node =
                rank // processes per node, torchrun's node-major numbering); intra-node: the rest

and the figures per step are the window's sums / the profiled steps, averaged over the ranks.

Each collective is counted in its own terms, as NCCL runs it (the convention of trace.py and the
planner): gloo runs a reduce-scatter as an all-reduce of the whole buffer, and its flight recorder
calls it one, so the kinds come from the rank's profiler trace, whose c10d calls pair one to one,
in order, with the recorder's entries (trace.collective_kinds). When they do not pair (a different
count, or kinds that disagree), the recorder's own kinds are used and `kinds_from` says so.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from swiftlite.checkpoint import layout
from swiftlite.planner.topology import group_crosses  # the planner's rule for what crosses a node boundary

#: Bytes per element of the dtype names the flight recorder writes (c10::ScalarType names).
_FR_BYTES = {"Float": 4, "Double": 8, "BFloat16": 2, "Half": 2, "Long": 8, "Int": 4, "Short": 2,
             "Byte": 1, "Char": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1}


def _bytes(sizes: list, dtypes: list) -> int:
    total = 0
    for i, shape in enumerate(sizes or []):
        dtype = dtypes[i] if i < len(dtypes or []) else (dtypes or ["Float"])[-1]
        total += math.prod(shape) * _FR_BYTES.get(dtype, 4)
    return total


def entry_kind(entry: dict) -> str | None:
    """The collective kind the flight recorder names (trace.py's names), None for barriers and p2p."""
    if entry.get("is_p2p"):
        return None
    name = str(entry.get("profiling_name", "")).split(":")[-1].lower()
    for kind, words in (("all_gather", ("all_gather", "allgather")), ("reduce_scatter", ("reduce_scatter",)),
                        ("all_reduce", ("all_reduce", "allreduce")), ("broadcast", ("broadcast",)),
                        ("all_to_all", ("alltoall", "all_to_all"))):
        if any(w in name for w in words):
            return kind
    return None


#: A trace kind and the recorder kind that may stand for it (gloo: reduce-scatter -> all-reduce).
_PAIRS = {("reduce_scatter", "all_reduce")}


def entry_ring_bytes(entry: dict, group_size: int, kind: str | None = None) -> tuple[str, float] | None:
    """(kind, ring bytes this rank moves) of one flight-recorder entry, else None (barriers, p2p).
    `kind`: the collective as called (from the trace), when the recorder names what gloo ran."""
    kind = kind or entry_kind(entry)
    if group_size < 2 or kind is None:
        return None
    ring = (group_size - 1) / group_size
    out_b = _bytes(entry.get("output_sizes"), entry.get("output_dtypes"))
    in_b = _bytes(entry.get("input_sizes"), entry.get("input_dtypes"))
    if kind == "all_gather":
        return kind, ring * (out_b or group_size * in_b)
    if kind == "reduce_scatter":  # the whole buffer goes in (gloo's all-reduce form records it as both)
        return kind, ring * (in_b or group_size * out_b)
    if kind == "all_reduce":
        return kind, 2 * ring * in_b
    return kind, ring * in_b     # broadcast, all-to-all


def _paired_kinds(entries: list[dict], trace_kinds: list[str] | None) -> list[str | None] | None:
    """The trace's kind for each recorder entry, when the two pair one to one; else None."""
    fr = [entry_kind(e) for e in entries]
    if not trace_kinds or sum(k is not None for k in fr) != len(trace_kinds):
        return None
    it = iter(trace_kinds)
    out: list[str | None] = []
    for k in fr:
        if k is None:
            out.append(None)
            continue
        t = next(it)
        if t != k and (t, k) not in _PAIRS:
            return None
        out.append(t)
    return out


def rank_link_bytes(record: dict, per_node: int, trace_kinds: list[str] | None = None) -> dict[str, Any]:
    """Intra-/inter-node ring bytes of one rank's collectives_rank<r>.json record (the whole window);
    `trace_kinds`: the rank's trace.collective_kinds, to count each collective as it was called."""
    groups = {str(k): [int(r) for r in v] for k, v in record.get("groups", {}).items()}
    intra = inter = 0.0
    by_group: dict[str, dict[str, Any]] = {}
    by_kind: dict[str, float] = {}
    entries = sorted(record.get("entries", []),
                     key=lambda e: (int(e.get("time_created_ns", 0)), int(e.get("record_id", 0))))
    kinds = _paired_kinds(entries, trace_kinds)
    for i, e in enumerate(entries):
        pg = e.get("process_group") or [""]
        name = str(pg[0])
        ranks = groups.get(name)
        if not ranks:
            continue
        counted = entry_ring_bytes(e, len(ranks), kinds[i] if kinds else None)
        if counted is None:
            continue
        crosses = group_crosses(ranks, per_node)
        if crosses:
            inter += counted[1]
        else:
            intra += counted[1]
        g = by_group.setdefault(f"{pg[1] if len(pg) > 1 else name}{ranks}",
                                {"ranks": ranks, "crosses_nodes": crosses, "bytes": 0.0, "collectives": 0})
        g["bytes"] += counted[1]
        g["collectives"] += 1
        by_kind[counted[0]] = by_kind.get(counted[0], 0.0) + counted[1]
    return {"intra": intra, "inter": inter, "groups": by_group, "by_kind": by_kind,
            "kinds_from": "trace" if kinds else "flight recorder"}


def link_bytes(prof_dir: str | Path, per_node: int, steps: int) -> dict[str, Any] | None:
    """Per step, averaged over the ranks: intra- and inter-node bytes and the groups that carried
    them; None when the run wrote no collectives files (flight recorder off, one process)."""
    files = sorted(Path(prof_dir).glob(layout.rank_glob("collectives")))
    if not files:
        return None
    from swiftlite.bench.trace import collective_kinds
    per_rank = []
    for p in files:
        trace = p.with_name(layout.rank_file("trace", layout.rank_of("collectives", p)))
        kinds = collective_kinds(trace) if trace.is_file() else None
        per_rank.append(rank_link_bytes(json.loads(p.read_text()), per_node, kinds))
    n = max(1, steps)
    groups: dict[str, dict[str, Any]] = {}
    for r in per_rank:
        for key, g in r["groups"].items():
            agg = groups.setdefault(key, {"ranks": g["ranks"], "crosses_nodes": g["crosses_nodes"],
                                          "bytes_per_step": 0.0, "collectives_per_step": 0.0})
            # each group is seen by its members only: its figures are per member rank
            members = sum(1 for rr in per_rank if key in rr["groups"])
            agg["bytes_per_step"] += g["bytes"] / n / members
            agg["collectives_per_step"] += g["collectives"] / n / members
    kinds: dict[str, float] = {}
    for r in per_rank:
        for k, v in r["by_kind"].items():
            kinds[k] = kinds.get(k, 0.0) + v / n / len(per_rank)
    sources = sorted({r["kinds_from"] for r in per_rank})
    return {"ranks": len(per_rank),
            "intra_node_bytes_per_step": statistics.mean(r["intra"] for r in per_rank) / n,
            "inter_node_bytes_per_step": statistics.mean(r["inter"] for r in per_rank) / n,
            "bytes_by_kind": dict(sorted(kinds.items())), "groups": groups, "kinds_from": ", ".join(sources)}


__all__ = ["entry_kind", "entry_ring_bytes", "link_bytes", "rank_link_bytes"]
