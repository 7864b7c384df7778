"""Each checker can fail: the build-it exercises, the value exercises and the quizzes (issue 27).

The build-it checkers are taken from the book as ``test_exercise_checkers`` takes them (the
solutions pass strictly, the stubs wait there); here every exercise gets at least three answers a
learner might write, each wrong in one way, and each must get a ❌.
"""

from __future__ import annotations

import ast
import math
import random
import re
from pathlib import Path

import pytest
import torch

from labkit.memory.prefix import CacheKey, block_hash
from labkit.model.decoder import apply_rope, rope_cos_sin
from labkit.teaching import answers, build_it, guards, quizzes
from labkit.teaching.build_it_routing import WRONG_ROUTES
from labkit.teaching.build_it_tiers import WRONG_DECISIONS
from labkit.teaching.exercises import Exercises
from test_exercise_checkers import chapter, verdict

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- 01: one decode step


def _attend(q, keys, values, scale=True, interleave=True):
    group = q.shape[0] // keys.shape[1]
    spread = (lambda t: t.repeat_interleave(group, 1)) if interleave else (lambda t: t.repeat(1, group, 1))
    scores = torch.einsum("hd,thd->ht", q, spread(keys)) / (q.shape[-1] ** 0.5 if scale else 1.0)
    return torch.einsum("ht,thd->hd", scores.softmax(-1), spread(values))


def _rope(x, position, inv_freq):
    """x [heads, D] rotated to ``position`` with labkit's own RoPE, as the chapter's solution does."""
    cos, sin = rope_cos_sin(torch.tensor([[position]]), inv_freq)
    return apply_rope(x[None, None], cos, sin)[0, 0]


def _step(k_cache, v_cache, q, k, v, inv_freq, position=None, rope_q=True, rope_k=True, **attend):
    """The chapter's decode step, each rule switchable; ``position`` defaults to the right one, the cache length."""
    position = k_cache.shape[0] if position is None else position
    q = _rope(q, position, inv_freq) if rope_q else q
    k = _rope(k, position, inv_freq) if rope_k else k
    k_cache, v_cache = torch.cat([k_cache, k[None]]), torch.cat([v_cache, v[None]])
    return k_cache, v_cache, _attend(q, k_cache, v_cache, **attend)


def attends_before_appending_01(k_cache, v_cache, q, k, v, inv_freq):
    position = k_cache.shape[0]
    q, k = _rope(q, position, inv_freq), _rope(k, position, inv_freq)
    out = _attend(q, k_cache, v_cache)  # the new token does not see itself (and the first step sees nothing)
    return torch.cat([k_cache, k[None]]), torch.cat([v_cache, v[None]]), out


def unscaled_01(k_cache, v_cache, q, k, v, inv_freq):
    return _step(k_cache, v_cache, q, k, v, inv_freq, scale=False)


def heads_tiled_01(k_cache, v_cache, q, k, v, inv_freq):
    return _step(k_cache, v_cache, q, k, v, inv_freq, interleave=False)


def newest_only_01(k_cache, v_cache, q, k, v, inv_freq):
    # the cache is replaced, not appended to (the position is still the right one)
    return _step(k_cache[:0], v_cache[:0], q, k, v, inv_freq, position=k_cache.shape[0])


def position_0_always_01(k_cache, v_cache, q, k, v, inv_freq):
    return _step(k_cache, v_cache, q, k, v, inv_freq, position=0)  # as if every token came first


def position_off_by_one_01(k_cache, v_cache, q, k, v, inv_freq):
    return _step(k_cache, v_cache, q, k, v, inv_freq, position=k_cache.shape[0] + 1)  # counted after the append


def rope_on_q_only_01(k_cache, v_cache, q, k, v, inv_freq):
    return _step(k_cache, v_cache, q, k, v, inv_freq, rope_k=False)


def test_an_off_by_one_position_is_invisible_to_attention_alone():
    """Why the checker compares the stored keys and starts a sequence after a prefill: every position
    shifted by one leaves each output of a sequence fed from an empty cache as it was (RoPE's scores
    depend on distances only), while every stored key is rotated to the wrong angle."""
    from labkit.model.decoder import DecoderConfig, rope_inv_freq

    g = torch.Generator().manual_seed(0)
    inv_freq = rope_inv_freq(DecoderConfig(head_dim=16))
    q, k, v = (torch.randn(12, heads, 16, generator=g) for heads in (4, 2, 2))
    right = shifted = (torch.empty(0, 2, 16), torch.empty(0, 2, 16))
    for t in range(12):
        *right, out = _step(*right, q[t], k[t], v[t], inv_freq)
        *shifted, shifted_out = position_off_by_one_01(*shifted, q[t], k[t], v[t], inv_freq)
        torch.testing.assert_close(shifted_out, out, atol=1e-5, rtol=1e-5)
    assert (shifted[0] - right[0]).abs().max() > 0.1 and torch.equal(shifted[1], right[1])


# --------------------------------------------------------------------------- 02: sequences that fit a device


def _fits(device_gib, reserved_gib, context_len, gib=1024**3, per_token=2 * 32 * 8 * 128 * 2, reserve=True,
          whole_gib=False, count=lambda x: int(x // 1)):
    pool = (device_gib - (reserved_gib if reserve else 0)) * gib
    pool = int(device_gib - reserved_gib) * gib if whole_gib else pool
    return count(pool / (context_len * per_token))


def reserve_ignored_02(d, r, t):
    return _fits(d, r, t, reserve=False)


def decimal_gigabytes_02(d, r, t):
    return _fits(d, r, t, gib=10**9)


def query_heads_in_fits_02(d, r, t):
    return _fits(d, r, t, per_token=2 * 32 * 32 * 128 * 2)  # 32 query heads for 8 KV heads


def rounded_02(d, r, t):
    return _fits(d, r, t, count=round)  # a sequence that almost fits counts


def not_whole_sequences_02(d, r, t):
    return _fits(d, r, t, count=lambda x: x)  # 6.5 sequences


def whole_gib_only_02(d, r, t):
    return _fits(d, r, t, whole_gib=True)  # a pool of 7.75 GiB taken as 7


# --------------------------------------------------------------------------- 02: the formula from a config.json


def _config_bytes(config, kv_key="num_key_value_heads", derive_head_dim=False, kv_default=None, sizes=None, factor=2):
    query_heads = config["num_attention_heads"]
    kv_heads = config.get(kv_key, query_heads if kv_default is None else kv_default)
    derived = config["hidden_size"] // query_heads
    head_dim = derived if derive_head_dim else config.get("head_dim", derived)
    element = (sizes or {"float32": 4, "bfloat16": 2, "float16": 2})[config["torch_dtype"]]
    return factor * config["num_hidden_layers"] * kv_heads * head_dim * element


def query_heads_02(config):
    return _config_bytes(config, kv_key="num_attention_heads")  # the GQA mistake


def head_dim_always_derived_02(config):
    return _config_bytes(config, derive_head_dim=True)


def one_kv_head_by_default_02(config):
    return _config_bytes(config, kv_default=1)  # a missing num_key_value_heads read as multi-query


def two_bytes_always_02(config):
    return _config_bytes(config, sizes={"float32": 2, "bfloat16": 2, "float16": 2})


def no_factor_2_02(config):
    return _config_bytes(config, factor=1)  # K only


# --------------------------------------------------------------------------- A3: windowed and latent caches


def _bytes(shape, length, factor=None, every_layer=False, op=min, window=True):
    per_layer = (factor or (1 if shape.latent else 2)) * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes
    windowed = (shape.num_layers if every_layer else len(shape.sliding_layers)) if shape.sliding_layers and window else 0
    kept = op(length, shape.sliding_window) if windowed else length
    return ((shape.num_layers - windowed) * length + windowed * kept) * per_layer


def latent_with_factor_2_a3(shape, length):
    return _bytes(shape, length, factor=2)


def window_in_every_layer_a3(shape, length):
    return _bytes(shape, length, every_layer=True)


def max_for_min_a3(shape, length):
    return _bytes(shape, length, op=max)


def window_ignored_a3(shape, length):
    return _bytes(shape, length, window=False)


# --------------------------------------------------------------------------- 03: allocator and block tables


class _Pager:
    """The solution's shape, with one rule to break in each subclass."""

    def __init__(self, num_blocks, block_size):
        self.block_size, self.free_ids, self.tables = block_size, list(range(num_blocks)), {}

    def num_free(self):
        return len(self.free_ids)

    def new_blocks(self, tokens, n, held):
        return -(-(tokens + n) // self.block_size) - held

    def append(self, seq_id, n):
        blocks, tokens = self.tables.get(seq_id, ([], 0))
        new = self.new_blocks(tokens, n, len(blocks))
        if new > len(self.free_ids):
            return None
        blocks = blocks + [self.free_ids.pop() for _ in range(new)]
        self.tables[seq_id] = (blocks, tokens + n)
        return [self.slot(blocks, p) for p in range(tokens, tokens + n)]

    def slot(self, blocks, p):
        return blocks[p // self.block_size] * self.block_size + p % self.block_size

    def free(self, seq_id):
        blocks, _ = self.tables.pop(seq_id)
        self.free_ids.extend(blocks)


class NeverFrees03(_Pager):
    def free(self, seq_id):
        self.tables.pop(seq_id)


class OffByOneSlot03(_Pager):
    def slot(self, blocks, p):
        return super().slot(blocks, p) + 1


class FloorBlocks03(_Pager):
    def new_blocks(self, tokens, n, held):
        return max(0, (tokens + n) // self.block_size - held)


class TakesBeforeRefusing03(_Pager):
    def append(self, seq_id, n):
        blocks, tokens = self.tables.get(seq_id, ([], 0))
        new = self.new_blocks(tokens, n, len(blocks))
        taken = [self.free_ids.pop() for _ in range(min(new, len(self.free_ids)))]  # taken, then refused
        if len(taken) < new:
            return None
        blocks = blocks + taken
        self.tables[seq_id] = (blocks, tokens + n)
        return [self.slot(blocks, p) for p in range(tokens, tokens + n)]


# --------------------------------------------------------------------------- 04: hash chain and match


def _hits(token_ids, block_size, key, cached, cap=True, parent_chain=True, stop_at_a_miss=True):
    parent, hit = None, 0
    for i in range(((len(token_ids) - 1) if cap else len(token_ids)) // block_size):
        parent = block_hash(parent if parent_chain else None, token_ids[i * block_size:(i + 1) * block_size], key)
        if parent not in cached:
            if stop_at_a_miss:
                break
            continue
        hit += block_size
    return hit


def no_len_minus_1_cap_04(token_ids, block_size, key, cached):
    return _hits(token_ids, block_size, key, cached, cap=False)


def key_ignored_04(token_ids, block_size, key, cached):
    return _hits(token_ids, block_size, CacheKey(), cached)


def no_parent_04(token_ids, block_size, key, cached):
    return _hits(token_ids, block_size, key, cached, parent_chain=False)


def keeps_counting_after_a_miss_04(token_ids, block_size, key, cached):
    return _hits(token_ids, block_size, key, cached, stop_at_a_miss=False)  # a cached child of an evicted parent


# --------------------------------------------------------------------------- 05: the budget pass


def _plan(running, waiting, free, budget, bs, blocks_count=True, skip=True, newest=True, gate=True):
    planned, preempted, live = [], [], list(running)

    def blocks(c, h, t):
        return max(0, -(-(c + t) // bs) - h) if blocks_count else 0

    i = 0
    while i < len(live) and budget:
        name, c, h, new = live[i]
        tokens = min(new, budget)
        while blocks(c, h, tokens) > free:
            victim = live.pop() if newest else live.pop(0)
            free += victim[2]
            preempted.append(victim[0])
            if victim[0] == name or not live:
                break
        if name not in preempted:
            planned.append((name, tokens))
            free -= blocks(c, h, tokens)
            budget -= tokens
        i += 1
    for name, p in [] if preempted and gate else waiting:
        tokens = min(p, budget)
        if tokens == 0:
            break
        if blocks(0, 0, tokens) <= free:
            planned.append((name, tokens))
            free -= blocks(0, 0, tokens)
            budget -= tokens
        elif not skip:
            break
    return planned, preempted


def ignores_blocks_05(*args):
    return _plan(*args, blocks_count=False)


def stops_at_a_misfit_05(*args):
    return _plan(*args, skip=False)


def preempts_the_oldest_05(*args):
    return _plan(*args, newest=False)


def admits_after_a_preemption_05(*args):
    return _plan(*args, gate=False)


# --------------------------------------------------------------------------- 06: latencies from a trace


def _latencies(arrivals, steps, at_start=False, tpot_by_n=False, itl_from_arrival=False, itl_means=False):
    first, last, count, itl = {}, {}, {}, []
    for start, end, sampled in steps:
        for i in sampled:
            if i in first:
                itl.append(end - last[i])
            else:
                first[i] = start if at_start else end
                if itl_from_arrival:
                    itl.append(end - arrivals[i])
            last[i], count[i] = end, count.get(i, 0) + 1
    ttft = [first[i] - a for i, a in enumerate(arrivals)]
    tpot = [None if count[i] == 1 else (last[i] - first[i]) / (count[i] if tpot_by_n else count[i] - 1)
            for i in range(len(arrivals))]
    return ttft, tpot, sorted(t for t in tpot if t is not None) if itl_means else sorted(itl)


def ttft_to_the_step_start_06(arrivals, steps):
    return _latencies(arrivals, steps, at_start=True)


def tpot_over_all_tokens_06(arrivals, steps):
    return _latencies(arrivals, steps, tpot_by_n=True)


def itl_with_the_first_wait_06(arrivals, steps):
    return _latencies(arrivals, steps, itl_from_arrival=True)


def itl_as_request_means_06(arrivals, steps):
    return _latencies(arrivals, steps, itl_means=True)


WRONG_FITS_02 = (reserve_ignored_02, decimal_gigabytes_02, query_heads_in_fits_02, rounded_02, not_whole_sequences_02,
                 whole_gib_only_02)
WRONG_CACHED_TOKENS_04 = (no_len_minus_1_cap_04, key_ignored_04, no_parent_04, keeps_counting_after_a_miss_04)

WRONG = [
    ("01_why_the_cache_grows", "Exercise 3", f) for f in
    (attends_before_appending_01, unscaled_01, heads_tiled_01, newest_only_01, position_0_always_01,
     position_off_by_one_01, rope_on_q_only_01)] + [
    ("02_cost_per_token", "Exercise 3", f) for f in WRONG_FITS_02] + [
    ("02_cost_per_token", "Exercise 4", f) for f in
    (query_heads_02, head_dim_always_derived_02, one_kv_head_by_default_02, two_bytes_always_02, no_factor_2_02)] + [
    ("03_paging", "Exercise 4", f) for f in (NeverFrees03, OffByOneSlot03, FloorBlocks03, TakesBeforeRefusing03)] + [
    ("04_prefix_reuse", "Exercise 1", f) for f in WRONG_CACHED_TOKENS_04] + [
    ("05_scheduler", "Exercise 2", f) for f in
    (ignores_blocks_05, stops_at_a_misfit_05, preempts_the_oldest_05, admits_after_a_preemption_05)] + [
    ("06_from_fit_to_serve", "Exercise 3", f) for f in
    (ttft_to_the_step_start_06, tpot_over_all_tokens_06, itl_with_the_first_wait_06, itl_as_request_means_06)] + [
    ("07_many_replicas", "Exercise 1", f) for f in WRONG_ROUTES.values()] + [
    ("08_moving_the_cache", "Exercise 1", f) for f in WRONG_DECISIONS.values()] + [
    ("A3_fewer_bytes_per_element", "Exercise 2", f) for f in
    (latent_with_factor_2_a3, window_in_every_layer_a3, max_for_min_a3, window_ignored_a3)]


@pytest.mark.parametrize("stem, exercise, wrong", WRONG, ids=[w.__name__ for _, _, w in WRONG])
def test_a_wrong_build_it_answer_gets_a_cross(stem, exercise, wrong):
    """Run on fresh hidden cases each time: three draws, each must refuse the answer."""
    chapter(stem)  # the solution passed, strictly, while the chapter's cells ran
    for _ in range(3):
        out = verdict(stem, exercise, wrong)
        assert out.startswith(f"❌ {exercise}"), out


def test_every_wrong_answer_is_right_elsewhere():
    """The wrong answers differ from the solution in one rule only: their shared helpers are right."""
    from labkit.teaching import build_it

    ex = Exercises("x", strict=True)
    ex.check_behaviour("01", _step, build_it.decode_step_check())
    ex.check_function("02", _fits, build_it.fits_cases())
    ex.check_function("02", _config_bytes, build_it.config_bytes_cases())
    ex.check_behaviour("03", _Pager, build_it.pager_check())
    ex.check_function("04", _hits, build_it.cached_tokens_cases())
    ex.check_behaviour("05", _plan, build_it.plan_step_check())
    ex.check_behaviour("06", _latencies, build_it.latencies_check())
    ex.check_function("A3", _bytes, build_it.sequence_bytes_cases())


# --------------------------------------------------------------------------- cases no cell can replay (issue 39)


# every function of build_it that draws cases (all but the A3 comparison and the two names that are not checkers)
DRAWING = [name for name in build_it.__all__ if name not in ("kv_quant_problems", "Cases", "SHAPES")]


def _drawn(name: str) -> str:
    """What one run of the checker ``name`` drew, as text: its cases, or what its verifier keeps in its closure."""
    drawn = getattr(build_it, name)()
    if callable(drawn):
        drawn = [cell.cell_contents for cell in drawn.__closure__ or () if not callable(cell.cell_contents)]
    return repr(drawn)


def _seed_every_global_generator() -> None:
    import numpy

    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)


@pytest.mark.parametrize("name", DRAWING)
def test_no_cell_can_replay_a_checkers_cases(name, monkeypatch):
    """Issue 39: a cell that seeds every global generator before each run, or swaps the module attribute
    the checkers once drew from for a generator seeded alike every time, still gets new cases each run."""
    runs = []
    for _ in range(2):
        _seed_every_global_generator()
        runs.append(_drawn(name))
    assert runs[0] != runs[1]

    def seeded_alike(*args):
        return random.Random(0)

    monkeypatch.setattr(guards, "hidden_rng", seeded_alike)
    monkeypatch.setattr(build_it, "hidden_rng", seeded_alike, raising=False)
    monkeypatch.setattr(random, "SystemRandom", seeded_alike)
    assert guards.hidden_rng().random() == guards.hidden_rng().random()  # the swap took: it replays
    assert _drawn(name) != _drawn(name)


def _decorator_names(fn: ast.FunctionDef) -> set[str]:
    return {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in fn.decorator_list}


def test_the_books_own_checkers_take_their_generator_from_draws_hidden_cases():
    """Issue 39: the checkers written in a chapter's source draw as labkit's do. A function there that
    draws cases takes ``rng`` first and is wrapped by ``draws_hidden_cases`` (so no later cell can swap
    the generator it gets); none calls ``hidden_rng`` by a name a cell could rebind."""
    drawing = []
    for source in sorted((ROOT / "book").glob("*.py")):
        tree = ast.parse(source.read_text())
        assert "hidden_rng" not in source.read_text(), f"{source.name} names hidden_rng"
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            params = [a.arg for a in fn.args.args]
            names = [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == "rng"]
            free = names and not any(isinstance(n.ctx, ast.Store) for n in names)  # rng from outside the function
            wrapped = "draws_hidden_cases" in _decorator_names(fn)
            if wrapped or (free and "rng" not in params and fn in tree.body):
                assert params[:1] == ["rng"] and wrapped, f"{source.name}: {fn.name} draws cases without its own generator"
                drawing.append(fn.name)
    assert len(drawing) >= 9  # 01, 03 (two), 04, 05 (two), 06 (two), A1


def test_the_hidden_generator_ignores_a_seed():
    rng = guards.hidden_rng()
    rng.seed(0)
    first = [rng.random() for _ in range(3)]
    rng.seed(0)
    assert first != [rng.random() for _ in range(3)]


# --------------------------------------------------------------------------- an answer of the wrong shape (issue 38)


class PagerWithoutFree03(_Pager):
    """Everything but ``free``: the checker calls it only after several appends."""

    free = None


class PagerWithAFreeOfNoArgument03(_Pager):
    def free(self):
        self.tables.clear()


# (chapter, exercise, what the ❌ must name): each build-it checker, taken from the book
BUILD_IT = [("01_why_the_cache_grows", "Exercise 3",
             "a function decode_step(k_cache, v_cache, q, k, v, inv_freq)"),
            ("02_cost_per_token", "Exercise 3", "a function fits(device_gib, reserved_gib, context_len)"),
            ("02_cost_per_token", "Exercise 4", "a function bytes_per_token_from_config(config)"),
            ("03_paging", "Exercise 4", "a class Pager(num_blocks, block_size) with the methods append(seq_id, n), "
                                        "free(seq_id), num_free()"),
            ("04_prefix_reuse", "Exercise 1", "a function cached_tokens(token_ids, block_size, key, cached)"),
            ("05_scheduler", "Exercise 2", "a function plan_step(running, waiting, free_blocks, token_budget, "
                                           "block_size)"),
            ("06_from_fit_to_serve", "Exercise 3", "a function latencies(arrivals, steps)"),
            ("07_many_replicas", "Exercise 1", "a function route(prompt, sent, loads, block_size, cache_threshold, "
                                               "balance_abs_threshold, balance_rel_threshold)"),
            ("08_moving_the_cache", "Exercise 1", "a function reload_or_recompute(tier_tokens, cached_tokens, "
                                                  "suffix_tokens, bytes_per_token, tier, cost_model)"),
            ("A3_fewer_bytes_per_element", "Exercise 2", "a function sequence_bytes(shape, length)")]


def _wrong_shapes(stem: str) -> list[tuple[object, str]]:
    """(answer, how the ❌ must describe it): a number, a function of no arguments, and for the
    class exercise a class missing a method and one whose method takes the wrong arguments."""
    shapes = [(42, "got int 42")]
    if stem != "03_paging":
        shapes += [(lambda: None, "got function <lambda>(), which cannot be called with")]
    else:
        shapes += [(lambda: None, "got function <lambda>()."),  # a function where a class is expected
                   (PagerWithoutFree03, "got class PagerWithoutFree03, which has no method free"),
                   (PagerWithAFreeOfNoArgument03, "whose free cannot be called with (seq_id)"),
                   (_Pager(4, 2), "got _Pager object (an instance: hand in the class itself)")]
    return shapes


@pytest.mark.parametrize("stem, exercise, expected", BUILD_IT, ids=[s for s, _, _ in BUILD_IT])
def test_a_build_it_answer_of_the_wrong_shape_is_told_what_was_expected(stem, exercise, expected):
    """Issue 38: ``plan_step_check()`` with the answer 42 said "your code raised TypeError", an error the
    checker caused by calling 42. Now each checker says what it expected, before any hidden case runs."""
    chapter(stem)  # the solution passed, strictly
    for answer, got in _wrong_shapes(stem):
        out = verdict(stem, exercise, answer)
        assert out.startswith(f"❌ {exercise}: not yet. expected {expected}; "), out
        assert got in out and "your code raised" not in out, out
    with pytest.raises(AssertionError, match=f"expected {re.escape(expected)}; got int 42"):
        _, ex = chapter(stem)
        method, args, kwargs = ex.calls[exercise]
        getattr(Exercises(stem, strict=True), method)(exercise, 42, *args, **kwargs)


def test_a_verifier_called_directly_says_what_it_expected():
    """The verifier itself checks the shape, so it needs no Exercises around it."""
    from labkit.teaching import build_it

    assert build_it.plan_step_check()(42) == [
        "expected a function plan_step(running, waiting, free_blocks, token_budget, block_size); got int 42"]
    assert build_it.pager_check()(_Pager) == []  # the right shape, the right behaviour


def test_a3s_checker_says_it_expected_three_functions(capsys):
    from labkit.teaching import build_it

    cases = build_it.kv_quant_cases(seed=0, draws=1)
    ex = Exercises("A3_fewer_bytes_per_element")
    right = (lambda x: x.abs().amax(dim=(1, 3)) / 127,
             lambda x, s: torch.round(x / torch.where(s > 0, s, 1)[:, None, :, None]).clamp(-127, 127).to(torch.int8),
             lambda c, s: c.float() * s[:, None, :, None])
    for answer, says in ((42, "expected a tuple of three functions (block_scales(x), quantize(x, scales), "
                               "dequantize(codes, scales)); got int 42"),
                         (right[:2], "got tuple ("),
                         ((right[0], 42, right[2]), "expected a function quantize(x, scales); got int 42"),
                         ((right[0], lambda x: x, right[2]), "expected a function quantize(x, scales); got function "
                                                              "<lambda>(x), which cannot be called with")):
        ex.check_behaviour("Exercise 1", answer, lambda a: build_it.kv_quant_problems(a, cases))
        out = capsys.readouterr().out
        assert out.startswith("❌ Exercise 1") and says in out and "your code raised" not in out, out
    ex.check_behaviour("Exercise 1", right, lambda a: build_it.kv_quant_problems(a, cases))
    assert capsys.readouterr().out.startswith("✅ Exercise 1")


def test_an_error_raised_by_the_readers_code_is_still_the_readers():
    """The shape is right; the answer itself raises: that stays "your code raised"."""
    def plan_step(running, waiting, free_blocks, token_budget, block_size):
        return {}[running]

    out = verdict("05_scheduler", "Exercise 2", plan_step)
    assert "your code raised TypeError: unhashable type: 'list'" in out, out


# --------------------------------------------------------------------------- value exercises


def _book(stem: str) -> str:
    return (ROOT / "book" / f"{stem}.py").read_text()


def test_no_reader_cell_holds_an_expected_value():
    """Every value checker in the book names its exercise; labkit.teaching.answers computes the value."""
    stems = sorted(p.stem for p in (ROOT / "book").glob("*.py"))
    named = []
    for stem in stems:
        source = _book(stem)
        assert "expected=" not in re.sub(r"(?m)^#.*$", "", source.split("ex = Exercises(")[-1]), stem
        named += [(stem, name) for name in re.findall(r'ex\.check\("([^"]+)"', source)]
    assert sorted(named) == sorted(answers.EXERCISES), sorted(set(named) ^ set(answers.EXERCISES))


def test_a_value_checker_refuses_a_wrong_value(capsys):
    ex = Exercises("02_cost_per_token")
    ex.check("Exercise 1", None)
    right, _ = answers.expected("02_cost_per_token", "Exercise 1")
    ex.check("Exercise 1", 2 * 28 * 28 * 128 * 2)  # the query heads in place of the KV heads
    ex.check("Exercise 1", right)
    lines = capsys.readouterr().out.splitlines()
    assert [line[0] for line in lines] == ["⏳", "❌", "✅"], lines
    with pytest.raises(ValueError, match="name must be one of the value exercises"):
        answers.expected("02_cost_per_token", "Exercise 9")


# --------------------------------------------------------------------------- quizzes


def _quiz(stem: str, side: str) -> dict:
    source = _book(stem)
    tag = "SOLUTION" if side == "solutions" else "STUB"
    block = re.search(rf"# BEGIN {tag}\n(quiz = .*?)\n# END {tag}", source, re.S).group(1)
    return ast.literal_eval(block.split("=", 1)[1].split("#")[0].strip())


@pytest.mark.parametrize("stem", sorted(quizzes.QUIZZES))
def test_each_quiz_waits_refuses_and_passes(stem, capsys):
    questions = quizzes.QUIZZES[stem]
    assert 3 <= len(questions) <= 5 and "**Quiz.**" in _book(stem)
    Exercises(stem).quiz(_quiz(stem, "chapters"))
    assert all(line.startswith("⏳") for line in capsys.readouterr().out.splitlines())
    solution = _quiz(stem, "solutions")
    Exercises(stem, strict=True).quiz(solution)  # every answer right, each with its explanation
    assert capsys.readouterr().out.count("✅") == len(questions)
    for number, question in enumerate(questions, start=1):
        want = question.expected()
        others = [c for c in "abc" if c != want] if isinstance(want, str) else [want * 2 + 1, -1]
        for wrong in others:
            with pytest.raises(AssertionError):
                Exercises(stem, strict=True).quiz({**solution, number: wrong})
            assert f"❌ Question {number}" in capsys.readouterr().out
        if not isinstance(want, str):
            assert math.isclose(solution[number], want, rel_tol=question.rel_tol)


@pytest.mark.parametrize("checker, right, wrong_answers", [
    ("cached_tokens_cases", _hits, WRONG_CACHED_TOKENS_04), ("fits_cases", _fits, WRONG_FITS_02)])
def test_every_draw_refutes_each_wrong_answer(checker, right, wrong_answers):
    """A chapter draws its hidden cases once; each draw on its own must refute every wrong answer.
    Found by this loop: when both rounds' prompts used the default key and the prompt was two blocks
    long, hashing without the key gave every right count (about 1 draw in 250). Chapter 04's draws
    always hold a cached child of an evicted parent (issue 39), chapter 02's a pool of exactly k sequences."""
    from labkit.teaching import build_it

    for _ in range(400):
        cases = getattr(build_it, checker)()
        assert all(right(*args) == want for args, want in cases)
        for wrong in wrong_answers:
            assert any(wrong(*args) != want for args, want in cases), wrong.__name__
