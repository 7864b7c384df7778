"""The formats of a KV cache that holds fewer bytes per element (appendix A3, which deepens chapter 02).

Chapter 02's formula is ``2 × L × Hkv × D × b``. A 16-bit cache has b = 2 bytes. Store each
element in 8 bits (fp8 or int8) and b = 1; in 4 bits, two elements per byte, b = 0.5. A code
alone is not a number: it is multiplied by a **scale** to give the value back,

    q = quantize(x) = clamp(round(x / scale), -qmax, qmax)        x ≈ dequantize(q) = q × scale

int8 keeps codes -127..127 (qmax 127), int4 -7..7 (qmax 7), both symmetric around zero, with
``round`` to the nearest integer (ties to even, as ``torch.round``). fp8 is e4m3 (4 exponent
bits, 3 mantissa bits, largest finite value 448): its "round" is the rounding to the nearest
e4m3 number, and x / scale is clamped to ±448 first. fp8 spends its bits on an exponent, so for
its normal numbers (x / scale from 2**-6 to 448) the error is relative: at most 1/16 of the value,
about 2.25 % on average over values spread evenly on a log scale. Below 2**-6 e4m3 has only
subnormal numbers, 2**-9 apart, and an x / scale of 2**-10 or less becomes 0. int8's error is
absolute (at most scale / 2).

Where the scales live decides what they cost and how well they fit the values:

* ``per_tensor``: one scale for all of a layer's K, another for its V: vLLM's ``k_scale`` and
  ``v_scale`` for ``kv_cache_dtype="fp8"``. They are fixed before serving. vLLM 0.33.0 reads them
  from a quantized checkpoint
  (``model_executor/layers/quantization/kv_cache.py: BaseKVCacheMethod.process_weights_after_loading``,
  1.0 and a warning when that checkpoint has none); for a plain checkpoint it loads none and sets
  1.0 (``model_executor/layers/attention/attention.py: set_default_quant_scales``). labkit starts
  at 1.0 too, and ``labkit.caches.quant_quality.calibrate_kv_scales`` measures them on
  sample text, as the tools that write such checkpoints do. A value past the calibrated range is clamped.
* ``per_block``: one scale per (block, KV head), the largest |x| written into the block so far
  over qmax. A write that raises it rescales the codes already in the block (they are rounded
  again), so a block's scale only grows; a write at offset 0 starts the block afresh. 2 scales
  per block of 16 tokens and head cost almost nothing.
* ``per_group``: one scale for every ``group_size`` (32) consecutive elements of one token's
  head, set when the token is written and never changed. 4 bytes per 32 elements: 1 bit per
  element, a quarter of an int4 cache's data.

Every scale is float32, and a code is turned back into a number in float32 (code × scale, one
product) and rounded once to the dtype attention reads: what the Triton kernels compute.
``kv_cache_dtype`` names a scheme: ``"<element>_per_<scales>"``, e.g.
``"int8_per_block"`` (:data:`KV_CACHE_DTYPES`); ``"auto"`` means no quantization.

This module holds what a format *is*: its codes, its scales, the pools' shapes and the bytes per
token (chapter 02's formula with fewer bits), and its arithmetic in plain PyTorch, the reference the
Triton kernels (``labkit.kernels``) are tested against. ``labkit.caches.paged.KVPool`` stores K/V this
way with ``kv_cache_dtype=``; ``labkit.caches.quant_quality`` measures what a format costs in quality.

Non-finite values. A NaN or an infinity in K or V (an overflow upstream) is stored as follows, by the
Triton write kernel and by :func:`write_quantized` alike, bit for bit:

* int8 and int4 codes: NaN becomes code 0 (it reads back as 0.0); +inf and -inf saturate to +qmax
  and -qmax, as any value past the range does;
* fp8 (e4m3fn) codes: NaN stays NaN (e4m3fn has one; it is stored as 0x7F); ±inf saturate to ±448, its
  largest finite number, as any value past the range does;
* scales that the writes set (per block, per group) are the largest *finite* |x| over qmax: a NaN or
  an inf never changes a scale, so it never spoils another element's code, and a later write into
  the block stays finite. A token whose values (in one head) are all non-finite leaves the
  block's scale as it was (0 if its write starts the block). Per-tensor scales are fixed; they must
  be finite and > 0.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..checks import check_choice, check_int
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

    def __post_init__(self) -> None:
        check_choice("element", self.element, tuple(ELEMENTS))
        check_choice("scales", self.scales, SCALES)
        size = check_int("group_size", self.group_size, 1)
        if size & (size - 1) or (self.element == "int4" and size < 2):
            raise ValueError(f"group_size must be a power of two (the kernels tile by it), >= 2 for int4 "
                             f"(two codes per byte), got {self.group_size!r}")

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
        num_blocks = check_int("num_blocks", num_blocks, 1)
        block_size = check_int("block_size", block_size, 1)
        num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
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
        kv_factor = check_kv_factor(kv_factor)
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
        heads = check_kv_factor(kv_factor) * num_layers * num_kv_heads
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


def check_kv_factor(kv_factor: object) -> int:
    """``kv_factor`` as an int: 2 (separate K and V) or 1 (one latent vector per token, MLA), else ValueError."""
    if isinstance(kv_factor, bool) or not isinstance(kv_factor, numbers.Integral) or kv_factor not in (1, 2):
        raise ValueError(f"kv_factor must be 2 (separate K and V) or 1 (a latent, MLA cache), got {kv_factor!r}")
    return int(kv_factor)


def _describe(t: object) -> str:
    """What a refused tensor argument was, for a message."""
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def check_tensor_scales(q: KVQuant | None, **scales: torch.Tensor | float) -> None:
    """A per-tensor scheme's scales must be finite and > 0: every code is divided by them. ValueError naming
    the first that is not (``check_tensor_scales(q, k_scale=..., v_scale=...)``); each is one number, a
    float or a one-element tensor. Other schemes set their scales as they write: nothing to check."""
    if q is None or q.scales != "tensor":
        return
    for name, t in scales.items():
        one = isinstance(t, torch.Tensor) and t.numel() == 1 or isinstance(t, numbers.Real) and not isinstance(t, bool)
        value = float(t) if one else t
        if not (one and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must hold a finite scale > 0 for {q.name}, got {value!r}")


def check_pool(q: KVQuant, head_dim: int, data_name: str, data: object, scale_name: str, scale: object) -> None:
    """One of K or V in a pool of scheme ``q``, else ValueError naming the tensor that is wrong.

    ``data``: the codes, [num_blocks, block_size, num_kv_heads, head_dim] of ``q.storage_dtype``
    (head_dim / 2 bytes for int4: head_dim must be even). ``scale``: float32, ``q.scale_shape`` for
    that pool, on data's device. The reference write (``write_quantized``) and the kernels' argument
    checks (``labkit.kernels.arguments.check_kv_format``) both call this: one rule for what a pool is.
    """
    width = q.storage_shape(1, 1, 1, head_dim)[3]  # checks head_dim
    if not (isinstance(data, torch.Tensor) and data.dim() == 4 and data.dtype == q.storage_dtype
            and data.shape[3] == width):
        raise ValueError(f"{data_name} must be a {str(q.storage_dtype).replace('torch.', '')} tensor [num_blocks, "
                         f"block_size, num_kv_heads, {width}] for {q.name} with head_dim {head_dim}, got "
                         f"{_describe(data)}")
    want = q.scale_shape(*data.shape[:3], head_dim)
    if not (isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and tuple(scale.shape) == want
            and scale.device == data.device):
        raise ValueError(f"{scale_name} must be a float32 tensor of shape {want} for {q.name} (scales per "
                         f"{q.scales}) on {data_name}'s device, got {_describe(scale)}")


def check_slot_mapping(slot_mapping: object, num_tokens: int, num_slots: int,
                       device: torch.device | None = None) -> None:
    """Where ``num_tokens`` new tokens go: an int32 or int64 tensor [num_tokens] (on ``device``, if given)
    whose entries are slots in [0, num_slots - 1] or -1 (skip the token), no slot twice; else ValueError
    naming slot_mapping."""
    if not (isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 1
            and slot_mapping.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"slot_mapping must be an int32 or int64 tensor [num_tokens], got {_describe(slot_mapping)}")
    if device is not None and slot_mapping.device != device:
        raise ValueError(f"slot_mapping must be on the pool's device ({device}), got {slot_mapping.device}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must have num_tokens={num_tokens} entries, got {slot_mapping.shape[0]}")
    if num_tokens:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"slot_mapping entries must be -1 (skip) or slots in [0, {num_slots - 1}], "
                             f"got {lo}..{hi}")
        kept = slot_mapping[slot_mapping >= 0]
        if kept.unique().numel() != kept.numel():
            raise ValueError("slot_mapping must not send two tokens to the same slot")


# --------------------------------------------------------------------------- the arithmetic


def quantize(x: torch.Tensor, scale: torch.Tensor | float, element: str) -> torch.Tensor:
    """Codes of ``x`` for ``scale`` (broadcast against x): int8 codes for int8 and int4 (unpacked,
    in -7..7 for int4), float8_e4m3fn for fp8.

    ``scale``: a float, or a float tensor that broadcasts against x; every element finite and >= 0.
    A scale of 0 stands for an all-zero block: x is divided by 1 instead, so zeros get code 0, and
    whatever codes it scales read back as 0. Non-finite x: NaN gives int code 0 and fp8 NaN, ±inf
    saturates (the module's "Non-finite values").
    """
    check_choice("element", element, tuple(ELEMENTS))
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {_describe(x)}")
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.Tensor)) or \
            isinstance(scale, torch.Tensor) and not scale.is_floating_point():
        raise ValueError(f"scale must be a float or a float tensor, got {_describe(scale)}")
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if not bool((scale.isfinite() & (scale >= 0)).all()):
        raise ValueError(f"scale must be finite and >= 0 (0: an all-zero block), got {scale.flatten()[:4].tolist()}")
    try:
        torch.broadcast_shapes(scale.shape, x.shape)
    except RuntimeError:
        raise ValueError(f"scale of shape {tuple(scale.shape)} must broadcast against x {tuple(x.shape)}") from None
    return _codes(x, scale, element)


def _codes(x: torch.Tensor, scale: torch.Tensor, element: str) -> torch.Tensor:
    """quantize's arithmetic, unchecked: x / scale (1 where scale is 0), clamped to ±qmax, rounded.

    fp8 stores every NaN as one NaN, the positive one (bits 0x7F), whatever the sign of the NaN that came
    in, as the kernel does; int codes turn NaN into 0 first (``nan_to_num``, which also makes ±inf the
    largest float, clamped to ±qmax next).
    """
    qmax = ELEMENTS[element][1]
    y = x.float() / torch.where(scale > 0, scale, torch.ones_like(scale))
    if element == "fp8":
        return torch.where(y.isnan(), math.nan, y.clamp(-qmax, qmax)).to(torch.float8_e4m3fn)
    return torch.round(torch.nan_to_num(y, nan=0.0).clamp(-qmax, qmax)).to(torch.int8)  # ties to even


def dequantize(codes: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes × scale`` in float32, rounded once to ``dtype`` (int4 codes unpacked first with :func:`unpack_int4`).

    The product is float32 whatever ``dtype`` is, as the Triton kernels compute it: rounding the scale
    to bfloat16 first and multiplying there would round twice, and a quarter of the values would differ.
    """
    product = codes.float() * torch.as_tensor(scale, dtype=torch.float32, device=codes.device)
    return product.to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: element 2i + 8 in the low nibble, element 2i+1 + 8 in the high one.

    Adding 8 turns -7..7 into 1..15, an unsigned nibble; the last dimension halves. ``codes``: an
    integer tensor of int4 codes, -7..7 (what :func:`quantize` gives), with an even last dimension;
    anything else is refused (ValueError), since a code past a nibble would spill into its neighbour.
    """
    if not isinstance(codes, torch.Tensor) or codes.is_floating_point() or codes.is_complex() \
            or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor of int4 codes in [-7, 7], got {_describe(codes)}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes must have an even last dimension (two codes per byte), got shape {tuple(codes.shape)}")
    if codes.numel() and (int(codes.min()) < -7 or int(codes.max()) > 7):
        raise ValueError(f"codes must lie in [-7, 7] (int4's qmax is 7), got {int(codes.min())}..{int(codes.max())}")
    return _pack(codes)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """pack_int4's arithmetic, unchecked (the codes come from :func:`_codes`, already in -7..7)."""
    nibbles = (codes.to(torch.int16) + 8).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: int8 codes in -7..7, the last dimension doubled. ``packed``
    must be uint8 (a byte of two nibbles); an int8 byte would read its high nibble with a sign."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a uint8 tensor (two int4 codes per byte), got {_describe(packed)}")
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
    [num_blocks, block_size, Hkv, head_dim] in ``dtype``, each code × its scale in float32 rounded once."""
    codes = unpack_int4(data) if q.element == "int4" else data
    return dequantize(codes, _expand_scale(scale, q, codes.shape), dtype)


def _encode(x: torch.Tensor, scale: torch.Tensor, q: KVQuant) -> torch.Tensor:
    """Values [..., D] to what the pool stores [..., D or D/2] for ``scale`` broadcast against x."""
    codes = _codes(x, scale, q.element)
    return _pack(codes) if q.element == "int4" else codes


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| in float32 where x is finite, 0 where it is NaN or ±inf: what a scale may be set from."""
    x = x.float()
    return torch.where(x.isfinite(), x.abs(), torch.zeros_like(x))


def _group_amax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """max finite |x| over each group of ``group_size`` along the last dimension (the last may be shorter)."""
    d = x.shape[-1]
    pad = -d % group_size
    padded = torch.nn.functional.pad(finite_abs(x), (0, pad))
    return padded.reshape(*x.shape[:-1], -1, group_size).amax(dim=-1)


def check_write(q: object, x: object, data: object, scale: object,
                names: tuple[str, str, str] = ("x", "data", "scale")) -> None:
    """New tokens ``x`` for one pool of scheme ``q`` (its codes ``data`` and ``scale``), else ValueError naming
    the first that is wrong; ``names`` are what the caller calls x, data and scale. The slots are
    :func:`check_slot_mapping`'s."""
    if not isinstance(q, KVQuant):
        raise ValueError(f"q must be a KVQuant (e.g. kv_quant('int8_per_block')), got {type(q).__name__}")
    x_name, data_name, scale_name = names
    if not (isinstance(x, torch.Tensor) and x.dim() == 3 and x.is_floating_point()):
        raise ValueError(f"{x_name} must be a floating-point tensor [num_tokens, num_kv_heads, head_dim], got "
                         f"{_describe(x)}")
    check_pool(q, x.shape[-1], data_name, data, scale_name, scale)
    if x.shape[1] != data.shape[2] or x.device != data.device:
        raise ValueError(f"{x_name} must be [num_tokens, {data.shape[2]}, head_dim] on {data_name}'s device "
                         f"({data.device}), got {_describe(x)}")
    check_tensor_scales(q, **{scale_name: scale})


def write_quantized(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, slot_mapping: torch.Tensor,
                    q: KVQuant) -> None:
    """The reference write: new tokens ``x`` [num_tokens, Hkv, D] into one quantized pool, in place.

    Token t goes to slot ``slot_mapping[t]`` (-1: skipped). Per tensor: codes for the fixed scale.
    Per group: each token's scales from its own values. Per block: for each block written, the new
    scale is max(old scale, max |x_new| / qmax) per head, where the old scale counts only when the
    write does not start at offset 0 (a block is filled in order, so offsets below the first new
    one hold its earlier tokens); those earlier codes are re-encoded for the new scale. The tokens
    written into one block must sit at consecutive offsets (``labkit.kernels.paged_attention.write_kv`` checks it).

    Non-finite values (the module's paragraph): a scale is set from the finite |x| only, so a NaN or
    inf in one token changes no scale and no other token's codes; NaN is stored as int code 0 or fp8
    NaN, ±inf as ±qmax. Every argument is checked first (:func:`check_write`, :func:`check_slot_mapping`):
    a refused write changes nothing.
    """
    check_write(q, x, data, scale)
    check_slot_mapping(slot_mapping, x.shape[0], data.shape[0] * data.shape[1], data.device)
    _store(x, data, scale, slot_mapping, q)


def write_quantized_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor, q: KVQuant) -> None:
    """:func:`write_quantized` for K and V at once: both checked before either pool is written."""
    check_write(q, k, k_cache, k_scale, ("k", "k_cache", "k_scale"))
    check_write(q, v, v_cache, v_scale, ("v", "v_cache", "v_scale"))
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    check_slot_mapping(slot_mapping, k.shape[0], k_cache.shape[0] * k_cache.shape[1], k_cache.device)
    _store(k, k_cache, k_scale, slot_mapping, q)
    _store(v, v_cache, v_scale, slot_mapping, q)


@torch.no_grad()
def _store(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, slot_mapping: torch.Tensor, q: KVQuant) -> None:
    """write_quantized's arithmetic, on checked arguments."""
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
    amax = amax.scatter_reduce(0, run[:, None].expand(-1, x.shape[1]), finite_abs(x).amax(dim=-1), reduce="amax")
    old = torch.where((first > 0)[:, None], scale[touched], torch.zeros_like(amax))
    new = torch.maximum(old, amax / q.qmax)  # [touched, Hkv]
    earlier = torch.arange(block_size, device=slots.device)[None, :] < first[:, None]  # [touched, block_size]
    values = dequantize_pool(data[touched], old, q)  # the earlier tokens, as numbers
    kept = _encode(values, new[:, None, :, None], q)
    data[touched] = torch.where(earlier[:, :, None, None], kept, data[touched])
    scale[touched] = new
    data[blocks, offsets] = _encode(x, new[run][:, :, None], q)
