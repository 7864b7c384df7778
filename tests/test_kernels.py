"""The paged-attention kernels against plain float64 references (labkit.kernels).

Without a GPU every kernel runs in Triton's interpreter: the same kernel code, so the
same indexing, masking and online softmax are proven here. Every case uses fresh random
data, shuffled block tables, ragged lengths (1, around block boundaries, random), a pool
whose unused slots hold NaN, and an output buffer filled with NaN before the run.

Random data is drawn on the CPU from a seeded generator (the same numbers everywhere) and
then moved to ``labkit.DEVICE``: on a GPU the compiled kernels run, not the reference.
References run on CPU copies in float64. Tests about the fallback, the interpreter or
argument checks keep CPU tensors on purpose.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import labkit
from labkit.kernels import cpu, fallback, launch, paged_attention, reference
from labkit.kernels.device import Runtime
from labkit.model.decoder import causal_attention

TOL = {  # (atol, rtol) against the float64 reference; bf16 stores truncate in the interpreter
    torch.float32: (2e-5, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}
DEVICE = labkit.DEVICE
needs_kernels = pytest.mark.skipif(fallback.fallback_reason(torch.float32, labkit.DEVICE) is not None,
                                   reason="Triton kernels cannot run here")


def boundary_lens(block_size: int, gen: torch.Generator, extra: int = 2) -> list[int]:
    """1, lengths on and around block boundaries, and a few random lengths."""
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size]
    lens += torch.randint(1, 3 * block_size + 1, (extra,), generator=gen).tolist()
    return [n for n in lens if n >= 1]


def cpu64(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy on the CPU, where the references run."""
    return t.detach().cpu().double()


def make_pool(lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
              gen: torch.Generator, spare_blocks: int = 3, device: torch.device | str = DEVICE):
    """A NaN-filled pool, shuffled block tables (unused entries -1), random K/V in the used slots only.

    Built on the CPU, returned on ``device``.
    """
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + spare_blocks
    max_blocks = max(used) + 1  # one entry more than any sequence needs: never read
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(lens):
        ids = perm[taken : taken + used[i]]
        taken += used[i]
        block_tables[i, : used[i]] = ids.int()
        pos = torch.arange(n)
        slots = ids[pos // block_size] * block_size + pos % block_size  # only valid positions; the tail stays NaN
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (k_cache, v_cache, block_tables, seq_lens))


def assert_close_to(out: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert not out.isnan().any(), "an output element was never written or read a poisoned slot"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(cpu64(out), ref64.cpu(), atol=atol, rtol=rtol)


def decode_case(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables, seq_lens = make_pool(lens, num_kv_heads, head_dim, block_size, dtype, gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    got = paged_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out=out, **kwargs)
    assert got is out
    ref = reference.paged_decode_attention_ref(cpu64(q), cpu64(k_cache), cpu64(v_cache), block_tables.cpu(),
                                               seq_lens.cpu(), kwargs.get("scale"))
    return out, ref, (q, k_cache, v_cache, block_tables, seq_lens)


# -- decode -------------------------------------------------------------------------------------

# Every dtype with every head dim; head ratios and block sizes cycle through them.
RATIOS = [(4, 4), (8, 2), (5, 1), (6, 2)]
BLOCK_SIZES = [8, 16, 32, 64, 128]
DECODE_CASES = [(dtype, d, RATIOS[i % 4], BLOCK_SIZES[i % 5])
                for i, (dtype, d) in enumerate((dt, d) for dt in TOL for d in (64, 80, 96, 128, 256))]


@needs_kernels
@pytest.mark.parametrize("dtype,head_dim,heads,block_size", DECODE_CASES)
def test_decode_matches_reference(dtype, head_dim, heads, block_size):
    gen = torch.Generator().manual_seed(head_dim * block_size)
    lens = boundary_lens(block_size, gen)
    out, ref, _ = decode_case(lens, *heads, head_dim, block_size, dtype, seed=head_dim + block_size)
    assert_close_to(out, ref, dtype)


@needs_kernels
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", RATIOS)
def test_decode_block_sizes_and_head_ratios(block_size, heads):
    gen = torch.Generator().manual_seed(block_size * 7 + heads[0])
    out, ref, _ = decode_case(boundary_lens(block_size, gen, extra=1), *heads, 64, block_size, torch.float32,
                              seed=block_size + 100 * heads[0])
    assert_close_to(out, ref, torch.float32)


@needs_kernels
def test_decode_custom_scale():
    out, ref, _ = decode_case([3, 20], 4, 2, 64, 16, torch.float32, seed=5, scale=0.3)
    assert_close_to(out, ref, torch.float32)


@needs_kernels
def test_decode_ignores_poisoned_slots_and_table_padding():
    out, _, (q, k_cache, v_cache, block_tables, seq_lens) = decode_case([5, 16, 17], 8, 2, 64, 16,
                                                                       torch.float16, seed=11)
    # Change everything the kernel must not read: other values in the tail slots, bogus padding ids.
    for i, n in enumerate(seq_lens.tolist()):
        last = int(block_tables[i, (n - 1) // 16])
        k_cache[last, (n - 1) % 16 + 1 :] = 1e4
        v_cache[last, (n - 1) % 16 + 1 :] = -1e4
    block_tables[:, -1] = 10**6
    again = paged_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    assert torch.equal(again, out)


@pytest.mark.parametrize("heads", RATIOS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_batched_decode_reference_equals_the_per_sequence_reference(heads, block_size):
    """The engine's CPU path (one gather for the batch, a mask) against the loop over sequences,
    in float64, on ragged lengths, shuffled block tables and a NaN-poisoned pool."""
    gen = torch.Generator().manual_seed(block_size + 10 * heads[0])
    lens = boundary_lens(block_size, gen, extra=3)
    k_cache, v_cache, block_tables, seq_lens = make_pool(lens, heads[1], 32, block_size, torch.float64, gen,
                                                         device="cpu")
    q = torch.randn(len(lens), heads[0], 32, generator=gen, dtype=torch.float64)
    ref = reference.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens)
    got = cpu.paged_decode_attention_batched(q, k_cache, v_cache, block_tables, seq_lens)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    block_tables[:, -1] = 10**6  # padding past every sequence's blocks is never read
    torch.testing.assert_close(cpu.paged_decode_attention_batched(q, k_cache, v_cache, block_tables, seq_lens),
                               ref, rtol=1e-12, atol=1e-12)
    half = cpu.paged_decode_attention_batched(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens)
    assert half.dtype == torch.float32 and (half.double() - ref).abs().max() < 1e-5


def test_mixed_step_on_the_cpu_equals_the_per_sequence_reference():
    """A continuous-batching step: decode rows, prompt chunks and an idle sequence side by side.
    The CPU path batches the single-token rows and must put every row back where it belongs."""
    gen = torch.Generator().manual_seed(7)
    lens = [5, 17, 1, 33, 9, 16, 12]
    q_lens = [1, 6, 1, 1, 0, 16, 1]  # decode, chunk, decode, decode, nothing new, whole prompt, decode
    k_cache, v_cache, block_tables, seq_lens = make_pool(lens, 2, 16, 4, torch.float64, gen, device="cpu")
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), 4, 16, generator=gen, dtype=torch.float64)
    ref = reference.paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, cu)
    got = cpu.paged_attention_batched(q, k_cache, v_cache, block_tables, seq_lens, cu)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_a_planned_pass_writes_like_the_reference_and_skips_slot_minus_one():
    """Issue 43: the CPU path plans a pass once (``cpu.plan_batch``); its write is the reference's, a
    slot of -1 taking no token, and its attention over the pass is the per-sequence reference's."""
    gen = torch.Generator().manual_seed(3)
    lens, q_lens = [7, 12, 3], [2, 5, 1]
    k_cache, v_cache, block_tables, seq_lens = make_pool(lens, 2, 8, 4, torch.float64, gen, device="cpu")
    slots = torch.randperm(k_cache.shape[0] * 4, generator=gen)[:sum(q_lens)]
    slots[[1, 4]] = -1  # two tokens a prefix cache already holds
    k = torch.randn(sum(q_lens), 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(q_lens), 2, 8, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    plan = cpu.plan_batch(block_tables, seq_lens, cu, 4, slots, per_kv=2)  # 4 query heads, 2 KV heads
    assert [g.q_max for g in plan.groups] == [1, 5] and not plan.in_order  # decode rows, then the chunks
    pools = [torch.zeros_like(k_cache) for _ in range(4)]
    reference.write_kv_ref(k, v, pools[0], pools[1], slots)
    cpu.write_kv(k, v, pools[2], pools[3], plan)
    assert torch.equal(pools[2], pools[0]) and torch.equal(pools[3], pools[1])
    assert int((pools[2] != 0).any(-1).any(-1).sum()) == sum(q_lens) - 2  # 8 tokens written, 2 skipped
    q = torch.randn(sum(q_lens), 4, 8, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(cpu.paged_attention(q, k_cache, v_cache, plan),
                               reference.paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, cu),
                               rtol=1e-12, atol=1e-12)


def test_the_engine_plans_each_pass_once_on_the_cpu(monkeypatch):
    """Per-step metadata is built once, not per layer: one plan per forward pass, read by every layer."""
    from labkit.model.decoder import Decoder, DecoderConfig
    from labkit.serving.engine import Engine

    model = Decoder.random(DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2), seed=0)
    engine = Engine(model, num_blocks=16, block_size=4, use_triton=False)
    made = []
    monkeypatch.setattr(cpu, "plan_batch", lambda *a, plan=cpu.plan_batch: made.append(1) or plan(*a))
    engine.generate([[1, 2, 3, 4, 5], [6, 7]], 4)
    assert len(made) == len(engine.stats) > 0


@needs_kernels
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("num_splits", [3, 7])
def test_split_k_agrees_with_single_pass(dtype, num_splits):
    # Lengths such that short sequences leave some splits empty.
    lens = [1, 40, 333, 520]
    single, ref, args = decode_case(lens, 10, 2, 80, 16, dtype, seed=num_splits)
    split = torch.full_like(single, float("nan"))
    paged_attention.paged_decode_attention(*args, num_splits=num_splits, out=split)
    assert_close_to(split, ref, dtype)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(cpu64(split), cpu64(single), atol=atol, rtol=rtol)


def test_split_plan_is_chosen_for_long_contexts_with_few_sequences():
    splits, per_split = launch.choose_num_splits(1, 1, 4096, "cpu", block_n=64)
    assert splits > 1 and per_split % 64 == 0 and splits * per_split >= 4096 > (splits - 1) * per_split
    assert per_split >= launch.MIN_TOKENS_PER_SPLIT
    assert launch.choose_num_splits(64, 8, 4096, "cpu") == (1, 4096)  # enough programs already
    assert launch.choose_num_splits(1, 1, 300, "cpu") == (1, 300)  # too short to be worth it


@needs_kernels
def test_auto_split_path_matches_reference():
    lens = [1100]
    splits, _ = launch.choose_num_splits(1, 1, lens[0], DEVICE)
    assert splits > 1
    out, ref, _ = decode_case(lens, 4, 1, 64, 32, torch.float32, seed=3)
    assert_close_to(out, ref, torch.float32)


# -- prefill ------------------------------------------------------------------------------------

def prefill_case(lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables, seq_lens = make_pool(lens, num_kv_heads, head_dim, block_size, dtype, gen)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
    ref = reference.paged_prefill_attention_ref(cpu64(q), cpu64(k_cache), cpu64(v_cache), block_tables.cpu(),
                                                seq_lens.cpu(), cu)
    q, cu = q.to(DEVICE), cu.to(DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu, out=out)
    return out, ref


PREFILL_CASES = [  # dtype, head_dim, heads, block_size: every block size, every head dim in float32
    (torch.float32, 64, (4, 4), 8), (torch.float32, 80, (5, 1), 16), (torch.float32, 96, (6, 2), 32),
    (torch.float32, 128, (4, 2), 64), (torch.float32, 256, (2, 1), 128),
    (torch.float16, 96, (8, 2), 32), (torch.float16, 128, (6, 2), 16), (torch.float16, 64, (4, 1), 128),
    (torch.bfloat16, 64, (8, 2), 16), (torch.bfloat16, 256, (4, 1), 8), (torch.bfloat16, 80, (5, 1), 64),
]


@needs_kernels
@pytest.mark.parametrize("dtype,head_dim,heads,block_size", PREFILL_CASES)
def test_prefill_matches_reference(dtype, head_dim, heads, block_size):
    bs = block_size
    # whole prompts (q_len == seq_len), chunks after cached tokens, a single query, an idle sequence
    lens = [1, bs, bs + 1, 2 * bs + 3, 3 * bs, 2 * bs - 1]
    q_lens = [1, bs, 5, bs + 2, 1, 0]
    out, ref = prefill_case(lens, q_lens, *heads, head_dim, bs, dtype, seed=head_dim + bs)
    assert_close_to(out, ref, dtype)


@needs_kernels
def test_prefill_of_one_query_equals_decode():
    gen = torch.Generator().manual_seed(8)
    k_cache, v_cache, block_tables, seq_lens = make_pool([7, 16, 30], 2, 64, 8, torch.float32, gen)
    q = torch.randn(3, 6, 64, generator=gen).to(DEVICE)
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)
    pre = paged_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu)
    dec = paged_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    torch.testing.assert_close(pre, dec, atol=1e-6, rtol=1e-6)


# -- the compiled path's arithmetic (no upcast, tensor-core tiles), checked in the interpreter -----

@needs_kernels
@pytest.mark.parametrize("capability,dtype", [((8, 0), torch.float16), ((7, 5), torch.bfloat16)])
def test_compiled_launch_settings_in_the_interpreter(monkeypatch, capability, dtype):
    """The tiles a GPU gets (tensor-core path on sm80, FMA path on a T4), run by the interpreter.

    sm80 float16 keeps 16-bit tiles for tl.dot; a T4 upcasts bfloat16 loads to float32 with
    small tiles. Both must match the reference, with and without split-K, and in prefill.
    """
    monkeypatch.setattr(launch, "launch_capability", lambda: capability)
    monkeypatch.setattr(launch, "_group_tile", lambda g: max(16, launch._next_pow2(g)))
    settings = launch.launch_settings("decode", dtype, 80, capability)
    assert settings.upcast is (capability < (8, 0)) and settings.block_d == 128
    for splits in (1, 3):
        out, ref, _ = decode_case([1, 17, 150], 10, 2, 80, 16, dtype, seed=splits, num_splits=splits)
        assert_close_to(out, ref, dtype)
    out, ref = prefill_case([9, 40], [9, 20], 8, 2, 64, 16, dtype, seed=4)
    assert_close_to(out, ref, dtype)


@needs_kernels
def test_merge_reads_many_splits_in_chunks():
    """More splits than the merge kernel's tile (MERGE_BLOCK_K): the running maximum carries across chunks."""
    splits = 2 * launch.MERGE_BLOCK_K + 3
    out, ref, _ = decode_case([1, splits * 4, 97], 4, 2, 64, 8, torch.float32, seed=12, num_splits=splits)
    assert_close_to(out, ref, torch.float32)


# -- write_kv -----------------------------------------------------------------------------------

def guarded_cache(num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator,
                  device: torch.device | str = DEVICE):
    """A random cache that is a view into a buffer with one NaN guard block on each side.

    A write to slot -1 (block -1, offset block_size - 1) or past the last slot lands in a
    guard, where it shows up as a non-NaN value instead of silently corrupting memory.
    """
    buf = torch.full((num_blocks + 2, block_size, hkv, d), float("nan"), dtype=dtype)
    buf[1:-1] = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    buf = buf.to(device)
    return buf, buf[1:-1]


def assert_guards_untouched(buf: torch.Tensor) -> None:
    assert buf[0].isnan().all() and buf[-1].isnan().all(), "write_kv wrote outside the cache"


@needs_kernels
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_matches_reference(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, hkv, d = 6, 8, 3, 80
    k_buf, k_cache = guarded_cache(num_blocks, block_size, hkv, d, dtype, gen)
    v_buf, v_cache = guarded_cache(num_blocks, block_size, hkv, d, dtype, gen)
    last = num_blocks * block_size - 1
    # The first and the last slot (the guards' neighbours), random ones between, two skipped tokens.
    slots = torch.cat([torch.tensor([0, last]), 1 + torch.randperm(last - 1, generator=gen)[:8]])
    slots = slots[torch.randperm(10, generator=gen)]
    slots[[2, 7]] = -1
    k = torch.randn(10, hkv, d, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(10, hkv, d, generator=gen).to(dtype).to(DEVICE)
    slots = slots.to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv_ref(k, v, k_ref, v_ref, slots.to(slot_dtype))
    paged_attention.write_kv(k, v, k_cache, v_cache, slots.to(slot_dtype))
    assert_guards_untouched(k_buf)
    assert_guards_untouched(v_buf)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # a copy: bit-exact
    flat = k_cache.reshape(-1, hkv, d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], k[t])


# -- strided inputs: the wrappers must hand the kernels what they assume -------------------------

def spread(t: torch.Tensor, dim: int, fill: int) -> torch.Tensor:
    """The same values as ``t``, as a view with stride 2 along ``dim`` (the gaps hold ``fill``)."""
    shape = list(t.shape)
    shape[dim] *= 2
    wide = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    index = [slice(None)] * t.dim()
    index[dim] = slice(None, None, 2)
    wide[tuple(index)] = t
    view = wide[tuple(index)]
    assert torch.equal(view, t) and not view.is_contiguous()
    return view


@needs_kernels
def test_decode_and_prefill_with_strided_index_tensors_and_views():
    gen = torch.Generator().manual_seed(31)
    lens, q_lens, bs = [3, 17, 40], [3, 5, 1], 8
    k_cache, v_cache, block_tables, seq_lens = make_pool(lens, 2, 64, bs, torch.float32, gen)
    # The caches as a view into a pool with more KV heads: strides differ, head_dim stays dense.
    k_wide = torch.randn(*k_cache.shape[:2], 5, 64, generator=gen).to(DEVICE)
    v_wide = torch.randn(*v_cache.shape[:2], 5, 64, generator=gen).to(DEVICE)
    k_wide[:, :, 1:3], v_wide[:, :, 1:3] = k_cache, v_cache
    k_view, v_view = k_wide[:, :, 1:3], v_wide[:, :, 1:3]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    # Strided block tables (a column slice and a row slice), lengths and cumulative query counts.
    tables = spread(spread(block_tables, 1, 10**6), 0, 10**6)
    lens_view, cu_view = spread(seq_lens, 0, 0), spread(cu, 0, 10**6)
    q = torch.randn(len(lens), 64, 4, generator=gen).to(DEVICE).transpose(1, 2)  # [num_seqs, 4, 64], stride(-1) = 4
    ref = reference.paged_decode_attention_ref(cpu64(q), cpu64(k_cache), cpu64(v_cache), block_tables.cpu(),
                                               seq_lens.cpu())
    out = paged_attention.paged_decode_attention(q, k_view, v_view, tables, lens_view)
    assert_close_to(out, ref, torch.float32)
    qp = torch.randn(int(cu[-1]), 64, 4, generator=gen).to(DEVICE).transpose(1, 2)
    ref = reference.paged_prefill_attention_ref(cpu64(qp), cpu64(k_cache), cpu64(v_cache), block_tables.cpu(),
                                                seq_lens.cpu(), cu.cpu())
    out = paged_attention.paged_prefill_attention(qp, k_view, v_view, tables, lens_view, cu_view)
    assert_close_to(out, ref, torch.float32)


@needs_kernels
def test_write_kv_with_strided_inputs_and_a_cache_view():
    gen = torch.Generator().manual_seed(32)
    num_blocks, bs, hkv, d = 5, 8, 2, 64
    k_buf, k_cache = guarded_cache(num_blocks, bs, hkv, d, torch.float32, gen)
    v_buf, v_cache = guarded_cache(num_blocks, bs, hkv, d, torch.float32, gen)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:7]
    slots[3] = -1
    slots = slots.to(DEVICE)
    k = torch.randn(7, d, hkv, generator=gen).to(DEVICE).transpose(1, 2)  # head_dim not dense: stride(-1) = 2
    v = torch.randn(7, d, hkv, generator=gen).to(DEVICE).transpose(1, 2)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv_ref(k, v, k_ref, v_ref, slots)
    paged_attention.write_kv(k, v, k_cache, v_cache, spread(slots, 0, 0))  # gaps of slot 0: read wrongly, they'd clash
    assert_guards_untouched(k_buf)
    assert_guards_untouched(v_buf)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@needs_kernels
def test_write_then_attend_round_trip():
    """Write a sequence's K/V through slot mappings of a shuffled table, then attend: same as contiguous."""
    gen = torch.Generator().manual_seed(21)
    n, bs, hq, hkv, d = 29, 8, 4, 2, 64
    k = torch.randn(n, hkv, d, generator=gen)
    v = torch.randn(n, hkv, d, generator=gen)
    q = torch.randn(n, hq, d, generator=gen)
    expected = causal_attention(q[None].double(), k[None].double(), v[None].double())[0]
    k, v, q = k.to(DEVICE), v.to(DEVICE), q.to(DEVICE)
    k_cache = torch.full((6, bs, hkv, d), float("nan"), device=DEVICE)
    v_cache = torch.full((6, bs, hkv, d), float("nan"), device=DEVICE)
    table = torch.tensor([4, 0, 5, 2], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(n)], device=DEVICE)
    paged_attention.write_kv(k, v, k_cache, v_cache, slots)
    out = paged_attention.paged_prefill_attention(q, k_cache, v_cache, table[None],
                                                  torch.tensor([n], dtype=torch.int32, device=DEVICE),
                                                  torch.tensor([0, n], dtype=torch.int32, device=DEVICE))
    torch.testing.assert_close(cpu64(out), expected, atol=2e-5, rtol=1e-5)


# -- falling back to the reference ----------------------------------------------------------------

def pretend_runtime(monkeypatch, runtime: Runtime) -> None:
    """What labkit decided about the machine, replaced where the kernels read it: the fallback and the launches."""
    monkeypatch.setattr(fallback, "RUNTIME", runtime)
    monkeypatch.setattr(launch, "RUNTIME", runtime)


def test_fallback_runs_the_reference(monkeypatch):
    pretend_runtime(monkeypatch, Runtime(torch.device("cpu"), "unavailable", "testing the fallback"))
    assert "testing the fallback" in fallback.fallback_reason(torch.float32, "cpu")

    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton launcher ran although the kernels cannot run")

    for name in ("decode_triton", "prefill_triton", "write_kv_triton"):
        monkeypatch.setattr(launch, name, no_triton)
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, block_tables, seq_lens = make_pool([3, 9], 1, 64, 8, torch.float32, gen, device="cpu")
    q = torch.randn(2, 2, 64, generator=gen)
    monkeypatch.setattr(fallback, "_warned", set())
    with pytest.warns(RuntimeWarning, match="reference instead of Triton: .*testing the fallback"):
        out = paged_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    assert torch.equal(out, reference.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens))
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = paged_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu)
    assert not out.isnan().any()
    paged_attention.write_kv(q[:, :1], q[:, :1], k_cache, v_cache, torch.tensor([0, -1]))
    assert torch.equal(k_cache[0, 0], q[0, :1])


def pretend_compiled(monkeypatch, broken: list[str]) -> list[str]:
    """A compiled runtime whose Triton launchers in ``broken`` raise; CPU tensors stand in for CUDA ones."""
    pretend_runtime(monkeypatch, Runtime(torch.device("cpu"), "compiled", "pretend GPU", (9, 0)))
    monkeypatch.setattr(fallback, "fallback_reason", lambda dtype, device: None)
    monkeypatch.setattr(fallback, "_warned", set())
    monkeypatch.setattr(fallback, "failed_launches", {})
    calls: list[str] = []

    def make(name):
        def launcher(*args, **kwargs):
            calls.append(name)
            raise RuntimeError(f"{name}: sm_999 is not supported by this Triton")
        return launcher

    for name in broken:
        monkeypatch.setattr(launch, name, make(name))
    return calls


def test_failed_launch_on_a_gpu_warns_once_and_runs_the_reference(monkeypatch):
    calls = pretend_compiled(monkeypatch, ["decode_triton", "prefill_triton", "write_kv_triton"])
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache, block_tables, seq_lens = make_pool([3, 9], 1, 64, 8, torch.float32, gen, device="cpu")
    q = torch.randn(2, 2, 64, generator=gen)
    out = torch.full_like(q, float("nan"))
    with pytest.warns(RuntimeWarning, match=r"paged_decode_attention kernel failed to compile or launch for "
                                            r"torch.float32, head_dim 64 \(RuntimeError: decode_triton: sm_999"):
        got = paged_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out=out)
    assert got is out
    assert torch.equal(out, reference.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call neither warns again nor retries the launch
        again = paged_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    assert torch.equal(again, out) and calls == ["decode_triton"]

    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.warns(RuntimeWarning, match=r"paged_prefill_attention kernel failed .*prefill_triton: sm_999"):
        out = paged_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu)
    assert torch.equal(out, reference.paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, cu))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    new_k, new_v, slots = q[:, :1] + 1, q[:, :1] - 1, torch.tensor([5, -1])
    reference.write_kv_ref(new_k, new_v, k_ref, v_ref, slots)
    with pytest.warns(RuntimeWarning, match=r"write_kv kernel failed .*write_kv_triton: sm_999"):
        paged_attention.write_kv(new_k, new_v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)  # the pool's free slots hold NaN
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)


@pytest.mark.skipif(labkit.RUNTIME.triton_mode != "interpreter", reason="interpreter only")
def test_failed_launch_in_the_interpreter_is_an_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the kernel")

    monkeypatch.setattr(launch, "decode_triton", broken)
    args = _decode_args()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no silent fallback either
        with pytest.raises(RuntimeError, match="a bug in the kernel"):
            paged_attention.paged_decode_attention(**args)


@pytest.mark.skipif(labkit.RUNTIME.triton_mode != "compiled" or labkit.DEVICE.type != "cuda",
                    reason="needs a CUDA GPU on which Triton compiles")
def test_compiled_kernels_run_on_the_gpu_without_falling_back():
    """On a GPU the tests above must exercise the compiled kernels, not compare the reference with itself."""
    dtypes = [torch.float16, torch.float32] + ([torch.bfloat16] if labkit.RUNTIME.bf16_supported else [])
    for dtype in dtypes:
        assert fallback.fallback_reason(dtype, DEVICE) is None, dtype
    assert fallback.fallback_reason(torch.float32, "cpu") is not None  # CPU tensors would fall back
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed compile or launch warns and falls back: make it fail here
        for dtype in dtypes:
            out, ref, args = decode_case([1, 17, 300], 8, 2, 128, 16, dtype, seed=9)
            assert out.device.type == "cuda" and all(t.device.type == "cuda" for t in args)
            assert_close_to(out, ref, dtype)
            out, ref = prefill_case([9, 40], [9, 20], 8, 2, 128, 16, dtype, seed=10)
            assert out.device.type == "cuda"
            assert_close_to(out, ref, dtype)
    assert not fallback.failed_launches, fallback.failed_launches  # noqa: SLF001 - none so far in this process


@pytest.mark.skipif(labkit.RUNTIME.triton_mode != "interpreter", reason="interpreter only")
def test_fallback_reason_in_the_interpreter():
    assert fallback.fallback_reason(torch.float32, "cpu") is None
    assert "CPU tensors" in fallback.fallback_reason(torch.float32, "cuda")


# -- bad input ----------------------------------------------------------------------------------

def _decode_args():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, block_tables, seq_lens = make_pool([5, 12], 2, 64, 8, torch.float32, gen, device="cpu")
    q = torch.randn(2, 4, 64, generator=gen)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)


# (argument to replace, how, the message it must raise). Each pattern names the argument at fault.
BAD_DECODE = [
    # q in float16 against float32 caches: the caches are checked against q, and the message names both.
    ("q", lambda a: a["q"].half(), r"k_cache dtype \(torch.float32\) must equal q's dtype \(torch.float16\)"),
    ("q", lambda a: a["q"][0], r"^q must have 3 dimensions"),
    ("q", lambda a: a["q"].double(), r"^q must have dtype in"),
    ("q", lambda a: a["q"][..., :32], r"^q head_dim must equal k_cache head_dim 64"),
    ("q", lambda a: a["q"][:, :3], r"q num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
    ("k_cache", lambda a: a["k_cache"][0], r"^k_cache must have 4 dimensions"),
    ("k_cache", lambda a: a["k_cache"].int(), r"^k_cache must have dtype in"),
    # A k_cache that disagrees with v_cache: v_cache is checked against k_cache, so v_cache is named
    # (the pair is inconsistent; the message shows k_cache's shape or strides next to v_cache's).
    ("k_cache", lambda a: a["k_cache"][..., :32], r"^v_cache must have the shape of k_cache \(6, 8, 2, 32\)"),
    ("k_cache", lambda a: a["k_cache"].transpose(-1, -2).contiguous().transpose(-1, -2),
     r"^v_cache must have the strides of k_cache"),
    ("v_cache", lambda a: a["v_cache"][:2], r"^v_cache must have the shape of k_cache"),
    ("v_cache", lambda a: a["v_cache"].transpose(0, 1).contiguous().transpose(0, 1),
     r"^v_cache must have the strides of k_cache"),
    ("v_cache", lambda a: a["v_cache"].to("meta"), r"^v_cache must be on q's device \(cpu\), got meta"),
    ("block_tables", lambda a: a["block_tables"].long(), r"^block_tables must have dtype in \(int32\)"),
    ("block_tables", lambda a: a["block_tables"][:1], r"^block_tables and seq_lens must have num_seqs=2 rows"),
    ("block_tables", lambda a: a["block_tables"].clone().fill_(99), r"^block_tables entries in use must be block ids"),
    ("block_tables", lambda a: a["block_tables"].clone().fill_(-1), r"^block_tables entries in use must be block ids"),
    ("block_tables", lambda a: a["block_tables"].to("meta"), r"^block_tables must be on q's device \(cpu\), got meta"),
    ("seq_lens", lambda a: torch.tensor([0, 3], dtype=torch.int32), r"^seq_lens must lie in \[1, 24\]"),
    ("seq_lens", lambda a: torch.tensor([5, 10**4], dtype=torch.int32), r"^seq_lens must lie in \[1, 24\]"),
    ("seq_lens", lambda a: a["seq_lens"].float(), r"^seq_lens must have dtype in \(int32\)"),
    ("seq_lens", lambda a: a["seq_lens"].to("meta"), r"^seq_lens must be on q's device \(cpu\), got meta"),
    ("scale", lambda a: -1.0, r"^scale must be None or a finite number > 0, got -1.0"),
    ("scale", lambda a: float("nan"), r"^scale must be None or a finite number > 0, got nan"),
    ("scale", lambda a: True, r"^scale must be None or a finite number > 0, got True"),
    ("out", lambda a: torch.empty(3, 4, 64), r"^out must be None or a tensor shaped like q \(2, 4, 64\)"),
    ("out", lambda a: torch.empty(2, 64, 4).transpose(1, 2), r"^out must be contiguous in head_dim"),
]


@pytest.mark.parametrize("key,make_bad,match", BAD_DECODE)
def test_decode_rejects_bad_input(key, make_bad, match):
    args = _decode_args()
    args[key] = make_bad(args)
    with pytest.raises(ValueError, match=match):
        paged_attention.paged_decode_attention(**args)


def test_decode_rejects_q_on_another_device_naming_the_caches():
    """A meta q: the caches are checked against q, so the message names k_cache and q's device."""
    args = _decode_args()
    args["q"] = args["q"].to("meta")
    with pytest.raises(ValueError, match=r"^k_cache must be on q's device \(meta\), got cpu"):
        paged_attention.paged_decode_attention(**args)


def test_caches_must_be_dense_in_head_dim():
    args = _decode_args()
    for name in ("k_cache", "v_cache"):
        args[name] = args[name].transpose(-1, -2).contiguous().transpose(-1, -2)  # same strides, stride(-1) = 8
    with pytest.raises(ValueError, match=r"^k_cache must be contiguous in head_dim"):
        paged_attention.paged_decode_attention(**args)


BAD_PREFILL = [
    ("cu_seqlens_q", torch.tensor([0, 1], dtype=torch.int32)),  # wrong number of sequences
    ("cu_seqlens_q", torch.tensor([1, 2, 4], dtype=torch.int32)),  # does not start at 0
    ("cu_seqlens_q", torch.tensor([0, 3, 2], dtype=torch.int32)),  # decreases / wrong total
    ("cu_seqlens_q", torch.tensor([0, 1, 4], dtype=torch.int64)),
    ("cu_seqlens_q", torch.tensor([0, 3, 9], dtype=torch.int32)),  # total != q rows
    ("cu_seqlens_q", torch.tensor([0, 1, 4], dtype=torch.int32, device="meta")),
]


@pytest.mark.parametrize("name,cu", BAD_PREFILL)
def test_prefill_rejects_bad_input(name, cu):
    args = _decode_args()
    q = torch.randn(4, 4, 64)
    with pytest.raises(ValueError, match=rf"^{name} must"):
        paged_attention.paged_prefill_attention(q, args["k_cache"], args["v_cache"], args["block_tables"],
                                                args["seq_lens"], cu)


def test_prefill_rejects_more_queries_than_positions():
    args = _decode_args()  # seq_lens [5, 12]
    q = torch.randn(8, 4, 64)
    with pytest.raises(ValueError, match=r"query count \(from cu_seqlens_q\) must be <= its seq_lens entry"):
        paged_attention.paged_prefill_attention(q, args["k_cache"], args["v_cache"], args["block_tables"],
                                                args["seq_lens"], torch.tensor([0, 6, 8], dtype=torch.int32))


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(slot_mapping=torch.tensor([0, 10**5])), r"^slot_mapping entries must be -1 \(skip\) or slots in \[0, 31\]"),
    (lambda a: a.update(slot_mapping=torch.tensor([-2, 1])), r"^slot_mapping entries must be -1"),
    (lambda a: a.update(slot_mapping=torch.tensor([3, 3])), r"^slot_mapping must not send two tokens to the same slot"),
    (lambda a: a.update(slot_mapping=torch.tensor([1, 2, 3])), r"^slot_mapping must have num_tokens=2 entries"),
    (lambda a: a.update(slot_mapping=torch.tensor([1.0, 2.0])), r"^slot_mapping must have dtype in"),
    (lambda a: a.update(slot_mapping=torch.tensor([0, 1], device="meta")), r"^slot_mapping must be on k's device"),
    (lambda a: a.update(k_cache=a["k_cache"].half()), r"^k_cache dtype \(torch.float16\) must equal k's dtype"),
    (lambda a: a.update(v_cache=a["v_cache"].half()), r"^v_cache dtype \(torch.float16\) must equal k's dtype"),
    (lambda a: a.update(v=a["v"][:1]), r"^v must match k's shape"),
    (lambda a: a.update(v=a["v"].to("meta")), r"^v must be on k's device"),
    (lambda a: a.update(k=a["k"][:, :1], v=a["v"][:, :1]), r"^k must be \[num_tokens, 2, 64\] to match k_cache"),
])
def test_write_kv_rejects_bad_input_and_changes_nothing(change, match):
    args = dict(k=torch.randn(2, 2, 64), v=torch.randn(2, 2, 64), k_cache=torch.zeros(4, 8, 2, 64),
                v_cache=torch.zeros(4, 8, 2, 64), slot_mapping=torch.tensor([0, 1]))
    k_cache, v_cache = args["k_cache"], args["v_cache"]
    change(args)
    with pytest.raises(ValueError, match=match):
        paged_attention.write_kv(**args)
    assert not k_cache.any() and not v_cache.any()


def test_gather_kv_reads_blocks_in_table_order():
    cache = torch.arange(5 * 4, dtype=torch.float32).view(5, 4, 1, 1)  # slot s holds the number s
    got = reference.gather_kv(cache, torch.tensor([3, 0, 4], dtype=torch.int32), 10).flatten()
    assert got.tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 16, 17]
    assert math.isclose(float(got.sum()), sum([12, 13, 14, 15, 0, 1, 2, 3, 16, 17]))
