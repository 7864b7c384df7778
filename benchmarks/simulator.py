"""Benchmark: how fast the serving simulator of chapter 06 runs (``labkit.serving.sim.simulator``).

Simulates 10,000 ShareGPT-like requests (Poisson arrivals) end to end on the
teaching model with §06's pool (24 GiB device, 17 GiB set aside: 3,584 blocks of
16 tokens), through labkit's own scheduler, allocator and prefix cache, and
prints the requests simulated per second of wall time. Goal (issue 7): the whole
run under 10 s on the book's 2-core CPU machine.

It also times a smaller run both ways, stepping through every iteration and
with skip-ahead, checks that both give the same result, and prints the speed-up.
A CPU benchmark: no GPU is involved. Results go to
``benchmarks/results/simulator_<host>_<date>.json``.

Usage: ``python benchmarks/simulator.py [--requests 10000] [--rate 4] [--device "RTX 4090 (24 GiB)"]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import labkit  # noqa: E402,F401
from labkit.memory.pool_plan import plan_pool  # noqa: E402
from labkit.serving.sim.costmodel import CostModel  # noqa: E402
from labkit.serving.sim.simulator import Simulator  # noqa: E402
from labkit.serving.sim.workloads import sharegpt_like  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GOAL_S = 10.0


def timed_run(sim: Simulator, requests) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = sim.run(requests)
    return time.perf_counter() - wall, time.process_time() - cpu, result


def same(a, b) -> bool:
    """Both runs made the same schedule and measured the same times (intervals compared as multisets)."""
    fields = ("first_token", "finish", "step_start", "step_end", "used_blocks", "live_tokens")
    intervals = [np.sort(np.repeat(r.itl, r.itl_weight.astype(np.int64))) for r in (a, b)]
    return (all(np.array_equal(getattr(a, f), getattr(b, f)) for f in fields)
            and np.array_equal(*intervals) and a.schedule == b.schedule)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second (Poisson)")
    parser.add_argument("--device", default="RTX 4090 (24 GiB)")
    parser.add_argument("--check-requests", type=int, default=300,
                        help="size of the stepping-vs-skip-ahead comparison (0 to skip it)")
    args = parser.parse_args()

    pool = plan_pool()  # §06: 24 GiB - 17 GiB = 7 GiB = 3,584 blocks of 16 tokens
    cost = CostModel("teaching model", args.device)
    t0 = time.perf_counter()
    requests = sharegpt_like(args.requests, args.rate, seed=0)
    make_s = time.perf_counter() - t0
    sim = Simulator(cost, num_blocks=pool.num_blocks, block_size=16, max_num_batched_tokens=2048)
    wall, cpu, result = timed_run(sim, requests)
    summary = result.summary()

    rows = [
        ("requests", f"{args.requests:,}"),
        ("arrival rate", f"{args.rate:g} /s (Poisson)"),
        ("model / device", f"teaching model / {args.device} (datasheet roofline)"),
        ("pool", f"{pool.num_blocks:,} blocks of 16 tokens"),
        ("workload generation", f"{make_s:.2f} s"),
        ("simulation wall time", f"{wall:.2f} s (CPU {cpu:.2f} s)"),
        ("requests simulated per second", f"{args.requests / wall:,.0f}"),
        ("engine steps simulated", f"{result.num_steps:,} ({result.skipped_steps / result.num_steps:.1%} skipped ahead)"),
        ("mean running requests", f"{result.num_running.mean():.1f}"),
        ("simulated time", f"{result.makespan:,.1f} s"),
        ("TTFT p50 / p99", f"{summary['TTFT p50 (ms)']:.1f} / {summary['TTFT p99 (ms)']:.1f} ms"),
        ("ITL p50 / p99", f"{summary['ITL p50 (ms)']:.1f} / {summary['ITL p99 (ms)']:.1f} ms"),
        ("goal", f"whole run < {GOAL_S:g} s: {'PASS' if wall + make_s < GOAL_S else 'MISS'} "
                 f"({wall + make_s:.2f} s with generation)"),
    ]
    record = {"command": " ".join(sys.argv), "date": dt.date.today().isoformat(), "host": platform.node(),
              "cpus": os.cpu_count(), "python": platform.python_version(), "requests": args.requests,
              "rate": args.rate, "device": args.device, "wall_s": wall, "cpu_s": cpu,
              "generation_s": make_s, "requests_per_s": args.requests / wall, "steps": result.num_steps,
              "skipped_steps": result.skipped_steps, "summary": summary}

    if args.check_requests:
        small = sharegpt_like(args.check_requests, args.rate, seed=1)
        step_wall, _, stepped = timed_run(Simulator(cost, num_blocks=pool.num_blocks, skip_ahead=False,
                                                    record_schedule=True), small)
        skip_wall, _, skipped = timed_run(Simulator(cost, num_blocks=pool.num_blocks, record_schedule=True), small)
        identical = same(stepped, skipped)
        rows.append((f"{args.check_requests} requests, stepping vs skip-ahead",
                     f"{step_wall:.2f} s vs {skip_wall:.2f} s ({step_wall / skip_wall:.1f}x), "
                     f"identical: {identical}"))
        record.update(check_requests=args.check_requests, stepping_s=step_wall, skip_ahead_s=skip_wall,
                      identical=identical)

    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"simulator_{platform.node() or 'host'}_{record['date']}.json"
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
