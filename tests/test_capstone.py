"""The capstone's engine (issue 39): the book's pieces plugged into ``Engine``, checked in lockstep.

A small random decoder stands in for SmolLM2 (the notebook runs the real model against transformers):
the engine on labkit's pieces must give the tokens of the core engine, and each of four wrong pieces
must be caught at its first wrong answer and named by piece, step and request.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from labkit.model.decoder import Decoder, DecoderConfig
from labkit.serving.engine import Engine
from labkit.serving.pieces import Pieces
from labkit.teaching.capstone import WRONG_PIECES, PieceMismatch, lockstep, pieces_from_notebooks, serve

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(num_blocks=15, block_size=4, max_num_batched_tokens=48, prepare=False)
SYSTEM, NOTES = list(range(1, 10)), list(range(100, 112))
# Two requests with the same notes at once (the second's copies stay unnamed), one that leaves early,
# chats that share the system prompt, and the second notes question again at step 4.
WORKLOAD = [(1, "a", SYSTEM + NOTES + [40, 41, 42], 2), (1, "b", SYSTEM + NOTES + [50, 51, 52, 53, 54], 8),
            (1, "c", SYSTEM + [60, 61], 5), (1, "d", SYSTEM + [70, 71, 72], 5),
            (4, "b again", SYSTEM + NOTES + [50, 51, 52, 53, 54], 4)]


@pytest.fixture(scope="module")
def model():
    return Decoder.random(DecoderConfig(num_hidden_layers=2), seed=0)


def run(model, pieces):
    engine = Engine(model, **SETTINGS, pieces=pieces)
    return engine, serve(engine, WORKLOAD)


def test_labkit_pieces_give_the_core_engines_tokens_with_a_preemption_and_hits(model):
    engine, requests = run(model, lockstep(Pieces.labkit()))  # every call checked against itself
    core = Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=32, prepare=False)
    for _, name, prompt, limit in WORKLOAD:
        assert requests[name].output_token_ids == core.generate([prompt], limit, eos_token_id=())[0], name
    assert sum(s.preemptions for s in engine.stats) >= 1
    assert requests["c"].num_cached_tokens or requests["d"].num_cached_tokens
    assert engine.scheduler.pool.blocks_taken > SETTINGS["num_blocks"]  # blocks came back and went out again
    # b's notes blocks are named only by a, which leaves first: b again's hit stops at that gap
    assert requests["b again"].num_cached_tokens < len(SYSTEM + NOTES) // 4 * 4


@pytest.mark.parametrize("seam, what", [("Pager", "chapter 03's Pager"), ("cached_tokens", "chapter 04's cached_tokens"),
                                        ("plan_step", "chapter 05's plan_step"), ("decode_step", "decode_step")])
def test_a_wrong_piece_is_caught_and_named(model, seam, what):
    with pytest.raises(PieceMismatch) as caught:
        run(model, lockstep(dataclasses.replace(Pieces.labkit(), **{seam: WRONG_PIECES[seam]})))
    err = caught.value
    assert what in err.piece and err.where["step"] >= 1 and err.where["request"] in {w[1] for w in WORKLOAD}
    assert "yours:" in str(err) and "labkit's:" in str(err)
    if seam == "decode_step":
        assert err.where["position"] >= 1  # over one position the softmax is 1, whatever the scale
    if seam == "cached_tokens":
        assert err.where["request"] == "b again"


def test_the_pieces_come_from_the_saved_notebooks_and_a_stub_leaves_its_seam_to_labkit(tmp_path):
    solved, lines = pieces_from_notebooks(ROOT / "solutions")
    assert all(callable(getattr(solved, s)) for s in ("decode_step", "Pager", "cached_tokens", "plan_step"))
    assert all(": yours, from " in line for line in lines)
    stubs, lines = pieces_from_notebooks(ROOT / "chapters")
    assert stubs == Pieces() and all("labkit's in its place (still the stub)" in line for line in lines)
    _, lines = pieces_from_notebooks(tmp_path)
    assert all("labkit's in its place (no " in line for line in lines)
    with pytest.raises(ValueError, match="folder"):
        pieces_from_notebooks(tmp_path / "absent")


def test_bad_pieces_are_refused_before_any_work(model):
    with pytest.raises(ValueError, match="pieces"):
        Engine(model, **SETTINGS, pieces="labkit")
    with pytest.raises(ValueError, match="Pager"):
        Engine(model, **SETTINGS, pieces=Pieces(Pager=3))
    engine = Engine(model, **SETTINGS, pieces=Pieces(plan_step=lambda *rows: ([("nobody", 1)], [])))
    engine.add_request([1, 2, 3], 2)
    with pytest.raises(ValueError, match="plan_step, step 1"):
        engine.step()
    assert engine.scheduler.num_steps == 0 and engine.scheduler._step is None and engine.scheduler.waiting


def test_stepwise_attention_equals_the_core_pool_on_a_chunked_prefill(model):
    torch.manual_seed(0)
    prompts = [[int(t) for t in torch.randint(1, 500, (n,))] for n in (13, 7, 21)]
    ours = Engine(model, 32, 4, 8, prepare=False, pieces=Pieces()).generate(prompts, 3, eos_token_id=())
    assert ours == Engine(model, 32, 4, 8, prepare=False).generate(prompts, 3, eos_token_id=())


def test_labkits_answers_and_helpers_refuse_bad_input_by_name(model):
    from labkit.caches.stepwise import StepwiseKV
    from labkit.memory.prefix import CacheKey
    from labkit.serving.pieces import Pager, cached_tokens, plan_step

    pager = Pager(4, 2)
    with pytest.raises(ValueError, match="n must"):
        pager.append("s", -1)
    assert pager.append("s", 9) is None and pager.num_free() == 4  # one block over: refused, nothing taken
    with pytest.raises(ValueError, match="seq_id"):
        pager.free("never")
    with pytest.raises(ValueError, match="key"):
        cached_tokens([1, 2, 3], 2, "default", set())
    with pytest.raises(ValueError, match="token_budget"):
        plan_step([], [], 0, 0, 4)
    with pytest.raises(ValueError, match="pieces"):
        lockstep("labkit")
    with pytest.raises(ValueError, match="step must be a function"):
        StepwiseKV("decode_step", model.config, 4, 4)
    engine = Engine(model, **SETTINGS, pieces=Pieces())
    for bad in ([], [(0, "x", [1, 2], 1)], [(1, "x", [1, 2])]):
        with pytest.raises(ValueError, match="workload"):
            serve(engine, bad)
    assert not engine.has_unfinished() and not engine.stats
    assert cached_tokens([5] * 9, 4, CacheKey(), set()) == 0
