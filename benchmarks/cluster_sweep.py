"""Chapter 07's sweep: Mooncake's conversation trace on 1-16 simulated replicas behind each router.

Every router of ``labkit.serving.cluster.routers`` at every cluster size, the same requests, the same
servers: Llama-3-8B's cost on an A100 80GB, a 48 GiB KV pool each (the 80 GB less the 16 GB of bf16
weights and room for activations), blocks of 512 tokens (the trace's own), chapter 06's scheduler
with a budget of 8,192 tokens a step. The workload is one conversation in ten of the trace
(``sample_conversations``), at twice its speed (``time_scale=0.5``): 1,223 requests over 30 minutes
whose turns keep their own order and half their gaps. One replica is then busy but not swamped.

It is a simulation: the numbers are the same on any machine (a test reruns one row and compares).
It takes about a minute and a half here, so chapter 07 reads the committed result instead of rerunning
it. Writes ``benchmarks/results/cluster_sweep_<date>.json`` and ``.md``.

Usage: ``python benchmarks/cluster_sweep.py``
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import labkit  # noqa: E402,F401
from labkit.serving.cluster.cluster import simulate  # noqa: E402
from labkit.serving.cluster.routers import ROUTERS  # noqa: E402
from labkit.serving.sim.costmodel import CostModel  # noqa: E402
from labkit.serving.sim.mooncake import read_mooncake_trace  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SETUP = {
    "workload": {"one_in": 10, "time_scale": 0.5},
    "cost_model": {"model": "Llama-3-8B", "device": "A100 80GB SXM"},
    "simulator": {"pool_bytes": 48 * 2 ** 30, "block_size": 512, "max_num_batched_tokens": 8192},
    "router_settings": {"cache_aware": {"block_size": 512}},
}
REPLICAS = (1, 2, 4, 8, 16)
LOAD_BIN_S = 60.0  # the load figure: each replica's busy share of every minute


def run_point(specs, replicas: int, router: str, setup: dict = SETUP):
    """One row of the sweep: ``simulate`` with the setup's servers and router settings."""
    return simulate(specs, replicas, router, router_settings=setup["router_settings"].get(router),
                    cost_model=CostModel(**setup["cost_model"]), **setup["simulator"])


def load_over_time(result, width: float = LOAD_BIN_S) -> dict:
    """Per replica, the share of every ``width`` seconds it spent running steps (its busy share), from the
    start of each bin (``t``); steps that cross a bin's edge are split between the two bins."""
    end = max(r.step_end.max() for r in result.replicas if len(r.step_end))
    edges = np.arange(0.0, end + width, width)
    busy = []
    for r in result.replicas:
        inside = [np.clip(np.minimum(r.step_end, b + width) - np.maximum(r.step_start, b), 0, None).sum()
                  for b in edges[:-1]]
        busy.append([round(float(x) / width, 4) for x in inside])
    return {"t": edges[:-1].tolist(), "busy": busy}


def main() -> None:
    started = time.time()
    specs = read_mooncake_trace(**SETUP["workload"])
    rows, loads = [], {}
    for n in REPLICAS:
        for router in ROUTERS:
            t0 = time.time()
            result = run_point(specs, n, router)
            row = result.summary()
            row.update({"replica hit rates": [None if np.isnan(x) else float(x) for x in result.replica_hit_rates],
                        "requests per replica": result.requests_per_replica.tolist(),
                        "seconds": round(time.time() - t0, 1)})
            rows.append(row)
            if n == 4 and router in ("round_robin", "cache_aware"):
                loads[router] = {**load_over_time(result), "per_replica": result.per_replica()}
            print(f"{n:>2} {router:<13} hit {row['hit rate']:.3f}  TTFT p90 {row['TTFT p90 (ms)']:8.0f} ms  "
                  f"imbalance {row['load imbalance']:.2f}  ({row['seconds']} s)", flush=True)
    date = dt.datetime.now(dt.timezone.utc)
    record = {"command": "python benchmarks/cluster_sweep.py", "date": date.strftime("%Y-%m-%d %H:%M UTC"),
              "requests": len(specs), "prompt_tokens": int(sum(s.prompt_len for s in specs)),
              "span_s": float(max(s.arrival_time for s in specs)), "setup": SETUP, "rows": rows,
              "load_over_time_4_replicas": loads, "wall_s": round(time.time() - started, 1)}
    RESULTS.mkdir(exist_ok=True)
    name = f"cluster_sweep_{date:%Y-%m-%d}"
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# Chapter 07's sweep ({record['date']})", "",
             f"Command: `{record['command']}` ({record['wall_s']} s). {record['requests']:,} requests of Mooncake's "
             f"conversation trace (one conversation in {SETUP['workload']['one_in']}, time x "
             f"{SETUP['workload']['time_scale']}), {record['prompt_tokens']:,} prompt tokens over "
             f"{record['span_s']:.0f} s; each replica {SETUP['cost_model']['model']} on {SETUP['cost_model']['device']}, "
             f"{SETUP['simulator']['pool_bytes'] / 2 ** 30:.0f} GiB of KV pool, blocks of "
             f"{SETUP['simulator']['block_size']}, {SETUP['simulator']['max_num_batched_tokens']} tokens a step.", "",
             "| replicas | router | hit rate | TTFT p50 (ms) | TTFT p90 (ms) | ITL p90 (ms) | load imbalance |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['replicas']} | {r['router']} | {r['hit rate']:.3f} | {r['TTFT p50 (ms)']:.0f} | "
              f"{r['TTFT p90 (ms)']:.0f} | {r['ITL p90 (ms)']:.1f} | {r['load imbalance']:.2f} |" for r in rows]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / name}.json and .md")


if __name__ == "__main__":
    main()
