"""Block allocator, block tables and the paged KV cache (labkit.memory.paging).

The model and every tensor it is fed live on ``labkit.DEVICE`` (where ``PagedKVCache`` puts its
pool by default), so on a GPU the paged cache runs the compiled Triton kernels. On a CPU its default
is the batched PyTorch path (issue 43); the tests that compare with the contiguous cache run both
that default and the Triton kernels (``use_triton=True``, interpreted there).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from labkit.caches.contiguous import KVCache, generate
from labkit.caches.paged import PagedKVCache, generate_paged
from labkit.kernels.device import DEVICE
from labkit.memory.blocks import blocks_needed
from labkit.memory.paging import BlockAllocator, BlockTable, OutOfBlocksError
from labkit.model.decoder import Decoder, DecoderConfig


def snapshot(alloc: BlockAllocator) -> tuple:
    return list(alloc.ref_counts), list(alloc._free), alloc.num_free  # noqa: SLF001


# -- blocks_needed, BlockAllocator --------------------------------------------------------------

def test_blocks_needed_is_ceiling_division():
    rng = random.Random(0)
    for _ in range(200):
        n, bs = rng.randint(0, 5000), rng.randint(1, 128)
        assert blocks_needed(n, bs) == math.ceil(n / bs)
    assert blocks_needed(37, 16) == 3 and blocks_needed(32, 16) == 2 and blocks_needed(0, 16) == 0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="num_tokens"):
            blocks_needed(bad, 16)
    with pytest.raises(ValueError, match="block_size"):
        blocks_needed(10, 0)


def test_blocks_needed_counts_arrays_of_lengths_element_by_element():
    """One rule for every block count (issue 37): the kernels count torch lengths, the pool plan numpy ones."""
    lengths = [0, 1, 15, 16, 17, 37, 300]
    want = [math.ceil(n / 16) for n in lengths]
    for array in (np.array(lengths), np.array(lengths, dtype=np.int32), torch.tensor(lengths),
                  torch.tensor(lengths, dtype=torch.int32)):
        got = blocks_needed(array, 16)
        assert type(got) is type(array) and got.tolist() == want
    assert blocks_needed(np.array([], dtype=np.int64), 16).size == 0
    for bad in (np.array([1.5]), torch.tensor([2.0]), torch.tensor([True]), np.array([3, -1]), torch.tensor([-2])):
        with pytest.raises(ValueError, match="num_tokens"):
            blocks_needed(bad, 16)
    with pytest.raises(ValueError, match="block_size"):
        blocks_needed(torch.tensor([3]), 0)


def test_allocator_hands_out_each_block_once():
    alloc = BlockAllocator(7)
    ids = alloc.allocate_many(7)
    assert sorted(ids) == list(range(7)) and alloc.num_free == 0 and alloc.num_used == 7
    assert all(alloc.ref_counts[i] == 1 for i in ids)


def test_out_of_blocks_leaves_the_pool_unchanged():
    alloc = BlockAllocator(5)
    held = alloc.allocate_many(3)
    alloc.free(held[1])
    before = snapshot(alloc)
    with pytest.raises(OutOfBlocksError):
        alloc.allocate_many(4)
    assert snapshot(alloc) == before
    alloc.allocate_many(3)
    with pytest.raises(OutOfBlocksError):
        alloc.allocate()
    assert alloc.num_free == 0


def test_reference_counts_and_double_free():
    alloc = BlockAllocator(3)
    b = alloc.allocate()
    alloc.incref(b)
    alloc.incref(b)
    assert alloc.ref_counts[b] == 3
    assert alloc.free(b) is False and alloc.free(b) is False and not alloc.is_free(b)
    assert alloc.free(b) is True and alloc.is_free(b)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)
    with pytest.raises(ValueError, match="free"):
        alloc.incref(b)
    with pytest.raises(ValueError, match="block_id"):
        alloc.free(3)


def test_unnamed_blocks_are_reused_first_named_ones_least_recently_freed_first():
    """vLLM's BlockPool.free_blocks: a block no one can find again goes to the front of the free
    queue (reused at once), a named (cached) block to the back (evicted last, LRU)."""
    alloc = BlockAllocator(6)
    a, b, c, d, e, f = alloc.allocate_many(6)
    alloc.names.update({a: "A", c: "C"})
    for x in (c, b, a, d):
        alloc.free(x)
    assert list(alloc.free_block_ids()) == [d, b, c, a]
    alloc.free_blocks([f, e])  # freed together, tail first: they stay in that order at the front
    assert list(alloc.free_block_ids()) == [f, e, d, b, c, a]
    assert [alloc.allocate() for _ in range(5)] == [f, e, d, b, c]
    assert alloc.num_evictions == 1 and alloc.names == {a: "A"}  # handing out c dropped its name
    with pytest.raises(ValueError, match="double free"):
        alloc.free_blocks([f, f])
    assert alloc.ref_counts[f] == 1  # all-or-nothing


def test_revive_takes_back_a_specific_free_block():
    alloc = BlockAllocator(4)
    alloc.revive(2)
    assert alloc.ref_counts[2] == 1 and not alloc.is_free(2) and 2 not in alloc.allocate_many(3)
    with pytest.raises(ValueError, match="not free"):
        alloc.revive(2)


# -- BlockTable ---------------------------------------------------------------------------------

def test_block_table_slots_follow_the_physical_blocks():
    alloc = BlockAllocator(10)
    alloc.allocate_many(3)  # so the table gets non-trivial ids
    table = BlockTable(4)
    slots = table.append(6, alloc)
    assert len(table.block_ids) == 2 and table.empty_slots == 2
    b0, b1 = table.block_ids
    assert slots == [b0 * 4 + i for i in range(4)] + [b1 * 4, b1 * 4 + 1]
    assert table.append(2, alloc) == [b1 * 4 + 2, b1 * 4 + 3] and len(table.block_ids) == 2
    assert table.empty_slots == 0 and table.new_blocks_for(1) == 1


def test_block_table_append_is_all_or_nothing():
    alloc = BlockAllocator(3)
    table = BlockTable(16)
    table.append(37, alloc)  # the article's 37 tokens: 3 blocks, 11 empty slots
    assert len(table.block_ids) == 3 and table.empty_slots == 11
    before = (list(table.block_ids), table.num_tokens, snapshot(alloc))
    with pytest.raises(OutOfBlocksError):
        table.append(12, alloc)
    assert (list(table.block_ids), table.num_tokens, snapshot(alloc)) == before
    table.release(alloc)
    assert alloc.num_free == 3 and table.num_tokens == 0


def test_random_workload_keeps_the_books_balanced():
    rng = random.Random(1)
    alloc, tables = BlockAllocator(40), []
    for _ in range(300):
        if tables and rng.random() < 0.3:
            tables.pop(rng.randrange(len(tables))).release(alloc)
        else:
            table = tables[rng.randrange(len(tables))] if tables and rng.random() < 0.6 else BlockTable(8)
            try:
                table.append(rng.randint(1, 20), alloc)
            except OutOfBlocksError:
                continue
            if table not in tables:
                tables.append(table)
        owned = [b for t in tables for b in t.block_ids]
        assert len(owned) == len(set(owned)) == alloc.num_used
        assert all(blocks_needed(t.num_tokens, 8) == len(t.block_ids) for t in tables)


# -- PagedKVCache with the decoder ---------------------------------------------------------------

CONFIG = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder.random(CONFIG, seed=3).to(DEVICE)


@pytest.mark.parametrize("use_triton", [None, True], ids=["default", "triton"])
def test_paged_cache_reproduces_the_contiguous_cache_step_by_step(model, use_triton):
    prompt = torch.randint(0, CONFIG.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    paged = PagedKVCache(CONFIG, num_blocks=6, block_size=4, use_triton=use_triton)  # 9 + 4 tokens: 4 blocks
    contiguous = KVCache(CONFIG)
    feed = prompt
    with torch.no_grad():
        for _ in range(5):
            a = model(feed, cache=paged)
            b = model(feed, cache=contiguous)
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            assert paged.seq_len == contiguous.seq_len
            feed = b[:, -1:].argmax(-1)
    assert paged.allocator.num_used == blocks_needed(paged.seq_len, 4)


@pytest.mark.parametrize("use_triton", [None, True], ids=["default", "triton"])
def test_generate_paged_matches_contiguous_generation_for_a_ragged_batch(model, use_triton):
    gen = torch.Generator().manual_seed(4)
    lengths = [1, 8, 9, 13]  # one token, on and around the 8-token block boundary
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    paged = generate_paged(model, prompts, max_new_tokens=6, block_size=8, use_triton=use_triton)
    for prompt, got in zip(prompts, paged):
        want = generate(model, prompt, 6)
        assert got.tokens == want.tokens and got.cache_tokens == want.cache_tokens
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("use_triton", [None, True], ids=["default", "triton"])
def test_paged_cache_in_float16_stays_close(model, use_triton):
    prompt = list(range(1, 12))
    want = generate(model, prompt, 4)
    got = generate_paged(model, [prompt], 4, block_size=8, dtype=torch.float16, use_triton=use_triton)[0]
    torch.testing.assert_close(got.logits, want.logits, atol=3e-2, rtol=3e-2)


def test_ragged_batch_needs_explicit_positions(model):
    cache = PagedKVCache(CONFIG, num_blocks=8, block_size=4, batch_size=0)
    a, b = cache.add_sequence(), cache.add_sequence()
    with torch.no_grad():
        cache.select([a])
        model(torch.tensor([[1, 2, 3]], device=DEVICE), cache=cache)
        cache.select([b])
        model(torch.tensor([[4, 5, 6, 7, 8]], device=DEVICE), cache=cache)
        cache.select([a, b])
        assert cache.seq_lens() == [3, 5]
        assert cache.positions(2).tolist() == [[3, 4], [5, 6]]
        with pytest.raises(ValueError, match="positions"):
            model(torch.tensor([[1], [2]], device=DEVICE), cache=cache)
        model(torch.tensor([[1], [2]], device=DEVICE), positions=cache.positions(1), cache=cache)
    assert cache.seq_lens() == [4, 6]
    used = cache.allocator.num_used
    cache.free_sequence(a)
    assert cache.allocator.num_used == used - 1 and cache.active == [b]


def test_paged_cache_out_of_blocks_changes_nothing(model):
    cache = PagedKVCache(CONFIG, num_blocks=2, block_size=4, batch_size=2)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3], [4, 5, 6]], device=DEVICE), cache=cache)
        before = (cache.seq_lens(), snapshot(cache.allocator), [list(t.block_ids) for t in cache.tables.values()])
        with pytest.raises(OutOfBlocksError):
            model(torch.tensor([[1, 2], [3, 4]], device=DEVICE), cache=cache)  # needs 2 more blocks, none free
        after = (cache.seq_lens(), snapshot(cache.allocator), [list(t.block_ids) for t in cache.tables.values()])
    assert after == before


def test_paged_cache_memory_accounting():
    cache = PagedKVCache(CONFIG, num_blocks=5, block_size=16, dtype=torch.float16)
    per_block = 2 * CONFIG.num_hidden_layers * 16 * CONFIG.num_key_value_heads * CONFIG.head_dim * 2
    assert cache.bytes_per_block == per_block and cache.nbytes == 5 * per_block
    assert cache.k_caches[0].shape == (5, 16, CONFIG.num_key_value_heads, CONFIG.head_dim)
    assert cache.used_bytes == 0


def test_paged_cache_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(CONFIG, num_blocks=0)
    with pytest.raises(ValueError, match="dtype"):
        PagedKVCache(CONFIG, num_blocks=2, dtype=torch.int8)
    cache = PagedKVCache(CONFIG, num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="seq_id"):
        cache.select([7])
    with pytest.raises(ValueError, match="seq_ids"):
        cache.select([0, 0])
    q = torch.zeros(1, 1, 4, CONFIG.head_dim, device=DEVICE)
    k = torch.zeros(1, 1, 2, CONFIG.head_dim, device=DEVICE)
    with pytest.raises(ValueError, match="out of order"):
        cache.attend(1, q, k, k)
    with pytest.raises(ValueError, match="k and v"):
        cache.attend(0, q, k[..., :4], k[..., :4])
    with pytest.raises(ValueError, match="batch"):
        cache.attend(0, q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1))
    assert cache.seq_len == 0 and cache.allocator.num_used == 0


# -- the chapter's stepper ----------------------------------------------------------------------

def test_stepper_simulation_is_consistent():
    pytest.importorskip("ipywidgets", reason="the widget module needs ipywidgets (absent on bare GPU images)")
    from labkit.teaching.widgets.paging_stepper import DEFAULT_WORKLOAD, Request, simulate

    snaps = simulate(DEFAULT_WORKLOAD, num_blocks=16, block_size=4)
    assert snaps[-1].used_blocks == 0 and snaps[-1].tables == {}
    for snap in snaps:
        owned = [b for t in snap.tables.values() for b in t]
        assert len(owned) == len(set(owned)) == snap.used_blocks
        for name, table in snap.tables.items():
            assert len(table) == blocks_needed(snap.lengths[name], 4)
            assert [snap.owner[b] for b in table] == [name] * len(table)
            assert sum(snap.filled[b] for b in table) == snap.lengths[name]
    # A pool too small for two prompts at once: the second request waits, then runs.
    small = simulate([Request("A", 0, 8, 2), Request("B", 0, 8, 2)], num_blocks=3, block_size=4)
    assert any("B waits" in e for s in small for e in s.events)
    assert small[-1].used_blocks == 0
    with pytest.raises(ValueError, match="unique"):
        simulate([Request("A", 0, 1, 1), Request("A", 1, 1, 1)])



def test_stepper_block_ids_are_legible():
    """Issue 22: every block id is drawn at 9 pt or more, in a dark colour, and in the pool view it
    sits on the white strip above the slots, never on a coloured slot cell."""
    pytest.importorskip("ipywidgets", reason="the widget module needs ipywidgets (absent on bare GPU images)")
    import matplotlib
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from labkit.teaching.widgets.paging_stepper import draw_block_tables, draw_pool, simulate

    matplotlib.use("Agg")
    snap = simulate(num_blocks=16, block_size=4)[7]

    def luminance(colour) -> float:
        r, g, b = mcolors.to_rgb(colour)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    fig, ax = plt.subplots(figsize=(7, 2.4))
    draw_pool(snap, ax, block_size=4)
    ids = {t.get_text(): t for t in ax.texts if t.get_text().isdigit()}
    assert sorted(ids, key=int) == [str(b) for b in range(16)]
    cells = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_fill() and p.get_height() < 0.7]
    assert cells, "the pool view draws its slot cells"
    for b, text in ids.items():
        assert text.get_fontsize() >= 9, f"block {b}: {text.get_fontsize()} pt"
        if snap.owner[int(b)] is not None:
            assert luminance(text.get_color()) < 0.2, f"block {b}: colour {text.get_color()} is not dark"
        x, y = text.get_position()
        inside = [c for c in cells if c.get_x() <= x <= c.get_x() + c.get_width()
                  and c.get_y() <= y <= c.get_y() + c.get_height()]
        assert not inside, f"block {b}'s id is drawn on a slot cell"
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.5))
    draw_block_tables(snap, ax)
    numbers = [t for t in ax.texts if t.get_text().isdigit()]
    assert numbers and all(t.get_fontsize() >= 9 and luminance(t.get_color()) < 0.2 for t in numbers)
    filled = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_facecolor()[:3] != (1.0, 1.0, 1.0)]
    assert filled and all(p.get_alpha() is None or p.get_alpha() <= 0.35 for p in filled)  # light fills behind dark text
    plt.close(fig)

# -- issue 11: bugs at the edges ------------------------------------------------------------------

def test_a_bool_is_not_a_block_id():
    """``True == 1`` in Python, but a flag is not a block id: ``free(True)`` must not free block 1."""
    alloc = BlockAllocator(4)
    alloc.allocate_many(2)
    before = snapshot(alloc)
    for call in (alloc.free, alloc.revive, alloc.incref, alloc.is_free):
        with pytest.raises(ValueError, match="block_id"):
            call(True)
    assert snapshot(alloc) == before


def test_decode_only_means_one_new_token_per_sequence():
    """q_lens [2, 0] has as many tokens as sequences, but it is not a decode step: it must take the
    prefill kernel, and its output must match the float64 reference."""
    from labkit.caches.paged import AttentionMetadata
    from labkit.kernels import reference

    torch.manual_seed(0)
    bs, heads, kv_heads, dim = 4, 2, 1, 8
    k_cache = torch.randn(4, bs, kv_heads, dim, device=DEVICE)
    v_cache = torch.randn(4, bs, kv_heads, dim, device=DEVICE)
    meta = AttentionMetadata.build([[0, 1], [2]], seq_lens=[6, 3], q_lens=[2, 0], slot_mapping=[4, 5], device=DEVICE)
    assert not meta.decode_only
    assert AttentionMetadata.build([[0], [2]], [3, 2], [1, 1], [2, 9], DEVICE).decode_only
    q = torch.randn(2, heads, dim, device=DEVICE)
    ref = reference.paged_prefill_attention_ref(q.double(), k_cache.double(), v_cache.double(), meta.block_tables,
                                                meta.seq_lens, meta.cu_seqlens_q)
    from labkit.caches.paged import KVPool  # its attend picks the kernel from meta.decode_only
    cfg = DecoderConfig(vocab_size=10, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim)
    pool = KVPool(cfg, num_blocks=4, block_size=bs, use_triton=False)
    pool.k_caches[0].copy_(k_cache)
    pool.v_caches[0].copy_(v_cache)
    k_new, v_new = k_cache[1, :2][None], v_cache[1, :2][None]  # rewrite slots 4, 5 with what they hold
    pool.meta = meta
    out = pool.attend(0, q[None], k_new, v_new)[0]
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_paged_cache_refuses_a_bad_q_before_growing_its_tables():
    model = Decoder.random(DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8), seed=0).to(DEVICE)
    cache = PagedKVCache(model.config, num_blocks=4, block_size=4, device=DEVICE)
    k = torch.zeros(1, 3, 1, 8, device=DEVICE)
    bad_q = torch.zeros(1, 2, 2, 8, device=DEVICE)  # 2 new tokens, but k and v have 3
    before = (snapshot(cache.allocator), cache.seq_lens())
    with pytest.raises(ValueError, match="q"):
        cache.attend(0, bad_q, k, k)
    assert (snapshot(cache.allocator), cache.seq_lens()) == before
