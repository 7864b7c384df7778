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

from .real import is_available

# What the appendix's last real run printed and measured (committed): its vLLM cells show it (``recorded_run``).
RECORD = Path(__file__).resolve().parents[1] / "data" / "real_vllm_run.json"


def load_record(path: str | os.PathLike = RECORD) -> dict[str, Any]:
    """The committed record of the appendix's real runs (empty when there is none)."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else {}


def _rounded(value: Any) -> Any:
    """``value`` with every float to 6 significant digits (a measured time has no more)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def save_record(section: str, entry: dict[str, Any], path: str | os.PathLike = RECORD) -> None:
    """Store ``entry`` as the record's ``section``. The run it replaces moves to ``record["history"]
    [section]`` when it was made for the same inputs (the earlier runs of the same experiment)."""
    record = load_record(path)
    entry, old = _rounded(entry), record.get(section)
    if old is not None and old["inputs"] == entry["inputs"]:
        record.setdefault("history", {}).setdefault(section, []).append(old)
    elif old is not None:
        record.get("history", {}).pop(section, None)  # another experiment: its history goes with it
    record[section] = entry
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")


def json_normal(value: Any) -> Any:
    """``value`` as the record stores it: through JSON and back (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value))


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
    """
    inputs = json_normal(inputs)
    entry = load_record(path).get(section)
    if rerun is None:
        wanted = os.environ.get("LABKIT_VLLM_RERUN", "").split(",")
        rerun = "1" in wanted or section in wanted
    now = datetime.datetime.now(datetime.timezone.utc)
    if entry is not None and entry["inputs"] == inputs:
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
    return entry


def _machine() -> dict[str, Any]:
    """Where a run was made: the processor, its cores, and how busy the machine was (load averages over
    1, 5 and 15 minutes: runnable processes, which on a shared machine include other people's)."""
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "system": f"{platform.system()} {platform.machine()}",
            "load_before": list(os.getloadavg())}
