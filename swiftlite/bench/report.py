"""A bench's output: the rich table, bench.md and bench.png, all drawn from the report dict that
bench.json holds (bench/runner.py builds it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
    if (report["settings"].get("nnodes") or 1) > 1:  # bench --nnodes: the bytes by link (bench/groups.py)
        cols += [("intra MB/step", lambda r: _fmt(r.get("intra_node_bytes"), ".4g", 1e-6)),
                 ("inter MB/step", lambda r: _fmt(r.get("inter_node_bytes"), ".4g", 1e-6)),
                 ("inter theory MB", lambda r: _fmt(r.get("inter_node_bytes_theory"), ".4g", 1e-6)),
                 ("inter meas/theory", lambda r: _fmt(r.get("inter_node_ratio"), ".2f", 1, "x"))]
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
    """Print the report as a rich table (wide enough off a terminal), its errors and a footnote."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 160))
    s, d = report["settings"], report["device"]
    nodes = f"{s['nnodes']} local nodes x " if (s.get("nnodes") or 1) > 1 else ""
    table = Table(box=box.SIMPLE_HEAD,
                  title=f"swiftlite bench: {s['model']} x {nodes}{s['nproc_per_node']} process(es), "
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
    """bench.md: the settings in one paragraph, the table, errors, how comm and overlap are counted."""
    s, d, m = report["settings"], report["device"], report["machine"]
    dev = (f"{d.get('gpus')} x {d.get('device_name')}" if d.get("cuda")
           else f"CPU, {m.get('cpus')} cores, {m.get('memory_gib')} GiB")
    peak = d.get("peak_flops_per_device")
    lines = [
        f"### swiftlite bench, {report['date']}",
        "",
        f"{s['model']} ({_count(s['params'])} params), {s['train_type']}, {s['dtype']}, "
        + (f"{s['nnodes']} local nodes x " if (s.get("nnodes") or 1) > 1 else "") +
        f"{s['nproc_per_node']} process(es), per-device batch {s['per_device_train_batch_size']} x "
        f"max length {s['max_length']}, {s['steps']} steps (median of the steps after the first {s['skip_steps']}, "
        f"profiled steps excluded); {dev}; torch {d.get('torch', '?')}; load average "
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
              "profiled steps (torch.profiler) / swiftlite's estimate (planner/). overlap = share of "
              "collective time that ran under compute."]
    if (s.get("nnodes") or 1) > 1:
        lines += ["", f"{s['nnodes']} local nodes x {s['nproc_per_node']} processes (torchrun --nnodes on "
                  "127.0.0.1): intra / inter = bytes per rank per step in collectives whose process group "
                  "stays inside one node / spans nodes, counted per group from the flight recorder "
                  "(bench/groups.py); inter theory = planner/topology.py."]
    lines.append("")
    return "\n".join(lines)


def write_chart(report: dict, path: Path) -> None:
    """bench.png: step time, tokens/s, comm (measured vs theory), memory (measured vs estimate)."""
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
