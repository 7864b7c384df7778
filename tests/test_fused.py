"""labkit.model.fused: the decoder as the engine runs it computes what chapter 01's decoder computes.

Fusing stacks weights and packing reorders them: each output element stays the same dot product,
summed in another order by another kernel. The bound, for fused and for prepared models alike: as
close to the float64 model as the plain float32 one is, within a factor of 2. Unfusing gives back the
plain model bit for bit. The ``state_dict`` keeps the checkpoint's names and values, loads both ways, and the
tied embedding stays tied. The engine prepares a float32 model on a CPU by default, and only then.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import labkit  # noqa: F401  (sets up Triton before any kernel module)
from labkit.caches.contiguous import generate
from labkit.model import fused, prepack
from labkit.model.decoder import MLP, Attention, Decoder, DecoderConfig, RMSNorm
from labkit.serving.engine import Engine

CONFIG = DecoderConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
QWEN_LIKE = DecoderConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                          num_attention_heads=6, num_key_value_heads=2, qkv_bias=True, tie_word_embeddings=True)
IDS = torch.randint(0, CONFIG.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
needs_onednn = pytest.mark.skipif(not prepack.available(), reason="this PyTorch has no oneDNN")


def logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


def within_float32(got: torch.Tensor, plain: torch.Tensor, exact: torch.Tensor) -> None:
    """``got`` is as close to the float64 logits ``exact`` as the plain float32 model's are, within 2x."""
    plain_error = (plain.double() - exact).abs().max().item()
    assert 0 < plain_error < 1e-4
    assert (got.double() - exact).abs().max().item() <= 2 * plain_error


@pytest.mark.parametrize("config", [CONFIG, QWEN_LIKE], ids=["llama", "qwen-bias-tied"])
def test_fused_logits_are_the_plain_models_within_float32_and_unfuse_restores_it(config):
    model = Decoder.random(config, seed=1)
    plain, exact = logits(model), logits(copy.deepcopy(model).double())
    assert fused.fuse(model) == 4 * config.num_hidden_layers + 1  # norms, attention, MLP; the last norm
    assert all(type(layer.self_attn) is fused.FusedAttention and type(layer.mlp) is fused.FusedMLP
               for layer in model.model.layers)
    assert fused.is_fused(model) and fused.fuse(model) == 0  # already fused: nothing to do
    within_float32(logits(model), plain, exact)
    hidden = config.hidden_size
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (
        (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim, hidden)
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * config.intermediate_size, hidden)
    assert fused.unfuse(model) == 4 * config.num_hidden_layers + 1 and not fused.is_fused(model)
    assert all(type(layer.self_attn) is Attention and type(layer.mlp) is MLP and type(layer.input_layernorm) is RMSNorm
               for layer in model.model.layers) and type(model.model.norm) is RMSNorm
    assert torch.equal(logits(model), plain)


@pytest.mark.parametrize("config", [CONFIG, QWEN_LIKE], ids=["llama", "qwen-bias-tied"])
def test_the_state_dict_keeps_the_checkpoints_names_and_loads_both_ways(config):
    model = Decoder.random(config, seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fused.fuse(model)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    other = Decoder.random(config, seed=3)
    fused.fuse(other)
    other.load_state_dict(before)  # a plain checkpoint into a fused model
    assert torch.equal(logits(other), logits(model))
    plain = Decoder.random(config, seed=4)
    plain.load_state_dict(model.state_dict())  # a fused model's state into a plain one
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in before.items())
    with pytest.raises(RuntimeError, match="q_proj.weight"):  # a missing part is named, not skipped
        other.load_state_dict({k: v for k, v in before.items() if not k.endswith("layers.1.self_attn.q_proj.weight")})
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


@needs_onednn
def test_prepare_fuses_and_packs_a_float32_cpu_model_within_the_float32_bound():
    model = Decoder.random(QWEN_LIKE, seed=5)
    exact = logits(copy.deepcopy(model).double(), IDS)
    plain = logits(model)
    assert fused.can_prepare(model) and fused.prepare(model) and fused.is_prepared(model)
    assert fused.prepare(model)  # again: nothing changes
    packed = sum(type(m) is prepack.PackedLinear for m in model.modules())
    assert packed == 4 * QWEN_LIKE.num_hidden_layers + 1  # qkv, o, gate_up, down per layer; the vocabulary head
    within_float32(logits(model), plain, exact)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    fused.unprepare(model)
    assert not fused.is_fused(model) and not prepack.is_packed(model)
    assert torch.equal(logits(model), plain)


@needs_onednn
def test_a_prepared_model_follows_new_weights_copies_and_saves():
    model = Decoder.random(CONFIG, seed=6)
    fused.prepare(model)
    new = Decoder.random(CONFIG, seed=7)
    expected = logits(new)
    model.load_state_dict(new.state_dict())  # the packed copies are remade from the new weights
    torch.testing.assert_close(logits(model), expected, rtol=1e-4, atol=1e-4)
    for twin in (copy.deepcopy(model), _saved_and_loaded(model)):
        assert fused.is_prepared(twin)
        torch.testing.assert_close(logits(twin), expected, rtol=1e-4, atol=1e-4)


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_prepare_leaves_other_models_as_they_are():
    model = Decoder.random(CONFIG, seed=8).to(torch.bfloat16)
    assert not fused.can_prepare(model) and fused.prepare(model) is False
    assert not fused.is_fused(model) and not prepack.is_packed(model)


@pytest.mark.parametrize("bad", [None, "model", nn.Linear(4, 4), [Decoder.random(CONFIG)]])
@pytest.mark.parametrize("call", [fused.fuse, fused.unfuse, fused.is_fused, fused.prepare, fused.can_prepare])
def test_anything_but_a_decoder_is_refused(call, bad):
    with pytest.raises(ValueError, match="model must be a labkit.model.decoder.Decoder"):
        call(bad)


@needs_onednn
def test_the_engine_prepares_a_cpu_float32_model_by_default_and_only_then():
    model = Decoder.random(CONFIG, seed=9)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46]]
    alone = [generate(model, p, 6).tokens for p in prompts]  # chapter 01's decoder, unprepared
    with pytest.raises(ValueError, match="max_num_batched_tokens"):  # a refused engine changes nothing
        Engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="prepare"):
        Engine(model, num_blocks=16, block_size=4, prepare="yes")
    assert not fused.is_fused(model)
    as_given = Engine(model, num_blocks=16, block_size=4, prepare=False)
    assert not fused.is_fused(model) and as_given.generate(prompts, 6) == alone
    engine = Engine(model, num_blocks=16, block_size=4)
    assert fused.is_prepared(model) and not engine.backend.use_triton
    assert engine.generate(prompts, 6) == alone


@needs_onednn
def test_a_model_the_engine_prepared_runs_outside_the_engine_too():
    """The engine steps in inference mode, as vLLM does; what it made there (a packed copy remade after new
    weights, the buffer a one-row multiply fills) must still serve a plain forward afterwards."""
    model = Decoder.random(CONFIG, seed=10)
    engine = Engine(model, num_blocks=16, block_size=4)
    model.load_state_dict(Decoder.random(CONFIG, seed=11).state_dict())  # remade at the engine's next step
    engine.generate([[1, 2, 3]], 3)
    plain = Decoder.random(CONFIG, seed=11)
    torch.testing.assert_close(logits(model, IDS[:1, :1]), logits(plain, IDS[:1, :1]), rtol=1e-4, atol=1e-4)
    assert engine.generate([[4, 5]], 3) == [generate(plain, [4, 5], 3).tokens]
