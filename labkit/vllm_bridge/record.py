"""The record of the real vLLM runs that appendix A4 shows: ``labkit/data/real_vllm_run.json``.

vLLM runs only where ``make vllm`` has built its environment, and a run takes minutes. So every
real run is saved with its inputs, its date and the machine it ran on (``save_record``), and a
notebook cell shows the saved run made for the same inputs (``recorded_run``), wherever the book is
read. A rerun is asked for by name (``LABKIT_VLLM_RERUN``); the run it replaces stays in the
record's history.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Callable

from ..checks import check_flag, check_number
from .real import is_available

# What the appendix's last real run printed and measured (committed): its vLLM cells show it (``recorded_run``).
RECORD = Path(__file__).resolve().parents[1] / "data" / "real_vllm_run.json"


def load_record(path: str | os.PathLike = RECORD) -> dict[str, Any]:
    """The committed record of the appendix's real runs (empty when there is none)."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else {}


def _rounded(value: Any) -> Any:
    """``value`` with every float to 6 significant digits (a measured duration has no more), but never coarser
    than a millisecond: an absolute time (Unix seconds, ~1.8e9) keeps its milliseconds."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if abs(value) < 1e3 else round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def json_normal(value: Any) -> Any:
    """``value`` as the record stores it: every float to 6 significant digits, then through JSON and back
    (tuples become lists, keys strings).

    The one normalisation of the record: :func:`save_record` stores what it returns and
    :func:`recorded_run` compares with it, so inputs of 1/3 match the 0.333333 stored for them. It is
    idempotent: a value read back from the record comes out unchanged.
    """
    return json.loads(json.dumps(_rounded(value)))


def _normal_inputs(inputs: object, name: str = "inputs") -> dict[str, Any]:
    """``inputs`` as the record stores them (:func:`json_normal`): a dict of JSON values, all numbers finite.

    NaN is refused: it equals nothing, itself included, so no record could ever match it.
    """
    if not isinstance(inputs, dict):
        raise TypeError(f"{name} must be a dict of JSON values (str, int, float, bool, None, lists, dicts), "
                        f"got {type(inputs).__name__}")
    try:
        json.dumps(inputs, allow_nan=False)
    except ValueError:
        raise ValueError(f"{name} must hold finite numbers only, found NaN or an infinity (NaN equals "
                         "nothing, so no record would ever match it)") from None
    except TypeError as err:
        raise TypeError(f"{name} must hold JSON values only (str, int, float, bool, None, lists, dicts): "
                        f"{err}") from None
    return json_normal(inputs)


def _check_section(section: object) -> str:
    """``section`` if it can name a run in the record (``history`` is the record's own)."""
    if not isinstance(section, str) or not section or section == "history":
        raise ValueError(f"section must be a non-empty name other than 'history' (the record's past runs), "
                         f"got {section!r}")
    return section


ENTRY_KEYS = ("inputs", "date", "machine", "result")  # what recorded_run stores, and reads back


def _check_entry(entry: object) -> dict[str, Any]:
    """``entry`` if it is a record entry: the four keys of ``ENTRY_KEYS``, ``date`` an ISO date with its zone."""
    if not isinstance(entry, dict):
        raise TypeError(f"entry must be a dict with the keys {', '.join(ENTRY_KEYS)}, got {type(entry).__name__}")
    missing = [k for k in ENTRY_KEYS if k not in entry]
    if missing:
        raise ValueError(f"entry lacks the key(s) {', '.join(map(repr, missing))}: an entry holds "
                         f"{', '.join(ENTRY_KEYS)} (recorded_run's result)")
    _normal_inputs(entry["inputs"], "entry['inputs']")
    try:
        json.dumps(entry)
    except TypeError as err:
        raise TypeError(f"entry must hold JSON values only (str, int, float, bool, None, lists, dicts): {err}") \
            from None
    try:
        aware = datetime.datetime.fromisoformat(entry["date"]).tzinfo is not None
    except (TypeError, ValueError):
        aware = False
    if not aware:
        raise ValueError(f"entry['date'] must be an ISO date with its time zone, such as "
                         f"'2026-12-01T17:40:20+00:00', got {entry['date']!r}")
    return entry


def save_record(section: str, entry: dict[str, Any], path: str | os.PathLike = RECORD) -> None:
    """Store ``entry`` as the record's ``section``, normalised by :func:`json_normal`. The run it replaces
    moves to ``record["history"][section]`` when it was made for the same inputs (the earlier runs of the
    same experiment).

    ``entry``: ``{"inputs", "date", "machine", "result"}``, as :func:`recorded_run` builds it; ``date``
    in ISO form with its time zone. Anything else is refused before the record is read or written.
    """
    _check_section(section)
    _check_entry(entry)
    record = load_record(path)
    entry, old = json_normal(entry), record.get(section)
    if old is not None and json_normal(old["inputs"]) == entry["inputs"]:
        record.setdefault("history", {}).setdefault(section, []).append(old)
    elif old is not None:
        record.get("history", {}).pop(section, None)  # another experiment: its history goes with it
    record[section] = entry
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")


def recorded_run(section: str, inputs: dict[str, Any], run: Callable[[], dict[str, Any]], *,
                 rerun: bool | None = None, fresh_s: float = 1800,
                 path: str | os.PathLike = RECORD) -> dict[str, Any]:
    """A real run of vLLM, or the record of the last one: what the appendix's vLLM cells show.

    The record's ``section`` is returned when it was made for these ``inputs``, so that the notebook
    shows the same real run however often it is executed. ``run()`` runs (and replaces the section,
    with the inputs, the date and the machine; the run it replaces stays in the record's ``history``) when
    the record holds no run for these inputs, or when ``rerun`` is True; ``rerun=None`` reads
    ``LABKIT_VLLM_RERUN`` from the environment: ``1`` reruns every section, a comma-separated list of
    names (``serving``) only those. A rerun is skipped when the record's run is younger than
    ``fresh_s`` seconds: the generator executes the notebook twice (chapters/, then solutions/), and
    both must show the same run. Running needs vLLM (``make vllm``); without it a missing record is a
    ``RuntimeError`` that says so. Returns ``{"inputs", "date", "machine", "result"}``.

    ``inputs`` are compared as the record stores them (:func:`json_normal`: floats to 6 significant
    digits), so a float input matches the run saved for it; they must be JSON values, every number finite.
    """
    _check_section(section)
    inputs = _normal_inputs(inputs)
    if not callable(run):
        raise TypeError(f"run must be a function of no arguments that makes the run, got {type(run).__name__}")
    if rerun is not None:
        rerun = check_flag("rerun", rerun)
    check_number("fresh_s", fresh_s, 0)
    entry = load_record(path).get(section)
    if rerun is None:
        wanted = os.environ.get("LABKIT_VLLM_RERUN", "").split(",")
        rerun = "1" in wanted or section in wanted
    now = datetime.datetime.now(datetime.timezone.utc)
    if entry is not None and json_normal(entry["inputs"]) == inputs:
        age = (now - datetime.datetime.fromisoformat(entry["date"])).total_seconds()
        if not rerun or age < fresh_s:
            return entry
    if not is_available():
        raise RuntimeError(f"the record {Path(path).name} holds no run of {section!r} for these inputs, and vLLM is "
                           f"not set up here: run `make vllm` (Linux x86-64), then this cell again")
    machine = _machine()
    result = run()
    machine["load_after"] = list(os.getloadavg())
    entry = {"inputs": inputs, "date": now.isoformat(timespec="seconds"), "machine": machine, "result": result}
    save_record(section, entry, path)
    return json_normal(entry)  # as the record now holds it: the next execution shows the same digits


def _machine() -> dict[str, Any]:
    """Where a run was made: the processor, its cores, and how busy the machine was (load averages over
    1, 5 and 15 minutes: runnable processes, which on a shared machine include other people's)."""
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "system": f"{platform.system()} {platform.machine()}",
            "load_before": list(os.getloadavg())}
