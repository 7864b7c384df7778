"""Benchmark: reload a cached prefix from disk, or compute it again? Both sides measured (issue 42).

The book's real model (SmolLM2-135M-Instruct, float32, the CPU, one thread) on this machine:

* **recompute**: labkit's ``Engine`` prefills a random prompt of H + 1 tokens in one step (the
  prefix cache then holds its first H tokens); a second prompt with the same H tokens and another
  last token computes 1 token after H cached. The prefix's recompute cost is the difference of the
  two steps (the step the request needs anyway reads the weights too: see
  ``labkit.serving.sim.tiers``). Fastest of ``--repeats``.
* **reload**: the K/V bytes of H tokens (``2 × layers × kv_heads × head_dim × 4`` bytes a token) are
  written to a file, then read back into a tensor, fastest of ``--repeats``, three ways: plainly (the
  OS page cache serves it: a copy from memory), after ``posix_fadvise(DONTNEED)`` (the page cache
  dropped, if the kernel honours it), and with ``O_DIRECT`` (the page cache bypassed, if the file
  system allows it). This machine is a VM: its virtual disk may be cached by the host, so even a
  read that misses the guest's cache may not reach a physical disk.

Then the formula: a ``Tier`` from each way's measured bandwidth (a fit over the sizes) and latency (the
fastest 4 KiB read), a ``CostModel`` fitted to the measured steps (``labkit.serving.sim.fit``, with the
memory bandwidth measured by a copy), and ``break_even_tokens`` beside the crossing measured on the
grid of H; and the same with a straight line ``a + b × H`` fitted to the prefill times.

Usage: ``python benchmarks/tier_breakeven.py [--repeats 5]``; writes
``benchmarks/results/tier_breakeven_<date>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import mmap
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import labkit  # noqa: E402,F401
from labkit.model.pretrained import from_pretrained, real_model  # noqa: E402
from labkit.serving.engine import Engine  # noqa: E402
from labkit.serving.sim.fit import fit_steps, model_cost  # noqa: E402
from labkit.serving.sim.measure import measure_stream_bandwidth, timed_step  # noqa: E402
from labkit.serving.sim.tiers import Tier, break_even_tokens, prefix_recompute_seconds  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PREFIXES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
BLOCK = 1  # one-token blocks, so that every prefix is whole blocks the prefix cache keeps
PAGE = 4096
WAYS = ("page cache", "fadvise DONTNEED", "O_DIRECT")


def measure_recompute(model, repeats: int, rng: np.random.Generator) -> tuple[dict, list]:
    """Per H: the fastest step of H + 1 new tokens, and of 1 new token after H cached."""
    engine = Engine(model, num_blocks=2 * (max(PREFIXES) // BLOCK + 2) + 8, block_size=BLOCK,
                    max_num_batched_tokens=max(PREFIXES) + 8)
    vocab = model.config.vocab_size

    def one_step(prompt: list[int]):
        engine.scheduler.add_request(engine.make_request(prompt, 1, eos_token_id=()))
        sample = timed_step(engine)
        while engine.has_unfinished():
            engine.step()
        return sample

    one_step(rng.integers(0, vocab, 16).tolist())  # untimed: a fresh engine's first step
    out, samples = {}, []
    for h in PREFIXES:
        full, suffix = [], []
        for _ in range(repeats):
            prefix = rng.integers(0, vocab, h).tolist()  # new tokens each time: nothing cached before
            a = one_step(prefix + [int(rng.integers(vocab))])
            b = one_step(prefix + [int(rng.integers(vocab))])
            assert (a.new_tokens, a.context_tokens) == (h + 1, 0), a
            assert (b.new_tokens, b.context_tokens) == (1, h), b  # the prefix came from the cache
            full.append(a)
            suffix.append(b)
        fa, fb = min(full, key=lambda s: s.seconds), min(suffix, key=lambda s: s.seconds)
        samples += [fa, fb]
        out[h] = dict(full_s=fa.seconds, suffix_s=fb.seconds, extra_s=fa.seconds - fb.seconds)
        print(f"H={h:5}: prefill of H+1 {fa.seconds * 1e3:8.2f} ms, 1 token after H {fb.seconds * 1e3:7.2f} ms",
              flush=True)
    return out, samples


def _read(path: Path, buf: memoryview, way: str) -> float:
    """Seconds to read ``path`` into ``buf`` one way (the open and close included)."""
    if way == "fadvise DONTNEED":
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    flags = os.O_RDONLY | (os.O_DIRECT if way == "O_DIRECT" else 0)
    start = time.perf_counter()
    fd = os.open(path, flags)
    try:
        done = 0
        while done < len(buf):
            n = os.readv(fd, [buf[done:]])
            if n == 0:
                break
            done += n
    finally:
        os.close(fd)
    return time.perf_counter() - start


def measure_reload(bytes_per_token: int, repeats: int, folder: Path) -> dict:
    """Per way and per H: the fastest read of H tokens' K/V bytes into a tensor; and a 4 KiB probe."""
    sizes = {"4 KiB": PAGE} | {h: h * bytes_per_token for h in PREFIXES}
    out: dict = {way: {} for way in WAYS}
    for key, nbytes in sizes.items():
        padded = -(-nbytes // PAGE) * PAGE  # O_DIRECT reads whole, aligned pages
        path = folder / f"kv_{key}.bin".replace(" ", "")
        with open(path, "wb") as f:
            f.write(np.random.default_rng(0).integers(0, 256, padded, dtype=np.uint8).tobytes())
            f.flush()
            os.fsync(f.fileno())
        buf = mmap.mmap(-1, padded)  # page-aligned, as O_DIRECT needs
        tensor = torch.frombuffer(buf, dtype=torch.uint8)  # the K/V land in a tensor, no copy
        for way in WAYS:
            try:
                out[way][key] = min(_read(path, memoryview(buf), way) for _ in range(repeats))
            except OSError as e:
                out[way][key] = None
                out[way]["error"] = f"{type(e).__name__}: {e}"
        assert tensor.numel() == padded
        del tensor
        path.unlink()
    return out


def tier_from(reads: dict, bytes_per_token: int, name: str) -> Tier | None:
    """A tier from one way's reads: bandwidth from a straight line over the sizes, latency the 4 KiB read."""
    if any(reads.get(h) is None for h in PREFIXES) or reads.get("4 KiB") is None:
        return None
    x = np.array([h * bytes_per_token for h in PREFIXES], dtype=float)
    slope, _ = np.polyfit(x, np.array([reads[h] for h in PREFIXES]), 1)
    return Tier(name, 1 / slope, reads["4 KiB"], source="measured by benchmarks/tier_breakeven.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", default=None, help="where the K/V files are written (default: the temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    model = from_pretrained(real_model(), dtype=torch.float32)
    cfg = model.config
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    bpt = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    bandwidth = measure_stream_bandwidth()
    recompute, samples = measure_recompute(model, args.repeats, rng)
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        reload = measure_reload(bpt, args.repeats, Path(folder))
        fs_folder = folder
    fitted = fit_steps(samples, model_cost(cfg, 4, "SmolLM2-135M"), bandwidth).cost_model()
    # A straight line a + b x tokens through the prefills of 8 to 256 tokens (above the ridge, below where
    # attention's square shows), and the step the request needs anyway (1 token after H, the median).
    line = [h for h in PREFIXES if 8 <= h <= 256]
    b, a = np.polyfit(np.array(line, dtype=float) + 1, [recompute[h]["full_s"] for h in line], 1)
    suffix_s = float(np.median([recompute[h]["suffix_s"] for h in PREFIXES]))
    # Timing noise: the 1-token steps after H <= 16 cost the same on the roofline; their spread is the noise.
    noise_s = float(np.ptp([recompute[h]["suffix_s"] for h in PREFIXES if h <= 16]))

    ways = {}
    for way in WAYS:
        tier = tier_from(reload[way], bpt, f"this machine's disk, {way}")
        def first(margin: float) -> int | None:
            return next((h for h in PREFIXES if reload[way].get(h) is not None
                         and reload[way][h] + margin < recompute[h]["extra_s"]), None)
        row = dict(reads_s={str(k): v for k, v in reload[way].items()}, measured_first_h_on_grid=first(0.0),
                   measured_first_h_beyond_noise=first(noise_s))
        if tier is not None:
            per_token = bpt / tier.bandwidth
            row |= dict(bandwidth_GBps=tier.bandwidth / 1e9, latency_us=tier.latency * 1e6,
                        formula_break_even_fitted_costmodel=break_even_tokens(bpt, tier, fitted, 1 << 14),
                        # lat + p H < a + b (H + 1) - suffix_s  <=>  H > (lat - a - b + suffix_s) / (b - p)
                        formula_break_even_linear_fit=(None if b <= per_token else max(1, int(np.floor(
                            (tier.latency - a - b + suffix_s) / (b - per_token))) + 1)),
                        formula_extra_s={h: prefix_recompute_seconds(h, fitted) for h in PREFIXES})
        ways[way] = row

    date = dt.date.today().isoformat()
    record = dict(command=" ".join(["python", "benchmarks/tier_breakeven.py", *sys.argv[1:]]), date=date,
                  machine=f"{platform.node()} {platform.machine()} {platform.processor() or ''} "
                          f"{os.cpu_count()} CPUs, torch {torch.__version__}, 1 thread",
                  folder=fs_folder, model="SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to float32)",
                  bytes_per_token=bpt, stream_bandwidth_GBps=bandwidth / 1e9,
                  fitted_device=dict(peak_flops=fitted.device.peak_flops, overhead_s=fitted.overhead_s),
                  linear_fit=dict(a_s=a, b_s_per_token=b, fitted_on_h=line, suffix_step_median_s=suffix_s),
                  noise_s=noise_s, recompute=recompute, reload=ways,
                  wall_s=time.perf_counter() - started)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"tier_breakeven_{date}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (RESULTS / f"tier_breakeven_{date}.md").write_text(markdown(record))
    print(markdown(record))


def markdown(r: dict) -> str:
    bpt = r["bytes_per_token"]
    lines = [f"# Reload or recompute a prefix: measured ({r['date']})", "",
             f"Command: `{r['command']}`  ", f"Machine: {r['machine']}  ",
             f"Model: {r['model']}, {bpt} K/V bytes a token  ",
             f"Memory bandwidth (copy): {r['stream_bandwidth_GBps']:.1f} GB/s; fitted arithmetic rate "
             f"{r['fitted_device']['peak_flops'] / 1e9:.1f} GFLOP/s, overhead "
             f"{r['fitted_device']['overhead_s'] * 1e3:.2f} ms a step; line fit of the prefill: "
             f"{r['linear_fit']['a_s'] * 1e3:.1f} ms + {r['linear_fit']['b_s_per_token'] * 1e3:.3f} ms × tokens "
             f"(fitted on H = {r['linear_fit']['fitted_on_h']}); the step needed anyway (1 token after H, median) "
             f"{r['linear_fit']['suffix_step_median_s'] * 1e3:.1f} ms; timing noise (spread of the 1-token steps "
             f"after H <= 16) {r['noise_s'] * 1e3:.2f} ms  ",
             f"Wall time: {r['wall_s']:.0f} s", "",
             "| H | prefill H+1 (ms) | 1 token after H (ms) | recompute of the prefix (ms) | "
             + " | ".join(f"read: {w} (ms)" for w in WAYS) + " |",
             "|---:|---:|---:|---:|" + "---:|" * len(WAYS)]
    for h, row in r["recompute"].items():
        reads = [r["reload"][w]["reads_s"].get(str(h)) for w in WAYS]
        lines.append(f"| {h} | {row['full_s'] * 1e3:.2f} | {row['suffix_s'] * 1e3:.2f} | {row['extra_s'] * 1e3:.2f} | "
                     + " | ".join("n/a" if t is None else f"{t * 1e3:.3f}" for t in reads) + " |")
    lines += ["", "| read | bandwidth (GB/s) | latency (4 KiB read, us) | first H on the grid where the read wins "
              "(measured) | the same, by more than the noise | break-even H, fitted CostModel | "
              "break-even H, line fit |", "|---|---:|---:|---:|---:|---:|---:|"]
    for w in WAYS:
        x = r["reload"][w]
        if "bandwidth_GBps" in x:
            cells = [f"{x['bandwidth_GBps']:.2f}", f"{x['latency_us']:.0f}"] + [str(x[k]) for k in (
                "measured_first_h_on_grid", "measured_first_h_beyond_noise", "formula_break_even_fitted_costmodel",
                "formula_break_even_linear_fit")]
            lines.append(f"| {w} | " + " | ".join(cells) + " |")
        else:
            lines.append(f"| {w} | n/a: {x['reads_s'].get('error', 'failed')} | | | | | |")
    lines += ["", "Notes: the plain read is served by the OS page cache (a copy from memory, not the disk). "
              "`posix_fadvise(DONTNEED)` before each read and `O_DIRECT` make the guest read its virtual disk, and "
              "the reads slow down several times; but this is a VM, whose disk the host may cache, so these are not "
              "a physical SSD's figures. The recompute of a prefix is the step of H + 1 new tokens minus the step "
              "of 1 token after H cached (the step a request needs anyway); for the shortest prefixes it is "
              "within the timing noise above, so a crossing there is not resolved. The fitted CostModel's "
              "break-even is its ridge: below it the roofline calls the extra tokens free (the weight read "
              "dominates)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
