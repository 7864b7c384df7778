"""More requests than slots: continuous batching against static batches, on the real model (issue 32).

``python benchmarks/real_model.py --workload 64`` runs this. 64 chat requests to SmolLM2-135M-Instruct
(float32, the CPU), outputs drawn from 8 to 128 tokens (seeded; end-of-turn ignored, so both sides
compute the same tokens), at most 16 running at once on both sides:

* the book's ``Engine`` with ``max_num_seqs=16``: a request that finishes frees its slot, and a
  waiting one takes it in the next step (Orca's iteration-level scheduling, vLLM's scheduler);
* transformers' ``generate`` as static batches of 16 in arrival order, left-padded, each run until
  its longest member finishes (``min_new_tokens = max_new_tokens`` = that member's length), so a
  row whose request is done keeps computing until the batch ends.

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
from labkit.engine import Engine
from labkit.pretrained import chat_token_ids, from_pretrained, load_tokenizer, real_model

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
        return {"side": self.side, "arrivals": self.arrivals, "load": self.load, "wall_s": self.wall,
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
    rng = random.Random(seed)
    return prompts, [rng.randint(8, 128) for _ in prompts]


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


def run_engine(model, prompts, lengths, arrivals: list[float], label: str) -> Run:
    """The engine on the clock: requests join when they arrive; each step is timed."""
    run = Run("engine", label, load_average())
    engine = Engine(model, num_blocks=512, block_size=16, max_num_batched_tokens=512, max_num_seqs=SLOTS,
                    use_triton=labkit.RUNTIME.triton_mode == "compiled")
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

    run = Run("static batches", label, load_average())
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
    model = from_pretrained(path, dtype=torch.float32, device=labkit.DEVICE)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return path, model, load_tokenizer(path), hf


def main_64(args) -> None:
    path, model, tokenizer, hf = load_models()
    prompts, lengths = workload(tokenizer)
    useful = sum(lengths)
    closed = [0.0] * len(prompts)
    runs: list[Run] = []
    rate = args.rate
    arrivals = None if rate is None else poisson_arrivals(len(prompts), rate)
    for _ in range(args.repeat):
        runs.append(run_engine(model, prompts, lengths, closed, "closed"))
        print(runs[-1].summary(useful), flush=True)
        runs.append(run_static(hf, prompts, lengths, closed, "closed"))
        print(runs[-1].summary(useful), flush=True)
        if rate is None:  # the rate at which the engine, 16 busy, completes requests
            rate = len(prompts) / runs[0].wall
            arrivals = poisson_arrivals(len(prompts), rate)
        runs.append(run_engine(model, prompts, lengths, arrivals, "poisson"))
        print(runs[-1].summary(useful), flush=True)
        runs.append(run_static(hf, prompts, lengths, arrivals, "poisson"))
        print(runs[-1].summary(useful), flush=True)
    reference = one_at_a_time_tokens(hf, prompts, lengths) if args.check_one_at_a_time else None
    write_results(args, path, prompts, lengths, runs, rate, reference)


def _median_run(runs: list[Run], side: str, arrivals: str) -> Run:
    """The run of the median wall time (a run, not a mix of runs)."""
    mine = sorted((r for r in runs if r.side == side and r.arrivals == arrivals), key=lambda r: r.wall)
    return mine[(len(mine) - 1) // 2]


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


def write_results(args, path, prompts, lengths, runs: list[Run], rate: float, reference) -> None:
    useful = sum(lengths)
    engine_runs = [r for r in runs if r.side == "engine"]
    static_runs = [r for r in runs if r.side == "static batches"]
    same_static = sum(a == b for a, b in zip(engine_runs[0].outputs, static_runs[0].outputs))
    same_ref = None if reference is None else sum(a == b for r in engine_runs for a, b in zip(r.outputs, reference))
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    longest = [max(lengths[lo:lo + SLOTS]) for lo in range(0, len(lengths), SLOTS)]
    cmd = (f"python benchmarks/real_model.py --workload 64 --threads {args.threads} --repeat {args.repeat}"
           + (" --check-one-at-a-time" if args.check_one_at_a_time else "")
           + ("" if args.rate is None else f" --rate {args.rate:g}"))
    lines = [f"# More requests than slots: the engine against static batches ({when})", "",
             f"Command: `{cmd}`  ",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
             f"{torch.__version__}, {args.threads} threads on both sides; device {labkit.DEVICE}  ",
             f"Model: {path.name} (float32); {len(prompts)} chat requests, prompts {min(map(len, prompts))}-"
             f"{max(map(len, prompts))} tokens sharing a system prompt; outputs {min(lengths)}-{max(lengths)} tokens "
             f"(seed 0), {useful} in all; at most {SLOTS} running at once on both sides. Poisson arrivals at "
             f"{rate:.2f} requests/s (" + ("given" if args.rate is not None else "the engine's first closed-run "
             "completion rate") + ").", "",
             "Every run, in the order they ran (load: 1-minute load average at its start):", "",
             "| # | side | arrivals | load | wall (s) | useful tokens/s | steps | ms/step (computing) | busy slots per step | completion mean (s) | "
             "completion p90 (s) | TTFT p50 (s) | TTFT p90 (s) |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, r in enumerate(runs):
        s = r.summary(useful)
        lines.append(f"| {k + 1} | {r.side} | {r.arrivals} | {r.load:.2f} | {r.wall:.1f} | {s['tokens_per_s']:.1f} | "
                     f"{r.steps} | {s['ms_per_step']:.0f} | {s['busy_mean']:.1f} | {s['done_mean_s']:.1f} | {s['done_p90_s']:.1f} | "
                     f"{s['ttft_p50_s']:.2f} | {s['ttft_p90_s']:.2f} |")
    pairs = [(e.wall, s.wall) for e, s in zip([r for r in runs if r.side == "engine" and r.arrivals == "closed"],
                                               [r for r in runs if r.side == "static batches" and r.arrivals == "closed"])]
    ratios = [s / e for e, s in pairs]
    e_steps, s_steps = engine_runs[0].steps, sum(longest)
    lines += ["", f"Closed runs, engine speed-up in useful tokens/s, run by run: "
                  f"{', '.join(f'{x:.2f}x' for x in ratios)} (median {statistics.median(ratios):.2f}x).  ",
              f"Steps: the static batches make {s_steps} model calls (the sum over the {len(longest)} batches of "
              f"their longest member: {' + '.join(map(str, longest))}), the engine {e_steps}: "
              f"{s_steps / e_steps:.2f}x fewer. The rest of the ratio is the cost of a step: "
              f"{statistics.median(1000 * r.compute / r.steps for r in engine_runs if r.arrivals == 'closed'):.0f} ms for "
              f"the engine against "
              f"{statistics.median(1000 * r.compute / r.steps for r in static_runs if r.arrivals == 'closed'):.0f} ms "
              f"(medians).  ",
              f"Tokens: the engine's equal the static batches' for {same_static} of {len(prompts)} requests"
              + ("" if same_ref is None else
                 f"; transformers' one-at-a-time greedy tokens for {same_ref} of {len(engine_runs) * len(prompts)} "
                 f"(every engine run)") + "."]
    table = "\n".join(lines) + "\n\n" + all_at_once_note()
    print(table)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / (f"real_model_64_{platform.node() or 'host'}_{when[:10]}"
                      + ("" if args.rate is None else f"_rate{args.rate:g}"))
    Path(f"{stem}.md").write_text(table + "\n")
    keep = {k: _median_run(runs, *k) for k in [(s, a) for s in ("engine", "static batches") for a in ("closed", "poisson")]}
    record = {"command": cmd, "date": when, "threads": args.threads, "slots": SLOTS, "lengths": lengths,
              "prompt_lens": list(map(len, prompts)), "poisson_rate": rate, "batch_longest": longest,
              "tokens_equal_static": same_static, "tokens_equal_one_at_a_time": same_ref,
              "runs": [r.summary(useful) for r in runs],
              "outputs": {"engine closed": engine_runs[0].outputs, "static batches closed": static_runs[0].outputs,
                          "one at a time": reference},
              "traces": {f"{s} {a}": {k: v for k, v in asdict(r).items() if k != "outputs"} for (s, a), r in keep.items()}}
    Path(f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwritten to {stem.relative_to(ROOT)}.md and .json")
