"""Argument checks shared by every labkit module.

The book's rule for bad input: raise ``ValueError`` naming the parameter and the
allowed range, *before* any state changes. These two functions say it once.
"""

from __future__ import annotations

import math
import numbers


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (Python or NumPy integers; never bool), else ValueError."""
    if type(value) is int and value >= minimum:  # the common case, checked fast
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_number(name: str, value: object, minimum: float, *, strict: bool = False) -> float:
    """``value`` as a float >= ``minimum`` (> with ``strict``); NaN and bool are refused."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and not math.isnan(value) \
        and (value > minimum if strict else value >= minimum)
    if not ok:
        raise ValueError(f"{name} must be a number {'>' if strict else '>='} {minimum}, got {value!r}")
    return float(value)
