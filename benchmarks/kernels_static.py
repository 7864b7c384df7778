"""What the compiler makes of labkit's kernels on every GPU a reader may have, without a GPU.

Triton compiles ahead of time for any target: ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 75, 32))`` runs the whole pipeline (Triton IR, PTX, then NVIDIA's
``ptxas``, which the triton wheel ships) on a CPU. This script

1. records the launches labkit's public functions make (``paged_decode_attention`` with and
   without split-K and its merge, ``paged_prefill_attention`` with short and long queries,
   ``write_kv``, and decode and write over the quantized pools of ``labkit.memory.formats``): CPU tensors go in, labkit believes it runs compiled on the target, and each
   kernel's ``run`` is replaced by a recorder, so grid, arguments, constexprs, ``num_warps``
   and ``num_stages`` are exactly what a GPU launch would get;
2. compiles each recorded launch for sm75 (T4), sm80 (A100), sm86 (A10, RTX 30), sm89 (L4,
   RTX 40) and sm90 (H100/H200), with the same argument specialisation a real launch does;
3. reads registers and spills from ptxas's report, shared memory from the kernel's metadata,
   the stack frame from ``cuobjdump --dump-resource-usage``, and counts 128-bit global loads
   (``ld.global.v4.b32`` or 16-byte ``cp.async``) in the PTX;
4. computes the theoretical occupancy: warps per multiprocessor, limited by registers,
   shared memory, the warp limit and the block limit.

It is static analysis, not timing: it says whether a launch compiles, fits and spills, never
how fast it runs. A case labkit does not launch on a target (fp8 below sm89, where Triton has no
e4m3) is listed with the fallback labkit names instead (``labkit.kernels.fallback.kv_format_reason``).

Usage::

    python benchmarks/kernels_static.py             # the full grid; writes benchmarks/results/kernels_static.{json,md}
    python benchmarks/kernels_static.py --subset    # the test's subset, printed
    python benchmarks/kernels_static.py --subset --json out.json

``TRITON_INTERPRET`` must be off in this process (an interpreted kernel cannot be compiled):
the script sets ``TRITON_INTERPRET=0`` before importing labkit, which then keeps Triton's
compiler on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before labkit and triton: kernels must be compilable here
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said out loud (silences a warning)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import labkit  # noqa: E402,F401
import labkit.kernels.launch  # noqa: E402  (by its full name: this file calls a recorded launch `launch`)
from labkit.kernels import fallback, paged_attention, triton_paged  # noqa: E402
from labkit.kernels.device import Runtime  # noqa: E402
from labkit.memory import formats  # noqa: E402
from labkit.memory.blocks import blocks_needed  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
KiB = 1024


@dataclasses.dataclass(frozen=True)
class Gpu:
    """Per-block and per-multiprocessor limits of one GPU generation.

    From NVIDIA's CUDA C++ Programming Guide, table "Technical Specifications per Compute
    Capability", as encoded in NVIDIA/cccl libcudacxx/include/cuda/__device/arch_traits.h
    (``arch_traits<arch_id::sm_XX>``): shared memory per block is the opt-in maximum
    (per multiprocessor minus the 1 KiB the driver reserves per block from sm80 on).
    Every generation here has 65,536 32-bit registers per multiprocessor, at most 255 per
    thread, allocated per warp in units of 256.
    """

    name: str
    capability: tuple[int, int]
    examples: str
    shared_per_block: int
    shared_per_sm: int
    reserved_shared_per_block: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int = 65536
    register_unit: int = 256


GPUS = {
    "sm75": Gpu("sm75", (7, 5), "T4, RTX 20", 64 * KiB, 64 * KiB, 0, 32, 16),
    "sm80": Gpu("sm80", (8, 0), "A100", 163 * KiB, 164 * KiB, 1 * KiB, 64, 32),
    "sm86": Gpu("sm86", (8, 6), "A10, RTX 30", 99 * KiB, 100 * KiB, 1 * KiB, 48, 16),
    "sm89": Gpu("sm89", (8, 9), "L4, RTX 40", 99 * KiB, 100 * KiB, 1 * KiB, 48, 24),
    "sm90": Gpu("sm90", (9, 0), "H100, H200", 227 * KiB, 228 * KiB, 1 * KiB, 64, 32),
}

KERNELS = {  # kernel object name in labkit.kernels.triton_paged -> short name in the tables
    "paged_decode_kernel": "decode",
    "merge_splits_kernel": "merge",
    "paged_prefill_kernel": "prefill",
    "write_kv_kernel": "write_kv",
    "write_kv_quant_kernel": "write_kv_quant",
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


# ----------------------------------------------------------------------------------------------
# 1. Record the launches the public functions make
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Launch:
    """One kernel launch as labkit made it: what a GPU would have been asked to run."""

    case: str
    kernel: str  # a key of KERNELS
    grid: tuple
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def recording(capability: tuple[int, int]):
    """Make labkit believe it runs compiled on a GPU of ``capability``; collect launches instead of running them."""
    launches: list[Launch] = []
    # What labkit decided about the machine, where the kernels read it: the fallback and the launches.
    patched = [(fallback, "RUNTIME"), (labkit.kernels.launch, "RUNTIME"), (fallback, "fallback_reason")]
    saved = [(module, name, getattr(module, name)) for module, name in patched]
    fallback.RUNTIME = labkit.kernels.launch.RUNTIME = Runtime(torch.device("cpu"), "compiled",
                                                               "ahead-of-time compile", capability)
    fallback.fallback_reason = lambda dtype, device, kv_cache_dtype="auto": fallback.kv_format_reason(
        kv_cache_dtype, capability)  # only the cache format's own rule: fp8 needs sm89
    case = {"name": ""}

    def recorder(name):
        def run(*args, grid, warmup, **kwargs):
            launches.append(Launch(case["name"], name, tuple(grid), args, dict(kwargs)))
        return run

    for name in KERNELS:
        getattr(triton_paged, name).run = recorder(name)
    try:
        yield launches, case
    finally:
        for name in KERNELS:
            del getattr(triton_paged, name).run  # back to the class's method
        for module, name, value in saved:
            setattr(module, name, value)


def _pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def quantized_kind(kind: str) -> tuple[str, str]:
    """("decode", "int8_per_block") for "decode_int8_per_block"; (kind, "auto") for the others."""
    for scheme in formats.KV_CACHE_DTYPES[1:]:
        if kind.endswith("_" + scheme):
            return kind[: -len(scheme) - 1], scheme
    return kind, "auto"


def run_case(kind: str, dtype: torch.dtype, head_dim: int, group: int, block_size: int,
             num_kv_heads: int = 2) -> None:
    """Call one public function with CPU tensors shaped like a real batch (values do not matter)."""
    num_heads = group * num_kv_heads
    kind, scheme = quantized_kind(kind)
    if scheme != "auto":  # a quantized pool: codes and scales (per-tensor scales 1.0, the others 0)
        kq = formats.kv_quant(scheme)
        (k_cache, k_scale), (v_cache, v_scale) = (kq.empty_pool(64, block_size, num_kv_heads, head_dim)
                                                  for _ in range(2))
        kw = dict(kv_cache_dtype=scheme, k_scale=k_scale, v_scale=v_scale)
        if kind == "write_kv":
            k = torch.zeros(5, num_kv_heads, head_dim, dtype=dtype)
            paged_attention.write_kv(k, k.clone(), k_cache, v_cache, torch.arange(5, dtype=torch.int64), **kw)
            return
        blocks = blocks_needed(100, block_size)
        block_tables = torch.arange(2 * blocks, dtype=torch.int32).view(2, blocks) % 64
        q = torch.zeros(2, num_heads, head_dim, dtype=dtype)
        paged_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, torch.full((2,), 100, dtype=torch.int32),
                                               num_splits=1, **kw)
        return
    if kind == "write_kv":
        k_cache, v_cache = _pool(8, block_size, num_kv_heads, head_dim, dtype)
        k = torch.zeros(5, num_kv_heads, head_dim, dtype=dtype)
        paged_attention.write_kv(k, k.clone(), k_cache, v_cache, torch.arange(5, dtype=torch.int64))
        return
    seq_len = 2048 if kind in ("decode_split", "prefill_long") else 100
    num_seqs = 2
    blocks = blocks_needed(seq_len, block_size)
    k_cache, v_cache = _pool(num_seqs * blocks, block_size, num_kv_heads, head_dim, dtype)
    block_tables = torch.arange(num_seqs * blocks, dtype=torch.int32).view(num_seqs, blocks)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    if kind.startswith("decode"):
        q = torch.zeros(num_seqs, num_heads, head_dim, dtype=dtype)
        splits = 4 if kind == "decode_split" else 1
        paged_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_splits=splits)
    else:
        q_len = 200 if kind == "prefill_long" else 7
        cu = torch.arange(num_seqs + 1, dtype=torch.int32) * q_len
        q = torch.zeros(num_seqs * q_len, num_heads, head_dim, dtype=dtype)
        paged_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu)


def case_name(kind: str, dtype: str, head_dim: int, group: int, block_size: int) -> str:
    return f"{kind} {dtype} d{head_dim} g{group} bs{block_size}"


def record(cases: list[tuple], capability: tuple[int, int]) -> list[Launch]:
    """The launches of every case (kind, dtype name, head_dim, group, block_size) on ``capability``."""
    with recording(capability) as (launches, case), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "runs its PyTorch reference": listed by fallbacks()
        for kind, dtype, head_dim, group, block_size in cases:
            case["name"] = case_name(kind, dtype, head_dim, group, block_size)
            run_case(kind, DTYPES[dtype], head_dim, group, block_size)
    return launches


def fallbacks(cases: list[tuple], gpus: list[str]) -> list[dict]:
    """The cases labkit does not launch on a target, with the reason it names (fp8 below sm89)."""
    rows = []
    for gpu in gpus:
        for kind, dtype, head_dim, group, block_size in cases:
            reason = fallback.kv_format_reason(quantized_kind(kind)[1], GPUS[gpu].capability)
            if reason is not None:
                rows.append({"gpu": gpu, "case": case_name(kind, dtype, head_dim, group, block_size),
                             "kernel": quantized_kind(kind)[0], "fallback": reason})
    return rows


# ----------------------------------------------------------------------------------------------
# 2. Compile a launch for a target, as the launch itself would have
# ----------------------------------------------------------------------------------------------

_jit_functions: dict = {}


def _specialise(launch: Launch, target):
    """Signature, constexprs, attributes and options exactly as ``JITFunction.run`` derives them."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = getattr(triton_paged, launch.kernel)
    jit = fn if isinstance(fn, JITFunction) else _jit_functions.setdefault(launch.kernel, JITFunction(fn.fn))
    backend = make_backend(target)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    kwargs = dict(launch.kwargs, debug=False)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(jit, signature, constexprs, attrs), options


def _compile_key(launch: Launch, gpu: str) -> str:
    """Launches with the same key compile to the same binary: compile once."""
    from triton.backends.compiler import GPUTarget

    src, options = _specialise(launch, GPUTarget("cuda", GPUS[gpu].capability[0] * 10 + GPUS[gpu].capability[1], 32))
    # The source hash covers the kernel, its signature, constexprs and specialisation; the
    # other options are the same for every launch here.
    return f"{gpu}-{launch.kernel.strip('_')}-{src.hash()[:12]}-w{options.num_warps}s{options.num_stages}"


CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_launch(launch: Launch, gpu: str) -> dict:
    """Compile ``launch`` for ``gpu``; return what ptxas, the metadata, cuobjdump and the PTX say."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    cc = GPUS[gpu].capability[0] * 10 + GPUS[gpu].capability[1]
    target = GPUTarget("cuda", cc, 32)
    src, options = _specialise(launch, target)
    log = io.StringIO()
    start = time.perf_counter()
    try:
        # ptxas -v's report (registers, spills) is printed only when asked, and only on a real compile.
        with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            knobs.compilation.always_compile = True
            compiled = triton.compile(src, target=target, options=options.__dict__)
    except Exception as err:  # noqa: BLE001 - a compile error is a result, reported and tested
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]}
    seconds = time.perf_counter() - start
    report = log.getvalue()
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    stack = re.search(r"STACK:(\d+)", usage)
    ptx = compiled.asm["ptx"]
    loads = load_widths(ptx)
    return {
        "registers": int(regs.group(1)),
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)),
        "stack_bytes": int(stack.group(1)) if stack else None,
        "shared_bytes": int(compiled.metadata.shared),
        "num_warps": int(compiled.metadata.num_warps),
        "num_stages": int(compiled.metadata.num_stages),
        "load_widths": loads,
        "kv_loads_128bit": kv_loads_128bit(KERNELS[launch.kernel], loads),
        "tensor_core_ops": len(re.findall(r"\bw?mma\.", ptx)) + len(re.findall(r"wgmma\.", ptx)),
        "fp32_fma": len(re.findall(r"fma\.rn\.f32", ptx)),
        "compile_s": round(seconds, 2),  # not written to the JSON: it varies from run to run
    }


def load_widths(ptx: str) -> dict[str, int]:
    """How many global loads of each width the PTX has: ``ld.global`` and ``cp.async`` into shared memory.

    Keys are bits, with a ``v`` for vector loads ("v128" for ``ld.global.v4.b32``, "v64" for
    ``.v2.b32``) and ``cp`` for ``cp.async`` copies ("cp128" is a 16-byte copy, from sm80 on).
    """
    widths: dict[str, int] = {}
    for vec, kind in re.findall(r"ld\.global[.\w]*?(?:\.v(\d))?\.([bfsu]\d+)\s", ptx):
        key = f"v{int(vec) * int(kind[1:])}" if vec else kind[1:]
        widths[key] = widths.get(key, 0) + 1
    for size in re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+|\d+)", ptx):
        key = f"cp{8 * int(size, 0)}"
        widths[key] = widths.get(key, 0) + 1
    return widths


def kv_loads_128bit(kernel: str, widths: dict[str, int]) -> bool | None:
    """Whether the attention kernels read their K and V tiles 128 bits at a time (None for the others).

    K and V arrive either as ``ld.global.v4.b32`` into registers or, from sm80 on, as 16-byte
    ``cp.async`` copies into shared memory: there must be at least two such loads (K and V),
    and no ``cp.async`` narrower than 16 bytes except 4-byte index entries (block table). The
    q tile is loaded once, before the walk, and may be narrower when the tile is small
    (head_dim 64 over many threads); ``load_widths`` keeps every load for a closer look.
    """
    if kernel not in ("decode", "prefill"):
        return None
    wide = widths.get("v128", 0) + widths.get("cp128", 0)
    narrow_copies = [k for k in widths if k.startswith("cp") and k not in ("cp128", "cp32")]
    return wide >= 2 and not narrow_copies


def occupancy(result: dict, gpu: Gpu) -> dict:
    """Theoretical occupancy: resident warps per multiprocessor and what limits them.

    Blocks (programs) per multiprocessor are the least of: the block limit; the warp limit
    over warps per block; the register file over the registers one block takes (per warp,
    rounded up to the allocation unit); shared memory per multiprocessor over one block's
    shared memory plus what the driver reserves per block.
    """
    warps = result["num_warps"]
    regs_per_warp = math.ceil(result["registers"] * 32 / gpu.register_unit) * gpu.register_unit
    limits = {
        "blocks": gpu.max_blocks_per_sm,
        "warps": gpu.max_warps_per_sm // warps,
        "registers": gpu.registers_per_sm // (regs_per_warp * warps),
        "shared": (gpu.shared_per_sm // (result["shared_bytes"] + gpu.reserved_shared_per_block)
                   if result["shared_bytes"] else gpu.max_blocks_per_sm),
    }
    blocks = min(limits.values())
    limiter = min(limits, key=lambda k: (limits[k], k != "registers"))
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps,
            "occupancy": round(blocks * warps / gpu.max_warps_per_sm, 3), "limited_by": limiter}


def verdict(result: dict, gpu: Gpu) -> list[str]:
    """What is wrong with a compiled launch on ``gpu`` (empty: nothing)."""
    if "error" in result:
        return [f"compile error: {result['error']}"]
    problems = []
    if result["shared_bytes"] > gpu.shared_per_block:
        problems.append(f"shared memory {result['shared_bytes']} B > {gpu.shared_per_block} B per block")
    if result["spill_bytes"]:
        problems.append(f"{result['spill_bytes']} bytes of register spills")
    return problems


# ----------------------------------------------------------------------------------------------
# 2b. A bare tl.dot: what Triton itself does on sm75, without labkit's upcast
# ----------------------------------------------------------------------------------------------

@triton.jit
def _bare_dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """C = A @ B for one 16-bit tile, straight into tl.dot: no conversion to float32 first."""
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))  # float32 accumulation


BARE_DOT_TILE = 32  # M = N = K: one 32 x 32 x 32 product, 32,768 multiply-adds


def bare_dot(gpu: str, dtype: str) -> dict:
    """Compile one 16-bit ``tl.dot`` for ``gpu``; count float32 FMAs and tensor-core instructions.

    labkit's launches on sm75 upcast every load (``LaunchSettings.upcast``), so their zero
    tensor-core count says nothing about Triton. This kernel does not upcast: whatever the
    PTX and SASS hold is Triton's own choice for a float16 (or bfloat16) product on that GPU.
    PTX: ``fma.rn.f32`` against ``mma``; SASS (``cuobjdump -sass``): ``FFMA`` against ``HMMA``.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cc = GPUS[gpu].capability[0] * 10 + GPUS[gpu].capability[1]
    element = {"fp16": "*fp16", "bf16": "*bf16"}[dtype]
    src = ASTSource(fn=_bare_dot_kernel,
                    signature={"a_ptr": element, "b_ptr": element, "c_ptr": "*fp32",
                               "M": "constexpr", "N": "constexpr", "K": "constexpr"},
                    constexprs={"M": BARE_DOT_TILE, "N": BARE_DOT_TILE, "K": BARE_DOT_TILE})
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(CUOBJDUMP), "-sass", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    return {"gpu": gpu, "dtype": dtype, "tile": BARE_DOT_TILE,
            "ptx_fma_f32": len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
            "ptx_mma": len(re.findall(r"\bw?mma\.", ptx)),
            "sass_ffma": len(re.findall(r"\bFFMA\b", sass)),
            "sass_hmma": len(re.findall(r"\bHMMA\b", sass))}


def bare_dot_table(gpus: tuple[str, ...] = ("sm75", "sm80"), dtypes: tuple[str, ...] = ("fp16", "bf16")) -> list[dict]:
    return [bare_dot(gpu, dtype) for gpu in gpus for dtype in dtypes]


# ----------------------------------------------------------------------------------------------
# 3. The grids
# ----------------------------------------------------------------------------------------------

KINDS = ("decode", "decode_split", "prefill_short", "prefill_long", "write_kv")
HEAD_DIMS = (64, 80, 96, 128, 256)
GROUPS = (1, 4, 8)
BLOCK_SIZES = (8, 16, 128)

# Quantized pools (appendix A3): decode and write for every scheme, 16-token blocks, GQA group 4.
QUANT_DECODE = tuple(f"decode_{s}" for s in formats.KV_CACHE_DTYPES[1:])
QUANT_WRITE = tuple(f"write_kv_{s}" for s in formats.KV_CACHE_DTYPES[1:])
QUANT_HEAD_DIMS = (64, 128, 256)

FULL_GRID = [(kind, dtype, d, g, bs) for kind, dtype, d, g, bs in
             itertools.product(KINDS, DTYPES, HEAD_DIMS, GROUPS, BLOCK_SIZES)
             if kind != "write_kv" or g == 1]
FULL_GRID += [(kind, dtype, d, 4, 16) for kind, dtype, d in itertools.product(QUANT_DECODE, DTYPES, QUANT_HEAD_DIMS)]
FULL_GRID += [(kind, dtype, d, 1, 16) for kind, dtype, d in itertools.product(QUANT_WRITE, ("bf16", "fp32"),
                                                                             QUANT_HEAD_DIMS)]
# The test's subset: every kernel, every dtype, every head dim, both sides of each launch rule
# (tensor cores or FMAs; prefill's short and long tiles; group 1; a block size not a multiple of 16).
SUBSET = [
    ("decode", "fp16", 128, 4, 16), ("decode", "bf16", 96, 1, 8), ("decode", "fp32", 256, 8, 16),
    ("decode_split", "fp16", 256, 4, 16), ("decode_split", "fp32", 80, 4, 16),
    ("prefill_long", "fp16", 256, 4, 16), ("prefill_long", "fp32", 128, 4, 8),
    ("prefill_short", "bf16", 64, 8, 16), ("prefill_long", "bf16", 80, 1, 128),
    ("write_kv", "fp32", 256, 1, 16),
    # quantized pools: int4 with group scales (tensor cores from sm80), fp8 (sm89 and sm90 only), a
    # per-block write (its rescaling loop)
    ("decode_int4_per_group", "bf16", 128, 4, 16), ("decode_fp8_per_block", "fp16", 64, 4, 16),
    ("write_kv_int8_per_block", "bf16", 128, 1, 16),
]


def _compile_job(job: tuple[int, str, list]) -> list[dict]:
    """Worker: record the grid for one GPU, compile the launches whose index ``% workers`` matches."""
    worker, gpu, (grid, workers) = job
    launches = record(grid, GPUS[gpu].capability)
    rows, done = [], {}
    for launch in launches:
        key = _compile_key(launch, gpu)
        if zlib.crc32(key.encode()) % workers != worker:
            continue
        if key not in done:
            done[key] = compile_launch(launch, gpu)
        rows.append({"gpu": gpu, "case": launch.case, "kernel": KERNELS[launch.kernel], "key": key,
                     "grid": list(launch.grid), **_settings(launch), **done[key]})
    return rows


def _settings(launch: Launch) -> dict:
    """The launch's tile constexprs, as recorded."""
    return {"tiles": {k: v for k, v in launch.kwargs.items() if k.startswith("BLOCK_")},
            "upcast": launch.kwargs.get("UPCAST")}


def analyse(grid: list[tuple], gpus: list[str], workers: int = 1) -> list[dict]:
    """Record, compile (once per distinct binary) and judge every launch of ``grid`` on ``gpus``."""
    jobs = [(w, gpu, (grid, workers)) for gpu in gpus for w in range(workers)]
    if workers == 1:
        parts = [_compile_job(job) for job in jobs]
    else:
        with ProcessPoolExecutor(workers) as pool:
            parts = list(pool.map(_compile_job, jobs))
    rows = [row for part in parts for row in part]
    for row in rows:
        gpu = GPUS[row["gpu"]]
        row["problems"] = verdict(row, gpu)
        if "error" not in row:
            row.update(occupancy(row, gpu))
    return sorted(rows, key=lambda r: (r["gpu"], r["kernel"], r["case"]))


# ----------------------------------------------------------------------------------------------
# 4. Tables
# ----------------------------------------------------------------------------------------------

def summary(rows: list[dict]) -> list[dict]:
    """Per kernel and GPU: launches, distinct binaries, the worst registers/shared/spills, occupancy range."""
    out = []
    for (gpu, kernel), group in itertools.groupby(sorted(rows, key=lambda r: (r["gpu"], r["kernel"])),
                                                  key=lambda r: (r["gpu"], r["kernel"])):
        group = list(group)
        ok = [r for r in group if "error" not in r]
        out.append({
            "gpu": gpu, "kernel": kernel, "launches": len(group), "binaries": len({r["key"] for r in group}),
            "errors": len(group) - len(ok),
            "max_registers": max(r["registers"] for r in ok),
            "max_shared_kib": round(max(r["shared_bytes"] for r in ok) / KiB, 1),
            "shared_limit_kib": GPUS[gpu].shared_per_block // KiB,
            "spill_bytes": max(r["spill_bytes"] for r in ok),
            "warps": sorted({r["num_warps"] for r in ok}), "stages": sorted({r["num_stages"] for r in ok}),
            "min_occupancy": min(r["occupancy"] for r in ok), "max_occupancy": max(r["occupancy"] for r in ok),
            "kv_loads_128bit": None if kernel not in ("decode", "prefill") else all(r["kv_loads_128bit"] for r in ok),
            "problems": sum(bool(r["problems"]) for r in group),
        })
    return out


def markdown(rows: list[dict], header: str, fallback_rows: list[dict] = ()) -> str:
    """The summary as a Markdown table, and the per-launch detail for decode and prefill at head_dim 128."""
    lines = [header, "",
             "| GPU | kernel | launches | binaries | max registers | max shared (KiB) / limit | spills (B) | "
             "warps | stages | occupancy | K/V loads 128-bit | problems |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary(rows):
        occ = f"{s['min_occupancy']:.0%}" if s["min_occupancy"] == s["max_occupancy"] else \
            f"{s['min_occupancy']:.0%}-{s['max_occupancy']:.0%}"
        lines.append(f"| {s['gpu']} | {s['kernel']} | {s['launches']} | {s['binaries']} | {s['max_registers']} | "
                     f"{s['max_shared_kib']} / {s['shared_limit_kib']} | {s['spill_bytes']} | "
                     f"{','.join(map(str, s['warps']))} | {','.join(map(str, s['stages']))} | {occ} | "
                     f"{ {True: 'yes', False: 'no', None: '-'}[s['kv_loads_128bit']]} | {s['problems']} |")
    lines += ["", "Decode (no split) and long prefill at head_dim 128, group 4, block size 16:", "",
              "| GPU | kernel | dtype | tiles | warps | stages | registers | shared (KiB) | spills (B) | "
              "warps/SM | limited by | global loads by width (bits) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kind, dtype, d, g, bs = r["case"].split()
        if kind in ("decode", "prefill_long") and d == "d128" and g == "g4" and bs == "bs16" and \
                r["kernel"] in ("decode", "prefill") and "error" not in r:
            tiles = " ".join(f"{k[6:]}={v}" for k, v in r["tiles"].items())
            lines.append(f"| {r['gpu']} | {r['kernel']} | {dtype} | {tiles} | {r['num_warps']} | {r['num_stages']} | "
                         f"{r['registers']} | {r['shared_bytes'] / KiB:.1f} | {r['spill_bytes']} | "
                         f"{r['warps_per_sm']} of {GPUS[r['gpu']].max_warps_per_sm} | {r['limited_by']} | "
                         f"{', '.join(f'{k}: {n}' for k, n in sorted(r['load_widths'].items()))} |")
    if fallback_rows:
        lines += ["", "Not launched (labkit names the fallback instead):", "",
                  "| GPU | kernel | cases | reason |", "|---|---|---|---|"]
        for (gpu, kernel), group in itertools.groupby(fallback_rows, key=lambda r: (r["gpu"], r["kernel"])):
            group = list(group)
            lines.append(f"| {gpu} | {kernel} | {len(group)} | {group[0]['fallback'].split(': ', 1)[1]} |")
    return "\n".join(lines) + "\n"


def to_json(rows: list[dict], meta: dict, fallback_rows: list[dict] = ()) -> str:
    """The results file: each distinct binary once, then one line per launch naming its binary, then
    the cases not launched on a target (``fallbacks``: fp8 below sm89).

    ``rows_of`` (and the chapter, and the test) join them back into one row per launch.
    """
    per_launch = ("gpu", "case", "kernel", "grid")
    binaries = {r["key"]: {k: v for k, v in r.items() if k not in per_launch + ("key", "compile_s")} for r in rows}
    launches = [{**{k: r[k] for k in per_launch}, "binary": r["key"]} for r in rows]
    lines = ['{"meta": ' + json.dumps(meta) + ',', ' "binaries": {']
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in sorted(binaries.items())]
    lines[-1] = lines[-1].rstrip(",")
    lines += [' },', ' "launches": [']
    lines += [f"  {json.dumps(launch)}," for launch in launches]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" ],", ' "fallbacks": [']
    lines += [f"  {json.dumps(r)}," for r in fallback_rows]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" ]", "}"]
    return "\n".join(lines) + "\n"


def rows_of(doc: dict) -> list[dict]:
    """One row per launch from a results file: the launch joined with its binary's figures."""
    return [{**launch, "key": launch["binary"], **doc["binaries"][launch["binary"]]} for launch in doc["launches"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subset", action="store_true", help="only the test's subset")
    parser.add_argument("--gpus", nargs="+", default=list(GPUS), choices=list(GPUS))
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--json", type=Path, help="where to write the results (default: results/ for the full grid)")
    parser.add_argument("--bare-dot", action="store_true",
                        help="only compile one 16-bit tl.dot for sm75 and sm80 and count its instructions "
                             "(default output: results/bare_dot.json)")
    args = parser.parse_args()
    if args.bare_dot:
        rows = bare_dot_table()
        print(f"{'GPU':5s} {'dtype':5s} {'PTX fma.rn.f32':>14s} {'PTX mma':>7s} {'SASS FFMA':>9s} {'SASS HMMA':>9s}")
        for r in rows:
            print(f"{r['gpu']:5s} {r['dtype']:5s} {r['ptx_fma_f32']:14d} {r['ptx_mma']:7d} {r['sass_ffma']:9d} "
                  f"{r['sass_hmma']:9d}")
        path = args.json or RESULTS / "bare_dot.json"
        meta = {"triton": triton.__version__, "command": "python benchmarks/kernels_static.py --bare-dot",
                "date": time.strftime("%Y-%m-%d")}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {path}")
        return 0
    grid = SUBSET if args.subset else FULL_GRID
    start = time.perf_counter()
    rows = analyse(grid, args.gpus, args.workers)
    not_launched = fallbacks(grid, args.gpus)
    took = time.perf_counter() - start
    compile_s = sum({r["key"]: r.get("compile_s", 0) for r in rows}.values())
    meta = {"triton": triton.__version__, "torch": torch.__version__, "grid": "subset" if args.subset else "full",
            "command": "python benchmarks/kernels_static.py" + (" --subset" if args.subset else ""),
            "launches": len(rows), "binaries": len({r["key"] for r in rows}), "not_launched": len(not_launched),
            "compile_cpu_seconds": round(compile_s), "wall_seconds": round(took),
            "gpus": {k: dataclasses.asdict(v) for k, v in GPUS.items() if k in args.gpus}}
    header = (f"Static analysis (no timing): {meta['launches']} launches, {meta['binaries']} distinct binaries, "
              f"triton {meta['triton']}, `{meta['command']}`.")
    table = markdown(rows, header, not_launched)
    print(table)
    path = args.json or (None if args.subset else RESULTS / "kernels_static.json")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(to_json(rows, meta, not_launched))
        if not args.subset:
            (RESULTS / "kernels_static.md").write_text(table)
        print(f"wrote {path}")
    bad = [r for r in rows if r["problems"]]
    for r in bad:
        print(f"PROBLEM {r['gpu']} {r['kernel']} [{r['case']}]: {'; '.join(r['problems'])}")
    print(f"{len(rows)} launches, {meta['binaries']} binaries, {len(bad)} with problems, {took:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
