"""The hidden cases of the "build it" exercises: the reader writes a core piece, labkit judges it.

Each chapter 01 to 06 asks the reader to write one piece the chapter teaches, behind a small
interface, and checks it on cases the reader never sees. A function here draws those cases
afresh (``guards.draws_hidden_cases``: random sizes, ragged lengths, and the edges every run: empty, exactly
full, one over), computes what labkit's own implementation gives on each, and returns either
the cases (for ``Exercises.check_function``) or a ``verify(answer) -> list[str]`` for
``Exercises.check_behaviour``. Everything labkit computes is computed *before* the reader's
code runs: the checker refuses calls to the functions being rebuilt while the answer runs,
and ``verify`` only compares. A failure names the first failing case in words: its input,
what labkit gives, what the answer gave.

Each exercise names the shape of its answer (``SHAPES``: a function and its parameters, or a class
and its methods). Before any hidden case runs, an answer of another shape is told what was
expected ("expected a function plan_step(running, ...); got int 42"): ``verify`` returns that
sentence, and the cases carry the shape for ``Exercises.check_function`` (``Cases``). The
reader's code raising an error while a case runs is still the reader's error.

| chapter | the reader writes | labkit's own |
|---|---|---|
| 01 | ``decode_step``: RoPE at the cache length, append K/V, attend | ``causal_attention``, RoPE at true positions |
| 02 | ``fits``: how many sequences a device's pool holds | ``capacity.sequences_that_fit`` |
| 02 | ``bytes_per_token_from_config``: the formula read off a ``config.json`` dict | ``ModelShape.from_config`` |
| 03 | ``Pager``: block allocator, block tables, slot mapping, free | ``BlockAllocator`` and ``BlockTable`` |
| 04 | ``cached_tokens``: hash chain with extra keys, match capped at len - 1 | ``PrefixCache.match`` |
| 05 | ``plan_step``: the budget pass with preemption | ``serving.scheduler.plan_iteration`` |
| 06 | ``latencies``: TTFT, TPOT and ITL from a step trace | ``Simulator`` and ``SimResult`` |
| A3 | ``block_scales``, ``quantize``, ``dequantize``: int8 with per-block scales | ``memory.formats`` |
| A3 | ``sequence_bytes``: a cache with sliding-window or latent layers | ``ModelShape.cache_bytes`` |
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..checks import check_int
from ..memory.blocks import blocks_needed
from .guards import AnswerShape, class_shape, described, draws_hidden_cases, function_shape, torch_generator

__all__ = ["decode_step_check", "fits_cases", "config_bytes_cases", "sequence_bytes_cases", "pager_check",
           "cached_tokens_cases", "plan_step_check", "latencies_check", "kv_quant_cases", "kv_quant_problems", "Cases",
           "SHAPES"]

Verify = Callable[[Any], list[str]]

SHAPES: dict[str, AnswerShape] = {
    "decode_step": function_shape("decode_step", "k_cache", "v_cache", "q", "k", "v", "inv_freq"),
    "fits": function_shape("fits", "device_gib", "reserved_gib", "context_len"),
    "bytes_per_token_from_config": function_shape("bytes_per_token_from_config", "config"),
    "sequence_bytes": function_shape("sequence_bytes", "shape", "length"),
    "Pager": class_shape("Pager", ("num_blocks", "block_size"), append=("seq_id", "n"), free=("seq_id",),
                         num_free=()),
    "cached_tokens": function_shape("cached_tokens", "token_ids", "block_size", "key", "cached"),
    "plan_step": function_shape("plan_step", "running", "waiting", "free_blocks", "token_budget", "block_size"),
    "latencies": function_shape("latencies", "arrivals", "steps"),
    "block_scales": function_shape("block_scales", "x"),
    "quantize": function_shape("quantize", "x", "scales"),
    "dequantize": function_shape("dequantize", "codes", "scales"),
}


class Cases(list):
    """Hidden ``(args, expected)`` cases that also say what they are for: ``expects``, the shape of the
    function they call (``Exercises.check_function`` checks it before the first case)."""

    def __init__(self, cases: list[tuple[tuple, Any]], expects: AnswerShape):
        super().__init__(cases)
        self.expects = expects


def _max_diff(got: Any, want: torch.Tensor) -> str:
    if not isinstance(got, torch.Tensor):
        return f"a {type(got).__name__}, not a tensor"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    return f"values off by up to {(got.double() - want).abs().max().item():.2e}"


# --------------------------------------------------------------------------- 01: one decode step


def _rotated(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE in float64, the checker's own: token t of x [T, heads, D] rotated to position t.

    Llama's half-split pairs (x[i], x[i + D/2]) turn by the angle ``t * inv_freq[i]``, as
    ``labkit.model.decoder.apply_rope`` rotates them, here without its float32 step.
    """
    angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv_freq.double()  # [T, D/2]
    cos, sin = (f(torch.cat([angles, angles], dim=-1))[:, None, :] for f in (torch.cos, torch.sin))
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@draws_hidden_cases
def decode_step_check(rng) -> Verify:
    """``decode_step(k_cache, v_cache, q, k, v, inv_freq) -> (k_cache, v_cache, out)`` over whole sequences.

    Caches ``[T, Hkv, D]``, ``q`` ``[Hq, D]``, ``k``, ``v`` ``[Hkv, D]``, float64; ``inv_freq`` ``[D / 2]``
    is ``rope_inv_freq`` of a config with that ``head_dim`` and a drawn ``rope_theta``. The new token
    sits at position T, the cache length: the step rotates its ``q`` and ``k`` there (RoPE), appends
    ``k`` and ``v``, and attends over the cache. Each step's ``out`` must equal causal attention
    recomputed over the whole sequence with RoPE at the true positions (float64), and the caches
    must hold every token's rotated key and its value, in order.

    The stored keys are compared because attention alone cannot see every position shifted by the
    same amount (RoPE's scores depend only on distances); such keys go wrong when they meet keys
    stored at the true positions, so the first sequence starts from a cache that a prefill filled.
    Then one token on one head from an empty cache; GQA with two KV heads; a random shape.
    """
    from ..model.decoder import DecoderConfig, causal_attention, rope_inv_freq

    g = torch_generator(rng)
    n = rng.randint(6, 16)  # the first sequence's tokens; a prefill stored 2 to n - 2 of them
    shapes = [  # (KV heads, query heads per KV head, head_dim, tokens, tokens already cached)
        (rng.choice([1, 2]), rng.choice([2, 4]), rng.choice([8, 16]), n, rng.randint(2, n - 2)),
        (1, 1, rng.choice([4, 8]), 1, 0),
        (2, rng.choice([2, 4]), rng.choice([4, 8]), rng.randint(3, 12), 0),
        (rng.choice([1, 2, 4]), rng.choice([1, 3]), rng.choice([8, 16]), rng.randint(2, 16), 0)]
    cases = []
    for kv_heads, group, d, steps, cached in shapes:
        q, k, v = (torch.randn(steps, heads, d, generator=g, dtype=torch.float64)
                   for heads in (kv_heads * group, kv_heads, kv_heads))
        inv_freq = rope_inv_freq(DecoderConfig(head_dim=d, rope_theta=rng.choice([10_000.0, 500_000.0])))
        keys = _rotated(k, inv_freq)  # what the cache must hold: token t's key rotated to position t
        want = causal_attention(_rotated(q, inv_freq)[None], keys[None], v[None])[0]  # every position at once
        cases.append((kv_heads, group, d, cached, q, k, v, inv_freq, keys, want))

    def verify(decode_step: Callable) -> list[str]:
        if problem := SHAPES["decode_step"].problem(decode_step):
            return [problem]
        for kv_heads, group, d, cached, q, k, v, inv_freq, keys, want in cases:
            prefilled = f", the first {cached} stored by a prefill at positions 0 to {cached - 1}" if cached else ""
            where = f"sequence length {q.shape[0]}, Hq {kv_heads * group}, Hkv {kv_heads}, D {d}{prefilled}"
            k_cache, v_cache = keys[:cached].clone(), v[:cached].clone()
            for t in range(cached, q.shape[0]):
                got = decode_step(k_cache, v_cache, q[t], k[t], v[t], inv_freq.clone())
                if type(got) is not tuple or len(got) != 3:
                    return [f"{where}: at position {t} the step returned {type(got).__name__}; expected "
                            "(k_cache, v_cache, out)"]
                k_cache, v_cache, out = got
                if not _close(out, want[t]):
                    return [f"{where}: at position {t} (a cache of {t} tokens before it) the output should equal "
                            f"attention recomputed over all {t + 1} tokens, RoPE at their true positions; got "
                            f"{_max_diff(out, want[t])}"]
                for label, cache, full, what in (("k_cache", k_cache, keys, "key rotated to its position (RoPE)"),
                                                 ("v_cache", v_cache, v, "value, not rotated")):
                    if not _close(cache, full[:t + 1]):
                        return [f"{where}: after position {t} {label} should hold the {t + 1} tokens in order, "
                                f"token i's {what} at row i, shape {tuple(full[:t + 1].shape)}; got "
                                f"{_max_diff(cache, full[:t + 1])}"]
        return []

    return verify


def _close(got: Any, want: torch.Tensor) -> bool:
    """``got`` is a tensor of ``want``'s shape within 1e-4: RoPE through ``apply_rope`` computes in float32."""
    return isinstance(got, torch.Tensor) and got.shape == want.shape and \
        torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- 02: what fits; the formula from a config


@draws_hidden_cases
def fits_cases(rng) -> Cases:
    """``((device_gib, reserved_gib, context_len), sequences)`` for ``fits``, by ``sequences_that_fit`` (the
    teaching model). Drawn afresh: a pool of exactly k sequences, then one token longer each (k - 1 fit:
    not rounded, not ceiled); a reserve in quarters of a GiB with 1,024 or 2,048-token sequences (whole
    GiB only is wrong); a pool shorter than one sequence; no reserve; two at random. Every amount is a
    multiple of 1/4 GiB, exact in binary, so no way of writing the arithmetic rounds differently."""
    from ..memory.capacity import TEACHING_MODEL, sequences_that_fit
    from ..units import GiB

    per_token = TEACHING_MODEL.bytes_per_token()
    devices = [16, 24, 40, 48, 80, 141]
    device = rng.choice(devices)
    context = rng.choice([c for c in (2048, 4096, 8192, 32768, 131072) if 3 * c * per_token <= device * GiB])
    k = rng.randint(2, device * GiB // (context * per_token) - 1)
    exact = device - k * context * per_token / GiB  # the reserve that leaves exactly k sequences
    short = rng.choice([0.25, 0.5, 1.0])  # a pool of this many GiB, shorter than the sequence
    args = [(device, exact, context), (device, exact, context + 1),
            (device, rng.randint(1, device // 2) - rng.choice([0.25, 0.5, 0.75]), rng.choice([1024, 2048])),
            (device, device - short, rng.randint(int(short * GiB) // per_token + 1, 65_536)),
            (rng.choice(devices), 0, rng.randint(1, 32_768))]
    args += [(d, rng.randint(0, 4 * d - 1) / 4, rng.randint(1, 65_536)) for d in rng.choices(devices, k=2)]  # random
    return Cases([(a, sequences_that_fit(a[2] * per_token, a[0] * GiB, a[1] * GiB)) for a in args], SHAPES["fits"])


@draws_hidden_cases
def config_bytes_cases(rng) -> Cases:
    """``((config,), bytes)`` for ``bytes_per_token_from_config(config)``, by ``ModelShape.from_config``.

    Llama-style ``config.json`` dicts drawn afresh, one for each way the file can read: with and without
    ``num_key_value_heads`` (without it, one KV head per query head), with and without ``head_dim``
    (without it, ``hidden_size // num_attention_heads``), each in float32, bfloat16 and float16. Where
    the KV heads are given they are fewer than the query heads (GQA), and a given ``head_dim`` always
    differs from the quotient, so that reading the query heads, deriving a given ``head_dim``, or
    taking 2 bytes for every dtype each fails some case. The element is the file's ``torch_dtype``:
    ``from_config`` gets it as ``dtype=`` (it would otherwise serve float32 in 16 bits, as vLLM does).
    """
    from ..memory.capacity import ModelShape

    cases = []
    for kv_given in (True, False):
        for head_dim_given in (True, False):
            for dtype in ("float32", "bfloat16", "float16"):
                query_heads = rng.choice([8, 16, 32, 64])
                quotient = rng.choice([64, 96, 128])
                config = {"architectures": ["LlamaForCausalLM"], "hidden_size": query_heads * quotient,
                          "intermediate_size": 4 * query_heads * quotient, "num_hidden_layers": rng.randint(1, 96),
                          "num_attention_heads": query_heads, "max_position_embeddings": rng.choice([4096, 8192]),
                          "vocab_size": rng.choice([32_000, 128_256]), "torch_dtype": dtype}
                if kv_given:
                    config["num_key_value_heads"] = rng.choice([h for h in (1, 2, 4, 8) if h < query_heads])
                if head_dim_given:
                    config["head_dim"] = rng.choice([d for d in (64, 128, 256) if d != quotient])
                expected = ModelShape.from_config(config, dtype=dtype).bytes_per_token()
                cases.append(((config,), expected))
    rng.shuffle(cases)
    return Cases(cases, SHAPES["bytes_per_token_from_config"])


# --------------------------------------------------------------------------- A3: windowed and latent caches


@draws_hidden_cases
def sequence_bytes_cases(rng) -> Cases:
    """``((shape, length), bytes)`` for ``sequence_bytes(shape, length)``, by ``ModelShape.cache_bytes``.

    Four kinds of model drawn afresh (plain; a window in every layer; a window in some layers; a
    latent MLA cache), each at the lengths that matter: 0, 1, the window exactly, one over it, long.
    """
    from ..memory.capacity import ModelShape

    cases = []
    for kind in ("plain", "window in every layer", "window in some layers", "latent"):
        layers, window = rng.randint(2, 12), rng.choice([16, 32, 64, 128])
        sliding: tuple[int, ...] = ()
        if kind == "window in every layer":
            sliding = tuple(range(layers))
        elif kind == "window in some layers":
            sliding = tuple(sorted(rng.sample(range(layers), rng.randint(1, layers - 1))))
        latent = kind == "latent"
        shape = ModelShape(f"a {kind} model", layers, 1 if latent else rng.choice([1, 2, 4, 8]),
                           rng.choice([288, 576]) if latent else rng.choice([64, 128, 256]), rng.choice([1, 2, 4]),
                           sliding_window=window if sliding else None, sliding_layers=sliding, latent=latent)
        for length in (0, 1, window, window + 1, rng.randint(2 * window, 50 * window)):
            cases.append(((shape, length), shape.cache_bytes(length)))
    return Cases(cases, SHAPES["sequence_bytes"])


# --------------------------------------------------------------------------- 03: allocator and block tables


def _pager_scenario(rng) -> tuple[int, int, list[tuple]]:
    """A pool and a random sequence of operations, with labkit's outcome of each.

    Operations: ``("append", seq, n, ok, free_after)`` and ``("free", seq, None, True, free_after)``.
    It always includes an empty append, a tail filled exactly, the pool filled exactly, appends one
    token and one block over what is free (refused, nothing changes), and frees that make room again.
    """
    from ..memory.paging import BlockAllocator, BlockTable, OutOfBlocksError

    block_size, num_blocks = rng.randint(2, 8), rng.randint(6, 12)
    allocator, tables, ops = BlockAllocator(num_blocks), {}, []

    def append(seq: str, n: int) -> None:
        table = tables.get(seq) or BlockTable(block_size)
        try:
            table.append(n, allocator)
            tables[seq], ok = table, True
        except OutOfBlocksError:
            ok = False
        ops.append(("append", seq, n, ok, allocator.num_free))

    def free(seq: str) -> None:
        tables.pop(seq).release(allocator)
        ops.append(("free", seq, None, True, allocator.num_free))

    append("a", 0)  # an empty sequence takes no block
    append("a", rng.randint(1, 2 * block_size))
    append("a", -tables["a"].num_tokens % block_size or block_size)  # fill its tail exactly
    append("b", rng.randint(1, block_size - 1))  # a partly filled block
    append("c", allocator.num_free * block_size)  # the pool exactly full
    append("d", 1)  # one over: refused
    free("b")
    append("e", (allocator.num_free + 1) * block_size)  # one block more than is free: refused, nothing taken
    append("d", rng.randint(1, block_size))  # b's block, reused
    free("a")
    for _ in range(6):  # then at random, sometimes past what is free
        live = sorted(tables)
        if live and rng.random() < 0.3:
            free(rng.choice(live))
        else:
            room = allocator.num_free * block_size
            append(rng.choice(live + ["e", "f", "g"]), rng.randint(1, room + block_size + 1))
    return num_blocks, block_size, ops


@draws_hidden_cases
def pager_check(rng) -> Verify:
    """``Pager(num_blocks, block_size)`` with ``append(seq_id, n)`` (the new tokens' slots, or ``None``
    when the pool is short, changing nothing), ``free(seq_id)`` and ``num_free()``, replayed against
    ``BlockAllocator`` and ``BlockTable`` on three scenarios drawn afresh.

    Block ids may differ from labkit's (any free block will do); what is checked: the free count
    after every operation, refusals, and that every slot is ``block_id * block_size + offset`` of
    a block that no other live sequence holds.
    """
    scenarios = [_pager_scenario(rng) for _ in range(3)]

    def verify(pager_class: Callable) -> list[str]:
        if problem := SHAPES["Pager"].problem(pager_class):
            return [problem]
        for num_blocks, bs, ops in scenarios:
            pager, done = pager_class(num_blocks, bs), []
            tokens: dict[str, int] = {}  # seq -> tokens it holds
            blocks: dict[str, list[int]] = {}  # seq -> the physical blocks its slots lie in, by logical block
            for kind, seq, n, ok, free_after in ops:
                call = f"append({seq!r}, {n})" if kind == "append" else f"free({seq!r})"
                where = f"a pool of {num_blocks} blocks of {bs} slots, after [{', '.join(done[-4:]) or 'nothing'}]"
                if kind == "free":
                    pager.free(seq)
                    tokens.pop(seq), blocks.pop(seq)
                else:
                    slots = pager.append(seq, n)
                    if not ok:
                        if slots is not None:
                            return [f"{where}: {call} needs more blocks than are free; expected None "
                                    f"(nothing changed), got {slots!r}"]
                    else:
                        problem = _slot_problem(slots, seq, n, bs, num_blocks, tokens, blocks)
                        if problem:
                            return [f"{where}: {call} {problem}"]
                got = pager.num_free()
                if got != free_after:
                    return [f"{where}: after {call}, num_free() should be {free_after}, got {got!r}"]
                done.append(call)
        return []

    return verify


def _slot_problem(slots: Any, seq: str, n: int, bs: int, num_blocks: int, tokens: dict, blocks: dict) -> str:
    """What is wrong with ``slots`` for ``n`` new tokens of ``seq`` (and record them), or ''."""
    if type(slots) is not list or len(slots) != n or any(type(s) is not int for s in slots):
        return f"should return a list of {n} slots (ints), got {slots!r}"
    start, held = tokens.get(seq, 0), list(blocks.get(seq, []))
    others = {b for s, bl in blocks.items() if s != seq for b in bl}
    for i, slot in enumerate(slots):
        pos = start + i
        if not 0 <= slot < num_blocks * bs:
            return f"gave slot {slot} to position {pos}, outside the pool's {num_blocks * bs} slots"
        if slot % bs != pos % bs:
            return (f"gave slot {slot} to position {pos}: expected offset {pos % bs} in its block "
                    f"(slot = block_id * {bs} + position % {bs}), got offset {slot % bs}")
        block, logical = slot // bs, pos // bs
        if logical < len(held) and held[logical] != block:
            return (f"gave position {pos} a slot in block {block}, but its logical block {logical} "
                    f"is block {held[logical]}")
        if logical == len(held):
            if block in others or block in held:
                return f"gave position {pos} a slot in block {block}, which another sequence (or block) holds"
            held.append(block)
    tokens[seq], blocks[seq] = start + n, held
    return ""


# --------------------------------------------------------------------------- 04: hash chain and match


@draws_hidden_cases
def cached_tokens_cases(rng) -> Cases:
    """``((token_ids, block_size, key, cached_names), hit)`` for ``cached_tokens``, by ``PrefixCache.match``.

    A cache is filled with a few prompts under random keys (their full blocks named, as
    ``cache_full_blocks`` does); ``cached_names`` are the names it holds. Then prompts of every kind
    that matters: served before whole (exactly full blocks: the len - 1 cap), whole plus one
    token, a shared start then a change, the same tokens under another key, one token, less
    than a block, and a served prompt grown longer. Last, a parent evicted while its child's name
    stays (``allocator.forget``, what an eviction calls; labkit's LRU order evicts leaves first,
    so the checker evicts it itself): the hit stops at the parent, so counting on after a miss fails.
    """
    from ..memory.paging import BlockAllocator
    from ..memory.prefix import CacheKey, PrefixCache

    cases = []
    for round_ in range(2):
        bs = rng.choice([2, 4, 16])
        keys = [CacheKey(), CacheKey(adapter="legal"), CacheKey(salt="tenant-1"), CacheKey(cache_dtype="fp8")]
        # the first round's prompts carry a key other than the default: an answer that hashes without
        # the key then misses their blocks (drawn freely, 1 draw in about 250 let it pass)
        key = rng.choice(keys[1:] if round_ == 0 else keys)
        other = rng.choice([k for k in keys if k != key])
        cache = PrefixCache(BlockAllocator(256), block_size=bs)
        whole = [rng.randrange(50_000) for _ in range(bs * rng.randint(2, 5))]
        served = [(whole, key), (whole[:bs] + [rng.randrange(50_000) for _ in range(2 * bs)], other)]
        tables = []
        for prompt, k in served:
            tables.append(cache.allocate(prompt, k)[0])
            cache.cache_full_blocks(tables[-1])
        changed = list(whole)
        changed[rng.randrange(bs, len(whole))] += 1  # a change after the first block
        prompts = [(whole, key), (whole + [7], key), (changed, key), (whole, other), (whole[:1], key),
                   (whole[:bs - 1] or whole[:1], key), (whole + [rng.randrange(50_000) for _ in range(3 * bs)], key),
                   ([rng.randrange(50_000) for _ in range(3 * bs)], key)]
        for evicted in (False, True):
            if evicted:  # block j of `whole` loses its name, its child j + 1 keeps its own
                j = rng.randrange(len(whole) // bs - 1)
                cache.allocator.forget(tables[0].block_ids[j])
                prompts = [(whole + [7], key), (whole[:(j + 2) * bs] + [rng.randrange(50_000)], key)]
            names = frozenset(entry.block_hash for entry in cache.allocator.names.values())
            for prompt, k in prompts:
                cases.append(((list(prompt), bs, k, names), cache.match(prompt, k).num_cached_tokens))
    return Cases(cases, SHAPES["cached_tokens"])


# --------------------------------------------------------------------------- 05: the budget pass


def _plan_scenarios(rng) -> list[tuple]:
    """Steps drawn afresh, with the edges: nothing to plan; blocks exactly enough; one block short
    (a preemption); the newest request preempting itself; the token budget binding; random ones."""
    scenarios = [([], [], rng.randint(0, 4), rng.randint(1, 16), 4)]
    bs = rng.choice([2, 4, 8])
    # Exactly full: two decodes at block boundaries take the last two free blocks.
    scenarios.append(([("a", 2 * bs, 2, 1), ("b", bs, 1, 1)], [("w", bs)], 2, 64, bs))
    # One short: the same with one free block: b (the newest) is preempted, and w waits.
    scenarios.append(([("a", 2 * bs, 2, 1), ("b", bs, 1, 1)], [("w", bs)], 1, 64, bs))
    # The newest preempts itself: one running request with no room to grow.
    scenarios.append(([("a", bs, 1, 1)], [("w", 1)], 0, 64, bs))
    # A waiting request that does not fit is skipped; a smaller one behind it fits.
    scenarios.append(([], [("big", 3 * bs), ("small", 1)], 1, 64, bs))
    # The budget binds: a long prompt is chunked, the one behind it gets nothing.
    scenarios.append(([], [("p", 5 * bs), ("q", 3)], 20, 2 * bs + 1, bs))
    for _ in range(8):
        bs = rng.choice([2, 4, 8])
        running = []
        for i in range(rng.randint(0, 4)):
            computed = rng.randint(1, 6 * bs)
            held = blocks_needed(computed, bs) + rng.choice([0, 0, 1])
            running.append((f"r{i}", computed, held, rng.choice([1, 1, rng.randint(2, 3 * bs)])))
        waiting = [(f"w{i}", rng.randint(1, 4 * bs)) for i in range(rng.randint(0, 3))]
        scenarios.append((running, waiting, rng.randint(0, 4), rng.randint(1, 6 * bs), bs))
    return scenarios


@draws_hidden_cases
def plan_step_check(rng) -> Verify:
    """``plan_step(running, waiting, free_blocks, token_budget, block_size) -> (planned, preempted)``.

    ``running``: ``[(name, computed, held, new_tokens)]`` oldest first; ``waiting``: ``[(name, prompt_len)]``
    in order. ``planned``: ``[(name, tokens)]`` in planning order; ``preempted``: names in the order preempted.
    """
    from ..serving.pieces import plan_step

    scenarios = [(s, plan_step(*s)) for s in _plan_scenarios(rng)]

    def verify(plan_step: Callable) -> list[str]:
        if problem := SHAPES["plan_step"].problem(plan_step):
            return [problem]
        for (running, waiting, free, budget, bs), (planned, preempted) in scenarios:
            got = plan_step([tuple(r) for r in running], [tuple(w) for w in waiting], free, budget, bs)
            ok = type(got) is tuple and len(got) == 2 and all(type(x) is list for x in got)
            got_plain = ([tuple(p) for p in got[0]], list(got[1])) if ok else got
            if not ok or got_plain != (planned, preempted):
                return [f"running {running}, waiting {waiting}, {free} free blocks, a budget of {budget} tokens, "
                        f"blocks of {bs}: expected (planned, preempted) = {(planned, preempted)}, got {got_plain!r}"]
        return []

    return verify


# --------------------------------------------------------------------------- 06: latencies from a step trace


def _trace(rng) -> tuple[list[float], list[tuple[float, float, list[int]]], tuple]:
    """Serve a small workload drawn afresh with the ``Simulator`` (every step, a pool tight enough to
    preempt): the arrivals, the step trace ``[(start, end, sampled request indices)]``, and labkit's
    ``(ttft, tpot, sorted itl)``."""
    from ..serving.sim.costmodel import CostModel
    from ..serving.sim.simulator import Simulator
    from ..serving.sim.workloads import RequestSpec

    n = rng.randint(4, 7)
    arrivals = sorted(rng.uniform(0.0, 0.05) for _ in range(n - 1)) + [1.0 + rng.random()]  # the last after a gap
    outputs = [1] + [rng.randint(2, 12) for _ in range(n - 1)]  # one request with a single token
    rng.shuffle(outputs)
    specs = [RequestSpec(i, arrivals[i], [rng.randrange(1, 50_000) for _ in range(rng.randint(5, 30))], outputs[i])
             for i in range(n)]
    sim = Simulator(CostModel("teaching model", "RTX 4090 (24 GiB)"), num_blocks=rng.randint(12, 14), block_size=4,
                    max_num_batched_tokens=32, skip_ahead=False, record_schedule=True, enable_prefix_caching=False)
    run = sim.run(specs)
    known = {i: len(specs[i].prompt_token_ids) for i in range(n)}
    steps = []
    for start, end, chunks in zip(run.step_start, run.step_end, run.schedule):
        sampled = []
        for request_id, first, num, _ in chunks:
            if first + num == known[request_id]:  # the chunk reaches its last known token: it samples
                sampled.append(request_id)
                known[request_id] += 1
        steps.append((float(start), float(end), sampled))
    ttft = [float(x) for x in run.ttft]
    tpot = [None if k == 1 else float((f - t) / (k - 1)) for f, t, k in zip(run.finish, run.first_token, run.output_len)]
    return arrivals, steps, (ttft, tpot, sorted(float(x) for x in run.itl))


@draws_hidden_cases
def latencies_check(rng) -> Verify:
    """``latencies(arrivals, steps) -> (ttft, tpot, itl)`` on two simulated traces drawn afresh.

    ``ttft[i]``: first token's step end minus arrival; ``tpot[i]``: mean interval between request
    i's tokens (``None`` for one token); ``itl``: every interval between two tokens of one request,
    pooled and sorted. Compared with the simulator's own records within 1e-9 s.
    """
    traces = [_trace(rng) for _ in range(2)]

    def close(a: Any, b: Any) -> bool:
        if b is None or a is None:
            return a is b
        return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isclose(a, b, abs_tol=1e-9)

    def verify(latencies: Callable) -> list[str]:
        if problem := SHAPES["latencies"].problem(latencies):
            return [problem]
        for arrivals, steps, (ttft, tpot, itl) in traces:
            got = latencies(list(arrivals), [(s, e, list(ids)) for s, e, ids in steps])
            where = f"{len(arrivals)} requests arriving at {[round(a, 3) for a in arrivals]} s, {len(steps)} steps"
            if type(got) is not tuple or len(got) != 3 or not all(type(x) is list for x in got):
                return [f"{where}: expected a tuple of three lists (ttft, tpot, itl), got {type(got).__name__}"]
            for label, want, have in (("ttft", ttft, got[0]), ("tpot", tpot, got[1])):
                if len(have) != len(want):
                    return [f"{where}: {label} should hold {len(want)} values, one per request, got {len(have)}"]
                for i, (w, h) in enumerate(zip(want, have)):
                    if not close(h, w):
                        return [f"{where}: {label}[{i}] (request {i}) expected {w if w is None else round(w, 6)}, "
                                f"got {h!r}"]
            have = sorted(got[2]) if all(isinstance(x, (int, float)) for x in got[2]) else got[2]
            if len(have) != len(itl) or not all(close(h, w) for h, w in zip(have, itl)):
                return [f"{where}: itl expected {len(itl)} intervals {[round(x, 6) for x in itl][:6]}..., "
                        f"got {len(have)}: {[round(x, 6) if isinstance(x, float) else x for x in have][:6]}..."]
        return []

    return verify


# --------------------------------------------------------------------------- A3: quantize a block


@draws_hidden_cases
def kv_quant_cases(rng, seed: int | None = None, draws: int = 3) -> list[dict]:
    """Hidden cases for appendix A3's exercise (int8 with per-block scales), drawn at random, with labkit's answers.

    Each case is a pool ``x`` [num_blocks, block_size, num_kv_heads, head_dim] of random shape
    whose first block is all zeros and whose second holds one outlier, its per-(block, head)
    ``scales`` [num_blocks, num_kv_heads], its ``codes``, the ``values`` they give back, and the
    codes for ``stale`` scales, half the right ones: a scale fixed before larger values came (as a
    calibrated per-tensor scale is), which the values then exceed. ``seed`` None: a fresh draw (from ``rng``).
    """
    from ..memory.formats import KVQuant, dequantize, quantize

    if seed is not None:
        check_int("seed", seed, 0)
    check_int("draws", draws, 1)
    gen = torch.Generator()
    gen.manual_seed(rng.getrandbits(62) if seed is None else seed)  # not torch's global generator: a cell seeds that
    q, cases = KVQuant("int8", "block"), []
    for _ in range(draws):
        nb, bs, heads, d = (int(torch.randint(lo, hi, (), generator=gen)) for lo, hi in ((3, 7), (2, 9), (1, 4), (4, 33)))
        x = torch.randn(nb, bs, heads, d, generator=gen) * torch.rand(nb, 1, heads, 1, generator=gen) * 4
        x[0] = 0.0
        x[1, int(torch.randint(0, bs, (), generator=gen)), 0, 0] = 40.0
        scales = x.abs().amax(dim=(1, 3)) / q.qmax
        wide = scales[:, None, :, None]
        codes = quantize(x, wide, "int8")
        cases.append(dict(x=x, scales=scales, codes=codes, values=dequantize(codes, wide),
                          stale=scales / 2, stale_codes=quantize(x, wide / 2, "int8")))
    return cases


def kv_quant_problems(answer, cases: list[dict]) -> list[str]:
    """What the reader's ``(block_scales, quantize, dequantize)`` get wrong on ``cases``, as sentences.

    ``block_scales(x)`` -> [num_blocks, num_kv_heads]; ``quantize(x, scales)`` -> int8 codes of x
    for per-block ``scales`` [num_blocks, num_kv_heads]; ``dequantize(codes, scales)`` -> float32.
    Only the reader's functions run here (the answers were computed before). An ``answer`` of another
    shape (not three functions taking those arguments) gets one sentence saying what was expected.
    """
    _check_kv_quant_cases(cases)
    if problem := _kv_quant_shape_problem(answer):
        return [problem]
    block_scales, quantize_fn, dequantize_fn = answer
    problems: list[str] = []
    for i, c in enumerate(cases):
        where = f"case {i + 1} (x of shape {tuple(c['x'].shape)})"
        s = block_scales(c["x"].clone())
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != tuple(c["scales"].shape):
            problems.append(f"{where}: block_scales gave {getattr(s, 'shape', type(s).__name__)}, expected a tensor "
                            f"of shape {tuple(c['scales'].shape)} (one scale per block and KV head)")
            continue
        if not torch.allclose(s.double(), c["scales"].double(), rtol=1e-6, atol=0):
            problems.append(f"{where}: block_scales differ, e.g. {s.flatten()[:3].tolist()} instead of "
                            f"{c['scales'].flatten()[:3].tolist()} (max |x| of each block and head, over 127)")
        codes = quantize_fn(c["x"].clone(), c["scales"].clone())
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.int8 or codes.shape != c["x"].shape:
            problems.append(f"{where}: quantize must return int8 codes shaped like x, got "
                            f"{getattr(codes, 'dtype', type(codes).__name__)} {tuple(getattr(codes, 'shape', ()))}")
            continue
        if not torch.equal(codes, c["codes"]):
            bad = (codes != c["codes"]).sum()
            problems.append(f"{where}: quantize gave {int(bad)} wrong codes (round to nearest, not toward zero; "
                            "an all-zero block has scale 0 and codes 0)")
        stale = quantize_fn(c["x"].clone(), c["stale"].clone())
        if not torch.equal(stale, c["stale_codes"]):
            problems.append(f"{where}: with scales too small for the values, quantize gave "
                            f"{int((stale != c['stale_codes']).sum())} wrong codes (clamp to -127..127 before the "
                            "cast: int8 wraps 200 round to -56)")
        values = dequantize_fn(c["codes"].clone(), c["scales"].clone())
        if not isinstance(values, torch.Tensor) or values.shape != c["x"].shape or \
                not torch.allclose(values.double(), c["values"].double(), rtol=1e-6, atol=1e-12):
            problems.append(f"{where}: dequantize differs from codes x the scale of their block and head")
    return problems


_KV_QUANT_KEYS = {"x", "scales", "codes", "values", "stale", "stale_codes"}


def _check_kv_quant_cases(cases: Any) -> None:
    """``cases`` must be what ``kv_quant_cases`` returns: a non-empty list of dicts with its keys."""
    if type(cases) is not list or not cases or not all(type(c) is dict and c.keys() == _KV_QUANT_KEYS for c in cases):
        raise ValueError(f"cases must be a non-empty list from kv_quant_cases() (dicts with keys "
                         f"{sorted(_KV_QUANT_KEYS)}), got {type(cases).__name__}")


def _kv_quant_shape_problem(answer: Any) -> str:
    """'' when ``answer`` is three functions ``(block_scales, quantize, dequantize)``, else what was expected."""
    shapes = [SHAPES[n] for n in ("block_scales", "quantize", "dequantize")]
    if type(answer) not in (tuple, list) or len(answer) != 3:
        return (f"expected a tuple of three functions ({', '.join(str(s).removeprefix('a function ') for s in shapes)})"
                f"; got {described(answer)}")
    return next((p for p in map(AnswerShape.problem, shapes, answer) if p), "")
