"""Byte sizes in binary units, written the way the book writes them.

1 KiB = 1,024 bytes, 1 MiB = 1,024 KiB, 1 GiB = 1,024 MiB.
"""

from __future__ import annotations

_UNITS = ["bytes", "KiB", "MiB", "GiB", "TiB"]


def format_bytes(n: int | float) -> str:
    """``131072 -> '128 KiB'``, ``1.5 * 2**30 -> '1.5 GiB'``, ``1441792 -> '1.375 MiB'``.

    Picks the largest unit in which the value is at least 1 and prints at most
    three decimals, dropping trailing zeros. Small counts stay in bytes with
    thousands separators: ``999 -> '999 bytes'``.
    """
    if n < 0:
        return "-" + format_bytes(-n)
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{int(n):,} bytes" if float(n).is_integer() else f"{n:,} bytes"
    text = f"{value:,.3f}".rstrip("0").rstrip(".")
    return f"{text} {_UNITS[unit]}"
