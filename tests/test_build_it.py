"""Each checker can fail: the build-it exercises, the value exercises and the quizzes (issue 27).

The build-it checkers are taken from the book as ``test_exercise_checkers`` takes them (the
solutions pass strictly, the stubs wait there); here every exercise gets at least three answers a
learner might write, each wrong in one way, and each must get a ❌.
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch

from labkit.memory.prefix import CacheKey, block_hash
from labkit.teaching import answers, quizzes
from labkit.teaching.exercises import Exercises
from test_exercise_checkers import chapter, verdict

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- 01: one decode step


def _attend(q, keys, values, scale=True, interleave=True):
    group = q.shape[0] // keys.shape[1]
    spread = (lambda t: t.repeat_interleave(group, 1)) if interleave else (lambda t: t.repeat(1, group, 1))
    scores = torch.einsum("hd,thd->ht", q, spread(keys)) / (q.shape[-1] ** 0.5 if scale else 1.0)
    return torch.einsum("ht,thd->hd", scores.softmax(-1), spread(values))


def attends_before_appending_01(k_cache, v_cache, q, k, v):
    out = _attend(q, k_cache, v_cache)  # the new token does not see itself (and the first step sees nothing)
    return torch.cat([k_cache, k[None]]), torch.cat([v_cache, v[None]]), out


def unscaled_01(k_cache, v_cache, q, k, v):
    k_cache, v_cache = torch.cat([k_cache, k[None]]), torch.cat([v_cache, v[None]])
    return k_cache, v_cache, _attend(q, k_cache, v_cache, scale=False)


def heads_tiled_01(k_cache, v_cache, q, k, v):
    k_cache, v_cache = torch.cat([k_cache, k[None]]), torch.cat([v_cache, v[None]])
    return k_cache, v_cache, _attend(q, k_cache, v_cache, interleave=False)


def newest_only_01(k_cache, v_cache, q, k, v):
    return k[None], v[None], _attend(q, k[None], v[None])  # the cache is replaced, not appended to


# --------------------------------------------------------------------------- 02: windowed and latent caches


def _bytes(shape, length, factor=None, every_layer=False, op=min, window=True):
    per_layer = (factor or (1 if shape.latent else 2)) * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes
    windowed = (shape.num_layers if every_layer else len(shape.sliding_layers)) if shape.sliding_layers and window else 0
    kept = op(length, shape.sliding_window) if windowed else length
    return ((shape.num_layers - windowed) * length + windowed * kept) * per_layer


def latent_with_factor_2_02(shape, length):
    return _bytes(shape, length, factor=2)


def window_in_every_layer_02(shape, length):
    return _bytes(shape, length, every_layer=True)


def max_for_min_02(shape, length):
    return _bytes(shape, length, op=max)


def window_ignored_02(shape, length):
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


def _hits(token_ids, block_size, key, cached, cap=True, parent_chain=True):
    parent, hit = None, 0
    for i in range(((len(token_ids) - 1) if cap else len(token_ids)) // block_size):
        parent = block_hash(parent if parent_chain else None, token_ids[i * block_size:(i + 1) * block_size], key)
        if parent not in cached:
            break
        hit += block_size
    return hit


def no_len_minus_1_cap_04(token_ids, block_size, key, cached):
    return _hits(token_ids, block_size, key, cached, cap=False)


def key_ignored_04(token_ids, block_size, key, cached):
    return _hits(token_ids, block_size, CacheKey(), cached)


def no_parent_04(token_ids, block_size, key, cached):
    return _hits(token_ids, block_size, key, cached, parent_chain=False)


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


WRONG = [
    ("01_why_the_cache_grows", "Exercise 3", f) for f in
    (attends_before_appending_01, unscaled_01, heads_tiled_01, newest_only_01)] + [
    ("02_cost_per_token", "Exercise 5", f) for f in
    (latent_with_factor_2_02, window_in_every_layer_02, max_for_min_02, window_ignored_02)] + [
    ("03_paging", "Exercise 5", f) for f in (NeverFrees03, OffByOneSlot03, FloorBlocks03, TakesBeforeRefusing03)] + [
    ("04_prefix_reuse", "Exercise 1", f) for f in (no_len_minus_1_cap_04, key_ignored_04, no_parent_04)] + [
    ("05_scheduler", "Exercise 2", f) for f in
    (ignores_blocks_05, stops_at_a_misfit_05, preempts_the_oldest_05, admits_after_a_preemption_05)] + [
    ("06_from_fit_to_serve", "Exercise 3", f) for f in
    (ttft_to_the_step_start_06, tpot_over_all_tokens_06, itl_with_the_first_wait_06, itl_as_request_means_06)]


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
    ex.check_behaviour("01", lambda kc, vc, q, k, v: (torch.cat([kc, k[None]]), torch.cat([vc, v[None]]),
                                                       _attend(q, torch.cat([kc, k[None]]), torch.cat([vc, v[None]]))),
                       build_it.decode_step_check())
    ex.check_function("02", _bytes, build_it.sequence_bytes_cases())
    ex.check_behaviour("03", _Pager, build_it.pager_check())
    ex.check_function("04", _hits, build_it.cached_tokens_cases())
    ex.check_behaviour("05", _plan, build_it.plan_step_check())
    ex.check_behaviour("06", _latencies, build_it.latencies_check())


# --------------------------------------------------------------------------- an answer of the wrong shape (issue 38)


class PagerWithoutFree03(_Pager):
    """Everything but ``free``: the checker calls it only after several appends."""

    free = None


class PagerWithAFreeOfNoArgument03(_Pager):
    def free(self):
        self.tables.clear()


# (chapter, exercise, what the ❌ must name): each build-it checker, taken from the book
BUILD_IT = [("01_why_the_cache_grows", "Exercise 3", "a function decode_step(k_cache, v_cache, q, k, v)"),
            ("02_cost_per_token", "Exercise 5", "a function sequence_bytes(shape, length)"),
            ("03_paging", "Exercise 5", "a class Pager(num_blocks, block_size) with the methods append(seq_id, n), "
                                        "free(seq_id), num_free()"),
            ("04_prefix_reuse", "Exercise 1", "a function cached_tokens(token_ids, block_size, key, cached)"),
            ("05_scheduler", "Exercise 2", "a function plan_step(running, waiting, free_blocks, token_budget, "
                                           "block_size)"),
            ("06_from_fit_to_serve", "Exercise 3", "a function latencies(arrivals, steps)")]


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


def test_every_draw_of_chapter_04s_cases_refutes_each_wrong_answer():
    """A chapter draws its hidden cases once; each draw on its own must refute every wrong answer.
    Found by this loop: when both rounds' prompts used the default key and the prompt was two blocks
    long, hashing without the key gave every right count (about 1 draw in 250)."""
    from labkit.teaching.build_it import cached_tokens_cases

    for _ in range(400):
        cases = cached_tokens_cases()
        for wrong in (no_len_minus_1_cap_04, key_ignored_04, no_parent_04):
            assert any(wrong(*args) != want for args, want in cases), wrong.__name__
