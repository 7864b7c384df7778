"""How each kernel is launched: tiles, warps, stages and splits per GPU generation, and the launchers.

``launch_settings`` is the one function that picks tiles for a GPU of a given compute capability
(or for the interpreter); ``tests/test_kernels_static.py`` compiles its launches for sm75 to sm90
without a GPU, so a setting that spills registers or overflows shared memory fails a test.
``choose_num_splits`` plans split-K decode for long contexts. The launchers (``decode_triton`` and
the rest) check nothing: the public functions of ``labkit.kernels.paged_attention`` check first, and
benchmarks time the bare launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int
from ..memory.formats import KVQuant
from .arguments import MAX_HEAD_DIM, SUPPORTED_DTYPES
from .device import RUNTIME
from .triton_paged import (KV_FORMATS, SCALE_KINDS, format_constexprs, merge_splits_kernel, paged_decode_kernel,
                           paged_prefill_kernel, write_kv_kernel, write_kv_quant_kernel)


LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); exp2 is the cheaper instruction on a GPU



MIN_TOKENS_PER_SPLIT = 256  # a split shorter than this costs more to merge than it saves
MERGE_BLOCK_K = 16  # the merge kernel reads this many splits per step


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _num_programs_target(device: torch.device) -> int:
    """How many programs keep the device busy: the GPU's multiprocessor count; a small number on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device | str = "cpu",
                      block_n: int = 64, target_programs: int | None = None) -> tuple[int, int]:
    """Split-K plan for decode: ``(num_splits, tokens_per_split)``.

    Decode launches one program per (sequence, KV head). With many sequences that
    fills the GPU; with one long sequence it leaves most multiprocessors idle while one
    program walks 32k positions. Then the positions are cut into ``num_splits`` chunks
    handled in parallel, each at least ``MIN_TOKENS_PER_SPLIT`` long, and merged.
    ``target_programs`` (default: the device's multiprocessor count; 8 on a CPU) is how many
    programs keep the device busy.
    """
    num_seqs = check_int("num_seqs", num_seqs, 1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
    max_seq_len = check_int("max_seq_len", max_seq_len, 1)
    block_n = check_int("block_n", block_n, 1)
    if target_programs is not None:
        check_int("target_programs", target_programs, 1)
    target = target_programs or _num_programs_target(torch.device(device))
    programs = num_seqs * num_kv_heads
    if programs >= target or max_seq_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1, max(max_seq_len, 1)
    splits = min(-(-target // programs), max_seq_len // MIN_TOKENS_PER_SPLIT)
    tokens_per_split = -(-max_seq_len // splits)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n  # whole BLOCK_N steps
    return -(-max_seq_len // tokens_per_split), tokens_per_split


@dataclass(frozen=True)
class LaunchSettings:
    """How one attention launch is cut up: tile sizes, warps per program and pipeline depth.

    ``block_m`` query rows per program (prefill; decode's rows are the GQA group padded to
    ``block_g``), ``block_n`` keys per step of the walk over the block table, ``block_d``
    head_dim padded to a power of two (80 and 96 become 128, the padding masked off).
    ``num_warps`` warps of 32 threads run one program; ``num_stages`` is how many steps of K/V
    loads are in flight at once (software pipelining through shared memory). ``upcast``
    converts loads to float32 before any arithmetic, and ``dot_precision`` is what ``tl.dot``
    may use for float32 products ("ieee": exact float32, never TF32).
    """

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    upcast: bool
    dot_precision: str = "ieee"

    def constexprs(self) -> dict:
        """The settings the kernels take as ``tl.constexpr`` plus the launch options."""
        return dict(BLOCK_D=self.block_d, BLOCK_N=self.block_n, UPCAST=self.upcast,
                    DOT_PRECISION=self.dot_precision, num_warps=self.num_warps, num_stages=self.num_stages)


def launch_settings(kernel: str, dtype: torch.dtype, head_dim: int,
                    capability: tuple[int, int] | None, max_len: int = 128, quantized: bool = False) -> LaunchSettings:
    """Tiles, warps and stages for ``kernel`` ("decode" or "prefill") on a GPU of ``capability``.

    Compiled, one rule decides everything: do the products run on **tensor cores**? They do
    for float16 and bfloat16 from compute capability 8.0 (A100, A10, L4, RTX 30/40, H100).
    They do not for float32 (labkit asks for exact float32 products), and not at all on a
    7.5 GPU (T4): Triton 3.9 turns every ``tl.dot`` there into float32 FMAs, whatever the
    input type, so labkit upcasts every load and computes in float32 on the FP32 units.

    * Tensor cores: a step reads 64 keys (32 when head_dim > 128), prefill tiles 64 queries
      on 8 warps, decode's padded group of 16 rows on 4, with 3 stages of loads in flight
      (asynchronous copies, compute capability 8.0 and up).
    * FMAs: every product and operand sits in registers, so the tiles shrink and the work is
      spread over more threads: 32 keys on 8 warps (16 keys on 4 warps when head_dim > 128:
      with 8, ptxas spilled there on sm86/sm89), 16 query rows, 2 stages; 1 stage on compute
      capability 7.5, which has no asynchronous copy to overlap with.

    With these tiles every launch compiles for sm75, sm80, sm86, sm89 and sm90 without a
    register spill and within each GPU's shared memory per block (64 KiB on a T4, 99 KiB on
    sm86/sm89). Larger ones were tried and failed: 64-key tiles overflow a T4's shared memory
    on the FMA path, and 4 warps spill registers there; 64-query prefill tiles on 4 warps
    spill on sm80/sm86. ``benchmarks/kernels_static.py`` compiles every combination ahead of
    time and tests/test_kernels_static.py a subset, so a change here that spills or overflows
    fails a test, GPU or not. Which tiles run *fastest* only a GPU can tell.

    ``quantized``: decode over a quantized pool (appendix A3). Dequantizing a tile takes more
    registers; on the FMA path ptxas spilled with the settings above (up to 7 KiB on sm86 at
    head_dim 256 with two stages; 8 bytes on sm90 at head_dim 128 with 32-key steps). There a step
    reads 16 keys, its loads are not pipelined (1 stage), and 8 warps share the work; the
    tensor-core path keeps its settings.

    Interpreted there are no registers or warps, only Python steps: one step as wide as the
    sequence (up to 128 keys), float32 throughout (the interpreter's bfloat16 is inexact).
    """
    _check_launch_args(kernel, dtype, head_dim, capability, max_len)
    if not isinstance(quantized, bool):
        raise ValueError(f"quantized must be True or False, got {quantized!r}")
    block_d = max(16, _next_pow2(head_dim))
    if capability is None:  # Triton's interpreter on the CPU
        return LaunchSettings(block_m=64, block_n=min(128, max(16, _next_pow2(max_len))), block_d=block_d,
                              num_warps=1, num_stages=1, upcast=True)
    wide = block_d > 128
    if dtype != torch.float32 and capability >= (8, 0):  # tensor cores, float32 accumulation
        return LaunchSettings(block_m=64, block_n=32 if wide else 64, block_d=block_d,
                              num_warps=8 if kernel == "prefill" else 4, num_stages=3, upcast=False,
                              dot_precision="tf32")  # only float32 inputs look at it; these are 16-bit
    if quantized:
        return LaunchSettings(block_m=16, block_n=16, block_d=block_d, num_warps=8, num_stages=1, upcast=True)
    return LaunchSettings(block_m=16, block_n=16 if wide else 32, block_d=block_d, num_warps=4 if wide else 8,
                          num_stages=2 if capability >= (8, 0) else 1, upcast=True)


KERNELS = ("decode", "prefill")


def _check_launch_args(kernel: object, dtype: object, head_dim: object, capability: object, max_len: object) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    if check_int("head_dim", head_dim, 1) > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if capability is not None and not (isinstance(capability, tuple) and len(capability) == 2
                                       and all(type(c) is int and c >= 0 for c in capability)):
        raise ValueError(f"capability must be None (the interpreter) or a (major, minor) pair of integers such as "
                         f"(8, 0), got {capability!r}")
    check_int("max_len", max_len, 1)


def launch_capability() -> tuple[int, int] | None:
    """The compute capability the kernels are compiled for; None in the interpreter."""
    return None if RUNTIME.interpreted else (RUNTIME.capability or (8, 0))


def _group_tile(group_size: int) -> int:
    """Decode's query rows per program: the GQA group, padded to 16 when compiled (tl.dot's minimum)."""
    return _next_pow2(group_size) if RUNTIME.interpreted else max(16, _next_pow2(group_size))



# The launchers: no checks (the public functions check), so that benchmarks can time the bare kernel.

def write_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_h, block_d = _next_pow2(num_kv_heads), _next_pow2(head_dim)
    # A copy: give each thread 16 bytes (one 128-bit load and store), with 1 to 8 warps.
    num_warps = min(8, max(1, block_h * block_d * k.element_size() // (32 * 16)))
    write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim, k_cache.shape[1],
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=num_warps,
    )


def write_runs(slot_mapping: torch.Tensor, block_size: int, kq: KVQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """How a quantized write is cut into programs: ``(order, runs)``.

    ``order``: the kept tokens (slot >= 0) sorted by slot. ``runs`` int64 [num_runs, 4]: block id,
    first offset, start in ``order``, count. A run is tokens that land in consecutive slots of one
    block. Per block, all the tokens written into a block must form one run (a block is filled in
    order: its scale covers the slots before the first new one); a gap raises ValueError naming
    slot_mapping.
    """
    kept = (slot_mapping >= 0).nonzero().flatten()
    order = kept[slot_mapping[kept].argsort()]
    slots = slot_mapping[order].long()
    blocks = slots // block_size
    starts = torch.ones_like(slots, dtype=torch.bool)
    starts[1:] = (slots[1:] != slots[:-1] + 1) | (blocks[1:] != blocks[:-1])
    starts = starts.nonzero().flatten()
    counts = torch.diff(starts, append=torch.tensor([len(slots)], device=slots.device))
    if kq.scales == "block" and bool((blocks[starts][1:] == blocks[starts][:-1]).any()):
        raise ValueError(f"slot_mapping must send the tokens written into one block of a {kq.name} cache to "
                         "consecutive slots: a block is filled in order, its scale covering the slots before "
                         "the first new one")
    return order, torch.stack([blocks[starts], slots[starts] % block_size, starts, counts], dim=1)


def write_kv_quant_triton(x, cache, scale, order, runs, kq: KVQuant) -> None:
    """Quantize one of K or V into its pool: one program per (run, KV head)."""
    if runs.shape[0] == 0:
        return
    head_dim = x.shape[-1]
    step = 2 if kq.element == "int4" else 1
    lanes = kq.group_size // step
    block_e = _next_pow2(head_dim // step)
    if kq.scales == "group":
        block_e = max(block_e, lanes)  # whole groups of lanes: the kernel reshapes them
    gs = _scale_strides(scale, kq)
    write_kv_quant_kernel[(runs.shape[0], x.shape[1])](
        x, cache, scale, order, runs,
        x.stride(0), x.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2),
        *gs, head_dim,
        QMAX=kq.qmax, KV_FORMAT=KV_FORMATS[kq.element], SCALES=SCALE_KINDS[kq.scales], GROUP_SIZE=kq.group_size,
        # at most 2,048 lanes a tile over 4 warps: 16 rows of 256 lanes spilled on sm90 (fp8, per block)
        BLOCK_R=min(16, _next_pow2(cache.shape[1]), max(1, 2048 // block_e)), BLOCK_E=block_e, num_warps=4,
        FP8_NAN_BY_BITS=RUNTIME.interpreted and kq.element == "fp8",
    )


def _scale_strides(scale: torch.Tensor | None, kq: KVQuant | None) -> tuple[int, int, int]:
    """(block, slot, head) strides of a scale tensor; 0 where the scheme has no such axis."""
    if kq is None or kq.scales == "tensor":
        return 0, 0, 0
    if kq.scales == "block":
        return scale.stride(0), 0, scale.stride(1)
    return scale.stride(0), scale.stride(1), scale.stride(2)


def decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, tokens_per_split,
                  max_len, out=None, kq: KVQuant | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    settings = launch_settings("decode", q.dtype, head_dim, launch_capability(), min(max_len, tokens_per_split),
                               quantized=kq is not None)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    if kq is None:
        k_scale = v_scale = q  # unused: a 16/32-bit pool has no scales
    paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, k_scale, v_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *_scale_strides(k_scale, kq),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if num_splits > 1 else 0,
        part_lse.stride(0), part_lse.stride(1),
        scale * LOG2E,
        group, head_dim, k_cache.shape[1], tokens_per_split,
        BLOCK_G=_group_tile(group), SPLIT=num_splits > 1, **settings.constexprs(),
        **format_constexprs(kq, RUNTIME.interpreted),
    )
    if num_splits > 1:
        merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out,
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            num_splits, head_dim,
            BLOCK_K=min(MERGE_BLOCK_K, _next_pow2(num_splits)), BLOCK_D=settings.block_d, num_warps=4,
        )
    return out


def prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_q_len,
                   max_len, out=None) -> torch.Tensor:
    total, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    if total == 0:
        return out
    settings = launch_settings("prefill", q.dtype, head_dim, launch_capability(), max_len)
    block_m = min(settings.block_m, max(16, _next_pow2(max_q_len)))  # short queries: a smaller tile
    paged_prefill_kernel[(num_seqs, -(-max_q_len // block_m), num_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale * LOG2E,
        group, head_dim, k_cache.shape[1],
        BLOCK_M=block_m, **settings.constexprs(),
    )
    return out
