"""The formats of a KV cache that holds fewer bytes per element (appendix A3, which deepens chapter 02).

Chapter 02's formula is ``2 × L × Hkv × D × b``. A 16-bit cache has b = 2 bytes. Store each
element in 8 bits (fp8 or int8) and b = 1; in 4 bits, two elements per byte, b = 0.5. A code
alone is not a number: it is multiplied by a **scale** to give the value back,

    q = quantize(x) = clamp(round(x / scale), -qmax, qmax)        x ≈ dequantize(q) = q × scale

int8 keeps codes -127..127 (qmax 127), int4 -7..7 (qmax 7), both symmetric around zero, with
``round`` to the nearest integer (ties to even, as ``torch.round``). fp8 is e4m3 (4 exponent
bits, 3 mantissa bits, largest finite value 448): its "round" is the rounding to the nearest
e4m3 number, and x / scale is clamped to ±448 first. fp8 spends its bits on an exponent, so its
error is relative (about 6 % at worst); int8's error is absolute (at most scale / 2).

Where the scales live decides what they cost and how well they fit the values:

* ``per_tensor``: one scale for all of a layer's K, another for its V: vLLM's ``k_scale`` and
  ``v_scale`` for ``kv_cache_dtype="fp8"``. They are fixed before serving. vLLM 0.33.0 reads them
  from the checkpoint and uses 1.0 when the checkpoint has none
  (``model_executor/layers/quantization/kv_cache.py: BaseKVCacheMethod.process_weights_after_loading``);
  labkit starts at 1.0 too, and ``labkit.caches.quant_quality.calibrate_kv_scales`` measures them on
  sample text, as the tools that write such checkpoints do. A value past the calibrated range is clamped.
* ``per_block``: one scale per (block, KV head), the largest |x| written into the block so far
  over qmax. A write that raises it rescales the codes already in the block (they are rounded
  again), so a block's scale only grows; a write at offset 0 starts the block afresh. 2 scales
  per block of 16 tokens and head cost almost nothing.
* ``per_group``: one scale for every ``group_size`` (32) consecutive elements of one token's
  head, set when the token is written and never changed. 4 bytes per 32 elements: 1 bit per
  element, a quarter of an int4 cache's data.

Every scale is float32. ``kv_cache_dtype`` names a scheme: ``"<element>_per_<scales>"``, e.g.
``"int8_per_block"`` (:data:`KV_CACHE_DTYPES`); ``"auto"`` means no quantization.

This module holds what a format *is*: its codes, its scales, the pools' shapes and the bytes per
token (chapter 02's formula with fewer bits), and its arithmetic in plain PyTorch, the reference the
Triton kernels (``labkit.kernels``) are tested against. ``labkit.caches.paged.KVPool`` stores K/V this
way with ``kv_cache_dtype=``; ``labkit.caches.quant_quality`` measures what a format costs in quality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import check_int
from .blocks import blocks_needed


# element -> (bits per element, qmax: the largest code, storage dtype of one pool element)
ELEMENTS: dict[str, tuple[int, float, torch.dtype]] = {
    "fp8": (8, 448.0, torch.float8_e4m3fn),
    "int8": (8, 127.0, torch.int8),
    "int4": (4, 7.0, torch.uint8),  # two codes per byte: element 2i in the low nibble, 2i+1 in the high
}
SCALES = ("tensor", "block", "group")
GROUP_SIZE = 32
KV_CACHE_DTYPES = ("auto",) + tuple(f"{e}_per_{s}" for e in ELEMENTS for s in SCALES)
SCALE_BYTES = 4  # float32


@dataclass(frozen=True)
class KVQuant:
    """One quantization scheme of the KV cache: an element format and where its scales live."""

    element: str  # "fp8", "int8" or "int4"
    scales: str   # "tensor", "block" or "group"
    group_size: int = GROUP_SIZE

    @property
    def name(self) -> str:
        return f"{self.element}_per_{self.scales}"

    @property
    def bits(self) -> int:
        return ELEMENTS[self.element][0]

    @property
    def qmax(self) -> float:
        """The largest code: 448 (fp8 e4m3), 127 (int8), 7 (int4)."""
        return ELEMENTS[self.element][1]

    @property
    def storage_dtype(self) -> torch.dtype:
        return ELEMENTS[self.element][2]

    def check_head_dim(self, head_dim: int) -> int:
        """int4 packs two elements per byte, so its head_dim must be even."""
        head_dim = check_int("head_dim", head_dim, 1)
        if self.element == "int4" and head_dim % 2:
            raise ValueError(f"head_dim must be even for {self.name} (two 4-bit codes per byte), got {head_dim}")
        return head_dim

    def num_groups(self, head_dim: int) -> int:
        """Scale groups per token and head (per_group): ceil(head_dim / group_size)."""
        return -(-head_dim // self.group_size)

    def storage_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
        """The pool of codes: the paged layout, with head_dim / 2 bytes per head for int4."""
        width = self.check_head_dim(head_dim) // (2 if self.element == "int4" else 1)
        return (num_blocks, block_size, num_kv_heads, width)

    def scale_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
        """(1,) per tensor; (num_blocks, num_kv_heads) per block; (num_blocks, block_size, num_kv_heads,
        groups) per group."""
        if self.scales == "tensor":
            return (1,)
        if self.scales == "block":
            return (num_blocks, num_kv_heads)
        return (num_blocks, block_size, num_kv_heads, self.num_groups(head_dim))

    def empty_pool(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Codes (zeros) and scales for one of K or V: per-tensor scales start at 1.0, vLLM's default;
        per-block and per-group scales at 0, set by the writes."""
        data = torch.zeros(self.storage_shape(num_blocks, block_size, num_kv_heads, head_dim),
                           dtype=self.storage_dtype, device=device)
        fill = 1.0 if self.scales == "tensor" else 0.0
        scale = torch.full(self.scale_shape(num_blocks, block_size, num_kv_heads, head_dim), fill,
                           dtype=torch.float32, device=device)
        return data, scale

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16,
                        kv_factor: int = 2) -> float:
        """Bytes one token adds to the cache: chapter 02's formula with b = bits / 8, plus the scales.

            2 × L × Hkv × D × bits / 8   +   2 × L × Hkv × (scale bytes per token and head)

        Per tensor the scales are 8 bytes per layer whatever the length: 0 per token. Per block
        they are 4 bytes per head and block: 4 / block_size per token. Per group, 4 bytes per
        ``group_size`` elements of every token: 4 × ceil(D / 32). ``kv_factor`` is 2 for separate
        K and V, 1 for a latent (MLA) cache.
        """
        num_layers = check_int("num_layers", num_layers, 1)
        num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
        head_dim = self.check_head_dim(head_dim)
        block_size = check_int("block_size", block_size, 1)
        data = kv_factor * num_layers * num_kv_heads * head_dim * self.bits / 8
        per_head = {"tensor": 0.0, "block": SCALE_BYTES / block_size,
                    "group": SCALE_BYTES * self.num_groups(head_dim)}[self.scales]
        return data + kv_factor * num_layers * num_kv_heads * per_head

    def cache_bytes(self, length: int, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16,
                    kv_factor: int = 2) -> int:
        """Bytes of one sequence of ``length`` tokens: its codes, plus the scales of its blocks (per
        block: a whole block's scales once it has a token) or of its tokens (per group). Per-tensor
        scales belong to the model, not to a sequence: 0 here."""
        length = check_int("length", length, 0)
        num_layers = check_int("num_layers", num_layers, 1)
        num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
        head_dim = self.check_head_dim(head_dim)
        block_size = check_int("block_size", block_size, 1)
        heads = kv_factor * num_layers * num_kv_heads
        data = heads * length * head_dim * self.bits // 8
        scales = {"tensor": 0, "block": blocks_needed(length, block_size),
                  "group": length * self.num_groups(head_dim)}[self.scales]
        return data + heads * scales * SCALE_BYTES


def kv_quant(kv_cache_dtype: object) -> KVQuant | None:
    """The scheme a ``kv_cache_dtype`` names (None for ``"auto"``: no quantization)."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return None
    element, scales = kv_cache_dtype.split("_per_")
    return KVQuant(element, scales)


def check_tensor_scales(q: KVQuant | None, **scales: torch.Tensor) -> None:
    """A per-tensor scheme's scales must be finite and > 0: every code is divided by them. ValueError naming
    the first that is not (``check_tensor_scales(q, k_scale=..., v_scale=...)``); other schemes set their
    scales as they write, so there is nothing to check."""
    if q is None or q.scales != "tensor":
        return
    for name, t in scales.items():
        value = float(t)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must hold a finite scale > 0 for {q.name}, got {value!r}")


# --------------------------------------------------------------------------- the arithmetic


def quantize(x: torch.Tensor, scale: torch.Tensor | float, element: str) -> torch.Tensor:
    """Codes of ``x`` for ``scale`` (broadcast against x): int8 codes for int8 and int4 (unpacked,
    in -7..7 for int4), float8_e4m3fn for fp8. A scale of 0 (an all-zero block) gives code 0."""
    qmax = ELEMENTS[element][1]
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    y = (x.float() / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(-qmax, qmax)
    if element == "fp8":
        return y.to(torch.float8_e4m3fn)
    return torch.round(y).to(torch.int8)  # to the nearest integer, ties to the even one


def dequantize(codes: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes × scale`` in ``dtype`` (int4 codes unpacked first with :func:`unpack_int4`)."""
    return codes.to(dtype) * torch.as_tensor(scale, device=codes.device).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: element 2i + 8 in the low nibble, element 2i+1 + 8 in the high one.

    Adding 8 turns -7..7 into 1..15, an unsigned nibble; the last dimension halves.
    """
    nibbles = (codes.to(torch.int16) + 8).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: int8 codes in -7..7, the last dimension doubled."""
    lo = (packed & 15).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def _expand_scale(scale: torch.Tensor, q: KVQuant, shape: tuple) -> torch.Tensor:
    """A pool's scales broadcast to its elements [num_blocks, block_size, Hkv, D]."""
    if q.scales == "tensor":
        return scale.reshape(1, 1, 1, 1)
    if q.scales == "block":
        return scale[:, None, :, None]
    return scale.repeat_interleave(q.group_size, dim=-1)[..., : shape[-1]]


def dequantize_pool(data: torch.Tensor, scale: torch.Tensor, q: KVQuant,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A whole pool (or a selection of its blocks, with the matching scales) as numbers:
    [num_blocks, block_size, Hkv, head_dim] in ``dtype``."""
    codes = unpack_int4(data) if q.element == "int4" else data
    return dequantize(codes, _expand_scale(scale, q, codes.shape), dtype)


def _encode(x: torch.Tensor, scale: torch.Tensor, q: KVQuant) -> torch.Tensor:
    """Values [..., D] to what the pool stores [..., D or D/2] for ``scale`` broadcast against x."""
    codes = quantize(x, scale, q.element)
    return pack_int4(codes) if q.element == "int4" else codes


def _group_amax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """max |x| over each group of ``group_size`` along the last dimension (the last group may be shorter)."""
    d = x.shape[-1]
    pad = -d % group_size
    padded = torch.nn.functional.pad(x.abs().float(), (0, pad))
    return padded.reshape(*x.shape[:-1], -1, group_size).amax(dim=-1)


@torch.no_grad()
def write_quantized(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, slot_mapping: torch.Tensor,
                    q: KVQuant) -> None:
    """The reference write: new tokens ``x`` [num_tokens, Hkv, D] into one quantized pool, in place.

    Token t goes to slot ``slot_mapping[t]`` (-1: skipped). Per tensor: codes for the fixed scale.
    Per group: each token's scales from its own values. Per block: for each block written, the new
    scale is max(old scale, max |x_new| / qmax) per head, where the old scale counts only when the
    write does not start at offset 0 (a block is filled in order, so offsets below the first new
    one hold its earlier tokens); those earlier codes are re-encoded for the new scale. The tokens
    written into one block must sit at consecutive offsets (``labkit.kernels.paged_attention.write_kv`` checks it).
    """
    block_size = data.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    x = x[keep].float()
    if slots.numel() == 0:
        return
    blocks, offsets = slots // block_size, slots % block_size
    if q.scales == "tensor":
        data[blocks, offsets] = _encode(x, scale.reshape(()), q)
        return
    if q.scales == "group":
        s = _group_amax(x, q.group_size) / q.qmax  # [tokens, Hkv, groups]
        scale[blocks, offsets] = s
        data[blocks, offsets] = _encode(x, s.repeat_interleave(q.group_size, dim=-1)[..., : x.shape[-1]], q)
        return
    # per block: one scale per (block, head), grown by the write; earlier codes re-encoded
    touched, run = torch.unique(blocks, return_inverse=True)
    first = torch.full((len(touched),), block_size, dtype=torch.long, device=slots.device)
    first = first.scatter_reduce(0, run, offsets, reduce="amin")
    amax = torch.zeros(len(touched), x.shape[1], device=x.device)
    amax = amax.scatter_reduce(0, run[:, None].expand(-1, x.shape[1]), x.abs().amax(dim=-1), reduce="amax")
    old = torch.where((first > 0)[:, None], scale[touched], torch.zeros_like(amax))
    new = torch.maximum(old, amax / q.qmax)  # [touched, Hkv]
    earlier = torch.arange(block_size, device=slots.device)[None, :] < first[:, None]  # [touched, block_size]
    values = dequantize_pool(data[touched], old, q)  # the earlier tokens, as numbers
    kept = _encode(values, new[:, None, :, None], q)
    data[touched] = torch.where(earlier[:, :, None, None], kept, data[touched])
    scale[touched] = new
    data[blocks, offsets] = _encode(x, new[run][:, :, None], q)
