"""A KV cache with fewer bytes per element (labkit.memory.formats, and the quantized paths of labkit.kernels).

The arithmetic is checked against its definition (round-trip error bounds, int4 packing, the
per-block rule that a block's scale only grows). The Triton kernels run in the interpreter on a
CPU (compiled on a GPU) and must equal the references: ``write_kv`` byte for byte (codes and
scales, poisoned slots left alone), ``paged_decode_attention`` against a float64
dequantize-then-attend reference, for every scheme, on ragged lengths, shuffled block tables,
GQA and pools whose unused slots and scales hold NaN or garbage. Shapes are small: the
interpreter is slow.
"""

from __future__ import annotations

import math

import pytest
import torch

import labkit
from labkit.caches import quant_quality
from labkit.caches.paged import KVPool, PagedKVCache
from labkit.kernels import fallback, paged_attention, reference
from labkit.memory import formats
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.teaching import build_it

DEVICE = labkit.DEVICE
SCHEMES = formats.KV_CACHE_DTYPES[1:]
needs_kernels = pytest.mark.skipif(fallback.fallback_reason(torch.float32, DEVICE) is not None,
                                   reason="Triton kernels cannot run here")


# -- the arithmetic -------------------------------------------------------------------------------

def test_names_parse_and_unknown_ones_are_refused():
    assert len(SCHEMES) == 9 and formats.kv_quant("auto") is None
    q = formats.kv_quant("int4_per_group")
    assert (q.element, q.scales, q.bits, q.qmax, q.storage_dtype) == ("int4", "group", 4, 7.0, torch.uint8)
    for bad in ("fp8", "int3_per_block", "", None, "INT8_PER_BLOCK"):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            formats.kv_quant(bad)
    with pytest.raises(ValueError, match="head_dim must be even for int4_per_block"):
        formats.kv_quant("int4_per_block").storage_shape(2, 4, 1, 63)


@pytest.mark.parametrize("element", list(formats.ELEMENTS))
def test_round_trip_error_is_what_the_format_promises(element):
    """int8/int4: at most half a scale step. fp8 e4m3: at most 2^-4 relative in its normal range
    (3 mantissa bits), half of 2^-9 absolute below it (subnormal steps)."""
    gen = torch.Generator().manual_seed(1)
    qmax = formats.ELEMENTS[element][1]
    x = torch.randn(4096, generator=gen) * 3
    x[0] = 3 * x.abs().max()  # past the range: clamped to qmax
    scale = float(x[1:].abs().max()) / qmax
    back = formats.dequantize(formats.quantize(x, scale, element), scale)
    assert back[0] == qmax * scale
    err = (back[1:] - x[1:]).abs()
    if element == "fp8":
        y = x[1:].abs() / scale
        normal = y >= 2 ** -6
        assert (err[normal] <= 2 ** -4 * x[1:].abs()[normal] * (1 + 1e-6)).all()
        assert (err[~normal] <= 2 ** -10 * scale * (1 + 1e-6)).all()
    else:
        assert (err <= scale / 2 * (1 + 1e-6)).all()
        assert formats.quantize(torch.tensor([0.5, 1.5, 2.5, -0.5]) * scale, scale, element).tolist() == [0, 2, 2, 0]


def test_int4_packs_two_codes_per_byte():
    codes = torch.randint(-7, 8, (3, 5, 2, 16), dtype=torch.int8)
    packed = formats.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 2, 8)
    assert torch.equal(formats.unpack_int4(packed), codes)
    assert formats.pack_int4(torch.tensor([-7, 7], dtype=torch.int8)).item() == 1 | (15 << 4)  # code + 8 per nibble


def test_per_block_scale_grows_rescales_earlier_codes_and_restarts_at_offset_zero():
    q = formats.kv_quant("int8_per_block")
    data, scale = q.empty_pool(2, 4, 1, 8)
    x = torch.full((3, 1, 8), 0.5)
    x[1] *= 4  # the second token is larger: the block's scale must grow
    formats.write_quantized(x[:1], data, scale, torch.tensor([0]), q)
    assert scale[0, 0] == 0.5 / 127
    formats.write_quantized(x[1:2], data, scale, torch.tensor([1]), q)
    assert scale[0, 0] == 2.0 / 127  # max |x| so far over 127
    back = formats.dequantize_pool(data, scale, q)[0, :2, 0]
    assert torch.allclose(back, x[:2, 0], atol=scale[0, 0].item() / 2)  # token 0 re-encoded for the new scale
    formats.write_quantized(x[2:], data, scale, torch.tensor([0]), q)  # offset 0: the block starts again
    assert scale[0, 0] == 0.5 / 127


@pytest.mark.parametrize("name", SCHEMES)
def test_the_cpu_decode_reads_codes_times_scales_in_float32_rounded_once(name, monkeypatch):
    """Issue 38's bug 7: under bfloat16 the CPU's batched decode rounded the scale to bfloat16 and
    multiplied there (24% of the values differed from the kernel's). It must attend over what a compiled
    kernel on tensor cores reads: code × scale in float32, rounded once to q's dtype."""
    from labkit.kernels import cpu

    q = formats.kv_quant(name)
    gen = torch.Generator().manual_seed(SCHEMES.index(name))
    head_dim, block_size, n = 64, 4, 12
    pools = [q.empty_pool(4, block_size, 2, head_dim) for _ in range(2)]
    (kc, ks), (vc, vs) = pools
    if q.scales == "tensor":
        ks.fill_(0.0123)
        vs.fill_(0.0071)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    slots = table[0].long()[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
    kw = dict(kv_cache_dtype=name, k_scale=ks, v_scale=vs)
    reference.write_kv_ref(torch.randn(n, 2, head_dim, generator=gen), torch.randn(n, 2, head_dim, generator=gen),
                           kc, vc, slots, **kw)
    seen = []
    sdpa = cpu.F.scaled_dot_product_attention

    def spy(query, k, v, **options):  # the K and V the batched decode attends over
        seen.append((k, v))
        return sdpa(query, k, v, **options)

    monkeypatch.setattr(cpu.F, "scaled_dot_product_attention", spy)
    query = torch.randn(1, 4, head_dim, generator=gen).bfloat16()
    cpu.paged_decode_attention_batched(query, kc, vc, table, torch.tensor([n], dtype=torch.int32), **kw)
    for (data, scale), got in zip(pools, seen[0]):
        once = formats.dequantize_pool(data, scale, q, torch.float32).to(torch.bfloat16)  # float32, rounded once
        want = reference.gather_kv(once, table[0], n).transpose(0, 1)  # [Hkv, positions, D]
        assert got.dtype == torch.float32 and int((got[0] != want.float()).sum()) == 0, name


def test_bytes_per_token_of_the_real_model():
    """SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, 23,040 bytes per token at bf16."""
    per_token = {name: formats.kv_quant(name).bytes_per_token(30, 3, 64, 16) for name in SCHEMES}
    assert per_token["fp8_per_tensor"] == per_token["int8_per_tensor"] == 23_040 / 2
    assert per_token["int8_per_block"] == 11_520 + 2 * 30 * 3 * 4 / 16
    assert per_token["int8_per_group"] == 11_520 + 2 * 30 * 3 * 2 * 4
    assert per_token["int4_per_tensor"] == 23_040 / 4 and per_token["int4_per_group"] == 5_760 + 1_440
    q = formats.kv_quant("int8_per_block")
    assert q.cache_bytes(33, 30, 3, 64, 16) == 33 * 11_520 + 3 * 2 * 30 * 3 * 4  # three blocks' scales


def test_greedy_agreement_counts_up_to_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert quant_quality.greedy_agreement(ref, ref) == (1.0, 4.0)
    assert quant_quality.greedy_agreement(ref, [[1, 2, 9, 4], [0, 6, 7, 8]]) == (2 / 8, 1.0)  # later matches do not count
    with pytest.raises(ValueError, match="references and outputs"):
        quant_quality.greedy_agreement(ref, ref[:1])


# -- the kernels against the references -----------------------------------------------------------

# scheme -> (head_dim, block_size): head dims not a power of two and partial groups of 32 included
SHAPES = {"fp8_per_tensor": (64, 8), "fp8_per_block": (40, 8), "fp8_per_group": (48, 4),
          "int8_per_tensor": (32, 8), "int8_per_block": (64, 4), "int8_per_group": (80, 8),
          "int4_per_tensor": (16, 8), "int4_per_block": (48, 8), "int4_per_group": (48, 8)}
LENS = [1, 7, 8, 9, 17]


def poisoned_pool(q, num_blocks, block_size, heads, head_dim, gen):
    """A pool whose every code and scale is garbage (fp8: NaN) until written."""
    data, scale = q.empty_pool(num_blocks, block_size, heads, head_dim)
    data.view(torch.uint8).copy_(torch.randint(0, 256, data.shape, generator=gen, dtype=torch.uint8))
    if q.element == "fp8":
        data.view(torch.uint8).fill_(0x7F)  # NaN in e4m3
    if q.scales != "tensor":
        scale.fill_(float("nan"))
    else:
        scale.fill_(0.02)  # a calibrated scale that some values exceed (they clamp)
    return data, scale


def write_sequences(write, q, name, lens, heads, head_dim, block_size, gen):
    """Random K/V for ragged sequences in shuffled blocks, written in two passes (most of each
    sequence, then its last token, as prefill then decode do). Returns pools, tables, lengths."""
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    pools = [poisoned_pool(q, num_blocks, block_size, heads, head_dim, gen) for _ in range(2)]
    tables = torch.full((len(lens), max(used) + 1), -1, dtype=torch.int32)
    taken, first, last = 0, [], []
    for i, n in enumerate(lens):
        ids = perm[taken: taken + used[i]]
        taken += used[i]
        tables[i, : used[i]] = ids.int()
        slots = ids[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        first.append(slots[:-1])
        last.append(slots[-1:])
    k = torch.randn(sum(lens), heads, head_dim, generator=gen) * 2
    v = torch.randn(sum(lens), heads, head_dim, generator=gen)
    (kc, ks), (vc, vs) = pools
    kw = dict(kv_cache_dtype=name, k_scale=ks, v_scale=vs)
    order = torch.cat(first + last)
    n_first = sum(len(f) for f in first)
    write(k[:n_first], v[:n_first], kc, vc, order[:n_first], **kw)
    write(k[n_first:], v[n_first:], kc, vc, order[n_first:], **kw)
    return kc, vc, ks, vs, tables, torch.tensor(lens, dtype=torch.int32)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@needs_kernels
@pytest.mark.parametrize("name", SCHEMES)
def test_write_and_decode_kernels_equal_the_references(name):
    q = formats.kv_quant(name)
    head_dim, block_size = SHAPES[name]
    seed = SCHEMES.index(name)
    pools = []
    for write in (reference.write_kv_ref, paged_attention.write_kv):
        gen = torch.Generator().manual_seed(seed)  # the same pools, data and poison for both writers
        pools.append(write_sequences(write, q, name, LENS, 2, head_dim, block_size, gen))
    ref, got = pools
    for a, b in zip(ref[:4], got[:4]):  # codes and scales byte for byte; poisoned slots untouched
        assert same_bytes(a, b), name
    kc, vc, ks, vs, tables, lens = got
    gen = torch.Generator().manual_seed(100 + seed)
    query = torch.randn(len(LENS), 8, head_dim, generator=gen)  # GQA: 8 query heads on 2 KV heads
    out = torch.full_like(query, float("nan"))
    kw = dict(kv_cache_dtype=name, k_scale=ks, v_scale=vs)
    paged_attention.paged_decode_attention(query.to(DEVICE), *(t.to(DEVICE) for t in (kc, vc, tables, lens)), out=out,
                                           **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    want = reference.paged_decode_attention_ref(query.double(), kc, vc, tables, lens, **kw)
    assert not out.isnan().any(), "an output read a poisoned slot or scale, or was never written"
    torch.testing.assert_close(out.double().cpu(), want, atol=2e-5, rtol=1e-5)
    # and quantization did something: the answer is not the unquantized one
    values = reference.dequantize_blocks(kc, vc, ks, vs, name, tables, lens, torch.float64)
    assert values[0].isfinite().any()


@needs_kernels
def test_quantized_decode_splits_and_bf16_queries():
    """Split-K over a quantized pool, and 16-bit queries (the dequantized tile meets q's dtype)."""
    name = "int4_per_group"
    gen = torch.Generator().manual_seed(7)
    kc, vc, ks, vs, tables, lens = write_sequences(reference.write_kv_ref, formats.kv_quant(name), name, [30, 3], 1,
                                                   32, 8, gen)
    kw = dict(kv_cache_dtype=name, k_scale=ks, v_scale=vs)
    query = torch.randn(2, 4, 32, generator=gen)
    want = reference.paged_decode_attention_ref(query.double(), kc, vc, tables, lens, **kw)
    split = paged_attention.paged_decode_attention(query, kc, vc, tables, lens, num_splits=2, **kw)
    torch.testing.assert_close(split.double(), want, atol=2e-5, rtol=1e-5)
    half = paged_attention.paged_decode_attention(query.bfloat16(), kc, vc, tables, lens, **kw)
    torch.testing.assert_close(half.double(), want, atol=1e-2, rtol=1.6e-2)


class Recording:
    """A cache that records every ``attend`` call of a forward pass and passes it on."""

    def __init__(self, cache):
        self.cache, self.calls = cache, []

    @property
    def seq_len(self):
        return self.cache.seq_len

    def attend(self, layer_idx, q, k, v):
        out = self.cache.attend(layer_idx, q, k, v)
        self.calls.append((layer_idx, q.clone(), k.clone(), v.clone(), out.clone()))
        return out


@needs_kernels
def test_a_quantized_paged_cache_attends_with_triton_as_with_the_references():
    """KVPool end to end: write, prefill (dequantized scratch pool) and decode, kernels against references.

    The model runs on the references' cache; the Triton cache then gets the very same q, k and v, layer
    by layer. (Running the model on each would feed layer 1 K/V that differ in the last bit, and a code
    at a rounding tie may then differ by one on some CPUs: a test of the machine, not of the kernels.)
    """
    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Decoder.random(cfg, seed=3)
    ref_cache = PagedKVCache(cfg, 4, 4, use_triton=False, kv_cache_dtype="int8_per_block")
    recording = Recording(ref_cache)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5, 6]]), cache=recording)  # prefill
        model(torch.tensor([[7]]), cache=recording)  # decode
    assert [c[0] for c in recording.calls] == [0, 1, 0, 1]
    cache = PagedKVCache(cfg, 4, 4, use_triton=True, kv_cache_dtype="int8_per_block")
    for layer_idx, q, k, v, want in recording.calls:
        got = cache.attend(layer_idx, q, k, v)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for ours, theirs in ((cache.k_caches, ref_cache.k_caches), (cache.v_caches, ref_cache.v_caches),
                         (cache.k_scales, ref_cache.k_scales), (cache.v_scales, ref_cache.v_scales)):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)  # the same codes and scales, bit for bit
    assert cache.bytes_per_block == 2 * 2 * (4 * 2 * 8) + 2 * 2 * 2 * 4  # codes (head_dim 8) + per-block scales


def test_fp8_before_sm89_names_its_fallback():
    assert fallback.kv_format_reason("fp8_per_block", (8, 0)).endswith(
        "the PyTorch reference (dequantize, then attend) runs instead")
    assert "compute capability 8.9" in fallback.kv_format_reason("fp8_per_tensor", (7, 5))
    assert fallback.kv_format_reason("fp8_per_tensor", (8, 9)) is None
    assert fallback.kv_format_reason("int4_per_group", (7, 5)) is None  # integer codes compile everywhere
    assert fallback.kv_format_reason("auto", (7, 5)) is None


def test_per_block_write_refuses_a_gap_and_changes_nothing():
    q = formats.kv_quant("int8_per_block")
    kc, ks = q.empty_pool(2, 4, 1, 8)
    vc, vs = q.empty_pool(2, 4, 1, 8)
    before = [t.clone() for t in (kc, vc, ks, vs)]
    k = torch.randn(2, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping must send the tokens written into one block"):
        paged_attention.write_kv(k, k, kc, vc, torch.tensor([0, 2]), kv_cache_dtype="int8_per_block", k_scale=ks, v_scale=vs)
    assert all(torch.equal(a, b) for a, b in zip(before, (kc, vc, ks, vs)))


# -- the appendix's exercise: hidden cases that known wrong answers fail -----------------------------

def right_scales(x):
    return x.abs().amax(dim=(1, 3)) / 127


def right_quantize(x, scales):
    s = scales[:, None, :, None]
    return torch.where(s > 0, x / torch.where(s > 0, s, 1), 0).round().clamp(-127, 127).to(torch.int8)


def right_dequantize(codes, scales):
    return codes.float() * scales[:, None, :, None]


WRONG = {
    "one scale for the whole tensor": (lambda x: (x.abs().max() / 127).expand(x.shape[0], x.shape[2]).clone(),
                                       right_quantize, right_dequantize),
    "truncation instead of rounding": (right_scales, lambda x, s: (x / torch.where(s > 0, s, 1)[:, None, :, None])
                                       .clamp(-127, 127).to(torch.int8), right_dequantize),
    "no clamp": (right_scales, lambda x, s: (x / torch.where(s > 0, s, 1)[:, None, :, None]).round().to(torch.int8),
                 right_dequantize),
    "scales not per block in dequantize": (right_scales, right_quantize, lambda c, s: c.float() * s.mean()),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_exercise_checker_passes_the_right_answer_and_fails_known_wrong_ones(seed):
    cases = build_it.kv_quant_cases(seed)
    assert build_it.kv_quant_problems((right_scales, right_quantize, right_dequantize), cases) == []
    for label, answer in WRONG.items():
        assert build_it.kv_quant_problems(answer, cases), f"{label} passed the checker"


def test_the_exercise_checker_refuses_labkits_own_functions(capsys):
    from labkit.teaching.exercises import Exercises

    cheat = (right_scales, lambda x, s: formats.quantize(x, s[:, None, :, None], "int8"), right_dequantize)
    cases = build_it.kv_quant_cases(5)
    Exercises("A3_fewer_bytes_per_element").check_behaviour(
        "Exercise", cheat, lambda a: build_it.kv_quant_problems(a, cases), forbid=[formats.quantize, formats.dequantize])
    assert "your answer calls `labkit.memory.formats.quantize`" in capsys.readouterr().out


def test_calibrate_measures_each_layers_range():
    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Decoder.random(cfg, seed=0)
    k_scales, v_scales = quant_quality.calibrate_kv_scales(model, list(range(20)), formats.kv_quant("int8_per_tensor"))
    observer = quant_quality.AmaxObserver(2)
    with torch.no_grad():
        model(torch.tensor([list(range(20))]), cache=observer)
    assert k_scales == [a / 127 for a in observer.k_amax] and len(v_scales) == 2
    assert all(math.isfinite(s) and s > 0 for s in k_scales + v_scales)
    pool = KVPool(cfg, 2, 4, kv_cache_dtype="int8_per_tensor", use_triton=False)
    pool.set_scales(k_scales, v_scales)
    assert pool.k_scales[1].item() == pytest.approx(k_scales[1])


def test_the_appendix_opens_with_what_it_teaches_and_stays_within_3500_words():
    import re
    from pathlib import Path

    source = (Path(__file__).resolve().parent.parent / "book" / "A3_fewer_bytes_per_element.py").read_text()
    cells = re.split(r"^# %%", source, flags=re.M)
    prose = [c for c in cells if c.startswith(" [markdown]")]
    words = sum(len(re.findall(r"\w+", c.replace("\n# ", "\n"))) for c in prose)
    assert words <= 3500, f"{words} words of prose"
    assert "[chapter 02](02_cost_per_token.ipynb)" in prose[0] and "**What you will learn**" in prose[0]
    assert all(f"## {part}" in source for part in ("Summary", "What you can now do", "Exercise", "References"))
