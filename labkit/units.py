"""Byte sizes in binary units, written the way the book writes them.

1 KiB = 1,024 bytes, 1 MiB = 1,024 KiB, 1 GiB = 1,024 MiB.
"""

from __future__ import annotations

import math
import numbers

KiB, MiB, GiB = 1024, 1024**2, 1024**3
_UNITS = ["bytes", "KiB", "MiB", "GiB", "TiB"]


def format_bytes(n: int | float, unit: str | None = None) -> str:
    """``131072 -> '128 KiB'``, ``1.5 * 2**30 -> '1.5 GiB'``, ``1441792 -> '1.375 MiB'``.

    By default picks the largest unit in which the value is at least 1; ``unit``
    forces one (``format_bytes(2**29, "GiB") -> '0.5 GiB'``, the way the book
    writes a column of sizes). At most three decimals, trailing zeros dropped.
    Small counts stay in bytes with thousands separators: ``999 -> '999 bytes'``.
    """
    if unit is not None and unit not in _UNITS:
        raise ValueError(f"unit must be one of {_UNITS}, got {unit!r}")
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or math.isnan(n):
        raise ValueError(f"n must be a number of bytes, got {n!r}")
    if n < 0:
        return "-" + format_bytes(-n, unit)
    if unit is None:
        index = 0
        while index < len(_UNITS) - 1 and n >= 1024 ** (index + 1):
            index += 1
    else:
        index = _UNITS.index(unit)
    if index == 0:
        return f"{int(n):,} bytes" if float(n).is_integer() else f"{n:,} bytes"
    text = f"{n / 1024 ** index:,.3f}".rstrip("0").rstrip(".")
    return f"{text} {_UNITS[index]}"
