"""Benchmark: the book's engine serving a real model, against transformers' ``generate``.

The same 16 chat requests (SmolLM2-135M-Instruct, the GGUF file ``make setup`` installs, float32 on
the CPU), each with a fixed output length between 8 and 64 tokens (end-of-turn ignored, so every
way computes the same tokens), served three ways in one run, on the same CPU threads:

1. ``labkit.serving.engine.Engine``: continuous batching (a finished request leaves the batch at once and
   a waiting one takes its place), paged KV, the prefix cache (the requests share a system
   prompt), the kernels' PyTorch references (on a GPU, the Triton kernels);
2. transformers ``generate``, one request at a time;
3. transformers ``generate`` on all 16 as one padded batch (left padding), run to the longest
   output: a static batch keeps every row busy until the longest request ends (Orca's point).

It prints tokens/s and wall time for each way, and their ratios, checks that the engine's greedy
tokens equal transformers' one-at-a-time tokens, and writes the table to
``benchmarks/results/real_model_<host>_<date>.md``. Goal (issue 18): the engine at least 2x the
one-at-a-time throughput and at least 1x the padded batch's.

A second workload (``--workload 64``, issue 32, code in ``benchmarks/continuous_batching.py``):
64 chat requests, outputs of 8 to 128 tokens, at most 16 running at once on both sides, where
continuous batching should win; and the same requests arriving as a Poisson stream.

Usage: ``python benchmarks/real_model.py [--threads 2] [--repeat 1] [--workload 16|64]``
(transformers reads the GGUF file itself, which needs ``accelerate``, a test dependency).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import labkit  # noqa: E402
from labkit.model.pretrained import chat_token_ids  # noqa: E402
from labkit.serving.engine import Engine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SYSTEM = ("You are a helpful assistant for the engineers who run a language-model server. "
          "Answer plainly and briefly.")
QUESTIONS = ["What is a KV cache?", "Why does decoding read the whole cache?", "What is paged attention?",
             "What is prefix caching?", "What is continuous batching?", "What is a block table?",
             "Why do long contexts cost memory?", "What is grouped-query attention?",
             "What limits the batch size of a server?", "What is time to first token?",
             "What is chunked prefill?", "Why is decode memory-bound?", "What is preemption?",
             "What does a tokenizer do?", "What is RoPE?", "What is quantization?"]
OUTPUT_LENS = [8 + round(56 * i / 15) for i in range(16)]  # 8 .. 64 tokens


def prompts_and_lengths(tokenizer) -> tuple[list[list[int]], list[int]]:
    prompts = [chat_token_ids(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in QUESTIONS]
    order = [(i * 7) % 16 for i in range(16)]  # lengths shuffled over the requests
    return prompts, [OUTPUT_LENS[j] for j in order]


def run_engine(model, prompts, lengths, use_triton: bool) -> tuple[float, list[list[int]], int]:
    engine = Engine(model, num_blocks=512, block_size=16, max_num_batched_tokens=512, use_triton=use_triton)
    requests = [engine.add_request(p, n, eos_token_id=()) for p, n in zip(prompts, lengths)]
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start, [list(r.output_token_ids) for r in requests], len(engine.stats)


@torch.no_grad()
def run_one_at_a_time(hf, prompts, lengths) -> tuple[float, list[list[int]]]:
    outputs = []
    start = time.perf_counter()
    for p, n in zip(prompts, lengths):
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
        outputs.append(out[0, len(p):].tolist())
    return time.perf_counter() - start, outputs


@torch.no_grad()
def run_padded_batch(hf, prompts, lengths) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at the last column
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(lengths), min_new_tokens=max(lengths),
                      do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - start
    return wall, [out[i, width:width + n].tolist() for i, n in enumerate(lengths)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads, the same for every way")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each way; the best is reported")
    parser.add_argument("--workload", type=int, choices=(16, 64), default=16,
                        help="16: all at once, three ways; 64: more requests than slots (continuous_batching.py)")
    parser.add_argument("--check-one-at-a-time", action="store_true",
                        help="workload 64: also run transformers one request at a time and compare tokens")
    parser.add_argument("--rate", type=float, default=None,
                        help="workload 64: Poisson arrivals per second (default: the engine's first closed-run "
                             "completion rate); the results' file names then end in _rate<RATE>")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.workload == 64:
        from continuous_batching import main_64  # noqa: E402  (benchmarks/, next to this file)
        main_64(args)
        return
    from continuous_batching import load_models  # noqa: E402  (benchmarks/, next to this file)

    path, model, tokenizer, hf = load_models()
    prompts, lengths = prompts_and_lengths(tokenizer)
    useful = sum(lengths)
    use_triton = labkit.RUNTIME.triton_mode == "compiled"

    best: dict[str, float] = {}
    outputs: dict[str, list[list[int]]] = {}
    steps = 0
    for _ in range(args.repeat):
        for name, run in (("engine", lambda: run_engine(model, prompts, lengths, use_triton)),
                          ("one at a time", lambda: run_one_at_a_time(hf, prompts, lengths)),
                          ("padded batch", lambda: run_padded_batch(hf, prompts, lengths))):
            wall, out, *rest = run()
            if rest:
                steps = rest[0]
            best[name] = min(wall, best.get(name, float("inf")))
            outputs[name] = out
    same = outputs["engine"] == outputs["one at a time"]
    same_batch = sum(a == b for a, b in zip(outputs["engine"], outputs["padded batch"]))

    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Real model served three ways ({when})", "",
             f"Command: `python benchmarks/real_model.py --threads {args.threads} --repeat {args.repeat}`  ",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
             f"{torch.__version__}, {args.threads} threads; device {labkit.DEVICE}, attention "
             f"{'Triton kernels' if use_triton else 'PyTorch references of the kernels'}  ",
             f"Model: {path.name} (float32); 16 chat requests, prompts {min(map(len, prompts))}-"
             f"{max(map(len, prompts))} tokens sharing a system prompt; outputs {min(lengths)}-{max(lengths)} "
             f"tokens, {useful} in all; best of {args.repeat}", "",
             "| way | wall (s) | tokens/s | engine speed-up |", "|---|---:|---:|---:|"]
    for name in best:
        lines.append(f"| {name} | {best[name]:.2f} | {useful / best[name]:.1f} | "
                     f"{best[name] / best['engine']:.2f}x |")
    lines += ["", f"Engine steps: {steps}. Engine tokens equal transformers' one-at-a-time tokens: {same}. "
                  f"Equal to the padded batch's for {same_batch} of 16 requests (padding changes float "
                  f"rounding in transformers' batched attention)."]
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    out_file = RESULTS / f"real_model_{platform.node() or 'host'}_{when[:10]}.md"
    out_file.write_text(table + "\n")
    print(f"\nwritten to {out_file.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
