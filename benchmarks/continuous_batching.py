"""More requests than slots: continuous batching against static batches, on the real model (issue 32).

``python benchmarks/real_model.py --workload 64`` runs this. 64 chat requests to SmolLM2-135M-Instruct
(float32, the CPU), outputs drawn from 8 to 128 tokens (seeded; end-of-turn ignored, so both sides
compute the same tokens), at most 16 running at once on both sides:

* the book's ``Engine`` with ``max_num_seqs=16``: a request that finishes frees its slot, and a
  waiting one takes it in the next step (Orca's iteration-level scheduling, vLLM's scheduler);
* transformers' ``generate`` as static batches of 16 in arrival order, left-padded, each run until
  its longest member finishes (``min_new_tokens = max_new_tokens`` = that member's length), so a
  row whose request is done keeps computing until the batch ends.

Two ways to multiply by the weights, on either side (``labkit.model.prepack``): ``nn.Linear`` as
transformers ships it, and the weights reordered once for oneDNN, as vLLM's CPU backend does at
load. The engine runs packed; transformers as shipped is the baseline the goal is measured
against; the two other pairings (both packed, both plain) show what scheduling alone buys.

Two arrival patterns: all 64 at time 0 (closed), and a Poisson stream at the rate the engine
completes requests in the closed run (about 16 busy). Both sides are timed the same way: each
model call is measured on the wall clock, and time with nothing to compute (waiting for the next
arrival) is skipped rather than slept, so an idle gap costs no machine time. A request's first
token and completion are the times its first and last tokens were computed (for a static batch
as if it streamed tokens: the most favourable reading for it).

Runs alternate (engine, static, engine, static ...) and each records the load average, since the
book's machine is shared. Results: ``benchmarks/results/real_model_64_<host>_<date>.{md,json}``;
chapter 05 draws its figure from the JSON file.
"""

from __future__ import annotations

import datetime as dt
import heapq
import json
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import labkit
from labkit.model.prepack import is_packed, prepack, unpack
from labkit.model.pretrained import chat_token_ids, from_pretrained, load_tokenizer, real_model
from labkit.serving.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SLOTS = 16
SYSTEM = ("You are a helpful assistant for the engineers who run a language-model server. "
          "Answer plainly and briefly.")
TOPICS = ["a KV cache", "paged attention", "prefix caching", "continuous batching", "a block table",
          "grouped-query attention", "time to first token", "chunked prefill", "preemption", "a tokenizer",
          "RoPE", "quantization", "the token budget of a step", "copy-on-write", "a decode step", "a prefill"]
STYLES = ["What is {t}?", "Explain {t} to a new engineer.", "Why does a server need {t}?", "Give an example of {t}."]


@dataclass
class Run:
    """One side, one arrival pattern: what the clock saw."""

    side: str                      # "engine" or "static batches"
    arrivals: str                  # "closed" or "poisson"
    gemm: str                      # "packed" (labkit.model.prepack) or "nn.Linear"
    load: float                    # 1-minute load average when the run started
    wall: float = 0.0              # seconds until the last request finished
    compute: float = 0.0           # of which in model calls (the rest waited for arrivals)
    steps: int = 0                 # model calls (forward passes), the prefill ones included
    step_end: list[float] = field(default_factory=list)  # when each model call ended
    busy: list[int] = field(default_factory=list)        # slots computing a useful token in that call
    first: list[float] = field(default_factory=list)     # per request: its first token, from its arrival
    done: list[float] = field(default_factory=list)      # per request: its last token, from its arrival
    outputs: list[list[int]] = field(default_factory=list)

    def summary(self, useful: int) -> dict:
        return {"side": self.side, "arrivals": self.arrivals, "gemm": self.gemm, "load": self.load, "wall_s": self.wall,
                "tokens_per_s": useful / self.wall, "steps": self.steps, "ms_per_step": 1000 * self.compute / self.steps,
                "busy_mean": statistics.fmean(self.busy), "done_mean_s": statistics.fmean(self.done), "done_p90_s": percentile(self.done, 90),
                "ttft_p50_s": percentile(self.first, 50), "ttft_p90_s": percentile(self.first, 90)}


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile, linear between the nearest ranks (numpy's default)."""
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def workload(tokenizer, n: int = 64, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """n chat prompts sharing a system prompt, and output lengths drawn from 8 to 128 tokens."""
    questions = [style.format(t=t) for style in STYLES for t in TOPICS][:n]
    prompts = [chat_token_ids(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in questions]
    return prompts, draw_lengths(len(prompts), seed)


def draw_lengths(n: int, seed: int = 0) -> list[int]:
    """n output lengths, uniform from 8 to 128 tokens (seeded)."""
    rng = random.Random(seed)
    return [rng.randint(8, 128) for _ in range(n)]


def fcfs_steps(lengths: list[int], slots: int = SLOTS) -> int:
    """Steps to serve ``lengths`` (output tokens each) first come, first served on ``slots`` slots, a
    freed slot refilled at the next step: each request in turn takes the slot that frees first. No
    first-come-first-served engine can take fewer; the book's takes exactly this many when every
    prompt fits one step's token budget."""
    free_at = [0] * slots
    for n in lengths:
        heapq.heappush(free_at, heapq.heappop(free_at) + n)
    return max(free_at)


def batch_longest(lengths: list[int], slots: int = SLOTS) -> list[int]:
    """Static batches of ``slots`` in arrival order each run as many steps as their longest member."""
    return [max(lengths[lo:lo + slots]) for lo in range(0, len(lengths), slots)]


def poisson_arrivals(n: int, rate: float, seed: int = 1) -> list[float]:
    """Arrival times of a Poisson stream of ``rate`` requests/s (exponential gaps), the first at 0."""
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def load_average() -> float:
    return os.getloadavg()[0]


def gemm_name(model) -> str:
    return "packed" if is_packed(model) else "nn.Linear"


def gemm_times(model, rows: tuple[int, ...] = (1, 16), repeat: int = 5) -> dict[str, dict[int, float]]:
    """Milliseconds for one pass over every linear layer of ``model`` (one step's multiplies) at
    ``rows`` rows, as ``nn.Linear`` and packed (best of ``repeat``); the model is left unpacked."""
    times: dict[str, dict[int, float]] = {}
    for packing in ("nn.Linear", "packed"):
        if packing == "packed":
            prepack(model)
        else:
            unpack(model)
        layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        times[packing] = {}
        with torch.no_grad():
            for n in rows:
                xs = [torch.randn(n, m.in_features) for m in layers]
                best = float("inf")
                for _ in range(repeat):
                    start = time.perf_counter()
                    for m, x in zip(layers, xs):
                        m(x)
                    best = min(best, time.perf_counter() - start)
                times[packing][n] = 1000 * best
    unpack(model)
    return times


def run_engine(model, prompts, lengths, arrivals: list[float], label: str) -> Run:
    """The engine on the clock: requests join when they arrive; each step is timed."""
    run = Run("engine", label, gemm_name(model), load_average())
    engine = Engine(model, num_blocks=512, block_size=16, max_num_batched_tokens=512, max_num_seqs=SLOTS,
                    prepare=False)  # the model's multiplies as this benchmark set them (its GEMM column)
    n = len(prompts)
    requests, first, done = [], [None] * n, [None] * n
    now = 0.0
    while len(requests) < n or engine.has_unfinished():
        while len(requests) < n and arrivals[len(requests)] <= now:
            i = len(requests)
            requests.append(engine.add_request(prompts[i], lengths[i], eos_token_id=()))
        if not engine.has_unfinished():
            now = arrivals[len(requests)]  # nothing to compute until the next arrival
            continue
        start = time.perf_counter()
        step = engine.step()
        now += time.perf_counter() - start
        run.compute += time.perf_counter() - start
        run.step_end.append(now)
        run.busy.append(step.stats.num_scheduled)
        for i, r in enumerate(requests):
            if first[i] is None and r.output_token_ids:
                first[i] = now - arrivals[i]
            if done[i] is None and r.is_finished:
                done[i] = now - arrivals[i]
    run.wall, run.steps, run.first, run.done = now, len(run.step_end), first, done
    run.outputs = [list(r.output_token_ids) for r in requests]
    return run


class _StepClock:
    """A transformers stopping criterion that never stops: it notes when each token was computed."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def run_static(hf, prompts, lengths, arrivals: list[float], label: str) -> Run:
    """Static batches of 16 in arrival order: a batch starts when its last member has arrived and
    the previous batch is done, and runs until its longest member has all its tokens."""
    from transformers import StoppingCriteriaList

    run = Run("static batches", label, gemm_name(hf), load_average())
    n = len(prompts)
    run.first, run.done, run.outputs = [0.0] * n, [0.0] * n, [[] for _ in range(n)]
    now = 0.0
    for lo in range(0, n, SLOTS):
        members = range(lo, min(lo + SLOTS, n))
        width = max(len(prompts[i]) for i in members)
        ids = torch.zeros(len(members), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(members):  # left padding: every prompt ends at the last column
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        longest = max(lengths[i] for i in members)
        now = max(now, max(arrivals[i] for i in members))  # the batch waits to fill
        clock = _StepClock()
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                          do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]))
        ends = [now + t - start for t in clock.times]  # one per model call
        now += time.perf_counter() - start
        run.compute += time.perf_counter() - start
        run.step_end += ends
        run.busy += [sum(lengths[i] > k for i in members) for k in range(len(ends))]
        for row, i in enumerate(members):
            run.first[i] = ends[0] - arrivals[i]
            run.done[i] = ends[lengths[i] - 1] - arrivals[i]
            run.outputs[i] = out[row, width:width + lengths[i]].tolist()
    run.wall, run.steps = now, len(run.step_end)
    return run


@torch.no_grad()
def one_at_a_time_tokens(hf, prompts, lengths) -> list[list[int]]:
    """transformers' greedy tokens, one request at a time: the reference both sides must equal."""
    outs = []
    for p, n in zip(prompts, lengths):
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def load_models():
    """The packaged GGUF's path, the book's decoder and transformers' Llama both read from it in float32,
    and the tokenizer. transformers' end-of-turn stop is off: fixed lengths, so every side computes the same tokens."""
    from transformers import AutoModelForCausalLM

    path = real_model()
    model = from_pretrained(path, dtype=torch.float32, device=labkit.DEVICE, prepare=False)  # packed here, per run
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return path, model, load_tokenizer(path), hf


def main_64(args) -> None:
    path, model, tokenizer, hf = load_models()
    prompts, lengths = workload(tokenizer)
    gemm = gemm_times(model)
    print("one step's multiplies, ms:", gemm, flush=True)
    useful = sum(lengths)
    closed = [0.0] * len(prompts)
    runs: list[Run] = []
    rate = args.rate
    arrivals = None if rate is None else poisson_arrivals(len(prompts), rate)

    def timed(side: str, packed: bool, times: list[float], label: str) -> None:
        target = model if side == "engine" else hf
        if packed:
            prepack(target)
        else:
            unpack(target)
        runs.append(run_engine(model, prompts, lengths, times, label) if side == "engine"
                    else run_static(hf, prompts, lengths, times, label))
        print(runs[-1].summary(useful), flush=True)

    for _ in range(args.repeat):  # engine and static alternate; the goal's pair first
        timed("engine", True, closed, "closed")
        timed("static batches", False, closed, "closed")
        timed("engine", False, closed, "closed")
        timed("static batches", True, closed, "closed")
        if rate is None:  # the rate at which the engine, 16 busy, completes requests
            rate = len(prompts) / runs[0].wall
            arrivals = poisson_arrivals(len(prompts), rate)
        timed("engine", True, arrivals, "poisson")
        timed("static batches", False, arrivals, "poisson")
    unpack(hf)
    reference = one_at_a_time_tokens(hf, prompts, lengths) if args.check_one_at_a_time else None
    write_results(args, path, prompts, lengths, runs, rate, reference, gemm)


def _median_run(runs: list[Run], side: str, arrivals: str, gemm: str) -> Run:
    """The run of the median wall time (a run, not a mix of runs)."""
    mine = sorted((r for r in runs if (r.side, r.arrivals, r.gemm) == (side, arrivals, gemm)), key=lambda r: r.wall)
    return mine[(len(mine) - 1) // 2]


GOAL = {"engine": "packed", "static batches": "nn.Linear"}  # the pair the goal is measured on


def all_at_once_note() -> str:
    """The committed 16-request table (``--workload 16``) and why it is level, for beside the 64-request one."""
    files = sorted(p for p in RESULTS.glob("real_model_*.md") if not p.name.startswith("real_model_64_"))
    table = [line for line in files[-1].read_text().splitlines() if line.startswith("|")] if files else []
    return "\n".join([
        f"## Beside it: 16 requests, all at once (`{files[-1].name if files else 'not run yet'}`)", "",
        *table, "",
        "There the engine and one padded batch are level, as they should be: all 16 requests are admitted in "
        "the first step, so both sides run about as many steps as the longest output (64), and on a CPU a "
        "small model's step costs nearly the same at any batch size (the weights are read once per step). "
        "That workload measures the cost of a step, not scheduling; the one above, with more requests than "
        "slots, is where continuous batching saves steps."])


def write_results(args, path, prompts, lengths, runs: list[Run], rate: float, reference, gemm) -> None:
    useful = sum(lengths)
    n = len(prompts)

    def pick(side: str, arrivals: str, packing: str) -> list[Run]:
        return [r for r in runs if (r.side, r.arrivals, r.gemm) == (side, arrivals, packing)]

    def speedups(engine_gemm: str, static_gemm: str) -> list[float]:
        """Closed runs, useful tokens/s of the engine over the static batches', pair by pair (same repeat)."""
        return [s.wall / e.wall for e, s in zip(pick("engine", "closed", engine_gemm),
                                                 pick("static batches", "closed", static_gemm))]

    def ms_per_step(side: str, packing: str) -> float:
        return statistics.median(1000 * r.compute / r.steps for r in pick(side, "closed", packing))

    engine_runs = [r for r in runs if r.side == "engine"]
    static_runs = [r for r in runs if r.side == "static batches"]
    base = pick("static batches", "closed", "nn.Linear")[0].outputs
    same_static = sum(a == b for a, b in zip(pick("engine", "closed", "packed")[0].outputs, base))
    same_packed_static = sum(a == b for r in static_runs for a, b in zip(r.outputs, base))
    same_ref = None if reference is None else sum(a == b for r in engine_runs for a, b in zip(r.outputs, reference))
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    longest = batch_longest(lengths)
    cmd = (f"python benchmarks/real_model.py --workload 64 --threads {args.threads} --repeat {args.repeat}"
           + (" --check-one-at-a-time" if args.check_one_at_a_time else "")
           + ("" if args.rate is None else f" --rate {args.rate:g}"))
    goal, plain, packed = speedups("packed", "nn.Linear"), speedups("nn.Linear", "nn.Linear"), speedups("packed", "packed")
    e_steps, s_steps = engine_runs[0].steps, sum(longest)
    draws = [sum(batch_longest(ls)) / fcfs_steps(ls) for ls in (draw_lengths(n, seed) for seed in range(20))]
    med = statistics.median
    lines = [f"# More requests than slots: the engine against static batches ({when})", "",
             f"Command: `{cmd}`  ",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
             f"{torch.__version__}, {args.threads} threads on both sides; device {labkit.DEVICE}  ",
             f"Model: {path.name} (float32); {n} chat requests, prompts {min(map(len, prompts))}-"
             f"{max(map(len, prompts))} tokens sharing a system prompt; outputs {min(lengths)}-{max(lengths)} tokens "
             f"(seed 0), {useful} in all; at most {SLOTS} running at once on both sides. Poisson arrivals at "
             f"{rate:.2f} requests/s (" + ("given" if args.rate is not None else "the engine's first closed-run "
             "completion rate") + ").  ",
             "GEMM: `nn.Linear` as transformers ships it, or `packed`: the same float32 weights reordered once "
             "for oneDNN (`labkit.model.prepack`, what vLLM's CPU backend does at load). One step's multiplies "
             "(every linear layer once, best of 5): " + "; ".join(
                 f"{rows} rows {gemm['nn.Linear'][rows]:.1f} ms as nn.Linear, {gemm['packed'][rows]:.1f} ms packed"
                 for rows in gemm["packed"]) + ".", "",
             "Every run, in the order they ran (load: 1-minute load average at its start):", "",
             "| # | side | GEMM | arrivals | load | wall (s) | useful tokens/s | steps | ms/step (computing) | busy slots per step | "
             "completion mean (s) | completion p90 (s) | TTFT p50 (s) | TTFT p90 (s) |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, r in enumerate(runs):
        s = r.summary(useful)
        lines.append(f"| {k + 1} | {r.side} | {r.gemm} | {r.arrivals} | {r.load:.2f} | {r.wall:.1f} | {s['tokens_per_s']:.1f} | "
                     f"{r.steps} | {s['ms_per_step']:.0f} | {s['busy_mean']:.1f} | {s['done_mean_s']:.1f} | {s['done_p90_s']:.1f} | "
                     f"{s['ttft_p50_s']:.2f} | {s['ttft_p90_s']:.2f} |")
    fmt = lambda xs: f"{', '.join(f'{x:.2f}x' for x in xs)} (median {med(xs):.2f}x)"  # noqa: E731
    lines += ["", "Closed runs, the engine's speed-up in useful tokens/s, repeat by repeat:", "",
              f"- engine (packed) against static batches as transformers ships them (nn.Linear): {fmt(goal)};",
              f"- the same GEMM on both sides, packed: {fmt(packed)}; nn.Linear: {fmt(plain)}.", "",
              f"Steps: the static batches make {s_steps} model calls (the sum over the {len(longest)} batches of "
              f"their longest member: {' + '.join(map(str, longest))}), the engine {e_steps}: "
              f"{s_steps / e_steps:.2f}x fewer. The rest of each ratio is the cost of a step (medians, prompt "
              f"steps included): engine {ms_per_step('engine', 'packed'):.0f} ms packed, "
              f"{ms_per_step('engine', 'nn.Linear'):.0f} ms nn.Linear; static batches "
              f"{ms_per_step('static batches', 'packed'):.0f} ms packed, "
              f"{ms_per_step('static batches', 'nn.Linear'):.0f} ms nn.Linear.  ",
              (f"The engine's {e_steps} steps are the fewest any first-come-first-served schedule of these lengths "
               f"can take" if e_steps == fcfs_steps(lengths) else f"The engine took {e_steps} steps; a "
               f"first-come-first-served schedule of these lengths needs at least {fcfs_steps(lengths)}")
              + " (each request in turn takes the slot that frees first). The step ratio depends on the draw: for "
              f"output lengths drawn with seeds 0-19, static steps over that fewest range from {min(draws):.2f}x to "
              f"{max(draws):.2f}x (median {med(draws):.2f}x); seed 0, used here, gives "
              f"{s_steps / fcfs_steps(lengths):.2f}x.  ",
              f"Tokens: the packed engine's equal the static batches' for {same_static} of {n} requests; every "
              f"static run's equal the first nn.Linear one's for {same_packed_static} of {len(static_runs) * n}"
              + ("" if same_ref is None else
                 f"; every engine run's equal transformers' one-at-a-time greedy tokens for {same_ref} of "
                 f"{len(engine_runs) * n}") + "."]
    table = "\n".join(lines) + "\n\n" + all_at_once_note()
    print(table)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / (f"real_model_64_{platform.node() or 'host'}_{when[:10]}"
                      + ("" if args.rate is None else f"_rate{args.rate:g}"))
    Path(f"{stem}.md").write_text(table + "\n")
    keep = {(side, a): _median_run(runs, side, a, GOAL[side]) for side in GOAL for a in ("closed", "poisson")}
    record = {"command": cmd, "date": when, "threads": args.threads, "slots": SLOTS, "lengths": lengths,
              "prompt_lens": list(map(len, prompts)), "poisson_rate": rate, "batch_longest": longest,
              "goal_gemm": GOAL, "gemm_ms": gemm,
              "speedups": {"goal": goal, "both packed": packed, "both nn.Linear": plain},
              "fcfs_steps": fcfs_steps(lengths), "step_ratio_by_seed": draws,
              "tokens_equal_static": same_static, "tokens_equal_one_at_a_time": same_ref,
              "runs": [r.summary(useful) for r in runs],
              "outputs": {"engine closed": pick("engine", "closed", "packed")[0].outputs, "static batches closed": base,
                          "one at a time": reference},
              "traces": {f"{s} {a}": {k: v for k, v in asdict(r).items() if k != "outputs"} for (s, a), r in keep.items()}}
    Path(f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwritten to {stem.relative_to(ROOT)}.md and .json")
