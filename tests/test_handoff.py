"""A real hand-over (``labkit.serving.handoff``): a prefill engine computes prompts, a decode engine takes their
K/V onto block ids of its own and generates; the greedy tokens are those of one engine doing both and of
generating each prompt alone. The claim rule: only K/V really written are handed over."""

from __future__ import annotations

import random

import pytest
import torch

import labkit  # first: sets up Triton's interpreter without a GPU
from labkit.caches.contiguous import generate
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.serving.engine import Engine
from labkit.serving.handoff import DecodeEngine, KVInbox, hand_over, transfer_bytes
from labkit.serving.tiered_engine import TieredEngine
from test_tier_store import poisoned  # NaN in every slot: a read before a write (or a load) shows up

CONFIG = DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
BS, NEW = 4, 4
rng = random.Random(0)
PROMPTS = [[rng.randrange(97) for _ in range(n)] for n in (3, 5, 8, 9, 13, 16, 22)]  # ragged, some on a block edge
FILLER = [rng.randrange(97) for _ in range(21)]


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder.random(CONFIG, seed=3).to(labkit.DEVICE)


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    return [generate(model, p, NEW).tokens for p in PROMPTS]


def engines(model, budget: int = 64) -> tuple[Engine, DecodeEngine]:
    prefill = poisoned(Engine(model, num_blocks=24, block_size=BS, max_num_batched_tokens=budget, prepare=False))
    decode = poisoned(DecodeEngine(model, num_blocks=48, block_size=BS, max_num_batched_tokens=64, prepare=False))
    decode.generate([FILLER], NEW)  # its free queue no longer starts where the prefill engine's does
    return prefill, decode


def blocks(engine: Engine, ids: list[int]) -> list[torch.Tensor]:
    pool = engine.backend
    return [c[b].clone() for b in ids for c in pool.k_caches + pool.v_caches]


def test_tokens_equal_after_the_hand_over_on_new_block_ids(model, reference):
    single = poisoned(Engine(model, num_blocks=24, block_size=BS, max_num_batched_tokens=64, prepare=False))
    assert single.generate(PROMPTS, NEW) == reference
    prefill, decode = engines(model)
    requests = [prefill.add_request(p, NEW) for p in PROMPTS]
    handed, sent_kv = {}, {}
    while len(handed) < len(requests):
        prefill.step()
        for r in requests:
            if r.output_token_ids and r.request_id not in handed:  # its prompt is computed
                full = (len(r.prompt_token_ids) - 1) // BS
                sent_kv[r.request_id] = (r.block_table.block_ids[:full], blocks(prefill, r.block_table.block_ids[:full]))
                handed[r.request_id] = hand_over(prefill, r, decode)
    assert not prefill.has_unfinished() and prefill.scheduler.allocator.num_free == 24  # all freed, after the copies
    full_tokens = [(len(p) - 1) // BS * BS for p in PROMPTS]
    assert [handed[r.request_id].tokens for r in requests] == full_tokens
    assert all(h.claimed_tokens == len(h.request.prompt_token_ids) - 1 for h in handed.values())
    assert isinstance(decode.tier, KVInbox)
    before = len(decode.stats)  # the filler's steps
    decode.step()  # admits them all: the delivered blocks are loaded onto the decode engine's own blocks
    new_ids = []
    for r in requests:
        moved, (old, kv) = handed[r.request_id].request, sent_kv[r.request_id]
        ids = moved.block_table.block_ids[:len(old)]
        new_ids += ids
        assert all(torch.equal(a, b) for a, b in zip(kv, blocks(decode, ids)))  # the same K/V
        sent_kv[r.request_id] = old
    assert new_ids != [b for r in requests for b in sent_kv[r.request_id]]  # on new block ids
    while decode.has_unfinished():
        decode.step()
    assert [handed[r.request_id].request.output_token_ids for r in requests] == reference
    stats = decode.tier.stats
    assert stats.loaded_blocks == sum(full_tokens) // BS and stats.loaded_tokens == sum(full_tokens)
    assert not decode.tier.delivered  # each delivery used once
    assert sum(s.tier_hit_tokens for s in decode.stats) == sum(full_tokens)
    assert sum(s.scheduled_tokens for s in decode.stats[:before]) == len(FILLER) + NEW - 1
    assert sum(s.preemptions for s in decode.stats) == 0
    computed = sum(s.scheduled_tokens for s in decode.stats[before:])
    assert computed == sum(len(p) + NEW - 1 for p in PROMPTS) - sum(full_tokens)  # the rest, and only the rest
    bytes_moved = sum(h.bytes for h in handed.values())
    assert bytes_moved == decode.tier.bytes_received == transfer_bytes(decode, sum(full_tokens))
    assert bytes_moved == sum(full_tokens) // BS * 2 * CONFIG.num_hidden_layers * BS * 2 * CONFIG.head_dim * 4


def test_a_hand_over_after_the_first_chunk_claims_only_that_chunk(model, reference):
    """The claim rule: with a budget of 6 tokens a step, the 22-token prompt has 6 tokens written after one step,
    in a table of two blocks (8 slots). The claim is 6 tokens, of which one full block is handed over; the
    decode engine computes the other 18. Claiming the table's 8 slots would hand over 2 unwritten ones."""
    prompt, want = PROMPTS[-1], reference[-1]
    prefill, decode = engines(model, budget=6)
    request = prefill.add_request(prompt, NEW)
    prefill.step()
    assert request.num_computed_tokens == 6 and len(request.block_table.block_ids) == 2  # mid-prompt, mid-block
    h = hand_over(prefill, request, decode)
    assert (h.claimed_tokens, h.tokens, h.sent_blocks) == (6, 4, 1)
    before = len(decode.stats)
    while decode.has_unfinished():
        decode.step()
    assert h.request.output_token_ids == want
    assert decode.tier.stats.loaded_tokens == 4
    assert sum(s.scheduled_tokens for s in decode.stats[before:]) == len(prompt) - 4 + NEW - 1


def test_a_hand_over_while_a_step_is_in_flight_is_refused(model):
    """Between schedule and postprocess, num_computed_tokens already counts the planned chunk (12 tokens), of which
    only 6 have K/V: handing those over would give the decode engine unwritten slots."""
    prefill, decode = engines(model, budget=6)
    request = prefill.add_request(PROMPTS[-1], NEW)
    prefill.step()
    prefill.scheduler.schedule()  # planned, not run
    assert request.num_computed_tokens == 12
    with pytest.raises(ValueError, match="prefill"):
        hand_over(prefill, request, decode)
    assert request.block_table is not None and not decode.has_unfinished()  # nothing moved


def test_blocks_the_decode_pool_holds_are_not_sent(model, reference):
    """A second request with the same prompt: the decode pool already holds its blocks, so nothing crosses the link."""
    prefill, decode = engines(model)
    firsts = []
    for _ in range(2):
        request = prefill.add_request(PROMPTS[-1], NEW)
        prefill.step()
        firsts.append(hand_over(prefill, request, decode))
        while decode.has_unfinished():
            decode.step()
        assert firsts[-1].request.output_token_ids == reference[-1]
    assert [h.sent_blocks for h in firsts] == [5, 0] and firsts[1].tokens == 20 and firsts[1].bytes == 0


def test_bad_inputs_name_themselves(model):
    prefill, decode = engines(model)
    request = prefill.add_request(PROMPTS[2], NEW)
    other = Engine(model, num_blocks=8, block_size=BS, prepare=False)
    stranger = other.add_request(PROMPTS[2], NEW)
    elsewhere = Decoder.random(CONFIG, seed=4)
    for call, name in [(lambda: hand_over(prefill, stranger, decode), "request"),
                       (lambda: hand_over(prefill, PROMPTS[2], decode), "request"),
                       (lambda: hand_over(prefill, request, other), "decode"),
                       (lambda: hand_over(prefill, request, TieredEngine(model, 8, BS, tier_blocks=2, prepare=False)),
                        "decode"),
                       (lambda: hand_over(prefill, request, DecodeEngine(elsewhere, 24, BS, prepare=False)), "decode"),
                       (lambda: hand_over(prefill, request, DecodeEngine(model, 24, 8, prepare=False)), "decode"),
                       (lambda: hand_over("prefill", request, decode), "prefill"),
                       (lambda: DecodeEngine(model, 24, BS, tier_dir="/tmp/x", prepare=False), "tier_dir"),
                       (lambda: transfer_bytes(None, 4), "engine"),
                       (lambda: transfer_bytes(decode, -1), "tokens"),
                       (lambda: transfer_bytes(decode, 2.0), "tokens")]:
        with pytest.raises(ValueError, match=name):
            call()
    assert prefill.scheduler.requests[request.request_id] is request and not decode.has_unfinished()
