"""Benchmark: time to first token with a prefix recomputed, found in the pool, or read back from a disk tier (issue 42).

The book's real model (SmolLM2-135M-Instruct, float32, the CPU, one thread) in labkit's ``TieredEngine``
(block size 16) with a ``DiskTierStore`` read with ``O_DIRECT`` where the filesystem allows it. For each
prefix length H, the prompt is H tokens of English text, then a question of ``SUFFIX`` tokens; the TTFT is
the time of the one engine step that computes the prompt and samples the first token (fastest of
``--repeats``, after a warm-up), three ways:

1. **recompute**: nothing cached (pool and tier emptied): the step computes all H + S tokens;
2. **pool hit**: an earlier request (same prefix, another question) left the prefix in the pool: the step
   computes the S tokens after H cached;
3. **tier hit**: the same earlier request, then a filler request of random tokens that fills the small
   pool, so the prefix's blocks were evicted into the tier (block files); the step reads them back
   (during ``schedule``: read, SHA-256 check, copy into fresh pool blocks) and computes the S tokens.
   Making room for the request evicts filler blocks, which this engine writes synchronously in the same
   step; vLLM writes when it stores (write-through, overlapped), so the table gives the TTFT without
   those writes (``store.write_s`` spent in the step, subtracted) and the raw step beside it.

Each timed request goes on untimed to ``CHECK_TOKENS`` greedy tokens, which must be equal in the three ways
(and equal transformers' ``generate`` unless ``--no-transformers``).

The store fsyncs each block file it writes (counted with the writes), so a tier hit reads blocks at rest
on the disk. The disk's read bandwidth as the tier sees it: ``bytes_read / read_s`` over the tier hits (read plus
checksum), and the raw read alone (open, ``O_DIRECT`` read, close) per block file.

**Throttled sweep** (H = 256): a ``DiskTierStore`` subclass sleeps after each block read so that the read
takes ``bytes / B`` (sleep = bytes / B - measured read, when positive). Sweeping B on a log grid, the tier
hit's TTFT crosses the recompute TTFT at a measured ``B*`` (interpolated linearly in 1/B between the grid
points that bracket it), compared with the formula ``B* = H_bytes / (extra(H) - L)``: ``H_bytes`` the bytes
read (the block files), ``extra(H)`` the extra time of recomputing the prefix (recompute TTFT - pool-hit
TTFT measured; or from a ``CostModel`` fitted to the measured steps; or from a straight line fitted to the
recompute TTFTs) and ``L`` what a tier hit costs beyond reading the bytes, which the throttle does not
slow: the SHA-256 checks and the copies into the pool, measured by the store on the unthrottled tier hit
(``read_s - raw read + load_s``). Tolerance: +-20%. A line through the sweep, ``TTFT = c + k x bytes / B``,
checks the throttle (k should be 1) and the decomposition (c should be the pool hit + L).

``O_DIRECT`` bypasses only this guest's page cache: the host may cache the virtual disk.

Usage: ``python benchmarks/tier_ttft.py [--repeats 3] [--no-transformers]``; writes
``benchmarks/results/tier_ttft_<date>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import mmap
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import labkit  # noqa: E402
from labkit.caches.tier_store import DiskTierStore  # noqa: E402
from labkit.model import fused  # noqa: E402
from labkit.model.pretrained import from_pretrained, load_tokenizer, real_model  # noqa: E402
from labkit.serving.sim.fit import fit_steps, model_cost  # noqa: E402
from labkit.serving.sim.measure import StepSample, measure_stream_bandwidth  # noqa: E402
from labkit.serving.sim.simulator import step_sums  # noqa: E402
from labkit.serving.sim.tiers import prefix_recompute_seconds  # noqa: E402
from labkit.serving.tiered_engine import TieredEngine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PREFIXES = [64, 128, 256, 512]
SWEEP_H = 256
BLOCK = 16
SUFFIX = 16  # the question's tokens: H + SUFFIX - 1 // 16 = H / 16, so a match stops at the prefix
CHECK_TOKENS = 8
TOLERANCE = 0.20
MB = 1e6
SWEEP_GRID_MBPS = [8.0 * 1.25 ** i for i in range(9)]  # 8 .. 47.7 MB/s, a factor 1.25 apart
TEXT = ("A language model server keeps, for every request it is serving, the keys and values that each "
        "attention layer computed for the tokens seen so far. This store is the KV cache. It grows by one "
        "entry per layer with every token, and it is read in full at every step of decoding, which is why "
        "decoding is bound by memory bandwidth rather than by arithmetic. When many requests share the same "
        "beginning, such as a long system prompt or a document that several questions are asked about, the "
        "server can keep the cache blocks of that shared prefix and hand them to each new request instead of "
        "computing them again. The pool of blocks is finite, though, and blocks that no running request holds "
        "are evicted, least recently used first, when new requests need room. A second tier behind the pool, "
        "host memory or a local disk, can keep evicted blocks for longer; a later request that asks for the "
        "same prefix then reads the blocks back instead of recomputing them. Whether that pays depends on two "
        "numbers: the time to move the bytes over the tier's link, and the extra time the model would spend "
        "computing those tokens again inside the step the request needs anyway. ")
QUESTIONS = (" Question: which two numbers decide whether reading cached blocks back from a tier pays?",
             " Question: why is decoding bound by memory bandwidth and not by arithmetic on a server?")


class ThrottledDiskTierStore(DiskTierStore):
    """A ``DiskTierStore`` that also times its raw reads, and, when ``bandwidth`` (bytes/s) is set, sleeps after
    each read so that the read takes ``bytes / bandwidth`` (no sleep if the disk was slower than that).

    Each write is also ``fsync``-ed (in ``write_s``): a block file is then at rest on the disk when it is read,
    as a block evicted long before a hit would be; otherwise an ``O_DIRECT`` read of a file written a moment
    before first waits for the kernel to write its dirty pages out.
    """

    def save(self, block_id, entry) -> None:
        super().save(block_id, entry)
        start = time.perf_counter()
        fd = os.open(self.path(entry), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.write_s += time.perf_counter() - start

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bandwidth: float | None = None
        self.raw_read_s = self.slept_s = 0.0
        self.reads: list[tuple[int, float]] = []  # (bytes, seconds) of each raw read

    def _read(self, path: Path):
        start = time.perf_counter()
        data = super()._read(path)
        seconds = time.perf_counter() - start
        self.raw_read_s += seconds
        self.reads.append((len(data), seconds))
        if self.bandwidth is not None:
            pause = len(data) / self.bandwidth - seconds
            if pause > 0:
                time.sleep(pause)
                self.slept_s += pause
        return data


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (idle and iowait count as not busy)."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def prompt_tokens(tokenizer) -> tuple[list[int], list[list[int]]]:
    """The prefix text's tokens (long enough for the largest H) and the questions, each cut to SUFFIX tokens."""
    ids: list[int] = []
    while len(ids) < max(PREFIXES):
        ids += list(tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    questions = [list(tokenizer(q, add_special_tokens=False)["input_ids"])[:SUFFIX] for q in QUESTIONS]
    assert all(len(q) == SUFFIX for q in questions), [len(q) for q in questions]
    return ids, questions


class Bench:
    """One ``TieredEngine`` for one prefix length: a pool just big enough for one request, a large tier."""

    def __init__(self, model, h: int, folder: Path, rng: np.random.Generator, direct_io: bool):
        self.h, self.rng, self.vocab = h, rng, model.config.vocab_size
        need = -(-(h + SUFFIX + CHECK_TOKENS) // BLOCK)
        self.num_blocks = need + 2
        self.engine = TieredEngine(model, self.num_blocks, BLOCK, max_num_batched_tokens=1024,
                                   tier_blocks=8 * self.num_blocks, tier_dir=folder, direct_io=direct_io,
                                   prepare=False)
        cache = self.engine.scheduler.prefix_cache
        cache.store = ThrottledDiskTierStore(self.engine.backend, folder, 8 * self.num_blocks, direct_io=direct_io)
        self.store: ThrottledDiskTierStore = cache.store

    def reset(self) -> None:
        """Nothing cached: the pool's names forgotten, the tier emptied (its files deleted)."""
        assert not self.engine.has_unfinished()
        assert self.engine.scheduler.prefix_cache.clear()
        for entry in list(self.store.entries.values()):
            self.store.discard(entry)

    def run(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Serve one request untimed; its tokens."""
        request = self.engine.add_request(prompt, max_tokens, eos_token_id=())
        while self.engine.has_unfinished():
            self.engine.step()
        return list(request.output_token_ids)

    def fill(self) -> None:
        """A request of random tokens that takes every block of the pool: every named block goes to the tier."""
        self.run(self.rng.integers(0, self.vocab, self.num_blocks * BLOCK - 1).tolist(), 1)

    def timed(self, prompt: list[int], max_tokens: int) -> dict:
        """The first step of a new request (its TTFT), what it computed and moved; then the rest, untimed."""
        s = self.store
        before = (s.write_s, s.read_s, s.raw_read_s, s.load_s, s.slept_s, s.bytes_read, len(s.reads))
        request = self.engine.add_request(prompt, max_tokens, eos_token_id=())
        start = time.perf_counter()
        step = self.engine.step()
        seconds = time.perf_counter() - start
        assert len(request.output_token_ids) == 1, "the prompt must be computed in one step"
        after = (s.write_s, s.read_s, s.raw_read_s, s.load_s, s.slept_s, s.bytes_read, len(s.reads))
        d = [a - b for a, b in zip(after, before)]
        while self.engine.has_unfinished():
            self.engine.step()
        new, context, pairs = step_sums(step)
        return dict(step_s=seconds, ttft_s=seconds - d[0], write_s=d[0], read_s=d[1], raw_read_s=d[2],
                    load_s=d[3], slept_s=d[4], bytes_read=d[5], block_reads=d[6], load_stat_s=step.stats.load_s,
                    tier_hit_tokens=step.stats.tier_hit_tokens, new_tokens=new, context_tokens=context,
                    pairs=pairs, tokens=list(request.output_token_ids))

    def way(self, name: str, prompt: list[int], other: list[int], max_tokens: int) -> dict:
        """One timed request the way ``name`` says (the state prepared first, untimed)."""
        if name == "recompute":
            self.reset()
        elif name == "pool hit":
            self.reset()
            self.run(other, 1)
        elif name == "tier hit":
            self.reset()
            self.run(other, 1)
            self.fill()
        r = self.timed(prompt, max_tokens)
        expect = {"recompute": (self.h + SUFFIX, 0, 0), "pool hit": (SUFFIX, self.h, 0),
                  "tier hit": (SUFFIX, self.h, self.h)}[name]
        got = (r["new_tokens"], r["context_tokens"], r["tier_hit_tokens"])
        assert got == expect, f"{name} at H={self.h}: (new, context, tier tokens) {got}, expected {expect}"
        if name != "tier hit":
            assert r["write_s"] == 0.0, f"{name} at H={self.h} wrote to the tier in the timed step"
        return r


def transformers_tokens(prompts: dict[int, list[int]]) -> dict[int, list[int]] | str:
    """Greedy tokens of transformers' Llama read from the same GGUF file, or why not."""
    try:
        from transformers import AutoModelForCausalLM
        path = real_model()
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
    except Exception as err:  # noqa: BLE001 - reported, not fatal
        return f"not run: {type(err).__name__}: {err}"
    out = {}
    with torch.no_grad():
        for h, p in prompts.items():
            ids = torch.tensor([p])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CHECK_TOKENS,
                            min_new_tokens=CHECK_TOKENS, do_sample=False)
            out[h] = g[0, len(p):].tolist()
    return out


def probe_reads(folder: Path, block_bytes: int, repeats: int = 20) -> dict:
    """Fastest O_DIRECT read (open, read, close) of a 4 KiB file, and of one block file's size read again and again
    (the second: a file the host has surely cached, the best this virtual disk gives)."""
    out = {}
    for name, size in (("4 KiB", 4096), ("one block", -(-block_bytes // 4096) * 4096)):
        path = folder / f"probe_{size}.bin"
        with open(path, "wb") as f:
            f.write(os.urandom(size))
            f.flush()
            os.fsync(f.fileno())
        buf = mmap.mmap(-1, size)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                got, view = 0, memoryview(buf)
                while got < size:
                    n = os.readv(fd, [view[got:]])
                    if n == 0:
                        break
                    got += n
            finally:
                os.close(fd)
            times.append(time.perf_counter() - start)
        out[name] = dict(bytes=size, fastest_s=min(times), median_s=float(np.median(times)))
        path.unlink()
    return out


def crossing(grid: list[float], tier: list[float], recompute: float) -> float | None:
    """B where the tier hit's TTFT meets the recompute TTFT, linear in 1/B between the bracketing points."""
    diff = [t - recompute for t in tier]  # > 0: the tier loses (slow bandwidth)
    for i in range(len(grid) - 1):
        if diff[i] > 0 >= diff[i + 1]:
            x0, x1 = 1 / grid[i], 1 / grid[i + 1]
            x = x0 + (x1 - x0) * diff[i] / (diff[i] - diff[i + 1])
            return 1 / x
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where the tier's block files go (default: the temp dir)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the check against transformers")
    parser.add_argument("--smoke", action="store_true", help="a quick run of the code paths; nothing written")
    args = parser.parse_args()
    global PREFIXES, SWEEP_GRID_MBPS
    if args.smoke:
        PREFIXES, SWEEP_GRID_MBPS = [64, SWEEP_H], [10.0, 20.0, 40.0]
    torch.set_num_threads(1)
    started, busy0, ru0 = time.perf_counter(), cpu_times(), resource.getrusage(resource.RUSAGE_SELF)
    load0 = os.getloadavg()
    rng = np.random.default_rng(0)
    path = real_model()
    model = from_pretrained(path, dtype=torch.float32)
    fused.prepare(model)
    prefix_ids, (q_timed, q_other) = prompt_tokens(load_tokenizer(path))
    cfg = model.config
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    bpt = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    bandwidth = measure_stream_bandwidth()
    folder = Path(tempfile.mkdtemp(prefix="tier_ttft_", dir=args.folder))
    ways = ("recompute", "pool hit", "tier hit")
    table, samples, prompts, read_mode = {}, [], {}, None
    try:
        for h in PREFIXES:
            bench = Bench(model, h, folder / f"h{h}", rng, direct_io=True)
            read_mode = bench.store.read_mode
            prompt, other = prefix_ids[:h] + q_timed, prefix_ids[:h] + q_other
            prompts[h] = prompt
            for name in ways:  # warm-up: every way once, untimed
                bench.way(name, prompt, other, 1)
            runs = {name: [] for name in ways}
            for rep in range(max(args.repeats, 5) if h == SWEEP_H else args.repeats):
                for name in ways:
                    runs[name].append(bench.way(name, prompt, other, CHECK_TOKENS if rep == 0 else 1))
            row = {}
            for name in ways:
                best = min(runs[name], key=lambda r: r["ttft_s"])
                row[name] = best | dict(all_ttft_s=[r["ttft_s"] for r in runs[name]],
                                        all_step_s=[r["step_s"] for r in runs[name]],
                                        tokens=runs[name][0]["tokens"])
                if name != "tier hit":
                    samples.append(StepSample(best["new_tokens"], best["context_tokens"], best["pairs"],
                                              best["ttft_s"], 1))
            row["tokens_equal"] = len({tuple(row[n]["tokens"]) for n in ways}) == 1 and all(
                r["tokens"][:1] == row["recompute"]["tokens"][:1] for n in ways for r in runs[n])
            hits = runs["tier hit"]
            row["tier_read"] = dict(bytes=sum(r["bytes_read"] for r in hits), read_s=sum(r["read_s"] for r in hits),
                                    raw_read_s=sum(r["raw_read_s"] for r in hits),
                                    block_reads=sum(r["block_reads"] for r in hits))
            table[h] = row
            print(f"H={h:4}: " + ", ".join(f"{n} {row[n]['ttft_s'] * 1e3:7.1f} ms" for n in ways)
                  + f" (tier step raw {row['tier hit']['step_s'] * 1e3:.1f} ms, writes "
                  f"{row['tier hit']['write_s'] * 1e3:.1f} ms); tokens equal {row['tokens_equal']}", flush=True)
            if h == SWEEP_H:
                sweep_bench = bench
            else:
                shutil.rmtree(folder / f"h{h}", ignore_errors=True)

        # The throttled sweep at H = SWEEP_H, on the same engine: each point pushes the prefix out again.
        bench, h = sweep_bench, SWEEP_H
        prompt, other = prompts[h], prefix_ids[:h] + q_other
        bench.way("tier hit", prompt, other, 1)  # the prefix in the tier
        sweep = []
        for b_mbps in SWEEP_GRID_MBPS:
            bench.store.bandwidth = b_mbps * MB
            rs = []
            for _ in range(args.repeats):
                bench.fill()
                r = bench.timed(prompt, 1)
                assert (r["new_tokens"], r["tier_hit_tokens"]) == (SUFFIX, h), r
                assert r["tokens"][:1] == table[h]["recompute"]["tokens"][:1]
                rs.append(r)
            best = min(rs, key=lambda r: r["ttft_s"])
            sweep.append(dict(bandwidth_MBps=b_mbps, ttft_s=best["ttft_s"], step_s=best["step_s"],
                              read_s=best["read_s"], raw_read_s=best["raw_read_s"], slept_s=best["slept_s"],
                              bytes_read=best["bytes_read"], all_ttft_s=[r["ttft_s"] for r in rs]))
            print(f"  B={b_mbps:6.2f} MB/s: tier hit TTFT {best['ttft_s'] * 1e3:7.1f} ms "
                  f"(recompute {table[h]['recompute']['ttft_s'] * 1e3:.1f} ms)", flush=True)
        bench.store.bandwidth = None
        try:
            probe = probe_reads(folder, int(table[SWEEP_H]["tier hit"]["bytes_read"] // (SWEEP_H // BLOCK)))
        except OSError as err:
            probe = {"error": f"{type(err).__name__}: {err}"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    hf = "skipped (--no-transformers)" if args.no_transformers else transformers_tokens(prompts)
    if isinstance(hf, dict):
        for h in PREFIXES:
            table[h]["equals_transformers"] = hf[h] == table[h]["recompute"]["tokens"]

    # The formula at H = SWEEP_H.
    row = table[SWEEP_H]
    rec, pool, tier = (row[n]["ttft_s"] for n in ways)
    blocks = SWEEP_H // BLOCK
    h_bytes = row["tier hit"]["bytes_read"]
    th = row["tier hit"]
    fixed = th["read_s"] - th["raw_read_s"] + th["load_s"]  # checks and copies into the pool, not throttled
    residual = tier - pool - th["raw_read_s"] - fixed  # the rest: the tier's bookkeeping, and timing noise
    fitted = fit_steps(samples, model_cost(cfg, 4, "SmolLM2-135M"), bandwidth).cost_model()
    rec_ttft = {h: table[h]["recompute"]["ttft_s"] for h in PREFIXES}
    lines_fit = {}
    for label, hs in (("H <= 256", [h for h in PREFIXES if h <= 256]), ("all H", PREFIXES)):
        slope, intercept = np.polyfit([h + SUFFIX for h in hs], [rec_ttft[h] for h in hs], 1)
        lines_fit[label] = dict(h=hs, slope_s_per_token=slope, intercept_s=intercept)
    extras = {"measured (recompute - pool hit)": rec - pool,
              "fitted CostModel (fit_steps)": prefix_recompute_seconds(SWEEP_H, fitted, SUFFIX),
              "straight line through H <= 256 (slope x H)": lines_fit["H <= 256"]["slope_s_per_token"] * SWEEP_H,
              "straight line through all H (slope x H)": lines_fit["all H"]["slope_s_per_token"] * SWEEP_H}
    measured = crossing(SWEEP_GRID_MBPS, [p["ttft_s"] for p in sweep], rec)
    # The sweep itself: TTFT = c + k x bytes / B, fitted over the grid (k ~ 1 if the throttle does what it says).
    k, c = np.polyfit([h_bytes / (p["bandwidth_MBps"] * MB) for p in sweep], [p["ttft_s"] for p in sweep], 1)
    formula = {}
    for name, extra in extras.items():
        b_star = h_bytes / (extra - fixed) / MB if extra > fixed else None
        formula[name] = dict(extra_s=extra, b_star_MBps=b_star,
                             b_star_no_latency_MBps=h_bytes / extra / MB,
                             ratio=None if (b_star is None or measured is None) else measured / b_star,
                             within=None if (b_star is None or measured is None) else
                             bool(abs(measured / b_star - 1) <= TOLERANCE))

    all_reads = [x for x in bench.store.reads]
    tier_bw = {h: table[h]["tier_read"] for h in PREFIXES}
    tot = {k: sum(t[k] for t in tier_bw.values()) for k in ("bytes", "read_s", "raw_read_s", "block_reads")}
    busy1, ru1 = cpu_times(), resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter() - started
    ncpu = os.cpu_count() or 1
    busy_frac = (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1)
    own_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    date = dt.datetime.now(dt.timezone.utc)
    record = dict(
        command=" ".join(["python", "benchmarks/tier_ttft.py", *sys.argv[1:]]),
        date_utc=date.strftime("%Y-%m-%d %H:%M UTC"),
        machine=f"{platform.node()} {platform.machine()} {ncpu} CPUs, torch {torch.__version__}",
        threads=torch.get_num_threads(), repeats=args.repeats,
        busy=dict(all_cpus_busy_share=busy_frac, this_process_cpu_s=own_cpu,
                  others_busy_share=max(0.0, busy_frac - own_cpu / (wall * ncpu)),
                  loadavg_start=load0, loadavg_end=os.getloadavg()),
        model="SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to float32)", bytes_per_token=bpt,
        block_size=BLOCK, suffix_tokens=SUFFIX, check_tokens=CHECK_TOKENS, read_mode=read_mode,
        stream_bandwidth_GBps=bandwidth / 1e9,
        fitted=dict(peak_flops=fitted.device.peak_flops, overhead_s=fitted.overhead_s),
        lines=lines_fit, probe_reads=probe,
        ttft={h: {n: {k: v for k, v in table[h][n].items()} for n in ways}
              | {k: table[h][k] for k in ("tokens_equal", "equals_transformers") if k in table[h]}
              for h in PREFIXES},
        transformers=hf if isinstance(hf, str) else "run",
        tier_read=dict(per_h=tier_bw, bandwidth_GBps=tot["bytes"] / tot["read_s"] / 1e9,
                       raw_bandwidth_GBps=tot["bytes"] / tot["raw_read_s"] / 1e9,
                       per_block_read_ms=1e3 * tot["read_s"] / tot["block_reads"],
                       per_block_raw_read_ms=1e3 * tot["raw_read_s"] / tot["block_reads"],
                       block_file_bytes=tot["bytes"] / tot["block_reads"],
                       sweep_engine_raw_reads_min_ms=1e3 * min(s for _, s in all_reads),
                       sweep_engine_raw_reads_median_ms=1e3 * float(np.median([s for _, s in all_reads]))),
        sweep=dict(h=SWEEP_H, blocks=blocks, bytes=h_bytes, fixed_cost_s=fixed, recompute_s=rec, pool_s=pool,
                   tier_unthrottled_s=tier, tier_raw_read_s=th["raw_read_s"], residual_s=residual,
                   sweep_fit=dict(intercept_s=c, slope_per_bytes_over_b=k), points=sweep,
                   measured_b_star_MBps=measured, formula=formula, tolerance=TOLERANCE),
        wall_s=wall)
    if args.smoke:
        print(markdown(record))
        return
    RESULTS.mkdir(exist_ok=True)
    stem = f"tier_ttft_{date.date().isoformat()}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(record))
    print(markdown(record))


def markdown(r: dict) -> str:
    b, t, s = r["busy"], r["tier_read"], r["sweep"]
    lines = [f"# TTFT with a prefix recomputed, in the pool, or read from a disk tier ({r['date_utc']})", "",
             f"Command: `{r['command']}`  ", f"Machine: {r['machine']}; {r['threads']} thread  ",
             f"How busy: all CPUs {100 * b['all_cpus_busy_share']:.0f}% busy over the run, of which this process "
             f"{r['busy']['this_process_cpu_s']:.0f} CPU-s; others about {100 * b['others_busy_share']:.0f}% of the "
             f"machine; load average {b['loadavg_start'][0]:.2f} at the start, {b['loadavg_end'][0]:.2f} at the end  ",
             f"Model: {r['model']}, {r['bytes_per_token']} K/V bytes a token, blocks of {r['block_size']} tokens; "
             f"prompt = H tokens of text + a {r['suffix_tokens']}-token question; fastest of {r['repeats']} "
             f"after a warm-up  ",
             f"Tier: `DiskTierStore`, read mode `{r['read_mode']}`; wall time {r['wall_s']:.0f} s", "",
             "## TTFT (ms)", "",
             "| H | recompute | pool hit | tier hit | tier hit, raw step (with its writes) | tier: reads + checks "
             "| tokens equal (3 ways) | = transformers |", "|---:|---:|---:|---:|---:|---:|:---:|:---:|"]
    for h, row in r["ttft"].items():
        th = row["tier hit"]
        lines.append(f"| {h} | {row['recompute']['ttft_s'] * 1e3:.1f} | {row['pool hit']['ttft_s'] * 1e3:.1f} | "
                     f"{th['ttft_s'] * 1e3:.1f} | {th['step_s'] * 1e3:.1f} | {th['read_s'] * 1e3:.2f} | "
                     f"{row['tokens_equal']} | {row.get('equals_transformers', r['transformers'])} |")
    lines += ["", f"Tier reads over all tier hits: {t['bandwidth_GBps']:.2f} GB/s read and checked (bytes_read / "
              f"read_s), {t['raw_bandwidth_GBps']:.2f} GB/s raw reads (open, read, close); per block file "
              f"({t['block_file_bytes'] / 1e3:.0f} kB): {t['per_block_read_ms']:.3f} ms read and checked, "
              f"{t['per_block_raw_read_ms']:.3f} ms raw.  "]
    pr = r["probe_reads"]
    if "error" in pr:
        lines.append(f"Probe of the disk: failed ({pr['error']}).")
    else:
        one = pr["one block"]
        lines.append(f"Probe of the disk (`O_DIRECT`, one file read 20 times, fastest): 4 KiB in "
                     f"{pr['4 KiB']['fastest_s'] * 1e6:.0f} us (median {pr['4 KiB']['median_s'] * 1e6:.0f} us); "
                     f"{one['bytes'] / 1e3:.0f} kB in {one['fastest_s'] * 1e3:.3f} ms = "
                     f"{one['bytes'] / one['fastest_s'] / 1e9:.2f} GB/s (median {one['median_s'] * 1e3:.3f} ms).")
    lines += ["",
              f"## Throttled tier at H = {s['h']} ({s['blocks']} block files, {s['bytes'] / 1e6:.2f} MB)", "",
              f"Recompute {s['recompute_s'] * 1e3:.1f} ms, pool hit {s['pool_s'] * 1e3:.1f} ms, unthrottled tier "
              f"hit {s['tier_unthrottled_s'] * 1e3:.1f} ms, of which raw reads "
              f"{s['tier_raw_read_s'] * 1e3:.1f} ms"
              f" and L = {s['fixed_cost_s'] * 1e3:.1f} ms of checks and copies into the pool (measured by the store; "
              f"not throttled); the rest, {s['residual_s'] * 1e3:.1f} ms, is bookkeeping and timing noise. "
              f"A line through the sweep, TTFT = c + k x bytes / B: c = {s['sweep_fit']['intercept_s'] * 1e3:.1f} ms "
              f"(pool hit + L = {(s['pool_s'] + s['fixed_cost_s']) * 1e3:.1f} ms), k = "
              f"{s['sweep_fit']['slope_per_bytes_over_b']:.3f} (1 if the throttle does what it says).", "",
              "| B (MB/s) | tier hit TTFT (ms) | slept (ms) |", "|---:|---:|---:|"]
    for p in s["points"]:
        lines.append(f"| {p['bandwidth_MBps']:.2f} | {p['ttft_s'] * 1e3:.1f} | {p['slept_s'] * 1e3:.1f} |")
    m = s["measured_b_star_MBps"]
    lines += ["", f"Measured crossing B* = {'not bracketed' if m is None else f'{m:.2f} MB/s'}.", "",
              "| extra(H) from | extra (ms) | B* formula (MB/s) | measured / formula | within ±"
              f"{100 * s['tolerance']:.0f}% | B* without L (MB/s) |", "|---|---:|---:|---:|:---:|---:|"]
    for name, f in s["formula"].items():
        bs = "n/a" if f["b_star_MBps"] is None else f"{f['b_star_MBps']:.2f}"
        ratio = "n/a" if f["ratio"] is None else f"{f['ratio']:.3f}"
        lines.append(f"| {name} | {f['extra_s'] * 1e3:.1f} | {bs} | {ratio} | {f['within']} | "
                     f"{f['b_star_no_latency_MBps']:.2f} |")
    lines += ["", "Straight lines through the recompute TTFTs (ms per token): " + "; ".join(
        f"{k}: {v['slope_s_per_token'] * 1e3:.3f}" for k, v in r["lines"].items())
        + ". The line through all H takes in the H = 512 point, where attention's square term shows, and "
        "overstates the per-token cost at H = 256.  ",
        f"Fitted CostModel: memory bandwidth pinned to the measured copy {r['stream_bandwidth_GBps']:.1f} GB/s, "
        f"arithmetic {r['fitted']['peak_flops'] / 1e9:.1f} GFLOP/s, overhead {r['fitted']['overhead_s'] * 1e3:.1f} ms "
        "a step (fitted to the recompute and pool-hit steps of the table).",
        "", "Notes: the TTFT is the one engine step that computes the prompt and samples the first token. "
              "A tier hit's step also writes the filler blocks it evicts (this engine spills synchronously); "
              "vLLM stores write-through and overlapped, so the tier-hit TTFT is given without those writes "
              "(`store.write_s` in the step, subtracted), the raw step beside it. `O_DIRECT` bypasses only this "
              "guest's page cache: the VM's host may cache its virtual disk, so the bandwidth is not a physical "
              "disk's. The throttle sleeps after each block read so that it takes bytes / B; L (the SHA-256 checks and "
              "the copies into the pool) is measured by the store on the unthrottled tier hit and is not throttled. "
              "The block files are fsync-ed when written (counted with the writes), so a tier hit reads blocks at "
              "rest; the tier's raw reads of these fresh files are slower than the probe's repeated read of one "
              "file, which the host has surely cached."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
