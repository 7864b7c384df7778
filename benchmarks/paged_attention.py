"""Benchmark: the paged decode kernel against contiguous attention (chapter 03).

On a CUDA GPU it times ``labkit.kernels``' Triton decode kernel with
``triton.testing.do_bench`` (median) over a grid of batch (1 to 128) x context
(512 to 32k), 32 query / 8 KV heads, head dim 128, block size 16, fp16 and bf16,
against:

* PyTorch's ``scaled_dot_product_attention`` on the same K/V laid out contiguously,
* FlexAttention (compiled) on the contiguous K/V, where the installed torch has it,
* the gather reference (``paged_decode_attention_ref``), on the smaller cases.

Decode reads every K and V byte once and does little arithmetic per byte, so its speed is
the speed of reading memory. The table shows the achieved bandwidth (K/V bytes over time)
and its fraction of the device's copy bandwidth, measured here with a large
device-to-device copy. Goals (issue 4): at batch 64 x 4,096 at least 80% of copy bandwidth
and no slower than 1.25x contiguous SDPA; at batch 1 x 32k at least 50% (through split-K).
Results go to ``benchmarks/results/paged_attention_<gpu>_<date>.json``.

Without a GPU it runs a small smoke test in Triton's interpreter: it checks the kernel
against the reference on a few tiny shapes and writes ``*.smoke.json`` (git-ignored).
Interpreted timings say nothing about a GPU, and no speed is claimed.

``--block-sizes 16 32 64 128`` sweeps the block size (default 16 only). Chapter 03 states as a
hypothesis, not a result, that larger blocks let the decode kernel read K/V faster (longer
contiguous runs per block-table lookup); this sweep is the measurement that would test it.
No such sweep has been run for this book yet. The goals are checked at block size 16.

Usage: ``python benchmarks/paged_attention.py [--quick] [--dtypes fp16 bf16] [--block-sizes 16 64]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import labkit  # noqa: E402  (first: decides compiled or interpreted Triton)
from labkit.kernels import launch, paged_attention, reference  # noqa: E402
from labkit.memory.blocks import blocks_needed  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
BATCHES = [1, 4, 16, 64, 128]
CONTEXTS = [512, 2048, 4096, 8192, 32768]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
MAX_KV_BYTES = 24 * 2**30  # skip grid points whose K/V alone exceed this
GATHER_MAX_TOKENS = 2**18  # the gather reference is a Python loop: only small cases


def make_case(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, device: str, seed: int = 0):
    """Random q and a pool with shuffled block tables; every sequence holds ``context`` tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = blocks_needed(context, block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    return q, k_cache, v_cache, block_tables, seq_lens


def kv_bytes(batch: int, context: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V that one decode step must read."""
    return 2 * batch * context * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def contiguous_kv(k_cache, block_tables, context):
    """The same K (or V) as one contiguous tensor [batch, num_kv_heads, context, head_dim]."""
    batch = block_tables.shape[0]
    return k_cache[block_tables.long()].view(batch, -1, *k_cache.shape[2:])[:, :context].transpose(1, 2).contiguous()


def copy_bandwidth(device: str, nbytes: int = 2**30) -> float:
    """Measured device copy bandwidth in bytes/s: a copy reads and writes nbytes."""
    import triton

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")  # like every other timing
    return 2 * nbytes / (ms * 1e-3)


def gpu_benchmark(dtypes: list[str], batches: list[int], contexts: list[int],
                  block_sizes: list[int] = [BLOCK_SIZE]) -> dict:  # noqa: B006 (never mutated)
    import triton
    import torch.nn.functional as F

    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as err:  # noqa: BLE001  (any failure: report and go on without it)
        flex, flex_error = None, repr(err)
    else:
        flex_error = None
    bench = lambda fn: triton.testing.do_bench(fn, return_mode="median")  # noqa: E731
    copy_bw = copy_bandwidth("cuda")
    rows = []
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    print(f"{'dtype':5} {'block':>5} {'batch':>5} {'context':>7} {'splits':>6} {'paged ms':>9} {'GB/s':>6} "
          f"{'of copy':>7} "
          f"{'sdpa ms':>8} {'x sdpa':>6} {'flex ms':>8} {'gather ms':>9}")
    for name in dtypes:
        dtype = DTYPES[name]
        for block_size, batch, context in itertools.product(block_sizes, batches, contexts):
            nbytes = kv_bytes(batch, context, NUM_KV_HEADS, HEAD_DIM, dtype)
            if nbytes > MAX_KV_BYTES:
                continue
            q, kc, vc, bt, sl = make_case(batch, context, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, block_size,
                                          dtype, "cuda")
            out = paged_attention.paged_decode_attention(q, kc, vc, bt, sl)  # checked call, also the warm-up
            block_n = launch.launch_settings("decode", dtype, HEAD_DIM, launch.launch_capability(), context).block_n
            splits, per_split = launch.choose_num_splits(batch, NUM_KV_HEADS, context, "cuda", block_n)
            scale = HEAD_DIM**-0.5
            # Time the launch itself (the public function adds host-side argument checks).
            ms = bench(lambda: launch.decode_triton(q, kc, vc, bt, sl, scale, splits, per_split, context))
            kd, vd = contiguous_kv(kc, bt, context), contiguous_kv(vc, bt, context)
            q4 = q[:, :, None]
            sdpa = lambda: F.scaled_dot_product_attention(q4, kd, vd, enable_gqa=True)  # noqa: E731
            expected = sdpa()[:, :, 0]
            err = (out.float() - expected.float()).abs().max().item()
            ms_sdpa = bench(sdpa)
            ms_flex = None
            if flex is not None:
                try:
                    ms_flex = bench(lambda: flex(q4, kd, vd, enable_gqa=True))
                except Exception as e:  # noqa: BLE001
                    flex, flex_error = None, repr(e)
            ms_gather = None
            if batch * context <= GATHER_MAX_TOKENS:
                ms_gather = bench(lambda: reference.paged_decode_attention_ref(q, kc, vc, bt, sl))
            bw = nbytes / (ms * 1e-3)
            row = dict(dtype=name, block_size=block_size, batch=batch, context=context, num_splits=splits,
                       paged_ms=ms, bandwidth_gbs=bw / 1e9, fraction_of_copy=bw / copy_bw, sdpa_ms=ms_sdpa,
                       slowdown_vs_sdpa=ms / ms_sdpa, flex_ms=ms_flex, gather_ms=ms_gather,
                       max_abs_error_vs_sdpa=err)
            rows.append(row)
            fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            print(f"{name:5} {block_size:5d} {batch:5d} {context:7d} {splits:6d} {ms:9.3f} {bw / 1e9:6.0f} "
                  f"{bw / copy_bw:7.0%} "
                  f"{ms_sdpa:8.3f} {ms / ms_sdpa:6.2f} {fmt(ms_flex):>8} {fmt(ms_gather):>9}")
            del q, kc, vc, kd, vd
            torch.cuda.empty_cache()
    goals = check_goals(rows)
    for goal in goals:
        print(("PASS " if goal["met"] else "MISS ") + goal["goal"] + f": {goal['measured']}")
    return dict(copy_bandwidth_gbs=copy_bw / 1e9, flex_error=flex_error, rows=rows, goals=goals)


def check_goals(rows: list[dict]) -> list[dict]:
    """The issue's speed goals, for each dtype measured, at block size 16 (``BLOCK_SIZE``)."""
    goals = []
    for name in sorted({r["dtype"] for r in rows}):
        by_key = {(r["batch"], r["context"]): r for r in rows
                  if r["dtype"] == name and r["block_size"] == BLOCK_SIZE}
        if (r := by_key.get((64, 4096))) is not None:
            goals.append(dict(goal=f"{name} batch 64 x 4096: >= 80% of copy bandwidth",
                              met=r["fraction_of_copy"] >= 0.8, measured=f"{r['fraction_of_copy']:.0%}"))
            goals.append(dict(goal=f"{name} batch 64 x 4096: <= 1.25x contiguous SDPA",
                              met=r["slowdown_vs_sdpa"] <= 1.25, measured=f"{r['slowdown_vs_sdpa']:.2f}x"))
        if (r := by_key.get((1, 32768))) is not None:
            goals.append(dict(goal=f"{name} batch 1 x 32768: >= 50% of copy bandwidth (split-K)",
                              met=r["fraction_of_copy"] >= 0.5, measured=f"{r['fraction_of_copy']:.0%}"))
    return goals


def cpu_smoke(dtypes: list[str], block_sizes: list[int] = [BLOCK_SIZE]) -> dict:  # noqa: B006
    """Tiny shapes in the interpreter: correctness against the reference, timings only for the record."""
    rows = []
    heads, kv_heads, head_dim = 8, 2, 64
    for name in dtypes:
        dtype = DTYPES[name]
        for block_size, (batch, context, splits) in itertools.product(
                block_sizes, [(1, 100, 1), (2, 300, None), (1, 600, 3)]):
            q, kc, vc, bt, sl = make_case(batch, context, heads, kv_heads, head_dim, block_size, dtype, "cpu")
            t0 = time.perf_counter()
            out = paged_attention.paged_decode_attention(q, kc, vc, bt, sl, num_splits=splits)
            seconds = time.perf_counter() - t0
            ref = reference.paged_decode_attention_ref(q.double(), kc.double(), vc.double(), bt, sl)
            err = (out.double() - ref).abs().max().item()
            ok = err < {"fp32": 1e-4, "fp16": 5e-3, "bf16": 5e-2}[name]
            rows.append(dict(dtype=name, batch=batch, context=context, num_heads=heads, num_kv_heads=kv_heads,
                             head_dim=head_dim, block_size=block_size, num_splits=splits, max_abs_error=err,
                             ok=ok, interpreter_seconds=seconds))
            print(f"{name:5} block {block_size:3d} batch {batch} x context {context:4d} splits {splits or 'auto':>4}: max error {err:.1e} "
                  f"{'ok' if ok else 'WRONG'} ({seconds:.2f} s interpreted, not a speed)")
    if not all(r["ok"] for r in rows):
        raise SystemExit("smoke test failed: the kernel disagrees with the reference")
    return dict(rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=list(DTYPES))
    parser.add_argument("--quick", action="store_true", help="GPU: only the goal points (64 x 4096, 1 x 32768)")
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[BLOCK_SIZE], choices=[8, 16, 32, 64, 128],
                        help="block sizes to sweep (default: 16); the goals are checked at 16")
    args = parser.parse_args()
    meta = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                command=" ".join(["python"] + sys.argv), torch=torch.__version__,
                triton_mode=labkit.RUNTIME.triton_mode, platform=platform.platform())
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    RESULTS.mkdir(parents=True, exist_ok=True)
    if labkit.RUNTIME.triton_mode == "compiled":
        gpu = torch.cuda.get_device_name()
        meta["gpu"] = gpu
        meta["shape"] = dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_sizes=args.block_sizes)
        print(f"{gpu}, {meta['date']}")
        if args.quick:
            result = gpu_benchmark(args.dtypes, [1, 64], [4096, 32768], args.block_sizes)
        else:
            result = gpu_benchmark(args.dtypes, BATCHES, CONTEXTS, args.block_sizes)
        slug = "".join(c if c.isalnum() else "_" for c in gpu).strip("_").lower()
        path = RESULTS / f"paged_attention_{slug}_{meta['date'][:10]}.json"
    else:
        print(f"No GPU ({labkit.RUNTIME.reason}). Smoke test in the interpreter; no speed is claimed.")
        result = cpu_smoke(args.dtypes, args.block_sizes)
        path = RESULTS / "paged_attention.smoke.json"
    path.write_text(json.dumps(dict(meta=meta, **result), indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
