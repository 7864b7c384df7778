"""NaN and inf in a quantized KV cache (issue 38): the Triton write kernel and its reference store them
alike, bit for bit, as ``labkit.memory.formats``' "Non-finite values" says, and spoil nothing else.

The property, for every ``kv_cache_dtype`` (element × scale placement) and a few seeds: ragged sequences
in shuffled blocks are written in three passes (most of each, one token each, the rest); in the middle
pass one token has NaN, +inf and -inf at random elements of its K and V (one head of it wholly
non-finite). Then

* kernel and reference hold the same bytes (codes and scales) after every pass;
* right after it is written, each non-finite element holds its documented code (int: NaN 0, ±inf
  ±qmax; fp8: NaN the NaN 0x7F, ±inf ±448);
* every other element's code, every scale, and so every other value read back, is exactly what a run
  gives whose bad elements are 0 instead: a NaN or inf reaches no other element, in its block or not;
* nothing read back is NaN or infinite, but the fp8 NaNs themselves.

Then the issue's two repros as it states them, and fp8's NaN read back as NaN by the decode kernel.
Shapes are tiny: Triton's interpreter is slow.
"""

from __future__ import annotations

import math

import pytest
import torch

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.kernels import fallback, paged_attention, reference
from labkit.memory import formats

SCHEMES = formats.KV_CACHE_DTYPES[1:]
HEADS, BLOCK_SIZE = 2, 4
needs_kernels = pytest.mark.skipif(fallback.fallback_reason(torch.float32, "cpu") is not None,
                                   reason="Triton's kernels cannot run on CPU tensors here")


def head_dim(q: formats.KVQuant) -> int:
    """Two scale groups, the second partial, per group; 8 elements otherwise."""
    return 40 if q.scales == "group" else 8


def empty_pools(q: formats.KVQuant, num_blocks: int, gen: torch.Generator) -> list[torch.Tensor]:
    """K's and V's codes and scales: [k_cache, v_cache, k_scale, v_scale]. Per tensor, calibrated scales
    that some values exceed (they saturate)."""
    (kc, ks), (vc, vs) = (q.empty_pool(num_blocks, BLOCK_SIZE, HEADS, head_dim(q)) for _ in range(2))
    if q.scales == "tensor":
        ks.fill_(float(torch.rand((), generator=gen)) * 0.02 + 0.005)
        vs.fill_(float(torch.rand((), generator=gen)) * 0.02 + 0.005)
    return [kc, vc, ks, vs]


def workload(q: formats.KVQuant, seed: int):
    """Three passes of (k, v, slot_mapping) over ragged sequences in shuffled blocks, the middle one
    with one bad token; the bad elements' mask; and the pools' block count."""
    gen = torch.Generator().manual_seed(seed)
    lens = [int(torch.randint(3, 11, (), generator=gen)) for _ in range(3)]
    used = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(used) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    cut = [int(torch.randint(1, n - 1, (), generator=gen)) for n in lens]  # pass 1: positions < cut
    passes = [([], []) for _ in range(3)]
    taken = 0
    for n, u, c in zip(lens, used, cut):
        ids = perm[taken: taken + u]
        taken += u
        slots = ids[torch.arange(n) // BLOCK_SIZE] * BLOCK_SIZE + torch.arange(n) % BLOCK_SIZE
        for p, part in enumerate((slots[:c], slots[c: c + 1], slots[c + 1:])):
            passes[p][0].append(part)
    out = []
    for slots, _ in passes:
        slot_mapping = torch.cat(slots)
        order = torch.randperm(len(slot_mapping), generator=gen)  # tokens in any order
        size = (len(slot_mapping), HEADS, head_dim(q))
        out.append([torch.randn(size, generator=gen) * 2, torch.randn(size, generator=gen), slot_mapping[order]])
    k, v, _ = out[1]
    bad_token = int(torch.randint(0, len(k), (), generator=gen))
    bad = torch.zeros(2, *k.shape, dtype=torch.bool)  # [K or V, token, head, element]
    bad[:, bad_token] = torch.rand(2, HEADS, head_dim(q), generator=gen) < 0.3
    bad[int(torch.randint(0, 2, (), generator=gen)), bad_token, int(torch.randint(0, HEADS, (), generator=gen))] = True
    kinds = torch.tensor([math.nan, math.inf, -math.inf])[torch.randint(0, 3, bad.shape, generator=gen)]
    for i, x in enumerate((k, v)):
        x[bad[i]] = kinds[i][bad[i]]
    return out, bad, num_blocks, gen


def clean(passes, bad):
    """The same passes, the bad elements 0."""
    k, v, slots = passes[1]
    return [passes[0], [k.masked_fill(bad[0], 0.0), v.masked_fill(bad[1], 0.0), slots], passes[2]]


def run(write, name, passes, pools, after=None):
    """Write the passes into (copies of) ``pools``; ``after(pools)`` after the middle pass."""
    pools = [t.clone() for t in pools]
    kc, vc, ks, vs = pools
    for i, (k, v, slots) in enumerate(passes):
        write(k, v, kc, vc, slots, kv_cache_dtype=name, k_scale=ks, v_scale=vs)
        if i == 1 and after is not None:
            after([t.clone() for t in pools])
    return pools


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def codes_of(q, data: torch.Tensor) -> torch.Tensor:
    """One code per element, as comparable integers (fp8: its bits)."""
    if q.element == "fp8":
        return bits(data).to(torch.int16)
    return (formats.unpack_int4(data) if q.element == "int4" else data).to(torch.int16)


def element_codes(q, pools, slots) -> torch.Tensor:
    """The codes of the tokens at ``slots``: [K or V, token, head, element]."""
    bs = BLOCK_SIZE
    return torch.stack([codes_of(q, pools[i])[slots // bs, slots % bs] for i in (0, 1)])


def documented(q, values: torch.Tensor) -> torch.Tensor:
    """The codes a NaN or ±inf is stored as, by the module's "Non-finite values"."""
    if q.element == "fp8":
        nan = torch.full_like(values, 0x7F, dtype=torch.int16)
        sat = bits(torch.where(values > 0, 448.0, -448.0).to(torch.float8_e4m3fn)).to(torch.int16)
        return torch.where(values.isnan(), nan, sat)
    qmax = int(q.qmax)
    return torch.where(values.isnan(), 0, torch.where(values > 0, qmax, -qmax)).to(torch.int16)


@needs_kernels
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", SCHEMES)
def test_non_finite_values_are_stored_as_documented_and_spoil_nothing(name, seed):
    q = formats.kv_quant(name)
    passes, bad, num_blocks, gen = workload(q, seed + 10 * SCHEMES.index(name))
    pools = empty_pools(q, num_blocks, gen)
    middle = {}
    ours = run(paged_attention.write_kv, name, passes, pools, after=lambda p: middle.setdefault("kernel", p))
    theirs = run(reference.write_kv_ref, name, passes, pools, after=lambda p: middle.setdefault("reference", p))
    baseline = run(reference.write_kv_ref, name, clean(passes, bad), pools)

    for a, b in zip(middle["kernel"] + ours, middle["reference"] + theirs):  # kernel == reference, bit for bit
        assert torch.equal(bits(a), bits(b)), name
    slots = passes[1][2].long()
    values = torch.stack(passes[1][:2])
    got = element_codes(q, middle["reference"], slots)
    assert torch.equal(got[bad], documented(q, values[bad])), "a NaN or inf was not stored as documented"

    for i in (2, 3):  # every scale as without the bad elements
        assert torch.equal(bits(theirs[i]), bits(baseline[i])), "a NaN or inf changed a scale"
    every = torch.arange(num_blocks * BLOCK_SIZE)
    ok = torch.ones(2, len(every), HEADS, head_dim(q), dtype=torch.bool)
    ok[:, slots] = ~bad  # every element but the bad ones
    final = element_codes(q, theirs, every)
    assert torch.equal(final[ok], element_codes(q, baseline, every)[ok]), "a NaN or inf spoiled another element"
    read = torch.stack([formats.dequantize_pool(theirs[i], theirs[i + 2], q).reshape(-1, HEADS, head_dim(q))
                        for i in (0, 1)])
    want = torch.stack([formats.dequantize_pool(baseline[i], baseline[i + 2], q).reshape(-1, HEADS, head_dim(q))
                        for i in (0, 1)])
    assert torch.equal(read[ok], want[ok])
    fp8_nan = torch.zeros_like(ok)
    if q.element == "fp8":
        fp8_nan[:, slots] = bad & values.isnan()
    assert read[~fp8_nan].isfinite().all() and read[fp8_nan].isnan().all()


# -- the repros, as it states them ---------------------------------------------------------

def write_both(name: str, tokens: list[torch.Tensor], slots: list[int], scale: float = 1.0):
    """Each token [1, D] written on its own into one block of a fresh one-head pool, by the kernel and by
    the reference: their (k_cache, k_scale) after the writes. Per tensor, ``scale`` is the fixed scale."""
    q = formats.kv_quant(name)
    out = []
    for write in (paged_attention.write_kv, reference.write_kv_ref):
        (kc, ks), (vc, vs) = (q.empty_pool(2, 8, 1, tokens[0].shape[-1]) for _ in range(2))
        if q.scales == "tensor":
            ks.fill_(scale)
            vs.fill_(scale)
        for x, slot in zip(tokens, slots):
            write(x[None], x[None].clone(), kc, vc, torch.tensor([slot]), kv_cache_dtype=name, k_scale=ks, v_scale=vs)
        out.append((kc, ks))
    return q, out


@needs_kernels
@pytest.mark.parametrize("name", ["int8_per_tensor", "fp8_per_tensor", "int8_per_block"])
def test_one_nan_in_a_token_is_stored_alike_by_kernel_and_reference(name):
    """The issue's bug 1: int8 per tensor, the kernel stored -qmax × scale; fp8 per tensor, -3.0 where the
    reference kept NaN; int8 per block, the reference turned the whole block NaN, earlier tokens too."""
    gen = torch.Generator().manual_seed(3)
    earlier = torch.randn(2, 1, 8, generator=gen)
    token = torch.randn(1, 8, generator=gen) * 0.5
    token[0, 5] = math.nan
    q, ((kc, ks), (rc, rs)) = write_both(name, [earlier[0], earlier[1], token], [0, 1, 2], scale=0.025)
    assert torch.equal(bits(kc), bits(rc)) and torch.equal(ks, rs), "kernel and reference disagree on NaN"
    back = formats.dequantize_pool(rc, rs, q)[0, :, 0]
    assert back[2, 5].isnan() if q.element == "fp8" else back[2, 5] == 0.0
    _, ((_, _), (clean_codes, clean_scale)) = write_both(name, [earlier[0], earlier[1], token.nan_to_num(0.0)],
                                                         [0, 1, 2], scale=0.025)
    assert torch.equal(rs, clean_scale)
    want = formats.dequantize_pool(clean_codes, clean_scale, q)[0, :, 0]
    assert torch.equal(back[:2], want[:2]), "the earlier tokens of the block changed"
    assert back[:2].isfinite().all()


@needs_kernels
@pytest.mark.parametrize("name", ["int8_per_block", "fp8_per_block", "int4_per_block"])
def test_an_inf_after_three_finite_tokens_leaves_the_block_finite(name):
    """The issue's bug 2: three finite tokens in a block, then a token with one inf. The scale became inf,
    every finite element of the block was lost, and every later write into it was NaN (0 × inf)."""
    gen = torch.Generator().manual_seed(4)
    finite = list(torch.randn(3, 1, 8, generator=gen))
    with_inf = torch.randn(1, 8, generator=gen) * 0.1  # its finite elements below the block's largest
    with_inf[0, 2] = math.inf
    later = torch.randn(1, 8, generator=gen)
    q, (_, (codes, scale)) = write_both(name, finite, [0, 1, 2])
    before = formats.dequantize_pool(codes, scale, q)[0, :3, 0]
    assert with_inf.nan_to_num(posinf=0.0).abs().max() < before.abs().max()

    q, ((kc, ks), (rc, rs)) = write_both(name, finite + [with_inf], [0, 1, 2, 3])
    assert torch.equal(bits(kc), bits(rc)) and torch.equal(ks, rs), "kernel and reference disagree on inf"
    assert torch.equal(rs, scale), f"the inf changed the block's scale to {rs[0].tolist()}"
    back = formats.dequantize_pool(rc, rs, q)[0, :4, 0]
    assert torch.equal(back[:3], before), "the earlier tokens of the block changed"
    assert back[3, 2] == q.qmax * rs[0, 0], "an inf saturates to the largest code"

    q, ((kc, ks), (rc, rs)) = write_both(name, finite + [with_inf, later], [0, 1, 2, 3, 4])
    assert torch.equal(bits(kc), bits(rc)) and torch.equal(ks, rs)
    assert rs.isfinite().all() and formats.dequantize_pool(rc, rs, q)[0, :5].isfinite().all(), \
        "a later write into the block was lost"


@needs_kernels
def test_fp8_nan_reads_back_as_nan_in_the_decode_kernel():
    """e4m3fn's NaN (0x7F) is NaN to attention, in the kernel as in the reference: the interpreter read it
    as 480. The sequence that holds it gets NaN; the other one does not notice."""
    name = "fp8_per_tensor"  # a fixed scale: only the NaN element is NaN
    q = formats.kv_quant(name)
    gen = torch.Generator().manual_seed(5)
    (kc, ks), (vc, vs) = (q.empty_pool(2, 4, 1, 8) for _ in range(2))
    ks.fill_(0.05)
    k, v = torch.randn(8, 1, 8, generator=gen), torch.randn(8, 1, 8, generator=gen)
    k[1, 0, 3] = math.nan  # sequence 0: slots 0..3 (block 0); sequence 1: block 1
    reference.write_kv_ref(k, v, kc, vc, torch.arange(8), kv_cache_dtype=name, k_scale=ks, v_scale=vs)
    query = torch.randn(2, 2, 8, generator=gen)
    tables, lens = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([4, 4], dtype=torch.int32)
    kw = dict(kv_cache_dtype=name, k_scale=ks, v_scale=vs)
    got = paged_attention.paged_decode_attention(query, kc, vc, tables, lens, **kw)
    want = reference.paged_decode_attention_ref(query, kc, vc, tables, lens, **kw)
    assert got[0].isnan().all() and want[0].isnan().all()
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
