"""Bad input to the formats of a quantized KV cache refused (issue 38): ``labkit.memory.formats`` (the
codes, scales, pools and the reference write), the reference write of ``labkit.kernels`` and appendix
A3's measurements (``labkit.caches.quant_quality``). One row a case, checked by
``tests/test_bad_inputs.py``'s ``run_case``: the exception, the parameter named in its message, and
the object and every argument unchanged (a refused write touches neither pool nor scale).
"""

from __future__ import annotations

import math

import pytest
import torch

import labkit  # noqa: F401  (first: Triton's interpreter without a GPU)
from labkit.caches import quant_quality
from labkit.kernels import paged_attention, reference
from labkit.memory import formats
from test_bad_inputs import On, run_case, tiny_decoder

nan, inf = math.nan, math.inf
INT8_BLOCK = formats.kv_quant("int8_per_block")
INT8_TENSOR = formats.kv_quant("int8_per_tensor")
X = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(0))  # 3 tokens, 1 KV head, head_dim 8
SLOTS = torch.tensor([0, 1, 2])


def block_pool() -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 per-block pool of 4 blocks of 4 slots, 1 KV head, head_dim 8: codes and scales."""
    return INT8_BLOCK.empty_pool(4, 4, 1, 8)


def tensor_pool() -> tuple[torch.Tensor, torch.Tensor]:
    return INT8_TENSOR.empty_pool(4, 4, 1, 8)


def scheme(name: str):
    return lambda: formats.kv_quant(name)


def kv_ref(**changes) -> tuple[tuple, dict]:
    """The arguments of a per-block ``write_kv_ref`` of X into fresh pools, with ``changes``."""
    (kc, ks), (vc, vs) = block_pool(), block_pool()
    args = dict(k=X, v=X.clone(), k_cache=kc, v_cache=vc, slot_mapping=SLOTS) | {
        k: v for k, v in changes.items() if k in ("k", "v", "k_cache", "v_cache", "slot_mapping")}
    kw = dict(kv_cache_dtype="int8_per_block", k_scale=ks, v_scale=vs) | {
        k: v for k, v in changes.items() if k in ("kv_cache_dtype", "k_scale", "v_scale")}
    return tuple(args.values()), kw


CASES = [
    # ---- KVQuant: the scheme itself (the rows first)
    ("KVQuant element int9", formats.KVQuant, ("int9", "block"), {}, ValueError, "element"),
    ("KVQuant group_size 0", formats.KVQuant, ("int8", "group", 0), {}, ValueError, "group_size"),
    ("KVQuant scales rows", formats.KVQuant, ("int8", "rows"), {}, ValueError, "scales"),
    ("KVQuant element None", formats.KVQuant, (None, "tensor"), {}, ValueError, "element"),
    ("KVQuant group_size 3 not a power of two", formats.KVQuant, ("int8", "group", 3), {}, ValueError, "group_size"),
    ("KVQuant int4 group_size 1 splits a byte", formats.KVQuant, ("int4", "group", 1), {}, ValueError, "group_size"),
    ("KVQuant group_size float", formats.KVQuant, ("fp8", "group", 32.0), {}, ValueError, "group_size"),
    ("KVQuant.empty_pool 0 blocks", On(scheme("int8_per_block"), "empty_pool"), (0, 4, 1, 8), {}, ValueError,
     "num_blocks"),
    ("KVQuant.empty_pool block_size 0", On(scheme("fp8_per_group"), "empty_pool"), (2, 0, 1, 8), {}, ValueError,
     "block_size"),
    ("KVQuant.empty_pool num_kv_heads -1", On(scheme("int8_per_tensor"), "empty_pool"), (2, 4, -1, 8), {}, ValueError,
     "num_kv_heads"),
    ("KVQuant.bytes_per_token kv_factor 0", On(scheme("int8_per_block"), "bytes_per_token"), (2, 2, 8),
     {"kv_factor": 0}, ValueError, "kv_factor"),
    ("KVQuant.bytes_per_token kv_factor True", On(scheme("fp8_per_tensor"), "bytes_per_token"), (2, 2, 8),
     {"kv_factor": True}, ValueError, "kv_factor"),
    ("KVQuant.cache_bytes kv_factor 3", On(scheme("int4_per_group"), "cache_bytes"), (10, 2, 2, 8),
     {"kv_factor": 3}, ValueError, "kv_factor"),
    # ---- quantize: the element, the scale, x
    ("quantize element int5", formats.quantize, (X, 0.1, "int5"), {}, ValueError, "element"),
    ("quantize scale -1", formats.quantize, (X, -1.0, "int8"), {}, ValueError, "scale"),
    ("quantize scale nan", formats.quantize, (X, nan, "int8"), {}, ValueError, "scale"),
    ("quantize scale inf", formats.quantize, (X, inf, "fp8"), {}, ValueError, "scale"),
    ("quantize scale tensor with one negative", formats.quantize, (X, torch.tensor([0.1, -0.1, 0.1])[:, None, None],
                                                                   "int8"), {}, ValueError, "scale"),
    ("quantize scale True", formats.quantize, (X, True, "int8"), {}, ValueError, "scale"),
    ("quantize scale that does not broadcast", formats.quantize, (X, torch.full((2,), 0.1), "int4"), {}, ValueError,
     "scale"),
    ("quantize x int tensor", formats.quantize, (torch.ones(4, dtype=torch.int32), 0.1, "int8"), {}, ValueError,
     "x must"),
    # ---- int4 packing: codes in -7..7, an even last dimension, an integer tensor; bytes are uint8
    ("pack_int4 odd length", formats.pack_int4, (torch.tensor([1, 2, 3], dtype=torch.int8),), {}, ValueError, "codes"),
    ("pack_int4 codes 8 and -9", formats.pack_int4, (torch.tensor([8, -9], dtype=torch.int8),), {}, ValueError,
     "codes"),
    ("pack_int4 code -8, past int4's qmax", formats.pack_int4, (torch.tensor([-8, 7], dtype=torch.int8),), {},
     ValueError, "codes"),
    ("pack_int4 float codes", formats.pack_int4, (torch.tensor([1.0, 2.0]),), {}, ValueError, "codes"),
    ("pack_int4 a list", formats.pack_int4, ([1, 2],), {}, ValueError, "codes"),
    ("unpack_int4 int8 bytes", formats.unpack_int4, (torch.tensor([1, -100], dtype=torch.int8),), {}, ValueError,
     "packed"),
    ("unpack_int4 a list", formats.unpack_int4, ([25],), {}, ValueError, "packed"),
    # ---- write_quantized: the reference write refuses before it writes
    ("write_quantized slot 99", formats.write_quantized, (X[:1], *block_pool(), torch.tensor([99]), INT8_BLOCK), {},
     ValueError, "slot_mapping"),
    ("write_quantized slot -2", formats.write_quantized, (X[:1], *block_pool(), torch.tensor([-2]), INT8_BLOCK), {},
     ValueError, "slot_mapping"),
    ("write_quantized two tokens to one slot", formats.write_quantized, (X[:2], *block_pool(), torch.tensor([1, 1]),
                                                                         INT8_BLOCK), {}, ValueError, "slot_mapping"),
    ("write_quantized slot_mapping too short", formats.write_quantized, (X, *block_pool(), SLOTS[:2], INT8_BLOCK), {},
     ValueError, "slot_mapping"),
    ("write_quantized slot_mapping float", formats.write_quantized, (X, *block_pool(), SLOTS.float(), INT8_BLOCK), {},
     ValueError, "slot_mapping"),
    ("write_quantized x with 2 heads into a 1-head pool", formats.write_quantized,
     (torch.randn(3, 2, 8), *block_pool(), SLOTS, INT8_BLOCK), {}, ValueError, "x must"),
    ("write_quantized x 2-D", formats.write_quantized, (X[:, 0], *block_pool(), SLOTS, INT8_BLOCK), {}, ValueError,
     "x must"),
    ("write_quantized codes of another format", formats.write_quantized,
     (X, *formats.kv_quant("fp8_per_block").empty_pool(4, 4, 1, 8), SLOTS, INT8_BLOCK), {}, ValueError, "data must"),
    ("write_quantized scale of the wrong shape", formats.write_quantized,
     (X, block_pool()[0], torch.zeros(4), SLOTS, INT8_BLOCK), {}, ValueError, "scale"),
    ("write_quantized scale float64", formats.write_quantized,
     (X, block_pool()[0], torch.zeros(4, 1, dtype=torch.float64), SLOTS, INT8_BLOCK), {}, ValueError, "scale"),
    ("write_quantized per-tensor scale 0", formats.write_quantized,
     (X, tensor_pool()[0], torch.zeros(1), SLOTS, INT8_TENSOR), {}, ValueError, "scale"),
    ("write_quantized q a name", formats.write_quantized, (X, *block_pool(), SLOTS, "int8_per_block"), {}, ValueError,
     "q must"),
    # ---- write_kv_ref: write_kv's checks of the pools and scales, K's and V's both before either is written
    ("write_kv_ref per-block k_scale of the wrong shape", reference.write_kv_ref, *kv_ref(k_scale=torch.zeros(4)),
     ValueError, "k_scale"),
    ("write_kv_ref per-block v_scale of the wrong shape", reference.write_kv_ref, *kv_ref(v_scale=torch.zeros(3, 1)),
     ValueError, "v_scale"),
    ("write_kv_ref per-block k_scale None", reference.write_kv_ref, *kv_ref(k_scale=None), ValueError, "k_scale"),
    ("write_kv_ref per-block v_scale float64", reference.write_kv_ref,
     *kv_ref(v_scale=torch.zeros(4, 1, dtype=torch.float64)), ValueError, "v_scale"),
    ("write_kv_ref slot 99", reference.write_kv_ref, *kv_ref(slot_mapping=torch.tensor([0, 1, 99])), ValueError,
     "slot_mapping"),
    ("write_kv_ref v_cache of another format", reference.write_kv_ref,
     *kv_ref(v_cache=formats.kv_quant("int4_per_block").empty_pool(4, 4, 1, 8)[0]), ValueError, "v_cache"),
    ("write_kv_ref per-tensor k_scale of 2 numbers", reference.write_kv_ref,
     (X, X.clone(), tensor_pool()[0], tensor_pool()[0], SLOTS),
     {"kv_cache_dtype": "int8_per_tensor", "k_scale": torch.ones(2), "v_scale": torch.ones(1)}, ValueError, "k_scale"),
    ("write_kv per-block v_cache with fewer blocks", paged_attention.write_kv,
     *kv_ref(**dict(zip(("v_cache", "v_scale"), INT8_BLOCK.empty_pool(3, 4, 1, 8)))), ValueError, "v_cache"),
    # ---- calibrate_kv_scales: a KVQuant, per tensor; token ids the model has
    ("calibrate_kv_scales q a name", quant_quality.calibrate_kv_scales, (tiny_decoder(), [1, 2, 3], "int8_per_tensor"),
     {}, ValueError, "q must"),
    ("calibrate_kv_scales q per block", quant_quality.calibrate_kv_scales,
     (tiny_decoder(), [1, 2, 3], INT8_BLOCK), {}, ValueError, "q must"),
    ("calibrate_kv_scales token past the vocabulary", quant_quality.calibrate_kv_scales,
     (tiny_decoder(), [1, 32], INT8_TENSOR), {}, ValueError, "token_ids"),
    ("calibrate_kv_scales token -1", quant_quality.calibrate_kv_scales, (tiny_decoder(), [1, -1], INT8_TENSOR), {},
     ValueError, "token_ids"),
    # ---- relative_error: x [tokens, Hkv, D], finite; block_size >= 1; q a KVQuant
    ("relative_error x 2-D", quant_quality.relative_error, (torch.randn(4, 8), INT8_BLOCK), {}, ValueError, "x must"),
    ("relative_error block_size 0", quant_quality.relative_error, (X, INT8_BLOCK), {"block_size": 0}, ValueError,
     "block_size"),
    ("relative_error x with an inf", quant_quality.relative_error,
     (torch.tensor([[[1.0, inf]]]), formats.kv_quant("fp8_per_block")), {}, ValueError, "x must"),
    ("relative_error no tokens", quant_quality.relative_error, (torch.zeros(0, 1, 8), INT8_TENSOR), {}, ValueError,
     "x must"),
    ("relative_error q a name", quant_quality.relative_error, (X, "int8_per_block"), {}, ValueError, "q must"),
    # ---- next_token_loss: chunk and block_size >= 1, ids below vocab_size
    ("next_token_loss chunk 0", quant_quality.next_token_loss, (tiny_decoder(), [1, 2, 3]), {"chunk": 0}, ValueError,
     "chunk"),
    ("next_token_loss chunk -4", quant_quality.next_token_loss, (tiny_decoder(), [1, 2, 3]), {"chunk": -4}, ValueError,
     "chunk"),
    ("next_token_loss token past the vocabulary", quant_quality.next_token_loss, (tiny_decoder(), [1, 2, 40]), {},
     ValueError, "token_ids"),
    ("next_token_loss token ids a tensor", quant_quality.next_token_loss, (tiny_decoder(), torch.tensor([1, 2, 3])),
     {}, ValueError, "token_ids"),
    # ---- greedy_agreement: every reference holds a token; every output is a list of ids
    ("greedy_agreement empty reference", quant_quality.greedy_agreement, ([[]], [[]]), {}, ValueError, "references"),
    ("greedy_agreement one of two references empty", quant_quality.greedy_agreement, ([[1], []], [[1], [2]]), {},
     ValueError, "references"),
    ("greedy_agreement output None", quant_quality.greedy_agreement, ([[1, 2]], [None]), {}, ValueError, "outputs"),
    ("greedy_agreement references a string", quant_quality.greedy_agreement, ("ab", [[1], [2]]), {}, ValueError,
     "references"),
]


@pytest.mark.parametrize("label, call, args, kwargs, exc, param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused(label, call, args, kwargs, exc, param):
    run_case(call, args, kwargs, exc, param)


def test_the_labels_are_unique():
    assert len({c[0] for c in CASES}) == len(CASES)
