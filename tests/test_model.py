"""The chapter-01 decoder: Llama compatibility, GQA, and bad input."""

import pytest
import torch

from labkit.model.decoder import Decoder, DecoderConfig, causal_attention, rope_inv_freq

TINY = DecoderConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)


def test_forward_shape_and_determinism():
    model = Decoder.random(TINY, seed=3)
    ids = torch.randint(0, TINY.vocab_size, (3, 9))
    logits = model(ids)
    assert logits.shape == (3, 9, TINY.vocab_size)
    assert torch.equal(logits, Decoder.random(TINY, seed=3)(ids))
    assert not torch.equal(logits, Decoder.random(TINY, seed=4)(ids))


def test_state_dict_keys_are_llama_checkpoint_keys():
    keys = set(Decoder(TINY).state_dict())
    for name in ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight",
                 "model.layers.1.post_attention_layernorm.weight"]:
        assert name in keys
    # K and V projections are sized by the KV heads, not the query heads (GQA).
    sd = Decoder(TINY).state_dict()
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (2 * TINY.head_dim, TINY.hidden_size)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (4 * TINY.head_dim, TINY.hidden_size)


def test_matches_hugging_face_llama():
    transformers = pytest.importorskip("transformers")
    # A RoPE base other than the default, as Llama 3 has, so a lost rope_theta would show.
    hf_config = transformers.LlamaConfig(**{**TINY.to_dict(), "rope_theta": 500000.0, "rope_scaling": None},
                                         attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    ours = Decoder(DecoderConfig.from_dict(hf_config.to_dict()))
    assert ours.config.rope_theta == 500000.0
    ours.load_state_dict(hf.state_dict())
    ids = torch.randint(0, TINY.vocab_size, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """Attention with 2 KV heads for 4 query heads is MHA where each KV head is copied to its group."""
    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, 5, 2, 8, dtype=torch.float64), torch.randn(2, 5, 2, 8, dtype=torch.float64)
    gqa = causal_attention(q, k, v)
    mha = causal_attention(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(gqa, mha)
    # Query heads 0 and 1 share KV head 0: with identical queries they get identical outputs.
    q[:, :, 1] = q[:, :, 0]
    out = causal_attention(q, k, v)
    torch.testing.assert_close(out[:, :, 0], out[:, :, 1])
    assert not torch.allclose(out[:, :, 0], out[:, :, 2])


def test_causal_attention_matches_sdpa_in_float64():
    torch.manual_seed(1)
    q = torch.randn(1, 3, 4, 16, dtype=torch.float64)
    k, v = torch.randn(1, 7, 4, 16, dtype=torch.float64), torch.randn(1, 7, 4, 16, dtype=torch.float64)
    mask = torch.ones(3, 7, dtype=torch.bool).tril(diagonal=7 - 3)  # query i sees keys <= 4 + i
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(causal_attention(q, k, v), ref)


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_attention_heads=6, num_key_value_heads=4), "num_attention_heads"),
    (dict(num_hidden_layers=-1), "num_hidden_layers"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(head_dim=7), "head_dim"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(hidden_size=65, head_dim=None), "hidden_size"),
])
def test_bad_config_names_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DecoderConfig(**{**TINY.to_dict(), **kwargs})


def test_from_dict_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="rope_scaling"):  # llama3 scaling needs all four of its numbers
        DecoderConfig.from_dict({**TINY.to_dict(), "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="rope_scaling"):  # another RoPE type, in the newer spelling
        DecoderConfig.from_dict({**TINY.to_dict(), "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}})
    with pytest.raises(ValueError, match="hidden_act"):
        DecoderConfig.from_dict({**TINY.to_dict(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        DecoderConfig.from_dict({**TINY.to_dict(), "partial_rotary_factor": 0.5})
    assert DecoderConfig.from_dict({**TINY.to_dict(), "rope_parameters": {"rope_type": "default",
                                                                          "rope_theta": 5e5}}).rope_theta == 5e5
    cfg = DecoderConfig.from_dict({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10,
                                   "intermediate_size": 8, "num_hidden_layers": 1, "model_type": "llama"})
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16 and not cfg.qkv_bias
    qwen = DecoderConfig.from_dict({**TINY.to_dict(), "model_type": "qwen2", "eos_token_id": [5, 6]})
    assert qwen.qkv_bias and qwen.eos_token_id == [5, 6]
    assert DecoderConfig.from_dict(qwen.to_dict()) == qwen  # labkit's own dict round-trips


LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # Llama 3.2's values


@pytest.mark.parametrize("head_dim, theta", [(64, 500000.0), (128, 500000.0), (32, 10000.0)])
def test_llama3_inv_freq_is_transformers(head_dim, theta):
    """Scaled RoPE: the same frequencies as transformers' _compute_llama3_parameters, pair by pair."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                         rope_theta=theta, rope_scaling=dict(LLAMA3))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = DecoderConfig.from_dict(hf_config.to_dict())
    assert ours.rope_scaling == LLAMA3
    got = rope_inv_freq(ours)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    plain = rope_inv_freq(DecoderConfig(**{**ours.to_dict(), "rope_scaling": None}))
    assert torch.equal(got[0], plain[0])                           # the fastest pair: kept
    torch.testing.assert_close(got[-1], plain[-1] / 32.0)           # the slowest: 32 times slower
    assert ((got < plain) & (got > plain / 32.0)).any()            # some pairs blended in between


def test_qkv_bias_matches_hugging_face_qwen2():
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.Qwen2Config(**{k: v for k, v in TINY.to_dict().items()
                                           if k not in ("rope_scaling", "qkv_bias")}, attn_implementation="eager")
    hf = transformers.Qwen2ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    ours = Decoder(DecoderConfig.from_dict(hf_config.to_dict()))
    ours.load_state_dict(hf.state_dict())
    ids = torch.randint(0, TINY.vocab_size, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)
        for layer in ours.model.layers:  # without the biases the logits move: the test can fail
            layer.self_attn.q_proj.bias.zero_()
        assert not torch.allclose(ours(ids), hf(ids).logits, atol=1e-3)


@pytest.mark.parametrize("bad, name", [
    (torch.zeros(5, dtype=torch.long), "input_ids"),          # wrong rank
    (torch.zeros(1, 5), "input_ids"),                         # float ids
    (torch.full((1, 3), 97), "input_ids"),                    # out of vocabulary
    (torch.full((1, 3), -1), "input_ids"),                    # negative id
    (torch.zeros(1, 0, dtype=torch.long), "input_ids"),       # no tokens
])
def test_bad_input_ids(bad, name):
    with pytest.raises(ValueError, match=name):
        Decoder.random(TINY)(bad)


def test_bad_positions_shape():
    with pytest.raises(ValueError, match="positions"):
        Decoder.random(TINY)(torch.zeros(1, 4, dtype=torch.long), positions=torch.arange(3)[None])


def test_logits_indices_give_the_same_logits_as_the_full_pass():
    model = Decoder.random(DecoderConfig(), seed=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    wanted = torch.tensor([0, 4, 10])
    with torch.no_grad():
        full, some = model(ids), model(ids, logits_indices=wanted)
    assert some.shape == (2, 3, model.config.vocab_size)
    torch.testing.assert_close(some, full[:, wanted], rtol=1e-5, atol=1e-5)
