"""labkit.serving.engine: continuous batching gives the same greedy tokens as generating each prompt alone.

The reference is chapter 01's contiguous cache (``labkit.caches.contiguous.generate``), one prompt at a
time. The engine mixes prompts in one flattened batch, splits long prompts into chunks,
reuses cached prefixes, copies shared tail blocks on write and preempts when its pool is
too small; none of that may change a single token. The K/V pools start poisoned with NaN,
so reading a slot that was never written (a wrong block table, a missing copy) shows up.

One test runs the Triton kernels (interpreted on a CPU, so it is kept small); the others
use the kernels' PyTorch references, which the kernel tests prove equal to the kernels.
"""

from __future__ import annotations

import random

import pytest
import torch

import labkit  # first: sets up Triton's interpreter without a GPU
from labkit.caches.contiguous import generate
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.serving.engine import Engine
from labkit.serving.variants.forking import ForkingScheduler

CONFIG = DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def model() -> Decoder:
    return Decoder.random(CONFIG, seed=3).to(labkit.DEVICE)  # on a GPU the compiled kernels run


def alone(model: Decoder, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    return [generate(model, p, max_new_tokens).tokens for p in prompts]


def poisoned_engine(model: Decoder, **kw) -> Engine:
    engine = Engine(model, **kw)
    for cache in engine.backend.k_caches + engine.backend.v_caches:
        cache.fill_(float("nan"))
    return engine


def random_prompts(seed: int, n: int, shared: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(CONFIG.vocab_size) for _ in range(shared)]
    return [prefix + [rng.randrange(CONFIG.vocab_size) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_triton_engine_mixed_chunked_prefix_and_preemption(model):
    """Everything at once on the real (interpreted) kernels: kept to about a dozen steps."""
    prompts = random_prompts(0, 3, shared=8, lo=1, hi=6) + [[5, 6, 7]]
    engine = poisoned_engine(model, num_blocks=7, block_size=4, max_num_batched_tokens=8, use_triton=True)
    assert engine.backend.use_triton
    steps = []
    requests = [engine.add_request(p, 5) for p in prompts]
    while engine.has_unfinished():
        steps.append(engine.step())
    out = [r.output_token_ids for r in requests]
    assert out == alone(model, prompts, 5)
    stats = engine.stats
    assert sum(s.prefix_hit_tokens for s in stats) > 0
    assert sum(s.preemptions for s in stats) > 0
    assert any(s.prefill_tokens and s.decode_tokens for s in stats)  # a mixed step
    assert any(not c.samples for s in steps for c in s.chunks)       # a prompt split into chunks
    assert engine.scheduler.allocator.num_free == 7


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_mixed_batches_of_ragged_prompts(model, seed):
    prompts = random_prompts(seed, 6, shared=0, lo=1, hi=14)
    engine = poisoned_engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=64, use_triton=False)
    assert engine.generate(prompts, 6) == alone(model, prompts, 6)
    assert sum(s.preemptions for s in engine.stats) == 0
    assert engine.scheduler.allocator.num_free == 64


@pytest.mark.parametrize("budget", [1, 3, 7])
def test_chunked_prefill(model, budget):
    prompts = random_prompts(4, 3, shared=0, lo=9, hi=17)
    engine = poisoned_engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=budget, use_triton=False)
    assert engine.generate(prompts, 4) == alone(model, prompts, 4)
    assert max(s.scheduled_tokens for s in engine.stats) <= budget
    assert sum(1 for s in engine.stats if s.prefill_tokens) >= -(-min(map(len, prompts)) // budget)


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_prefix_hits(model, block_size):
    prompts = random_prompts(5, 5, shared=17, lo=1, hi=6)
    engine = poisoned_engine(model, num_blocks=64, block_size=block_size, max_num_batched_tokens=24,
                             use_triton=False)
    assert engine.generate(prompts, 5) == alone(model, prompts, 5)
    hits = sum(s.prefix_hit_tokens for s in engine.stats)
    assert hits >= (17 // block_size) * block_size  # at least one later prompt reused the whole shared blocks
    # a second wave finds the prefix still cached after the first one finished
    more = random_prompts(6, 2, shared=0, lo=1, hi=4)
    more = [prompts[0][:17] + p for p in more]
    before = len(engine.stats)
    assert engine.generate(more, 3) == alone(model, more, 3)
    assert engine.stats[before].prefix_hit_tokens >= (17 // block_size) * block_size


def test_same_step_prefix_sharing_and_max_num_seqs(model):
    """Full blocks are named when allocated (as vLLM does), so identical prompts admitted in one step
    share them: the pass writes every chunk's K/V of a layer before any chunk attends, so the tokens
    stay identical (the pool is poisoned with NaN). ``max_num_seqs`` caps the running requests."""
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6]] * 3
    engine = poisoned_engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=64, use_triton=False)
    assert engine.generate(prompts, 4) == alone(model, prompts, 4)
    assert engine.stats[0].prefix_hit_tokens == 2 * 8  # the 2nd and 3rd prompts, in the first step
    capped = poisoned_engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=64, max_num_seqs=1,
                             use_triton=False)
    assert capped.generate(prompts, 4) == alone(model, prompts, 4)
    assert max(s.num_running for s in capped.stats) == 1


@pytest.mark.parametrize("num_blocks", [6, 8, 11])
def test_forced_preemption_with_a_small_pool(model, num_blocks):
    prompts = random_prompts(7, 5, shared=4, lo=3, hi=10)
    engine = poisoned_engine(model, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32,
                             use_triton=False)
    assert engine.generate(prompts, 8) == alone(model, prompts, 8)
    assert sum(s.preemptions for s in engine.stats) > 0
    assert engine.scheduler.allocator.num_free == num_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_fork_applies_copy_on_write(model, caching):
    engine = poisoned_engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=16,
                             enable_prefix_caching=caching, use_triton=False, scheduler_cls=ForkingScheduler)
    prompt = [3, 1, 4, 1, 5, 9]  # 6 tokens: the tail block is half full when the fork shares it
    parent = engine.add_request(prompt, 5)
    engine.step()                  # prefill, first token
    child = engine.scheduler.fork(parent)
    step = engine.step()
    assert step.copies  # the shared, partly filled tail block was copied before the write
    while engine.has_unfinished():
        engine.step()
    expected = alone(model, [prompt], 5)[0]
    assert parent.output_token_ids == expected and child.output_token_ids == expected


def test_skipping_the_copy_would_be_caught(model, monkeypatch):
    """The poisoned pool makes a missing copy-on-write visible: the test above can fail."""
    engine = poisoned_engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=16, use_triton=False,
                             scheduler_cls=ForkingScheduler)
    monkeypatch.setattr(engine.backend, "copy_blocks", lambda copies: None)
    parent = engine.add_request([3, 1, 4, 1, 5, 9], 3)
    engine.step()
    engine.scheduler.fork(parent)
    engine.step()
    k = engine.backend.k_caches[0][parent.block_table.block_ids[1]]
    assert torch.isnan(k[0]).all()  # the parent's new tail block lacks the prompt's positions 4 and 5


def test_engine_bad_input(model):
    engine = Engine(model, num_blocks=4, block_size=4, max_num_batched_tokens=8, use_triton=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request([1, 2], 0)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request([], 3)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request([CONFIG.vocab_size], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):  # 16 + 2 tokens need 5 blocks > 4
        engine.generate([[1, 2], list(range(16))], 2)
    assert not engine.has_unfinished()  # the valid prompt was not queued either
    with pytest.raises(ValueError, match="block_size"):
        Engine(model, num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine(model, num_blocks=4, block_size=4, max_num_batched_tokens=-1)
    with pytest.raises(ValueError, match="model"):
        Engine("not a model", num_blocks=4)


def test_eos_ids_stop_requests_even_under_preemption(model):
    """Several stop ids (as Llama 3 chat models have): each request ends at the first one it emits."""
    prompts = random_prompts(8, 4, shared=4, lo=3, hi=9)
    free = alone(model, prompts, 8)
    stop = [free[0][3], free[1][2], free[2][5]]  # the first id is the scheduler's, the others the engine's
    expected = []
    for out in free:
        ends = [i for i, t in enumerate(out) if t in stop]
        expected.append(out[:ends[0] + 1] if ends else out)
    assert any(len(e) < 8 for e in expected[1:])  # a request stopped on an id other than the first
    engine = poisoned_engine(model, num_blocks=6, block_size=4, max_num_batched_tokens=32, use_triton=False)
    assert engine.generate(prompts, 8, eos_token_id=stop) == expected
    assert sum(s.preemptions for s in engine.stats) > 0
    assert sum(s.finished for s in engine.stats) == len(prompts)
    assert engine.scheduler.allocator.num_free == 6
    with pytest.raises(ValueError, match="eos_token_id"):
        engine.add_request([1, 2], 3, eos_token_id=[1, CONFIG.vocab_size])


def test_the_engine_inherits_the_gate_and_parses_stop_ids_once(model):
    import numpy as np

    assert Engine(model, num_blocks=8, use_triton=False).scheduler.full_sequence_must_fit is True
    assert Engine(model, num_blocks=8, use_triton=False, full_sequence_must_fit=False) \
        .scheduler.full_sequence_must_fit is False
    engine = Engine(model, num_blocks=8, block_size=4, use_triton=False)
    assert engine.add_request([1, 2], 3, eos_token_id=np.int64(2)).stop_token_ids == {2}
    with pytest.raises(ValueError, match="eos_token_id"):
        engine.add_request([1, 2], 3, eos_token_id=True)
    with pytest.raises(ValueError, match="eos_token_id"):
        DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=True)


def test_kernel_backend_says_what_attend_runs(model, monkeypatch):
    """Issue 22: a chapter prints what runs, not what it assumes. use_triton=False is always the
    references; use_triton=True is Triton (compiled or interpreted) unless a fallback reason holds. Issue 43:
    the default is Triton only where it compiles, the batched path anywhere else."""
    from labkit.kernels import fallback

    refs = Engine(model, num_blocks=8, block_size=4, use_triton=False).backend
    assert refs.kernel_backend() == "the batched PyTorch path of labkit.kernels.cpu"
    default = Engine(model, num_blocks=8, block_size=4).backend
    assert default.use_triton == (labkit.RUNTIME.triton_mode == "compiled")
    triton_pool = Engine(model, num_blocks=8, block_size=4, use_triton=True).backend
    said = triton_pool.kernel_backend()
    mode = labkit.RUNTIME.triton_mode
    if fallback.fallback_reason(triton_pool.dtype, triton_pool.device) is None:
        assert said.startswith("the Triton kernels, ")
        assert ("compiled for the GPU" in said) == (mode == "compiled")
        assert ("interpreter" in said) == (mode == "interpreter")
    else:
        assert said.startswith("the kernels' PyTorch references (")
    monkeypatch.setattr(fallback, "fallback_reason", lambda dtype, device: "no Triton on this machine")
    assert triton_pool.kernel_backend() == "the kernels' PyTorch references (no Triton on this machine)"
