"""The export's RSS probe, a diagnostic for scripts/bench_export_memory.py and the memory test: off
unless SWIFTLITE_EXPORT_MEMLOG names a file (read through `swiftlite.env`)."""

from __future__ import annotations

import json
from pathlib import Path

from swiftlite import env


class MemProbe:
    """Diagnostics (scripts/bench_export_memory.py, the memory test): with SWIFTLITE_EXPORT_MEMLOG=FILE,
    record RSS when weight streaming starts and the peak RSS during it (VmHWM reset through
    /proc/self/clear_refs; a 5 ms sampler where that is not allowed) into FILE as JSON."""

    def __init__(self) -> None:
        self.path = env.settings().export_memlog
        if not self.path:
            return
        import threading
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.start_rss = _proc_kb("VmRSS")
        self.sampled = self.start_rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.sampled = max(self.sampled, _proc_kb("VmRSS"))

    def stop(self) -> None:
        if not self.path:
            return
        self._stop.set()
        self._thread.join()
        peak = _proc_kb("VmHWM") if self.hwm_reset else self.sampled
        Path(self.path).write_text(json.dumps({"start_rss": self.start_rss, "peak_rss": max(peak, self.sampled),
                                               "end_rss": _proc_kb("VmRSS"), "hwm_reset": self.hwm_reset}))


def _proc_kb(field_name: str) -> int:
    """A /proc/self/status memory field in bytes (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
