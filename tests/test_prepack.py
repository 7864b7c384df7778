"""labkit.model.prepack: the oneDNN-packed linear layers compute what ``nn.Linear`` computes.

Packing changes the order of the float32 sums, not the arithmetic: results are compared with
a tolerance, on random weights and inputs, with and without bias, through a whole model and
through the engine. Bad input raises and packs nothing. Issue 38: the packed copy follows
the weight (``load_state_dict``, in-place writes, a new tensor), a bias of another dtype is
refused, a packed model moved to another dtype says to unpack, copies and saves work, and a
forward that autograd would record raises.
"""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
from torch import nn

import labkit  # noqa: F401  (sets up Triton before any kernel module)
from labkit.caches.contiguous import generate
from labkit.model.decoder import Decoder, DecoderConfig
from labkit.model.prepack import PackedLinear, available, is_packed, prepack, unpack
from labkit.serving.engine import Engine

pytestmark = pytest.mark.skipif(not available(), reason="this PyTorch has no oneDNN")

CONFIG = DecoderConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
IDS = torch.randint(0, CONFIG.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))


def logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16, 37])
def test_packed_linear_matches_linear(bias, rows):
    torch.manual_seed(rows)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(2, rows, 48)
    expected = layer(x).detach()
    assert prepack(layer) == 1
    assert isinstance(layer, PackedLinear)
    with torch.no_grad():
        got = layer(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    layer.weight.data.zero_()  # a write through .data bumps no version: unseen (documented)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_prepack_model_logits_and_state_dict():
    model = Decoder.random(CONFIG, seed=3)
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    ids = torch.randint(0, CONFIG.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids)
    n = prepack(model)
    assert n == 7 * CONFIG.num_hidden_layers + 1  # q, k, v, o, gate, up, down per layer; the vocabulary head
    assert sum(type(m) is PackedLinear for m in model.modules()) == n
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, (ptr, value) in before.items():  # the weights themselves are untouched, not copied
        assert after[k].data_ptr() == ptr and torch.equal(after[k], value)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, rtol=1e-4, atol=1e-4)
    assert prepack(model) == 0  # already packed: nothing to do
    assert is_packed(model)
    assert unpack(model) == n and not is_packed(model) and unpack(model) == 0
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    with torch.no_grad():
        assert torch.equal(model(ids), expected)  # nn.Linear again, bit for bit


def test_engine_with_packed_model_matches_contiguous_cache():
    model = Decoder.random(CONFIG, seed=5)
    prompts = [[(7 * i + j) % CONFIG.vocab_size for j in range(n)] for i, n in enumerate([9, 14, 4])]
    expected = [generate(model, p, 6).logits for p in prompts]
    prepack(model)
    engine = Engine(model, num_blocks=32, block_size=4, max_num_batched_tokens=16, use_triton=False)
    requests = [engine.add_request(p, 6, eos_token_id=()) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    for request, logits in zip(requests, expected):
        # greedy tokens equal up to the reference's first near tie, if any (none on this seed)
        top2 = logits.topk(2, dim=-1).values
        ties = ((top2[:, 0] - top2[:, 1]) < 1e-3).nonzero().flatten().tolist()
        upto = ties[0] if ties else len(logits)
        assert upto >= 3
        assert request.output_token_ids[:upto] == logits.argmax(-1)[:upto].tolist()


@pytest.mark.parametrize("bad, message", [(0, r"batch_size must be an integer in \[1, 4096\]"),
                                          (True, "batch_size"), (5000, r"\[1, 4096\]")])
def test_bad_batch_size_raises(bad, message):
    model = Decoder.random(CONFIG)
    with pytest.raises(ValueError, match=message):
        prepack(model, batch_size=bad)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_not_a_module_or_not_float32_raises_and_packs_nothing():
    for f in (prepack, unpack, is_packed):
        with pytest.raises(ValueError, match="model must be a torch.nn.Module"):
            f("model")
    model = Decoder.random(CONFIG)
    model.model.layers[1].mlp.down_proj.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"float32 .*on the CPU; model\.layers\.1\.mlp\.down_proj\.weight"):
        prepack(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


# ---------------------------------------------------------------------------------------------- issue 38


def test_load_state_dict_repacks_the_new_weights():
    model, other = Decoder.random(CONFIG, seed=3), Decoder.random(CONFIG, seed=4)
    old, expected = logits(model), logits(other)
    assert (old - expected).abs().max() > 0.1  # the two models differ, so stale logits would show
    prepack(model)
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(logits(model), expected, rtol=1e-4, atol=1e-4)
    assert is_packed(model)


def test_in_place_write_and_new_weight_are_followed():
    torch.manual_seed(0)
    layer, x = nn.Linear(48, 80), torch.randn(5, 48)
    prepack(layer)
    with torch.no_grad():
        layer.weight.mul_(2)  # an in-place write bumps the weight's version
        torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5)
        layer.weight = nn.Parameter(torch.randn(80, 48))  # another tensor altogether
        torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5)
        layer.double().float()  # a round trip: new storage, same tensor object
        layer.weight.add_(1)
        torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_bias_of_another_dtype_is_refused_and_packs_nothing(dtype):
    model = Decoder.random(dataclasses.replace(CONFIG, qkv_bias=True), seed=1)
    layer = model.model.layers[1].self_attn.v_proj
    layer.bias = nn.Parameter(layer.bias.detach().to(dtype))
    with pytest.raises(ValueError, match=rf"bias in float32 on the CPU; model\.layers\.1\.self_attn\.v_proj\.bias is "
                                         rf"{dtype}"):
        prepack(model)
    assert not is_packed(model)


def test_a_moved_packed_model_says_to_unpack_and_packs_again_when_moved_back():
    model = Decoder.random(CONFIG, seed=3)
    expected = logits(model)
    prepack(model)
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"weight is torch.bfloat16 on cpu, and this layer is prepacked: call "
                                           r"labkit\.model\.prepack\.unpack\(model\)"):
        logits(model)
    model.float()  # back to float32 on the CPU: the next forward packs the (rounded) weights again
    plain = copy.deepcopy(model)
    unpack(plain)
    torch.testing.assert_close(logits(model), logits(plain), rtol=1e-4, atol=1e-4)
    assert (logits(model) - expected).abs().max() > 0  # the bfloat16 rounding shows: the copy was remade
    model.to(torch.bfloat16)
    assert unpack(model) == 7 * CONFIG.num_hidden_layers + 1  # the way out the error names
    assert logits(model).dtype == torch.bfloat16


def test_a_bias_changed_after_packing_is_checked_too():
    layer = nn.Linear(48, 80)
    prepack(layer)
    layer.bias = nn.Parameter(layer.bias.detach().double())
    with pytest.raises(RuntimeError, match=r"\.bias is torch.float64 on cpu, and this layer is prepacked"):
        with torch.no_grad():
            layer(torch.randn(5, 48))


def test_deepcopy_and_torch_save_keep_a_working_packed_model():
    model = Decoder.random(CONFIG, seed=3)
    prepack(model)
    expected = logits(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert is_packed(twin)
        torch.testing.assert_close(logits(twin), expected, rtol=0, atol=0)  # same weights, same packing
        twin.lm_head.weight.data.zero_()
        assert unpack(twin) == 7 * CONFIG.num_hidden_layers + 1
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=0)  # the copies share nothing with it


def test_a_forward_that_needs_gradients_raises():
    torch.manual_seed(0)
    layer = nn.Linear(48, 80)
    x = torch.randn(5, 48)
    prepack(layer)
    with pytest.raises(RuntimeError, match=r"inference-only.*torch\.no_grad\(\) or torch\.inference_mode\(\)"):
        layer(x)  # the weight requires grad: backward would leave weight.grad None
    layer.requires_grad_(False)
    with pytest.raises(RuntimeError, match="inference-only"):
        layer(x.requires_grad_())  # the input's gradient is not computed either
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5)
    unpack(layer.requires_grad_(True))
    layer(x).sum().backward()  # unpacked, it trains
    assert layer.weight.grad is not None


def test_a_weight_whose_new_storage_takes_the_old_address_is_still_seen():
    """New weights in new storage (``.data =``, as ``Module.to`` and ``.float()`` do) that the allocator
    places at the very address the packed copy was made from: the packed layer must still repack, never
    multiply with the copy of the old weights. Many rounds, so that the address is reused."""
    layer = nn.Linear(64, 96)
    prepack(layer)
    x = torch.randn(5, 64)
    with torch.no_grad():
        for _ in range(40):
            layer.weight.data = torch.randn(96, 64)  # values bfloat16 cannot hold; packed at the next forward
            torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5)
            layer.to(torch.bfloat16)  # the float32 storage is freed ...
            layer.float()             # ... and a new one, of the same size, may take its address
            torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias, rtol=1e-5, atol=1e-5)
