"""Byte sizes on the command line: the one parser (`--gpu-memory`, `--cpu-memory`, ...).

    parse_size("80GB") == 80 * 10**9       # GB, MB, KB, TB (and G, M, K, T): powers of 10
    parse_size("24GiB") == 24 * 2**30      # GiB, MiB, KiB, TiB: powers of 2
    parse_size("80") == 80 * 10**9         # a bare number is `bare_unit` (GB unless the caller says)

Case and spaces between number and unit do not matter. huggingface_hub's own parser
(`parse_size_to_int`, private in `huggingface_hub.serialization._base` in the installed version, not in
`huggingface_hub.utils`) knows only KB/MB/GB/TB, hence this one.
"""

from __future__ import annotations

import math
import re

from swiftlite.errors import UserError

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int | float, flag: str = "size", *, bare_unit: str = "GB") -> int:
    """Bytes from a size such as "80GB", "24GiB", "512MiB", "2TB" or a bare number (`bare_unit`).

    Anything else, or a size under one byte, is a UserError naming `flag` and the value.
    """
    if bare_unit.lower() not in _UNITS:
        raise ValueError(f"bare_unit {bare_unit!r}: not one of {', '.join(_UNITS)}")
    if isinstance(text, bool):
        raise UserError(f"{flag}: expected a size like 80GB or 24GiB, got {text!r}")
    m = _SIZE.match(str(text))
    unit = (m.group(2) or bare_unit).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UserError(f"{flag}: cannot read {text!r} as a size (use e.g. 80GB, 24GiB, or 80 for {bare_unit})")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise UserError(f"{flag}: size must be positive, got {text!r}")
    return int(value)


__all__ = ["parse_size"]
