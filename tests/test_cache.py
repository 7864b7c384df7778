"""The contiguous KV cache: cached decoding equals recomputation; the cache is the size we say."""

import pytest
import torch

from labkit.caches.contiguous import KVCache, generate
from labkit.model.decoder import Decoder, DecoderConfig

CFG = DecoderConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=1)


@pytest.mark.parametrize("seed, prompt_len", [(0, 1), (1, 7), (2, 30)])
def test_cached_generation_equals_recomputation(seed, prompt_len):
    model = Decoder.random(CFG, seed=seed)
    prompt = torch.randint(0, CFG.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    cached = generate(model, prompt, 12, use_cache=True)
    recomputed = generate(model, prompt, 12, use_cache=False)
    assert cached.tokens == recomputed.tokens
    torch.testing.assert_close(cached.logits, recomputed.logits, atol=1e-4, rtol=1e-4)


def test_cache_grows_one_token_per_decode_step_in_every_layer():
    model = Decoder.random(CFG)
    cache = KVCache(CFG)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache)
        assert cache.seq_len == 5
        for step in range(3):
            model(torch.tensor([[7]]), cache=cache)
            assert cache.seq_len == 6 + step
            assert all(k.shape == (1, 6 + step, 1, CFG.head_dim) for k in cache.k)


def test_nbytes_is_the_byte_formula():
    """2 (K and V) x layers x KV heads x head_dim x tokens x bytes per element."""
    model = Decoder.random(CFG)
    cache = KVCache(CFG)
    with torch.no_grad():
        model(torch.randint(0, CFG.vocab_size, (2, 11)), cache=cache)
    assert cache.nbytes == 2 * CFG.num_hidden_layers * CFG.num_key_value_heads * CFG.head_dim * 11 * 2 * 4


def test_stored_keys_equal_a_full_pass():
    """What prefill+decode stored is exactly what a full pass computes: earlier positions never change."""
    model = Decoder.random(CFG)
    ids = torch.randint(0, CFG.vocab_size, (1, 9))
    a, b = KVCache(CFG), KVCache(CFG)
    with torch.no_grad():
        model(ids, cache=a)
        model(ids[:, :4], cache=b)
        for t in range(4, 9):
            model(ids[:, t:t + 1], cache=b)
    for layer in range(CFG.num_hidden_layers):
        torch.testing.assert_close(a.k[layer], b.k[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.v[layer], b.v[layer], atol=1e-5, rtol=1e-5)


def test_bad_input():
    model = Decoder.random(CFG)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="max_new_tokens"):
            generate(model, [1, 2], bad)
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(model, [], 3)
    cache = KVCache(CFG)
    with pytest.raises(ValueError, match="k and v"):
        cache.attend(0, torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 2, 16), torch.zeros(1, 1, 2, 16))
    with pytest.raises(ValueError, match="layer_idx"):
        cache.attend(CFG.num_hidden_layers, torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, 16))
    assert cache.seq_len == 0 and cache.nbytes == 0
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
    with pytest.raises(ValueError, match="batch size 1"):  # two rows into a cache of one sequence
        model(torch.tensor([[4], [5]]), cache=cache)
    assert cache.seq_len == 3


def test_generate_stops_right_after_a_stop_token():
    from labkit.caches.contiguous import generate
    from labkit.model.decoder import Decoder, DecoderConfig

    model = Decoder.random(DecoderConfig(), seed=0)
    free = generate(model, [1, 2, 3], 8).tokens
    stop = free[3]
    first = free.index(stop)
    stopped = generate(model, [1, 2, 3], 8, eos_token_id=[511, stop])
    assert stopped.tokens == free[:first + 1] and stopped.logits.shape[0] == first + 1
    assert stopped.cache_tokens == 3 + first  # the stop token is never fed back
    import pytest
    with pytest.raises(ValueError, match="eos_token_id"):
        generate(model, [1, 2, 3], 8, eos_token_id=True)
