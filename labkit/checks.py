"""Argument checks shared by every labkit module.

The book's rule for bad input: raise ``ValueError`` naming the parameter and the
allowed range, *before* any state changes. These functions say it once.
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


def check_number(name: str, value: object, minimum: float, *, strict: bool = False, finite: bool = False) -> float:
    """``value`` as a float >= ``minimum`` (> with ``strict``); NaN and bool are refused, and infinity
    too with ``finite``."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and not math.isnan(value) \
        and (value > minimum if strict else value >= minimum) and (not finite or math.isfinite(value))
    if not ok:
        raise ValueError(f"{name} must be a {'finite ' if finite else ''}number {'>' if strict else '>='} {minimum}, "
                         f"got {value!r}")
    return float(value)


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is a bool (NumPy's too), else ValueError: a string such as 'no' is not a switch
    (``bool("no")`` is True)."""
    if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", "") == "b":
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of the strings ``choices``, else ValueError listing them."""
    if isinstance(value, str) and value in choices:
        return value
    raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_bytes(name: str, value: object, *, positive: bool = False) -> float:
    """A memory size in bytes: a finite real number >= 0 (> 0 with ``positive``); need not be whole (1.5 GiB).

    NaN, infinities and bool are refused: an infinite device would make every capacity infinite.
    """
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value) \
        and (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{name} must be a finite number of bytes {'>' if positive else '>='} 0, got {value!r}")
    return value


def check_token_ids(name: str, value: object, min_len: int = 0) -> tuple[int, ...]:
    """``value`` (a list, tuple or range) as a tuple of ints >= 0, at least ``min_len`` long, else ValueError."""
    if not isinstance(value, (list, tuple, range)):
        raise ValueError(f"{name} must be a list or tuple of integers >= 0, got {type(value).__name__} "
                         "(convert a tensor with .tolist())")
    tokens = tuple(value)
    # Exactly int (a bool is a subclass of int, and is refused), then min() for the sign; both run in C.
    if tokens and (set(map(type, tokens)) != {int} or min(tokens) < 0):
        bad = next(t for t in tokens if type(t) is not int or t < 0)
        raise ValueError(f"{name} must hold integers >= 0, found {bad!r}")
    if len(tokens) < min_len:
        raise ValueError(f"{name} must hold at least {min_len} token(s), got {len(tokens)}")
    return tokens


def parse_stop_token_ids(value: object, name: str = "eos_token_id", vocab_size: int | None = None) -> tuple[int, ...]:
    """Stop ids as a tuple: ``None`` (none), one token id, or a list or tuple of them (chat models list a few).

    The one parser of stop ids in labkit (``Request``, ``Engine``, ``DecoderConfig``). Python and NumPy
    integers are accepted, ``bool`` is not; ids must be >= 0 and, given ``vocab_size``, below it.
    """
    ids = () if value is None else (value,) if isinstance(value, numbers.Integral) else value
    top = "" if vocab_size is None else f" and < {vocab_size} (vocab_size)"
    if not isinstance(ids, (tuple, list, range)) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
            and (vocab_size is None or t < vocab_size) for t in ids):
        raise ValueError(f"{name} must be None, a token id >= 0{top}, or a list of them, got {value!r}")
    return tuple(int(t) for t in ids)
