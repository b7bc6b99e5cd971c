"""The machine a bench runs on: device facts and the peak FLOP/s that MFU is measured against.

Peak: the datasheet dense rate of a known GPU in the run's dtype (`DATASHEET_PEAKS`), else a matmul
loop measured once per bench in a subprocess (`probe_device`; torch stays out of the bench process).
GPU: 8192x8192 on cuda:0. CPU: 2048x2048 in the run's dtype on one thread (the runs get
OMP_NUM_THREADS=1 too, so the peak of a run is this figure times its processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from swiftlite import env

#: Dense tensor-core / FP32 peaks from vendor datasheets (FLOP/s per GPU, SXM parts, no sparsity).
DATASHEET_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
    "H100": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
}

#: The folder holding the swiftlite package: children started by the bench import this same copy.
PKG_ROOT = str(Path(__file__).resolve().parents[2])

_PEAK_PROBE = r"""
import json, sys, time
import torch
from swiftlite.dtypes import torch_dtype
dtype_name = sys.argv[1]
out = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
if out["cuda"]:
    out["gpus"] = torch.cuda.device_count()
    out["device_name"] = torch.cuda.get_device_name(0)
    out["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch_dtype(dtype_name)); b = torch.randn_like(a)
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
    a = torch.randn(n, n, dtype=torch_dtype(dtype_name)); b = torch.randn_like(a)
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


def child_pythonpath() -> str:
    """PYTHONPATH for a child process: this swiftlite first (the package may run from a checkout)."""
    current = env.get("PYTHONPATH")
    return PKG_ROOT + (os.pathsep + current if current else "")


def probe_device(dtype: str, timeout_s: int = 300) -> dict[str, Any]:
    """Device facts and a measured matmul peak (one subprocess; torch stays out of this process)."""
    extra = {"PYTHONPATH": child_pythonpath()}
    if not env.has("OMP_NUM_THREADS"):
        extra["OMP_NUM_THREADS"] = "1"
    try:
        proc = subprocess.run([sys.executable, "-c", _PEAK_PROBE, dtype], capture_output=True, text=True,
                              timeout=timeout_s, env=env.child_env(extra))
    except subprocess.TimeoutExpired:
        return {"cuda": False, "error": f"peak probe timed out after {timeout_s} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("PEAK_JSON "):
            return json.loads(line[len("PEAK_JSON "):])
    return {"cuda": False, "error": (proc.stderr.strip().splitlines() or ["peak probe failed"])[-1]}


def datasheet_peak(device_name: str | None, dtype: str) -> float | None:
    """The datasheet peak of a known GPU (matched by name) in `dtype`, else None."""
    if not device_name:
        return None
    for key, peaks in DATASHEET_PEAKS.items():
        if key in device_name.upper():
            return peaks.get(dtype)
    return None


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU count, memory, Python version and the load average when the bench starts."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    load = loadavg()
    if load is not None:
        info["loadavg_start"] = load
    return info
