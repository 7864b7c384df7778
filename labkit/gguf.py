"""A model in one file: reading GGUF, llama.cpp's format (chapter 01).

A Hugging Face checkpoint is a folder (``config.json``, safetensors shards, tokenizer
files). A GGUF file holds the same three things in one file:

* **metadata**, key-value pairs such as ``llama.block_count = 30`` or
  ``llama.attention.head_count_kv = 3``: the model's shape, its tokenizer (the vocabulary,
  the BPE merges, the special tokens) and its chat template;
* **tensor infos**: for each tensor its name (``blk.0.attn_q.weight``), its shape and its
  *type*, which says how its numbers are stored;
* the **tensor data**, aligned, one tensor after the other.

The types are what make GGUF small. ``F32``, ``F16`` and ``BF16`` store each weight as a
float. The quantized types store weights in blocks of 32 that share a scale: ``Q8_0``
keeps one float16 scale ``d`` and 32 signed bytes (``w = d * q``); ``Q4_0`` keeps ``d`` and
32 four-bit numbers (``w = d * (q - 8)``); ``Q4_1`` keeps ``d``, a float16 minimum ``m`` and
32 four-bit numbers (``w = d * q + m``). A 4-bit weight costs 5 bits with its share of the
scales (``Q4_1``: 20 bytes for 32 weights), against 16 bits in bf16: that is why the
SmolLM2-135M file the book uses holds 92 MiB of weights rather than 257 MiB in bfloat16.

Quantization changes the *weights* only. The KV cache holds what the model computes
(keys and values), in whatever dtype the engine chooses (the book uses bf16 or float32):
its shape, and so its bytes per token, come from the metadata alone.

``read_gguf`` opens a file: the header is a sequence of little-endian fields (counts, strings,
typed values), read here in a few dozen lines; the tensor bytes stay in the memory-mapped file.
The dequantization below is the book's own too; the tests check both against ggml-org's ``gguf``
package, the reference reader. ``decoder_config`` turns its metadata into a ``DecoderConfig``;
``state_dict`` dequantizes the tensors and renames them to the decoder's keys, undoing the
row order llama.cpp gives Q and K; ``load_gguf_tokenizer`` rebuilds the tokenizer from the
vocabulary in the file. ``labkit.pretrained.from_pretrained`` puts them together.

**A model file is untrusted input.** GGUF files come from the internet, and every number in the
header is a claim the file makes about itself: a count, a length, a shape, an offset. A reader that
believes them can be made to allocate a list of 2**64 items, to recurse until Python gives up, or
to build 100,000 layers from a 30 KB file. So every claim is checked before it is acted on:

* the header: each count and length against the bytes left in the file; nested arrays at most
  ``MAX_ARRAY_DEPTH`` deep; at most ``MAX_HEADER_ITEMS`` strings and arrays made into Python
  objects, holding at most ``MAX_HEADER_TEXT`` bytes of text (numeric arrays stay views of the
  file, read only when used), so a header costs under 100 MB whatever the file; at most ``MAX_TENSORS``
  tensors; no key and no tensor name twice; ``general.alignment`` a power of two (as gguf-py and
  ggml require);
* each tensor: 1 to 4 dimensions (ggml's limit), each at least 1, an element count that fits
  int64, rows a whole number of quantization blocks, an aligned offset, and bytes inside the file;
* the metadata the decoder needs: integers that are integers (``2``, not ``"2"``, ``2.7`` or
  ``True``: a file that spells them otherwise is refused, not coerced), floats that are finite;
* the tensor inventory against the config (``check_tensors``): every ``blk.N`` layer present,
  nothing extra, every shape as the config implies, *before* anything is built or dequantized;
* the weights as they are dequantized: a NaN or infinite scale or weight is refused, naming the
  tensor (one NaN weight turns every logit NaN);
* the tokenizer metadata: a list of strings for the vocabulary, merges as ``"a b"`` strings,
  special token ids inside the vocabulary.

Whatever fails raises ``GGUFError``, a ``ValueError`` that names the file and the reason, within
a second and a few megabytes, and nothing half-built is returned.
"""

from __future__ import annotations

import functools
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .model import DecoderConfig

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "read_gguf", "dequantize", "decoder_config", "check_tensors",
           "llama_tensor_shapes", "state_dict", "load_gguf_tokenizer", "SUPPORTED_TYPES"]

QK = 32  # weights per quantization block, for Q4_0, Q4_1 and Q8_0
# bytes per block of 32 weights: the float16 scale(s), then the numbers
BLOCK_BYTES = {"Q4_0": 2 + QK // 2, "Q4_1": 2 + 2 + QK // 2, "Q8_0": 2 + QK}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# Limits on what a header may ask of the reader. Real files stay below them: SmolLM2 has 272 tensors
# and about 98,000 strings of 0.5 MiB in all (its vocabulary and merges; Llama 3's are 408,403
# strings), Llama 3.1 405B has 126 layers.
MAX_TENSORS = 65_536
MAX_HEADER_ITEMS = 1 << 19  # strings and arrays made into Python objects, all keys and values together
MAX_HEADER_TEXT = 1 << 24  # bytes of those strings (16 MiB): with the items, under 100 MB of memory
MAX_ARRAY_DEPTH = 8  # arrays of arrays of ...
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_LAYERS = 512  # four times the deepest open models; building a layer costs about a millisecond
INT64_MAX = 2**63 - 1


class GGUFError(ValueError):
    """A GGUF file that cannot be read or does not describe a model labkit computes.

    A ``ValueError`` (so ``except ValueError`` catches it) with the file's ``path`` and the
    ``reason`` apart; its message is ``GGUF file '<path>': <reason>``.
    """

    def __init__(self, path: Path, reason: str):
        super().__init__(f"GGUF file {str(path)!r}: {reason}")
        self.path, self.reason = path, reason


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as stored: its GGUF ``type``, its ``shape`` as PyTorch orders it
    (rows, columns: ``[out_features, in_features]`` for a linear layer), and its raw bytes
    (``raw``: one row of the stored type per line, still quantized; None for a type labkit
    does not read)."""

    name: str
    type: str
    shape: tuple[int, ...]
    raw: np.ndarray | None

    @property
    def num_bytes(self) -> int:
        return 0 if self.raw is None else int(self.raw.nbytes)


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file read: its path, its metadata by key, its tensors by name (still quantized).

    Metadata values are Python ints, floats, bools and strings; an array of strings (or of
    arrays) is a list; an array of numbers is a read-only NumPy array viewing the file, so a
    metadata array of a billion numbers costs nothing until it is read.
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def types(self) -> dict[str, int]:
        """How many tensors are stored in each type, e.g. ``{"Q4_1": 210, "F32": 61, "Q8_0": 1}``."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type] = counts.get(t.type, 0) + 1
        return counts


def _fail(path: Path, why: str) -> GGUFError:
    return GGUFError(path, why)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file: metadata and tensor infos now, tensor bytes memory-mapped (read on use).

    Raises ``GGUFError`` (a ``ValueError``) naming the file and the reason for a file that is
    missing, is not a GGUF file, or whose header does not hold together: a count or a length
    past the end of the file, arrays nested too deep, a key or a tensor twice, a bad alignment,
    a tensor shape that overflows or does not fill whole blocks, tensor bytes past the end of the
    file (see the module's docstring for the list). A file read once is kept while it is
    unchanged on disk (same size and modification time).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise _fail(path, "no such file")
    stat = path.stat()
    return _read_gguf(path, stat.st_size, stat.st_mtime_ns)


# GGML's type ids (ggml.h) for the names in messages; labkit dequantizes SUPPORTED_TYPES only.
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
              10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 24: "I8", 25: "I16",
              26: "I32", 27: "I64", 28: "F64", 30: "BF16"}
# bytes per block and weights per block of the types labkit reads
TYPE_SIZES = {"F32": (4, 1), "F16": (2, 1), "BF16": (2, 1), **{k: (v, QK) for k, v in BLOCK_BYTES.items()}}
# GGUF metadata value types: struct formats of the scalars; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


class _Damaged(Exception):
    """A header field that cannot be true; read_gguf turns it into a GGUFError naming the file."""


class _Cursor:
    """Reads GGUF's little-endian fields one after the other, never past the end of the file.

    Every count and length is compared with the bytes left *before* anything is read or made, and
    the strings and arrays made into Python objects are counted (``MAX_HEADER_ITEMS``, and
    ``MAX_HEADER_TEXT`` bytes of text): a header that lies fails here, in bounded time and memory.
    """

    def __init__(self, view: memoryview):
        self.view, self.at = view, 0
        self.items_left, self.text_left = MAX_HEADER_ITEMS, MAX_HEADER_TEXT

    def left(self) -> int:
        return len(self.view) - self.at

    def take(self, n: int, what: str) -> int:
        """Step over ``n`` bytes; returns where they start."""
        if n > self.left():
            raise _Damaged(f"{what} needs {n:,} bytes at byte {self.at:,}, only {self.left():,} are left")
        start, self.at = self.at, self.at + n
        return start

    def scalar(self, fmt: str):
        start = self.take(struct.calcsize(fmt), "a number")
        return struct.unpack_from("<" + fmt, self.view, start)[0]

    def count(self, n: int, min_bytes: int, what: str) -> None:
        """Check a claimed count: each item needs ``min_bytes`` of the file and one Python object."""
        if n * min_bytes > self.left():
            raise _Damaged(f"{what} claims {n:,} items at byte {self.at:,}; the {self.left():,} bytes left "
                           f"hold at most {self.left() // min_bytes:,}")
        if n > self.items_left:
            raise _Damaged(f"{what} would make the header hold more than {MAX_HEADER_ITEMS:,} strings and arrays")
        self.items_left -= n

    def text(self, n: int) -> None:
        """Charge ``n`` bytes of strings to the header's budget."""
        if n > self.text_left:
            raise _Damaged(f"the header's strings would hold more than {MAX_HEADER_TEXT:,} bytes")
        self.text_left -= n

    def string(self) -> str:
        self.count(1, 0, "a string")
        n = _U64.unpack_from(self.view, self.take(8, "a string's length"))[0]
        start = self.take(n, "a string")
        self.text(n)
        return str(self.view[start:start + n], "utf-8")

    def strings(self, n: int) -> list[str]:
        """``n`` strings in a row (a vocabulary, the merges): the hot loop of reading a header."""
        self.count(n, 8, "an array of strings")
        view, at, end, text_left, out = self.view, self.at, len(self.view), self.text_left, []
        for _ in range(n):
            if at + 8 > end:
                raise _Damaged(f"a string's length runs past the end of the file at byte {at:,}")
            size = _U64.unpack_from(view, at)[0]
            if size > end - at - 8:
                raise _Damaged(f"a string of {size:,} bytes at byte {at:,} runs past the end of the file")
            if size > text_left:
                self.text(size)  # raises, saying why
            text_left -= size
            out.append(str(view[at + 8:at + 8 + size], "utf-8"))
            at += 8 + size
        self.at, self.text_left = at, text_left
        return out

    def value(self, kind: int, depth: int = 0):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise _Damaged(f"unknown metadata value type {kind} at byte {self.at - 4:,}")
        if depth >= MAX_ARRAY_DEPTH:
            raise _Damaged(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
        item, n = self.scalar("I"), self.scalar("Q")
        if item in _NUMPY:  # numbers: a read-only view of the file, nothing copied
            width = np.dtype(_NUMPY[item]).itemsize
            self.count(1, 0, "an array")
            start = self.take(n * width, f"an array of {n:,} numbers")
            return np.frombuffer(self.view, _NUMPY[item], n, start)
        if item == _STRING:
            return self.strings(n)
        if item == _ARRAY:
            self.count(n, 12, "an array of arrays")  # each needs its item type and count
            return [self.value(_ARRAY, depth + 1) for _ in range(n)]
        raise _Damaged(f"unknown array item type {item} at byte {self.at - 12:,}")


@functools.lru_cache(maxsize=4)
def _read_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    """Parse the header (metadata, tensor infos); tensor bytes stay in the memory-mapped file."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise _fail(path, "not a GGUF file (it does not start with the magic bytes 'GGUF')")
    view = memoryview(np.memmap(path, dtype=np.uint8, mode="r"))
    cur = _Cursor(view)
    cur.at = 4
    try:
        version = cur.scalar("I")
        if version not in (2, 3):
            swapped = " (a big-endian file? labkit reads little-endian ones)" if version in (2 << 24, 3 << 24) else ""
            raise _fail(path, f"GGUF version {version}{swapped}; labkit reads versions 2 and 3")
        num_tensors, num_kv = cur.scalar("Q"), cur.scalar("Q")
        if num_tensors > MAX_TENSORS:
            raise _fail(path, f"the header claims {num_tensors:,} tensors; labkit reads at most {MAX_TENSORS:,}")
        cur.count(num_kv, 8 + 4 + 1, "the metadata")  # a key's length, a value type, a one-byte value
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            if key in metadata:
                raise _fail(path, f"metadata key {key!r} appears twice")
            metadata[key] = cur.value(cur.scalar("I"))
        cur.count(num_tensors, 8 + 4 + 8 + 4 + 8, "the tensor infos")  # name length, dims, 1 dim, type, offset
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            n_dims = cur.scalar("I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise _fail(path, f"tensor {name!r} has {n_dims} dimensions; a tensor has 1 to {MAX_DIMS}")
            dims = [cur.scalar("Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    except (_Damaged, struct.error, UnicodeDecodeError) as err:
        raise _fail(path, f"truncated or damaged: its header cannot be read ({err})") from err
    alignment = metadata.get("general.alignment", 32)
    if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
        raise _fail(path, f"general.alignment must be a power of two (gguf-py and ggml refuse others), "
                          f"got {_describe(alignment)}")
    data_start = -(-cur.at // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, type_id, offset in infos:
        if name in tensors:
            raise _fail(path, f"tensor {name!r} appears twice")
        tensors[name] = _tensor(path, view, name, dims, type_id, offset, data_start, alignment)
    return GGUFFile(path, metadata, tensors)


def _tensor(path: Path, view: memoryview, name: str, dims: list[int], type_id: int, offset: int,
            data_start: int, alignment: int) -> GGUFTensor:
    """One tensor info checked against the file, its bytes a view of the file (nothing read yet)."""
    kind = GGML_TYPES.get(type_id, f"type {type_id}")
    shape = tuple(reversed(dims))  # GGUF lists the fastest axis first; PyTorch lists it last
    if min(shape) < 1:
        raise _fail(path, f"tensor {name!r} has shape {shape}; every dimension must be at least 1")
    elements = math.prod(shape)  # a Python int: it cannot wrap around
    if elements > INT64_MAX:
        raise _fail(path, f"tensor {name!r} has shape {shape}: {elements:,} elements overflow int64")
    if offset % alignment:
        raise _fail(path, f"tensor {name!r} starts at offset {offset:,}, not a multiple of the alignment "
                          f"{alignment}")
    if kind not in TYPE_SIZES:  # the bytes of a type labkit cannot read are never touched
        return GGUFTensor(name, kind, shape, None)
    block_bytes, per_block = TYPE_SIZES[kind]
    if shape[-1] % per_block:
        raise _fail(path, f"tensor {name!r} is {kind} with rows of {shape[-1]:,} weights, not a multiple of "
                          f"its block of {per_block}")
    rows, row_bytes = elements // shape[-1], shape[-1] // per_block * block_bytes
    start, end = data_start + offset, data_start + offset + rows * row_bytes
    if end > len(view):
        raise _fail(path, f"truncated: tensor {name!r} needs bytes up to {end:,}, the file ends at {len(view):,}")
    raw = np.frombuffer(view, np.uint8, rows * row_bytes, start).reshape(rows, row_bytes)
    return GGUFTensor(name, kind, shape, raw)


def _describe(value: Any) -> str:
    """A short description of a metadata value for a message (never the whole of a big array)."""
    if isinstance(value, np.ndarray):
        return f"an array of {value.size:,} {value.dtype}"
    if isinstance(value, list):
        return f"an array of {len(value):,} item{'' if len(value) == 1 else 's'}"
    text = repr(value)
    kind = {bool: "a bool", int: "an integer", float: "a float", str: "a string"}.get(type(value), type(value).__name__)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({kind})"


# ---- dequantization ---------------------------------------------------------------------------------


def _check_finite(name: str, values: np.ndarray, what: str) -> None:
    if not np.isfinite(values).all():
        bad = int(np.size(values) - np.count_nonzero(np.isfinite(values)))
        raise ValueError(f"tensor {name!r} holds {bad:,} NaN or infinite {what}: refused, since one NaN weight "
                         f"makes every logit NaN")


def _dequantize_blocks(raw: np.ndarray, kind: str, name: str) -> np.ndarray:
    """float32 weights, 32 per block, in storage order."""
    b = np.asarray(raw).reshape(-1, BLOCK_BYTES[kind])  # one line per block of 32 weights
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n_blocks, 1]: the block's scale
    _check_finite(name, d, "block scales")
    q = np.empty((b.shape[0], QK), np.float32)
    if kind == "Q8_0":
        q[:] = b[:, 2:].view(np.int8)
        q *= d
        return q
    packed = b[:, 4:] if kind == "Q4_1" else b[:, 2:]
    # 16 bytes hold 32 numbers: the low nibbles are weights 0..15, the high nibbles 16..31
    np.bitwise_and(packed, 0x0F, out=q[:, :QK // 2], casting="unsafe")
    np.right_shift(packed, 4, out=q[:, QK // 2:], casting="unsafe")
    if kind == "Q4_0":
        q -= 8.0
        q *= d
        return q
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)  # Q4_1: the block's minimum
    _check_finite(name, m, "block minimums")
    q *= d
    q += m
    return q


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's weights as a float32 array of ``tensor.shape``.

    Supported types: F32, F16, BF16, Q8_0, Q4_0, Q4_1 (``SUPPORTED_TYPES``); any other raises
    ``ValueError`` naming the tensor and its type. A NaN or infinite weight (in a float type) or
    block scale or minimum (in a quantized type, where a finite scale gives finite weights) raises
    ``ValueError`` naming the tensor: refused rather than warned about, since it would silently
    make the model's every output NaN.
    """
    kind, raw = tensor.type, tensor.raw
    if kind in FLOAT_TYPES:
        out = np.asarray(raw).view(FLOAT_TYPES[kind]).astype(np.float32)
        _check_finite(tensor.name, out, "weights")
    elif kind == "BF16":  # bfloat16 is the top half of a float32
        out = (np.asarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        _check_finite(tensor.name, out, "weights")
    elif kind in BLOCK_BYTES:
        out = _dequantize_blocks(raw, kind, tensor.name)
    else:
        raise ValueError(f"tensor {tensor.name!r} is stored as {kind}, which labkit does not dequantize "
                         f"(supported: {', '.join(SUPPORTED_TYPES)})")
    return out.reshape(tensor.shape)


# ---- metadata -> DecoderConfig --------------------------------------------------------------------

_REQUIRED = object()


def _meta(file: GGUFFile, key: str, *, required: bool = True, default: Any = None) -> Any:
    full = f"{file.architecture}.{key}"
    if full not in file.metadata:
        if required:
            raise _fail(file.path, f"metadata {full!r} is missing")
        return default
    return file.metadata[full]


def _meta_int(file: GGUFFile, key: str, *, minimum: int = 1, default: Any = _REQUIRED) -> int:
    """An integer field: any GGUF integer type; a string, float, bool or array is refused, not coerced."""
    value = _meta(file, key, required=default is _REQUIRED, default=default)
    if type(value) is not int or value < minimum:
        raise _fail(file.path, f"metadata '{file.architecture}.{key}' must be an integer >= {minimum}, "
                               f"got {_describe(value)}")
    return value


def _meta_float(file: GGUFFile, key: str, *, default: Any = _REQUIRED) -> float:
    """A float field (a GGUF float or integer): finite and > 0."""
    value = _meta(file, key, required=default is _REQUIRED, default=default)
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise _fail(file.path, f"metadata '{file.architecture}.{key}' must be a finite number > 0, "
                               f"got {_describe(value)}")
    return float(value)


def _token_list(file: GGUFFile) -> list[str] | None:
    """``tokenizer.ggml.tokens`` when the file has it, checked to be a non-empty list of strings."""
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    if not isinstance(tokens, list) or not tokens or not all(type(t) is str for t in tokens):
        raise _fail(file.path, f"tokenizer.ggml.tokens must be a non-empty array of strings, got {_describe(tokens)}")
    return tokens


def decoder_config(file: GGUFFile) -> DecoderConfig:
    """The decoder's shape from the file's metadata (only ``general.architecture == "llama"``).

    ==========================================  ==========================
    GGUF metadata                               ``DecoderConfig`` field
    ==========================================  ==========================
    ``llama.block_count``                       ``num_hidden_layers``
    ``llama.embedding_length``                  ``hidden_size``
    ``llama.feed_forward_length``               ``intermediate_size``
    ``llama.attention.head_count``              ``num_attention_heads``
    ``llama.attention.head_count_kv``           ``num_key_value_heads``
    ``llama.attention.key_length``              ``head_dim`` (default: hidden / heads)
    ``llama.rope.freq_base``                    ``rope_theta``
    ``llama.attention.layer_norm_rms_epsilon``  ``rms_norm_eps``
    ``llama.context_length``                    ``max_position_embeddings``
    ``llama.vocab_size`` (or the token list)    ``vocab_size``
    ``llama.rope.scaling.*``, ``rope_freqs``     refused: scaled RoPE is read from config.json only
    no ``output.weight`` tensor                 ``tie_word_embeddings``
    ``tokenizer.ggml.eos_token_id``             ``eos_token_id``
    ==========================================  ==========================

    Each field must have its type: an integer field holding ``"2"``, ``2.7``, ``True`` or an array
    (llama.cpp's per-layer head counts) is refused rather than coerced, since a coerced value is a
    guess about the model. Then the config is checked against the file's tensors
    (``check_tensors``), so a config the file cannot fill never reaches ``Decoder``: a file that
    claims 100,000 layers and holds one fails here, before a layer is built.
    """
    if file.architecture != "llama":
        raise _fail(file.path, f"general.architecture is {file.architecture!r}; labkit's decoder computes "
                               f"only 'llama' (Llama, SmolLM2, Mistral without sliding windows)")
    if _meta_int(file, "expert_count", minimum=0, default=0):
        raise _fail(file.path, "llama.expert_count is set: mixture-of-experts layers are not supported")
    heads = _meta_int(file, "attention.head_count")
    kv_heads = _meta_int(file, "attention.head_count_kv", default=heads)
    hidden = _meta_int(file, "embedding_length")
    if "llama.attention.key_length" not in file.metadata and hidden % heads:
        raise _fail(file.path, f"llama.embedding_length {hidden} does not divide by llama.attention.head_count "
                               f"{heads}, and llama.attention.key_length (head_dim) is not given")
    head_dim = _meta_int(file, "attention.key_length", default=hidden // heads)
    if _meta_int(file, "attention.value_length", default=head_dim) != head_dim:
        raise _fail(file.path, f"llama.attention.value_length {_meta(file, 'attention.value_length')} differs "
                               f"from key_length {head_dim}: the decoder has one head_dim for K and V")
    if _meta_int(file, "rope.dimension_count", default=head_dim) != head_dim:
        raise _fail(file.path, f"llama.rope.dimension_count is {_meta(file, 'rope.dimension_count')}, head_dim "
                               f"is {head_dim}: RoPE must rotate the whole head")
    scaling = _meta(file, "rope.scaling.type", required=False, default="none")
    if not (isinstance(scaling, str) and scaling == "none"):
        raise _fail(file.path, f"llama.rope.scaling.type {_describe(scaling)} is not supported")
    if "rope_freqs.weight" in file.tensors:  # Llama 3.1's scaling is stored as factors per frequency
        raise _fail(file.path, "the file stores RoPE frequency factors (rope_freqs.weight, Llama 3.1 scaling), "
                               "which labkit's GGUF reader does not read; load the safetensors checkpoint instead")
    tokens = _token_list(file)
    if "llama.vocab_size" in file.metadata or tokens is None:
        vocab = _meta_int(file, "vocab_size")
        if tokens is not None and len(tokens) != vocab:
            raise _fail(file.path, f"llama.vocab_size is {vocab:,} but tokenizer.ggml.tokens lists "
                                   f"{len(tokens):,} tokens")
    else:
        vocab = len(tokens)
    eos = file.metadata.get("tokenizer.ggml.eos_token_id")
    if eos is not None and (type(eos) is not int or not 0 <= eos < vocab):
        raise _fail(file.path, f"tokenizer.ggml.eos_token_id must be a token id in [0, {vocab}), "
                               f"got {_describe(eos)}")
    try:
        config = DecoderConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=_meta_int(file, "feed_forward_length"),
            num_hidden_layers=_meta_int(file, "block_count"), num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim,
            rope_theta=_meta_float(file, "rope.freq_base", default=10000.0),
            rms_norm_eps=_meta_float(file, "attention.layer_norm_rms_epsilon"),
            max_position_embeddings=_meta_int(file, "context_length"),
            tie_word_embeddings="output.weight" not in file.tensors, eos_token_id=eos)
    except GGUFError:
        raise
    except ValueError as err:  # DecoderConfig's own rules (heads a multiple of KV heads, head_dim even)
        raise _fail(file.path, f"its metadata describes no decoder labkit can build: {err}") from err
    check_tensors(file, config)
    return config


# ---- the tensor inventory ----------------------------------------------------------------------------

# GGUF tensor names -> the decoder's (Hugging Face Llama) state_dict keys
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_BLOCK = re.compile(r"blk\.(\d{1,9})\.")  # a longer number is no layer of ours (and int() of it is slow)


def llama_tensor_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a llama GGUF file holds for ``config``: GGUF name -> shape in PyTorch order.

    ``output.weight`` only when the embeddings are not tied; q/k/v biases only with ``qkv_bias``.
    """
    h, ffn, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (vocab, h)
    layer = {"attn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
             "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_norm.weight": (h,),
             "ffn_gate.weight": (ffn, h), "ffn_up.weight": (ffn, h), "ffn_down.weight": (h, ffn)}
    if config.qkv_bias:
        layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    for i in range(config.num_hidden_layers):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def check_tensors(file: GGUFFile, config: DecoderConfig) -> None:
    """The file's tensor inventory against ``config``, before anything is built or dequantized.

    In this order, each a ``GGUFError`` naming the file: the layers the tensor names number
    (``blk.0`` ... ``blk.N-1``) must be the config's layers, and at most ``MAX_LAYERS``; every
    tensor the decoder needs must be there and nothing else; every shape must be the one the
    config implies (``llama_tensor_shapes``). The names are read first, so a file claiming
    100,000 layers costs a set of its names, not a list of 900,000 expected tensors.
    """
    layers = {int(m.group(1)) for name in file.tensors if (m := _BLOCK.match(name))}
    n = config.num_hidden_layers
    if len(layers) != n or (layers and (min(layers), max(layers)) != (0, n - 1)):  # never range(n) itself
        held = (f"{len(layers):,} layer{'' if len(layers) == 1 else 's'} (blk.{min(layers)} to blk.{max(layers)})"
                if layers else "no layer")
        raise _fail(file.path, f"llama.block_count is {n:,}, but its tensors are named for {held}")
    if n > MAX_LAYERS:
        raise _fail(file.path, f"{n:,} layers: labkit builds at most {MAX_LAYERS} (MAX_LAYERS)")
    expected = llama_tensor_shapes(config)
    missing = [name for name in expected if name not in file.tensors]
    if missing:
        raise _fail(file.path, f"lacks tensor {missing[0]!r} ({len(missing)} missing in all), which the "
                               f"metadata's decoder needs")
    unknown = [name for name in file.tensors if name not in expected]
    if unknown:
        raise _fail(file.path, f"tensor {unknown[0]!r} is not part of the Llama decoder its metadata describes "
                               f"({len(unknown)} unknown in all)")
    for name, shape in expected.items():
        if file.tensors[name].shape != shape:
            raise _fail(file.path, f"tensor {name!r} has shape {file.tensors[name].shape}; the GGUF file's "
                                   f"metadata implies {shape}")


# ---- tensors -> the decoder's state_dict --------------------------------------------------------------


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo the row order llama.cpp gives Q and K weights.

    Hugging Face's Llama rotates dimension ``i`` of a head with dimension ``i + D/2``
    (``rotate_half``); llama.cpp rotates neighbours ``2i`` and ``2i + 1``. Its converter
    therefore reorders each head's rows from ``[0, 1, ..., D/2-1 | D/2, ..., D-1]`` to
    ``[0, D/2, 1, D/2+1, ...]`` so that the same weights give the same model under its RoPE.
    Reading the file back for the Hugging Face layout, each head's rows are put back.
    The rows must split into ``num_heads`` heads of an even size, else ``ValueError``.
    """
    rows = weight.shape[0]
    if num_heads < 1 or rows % num_heads or (rows // num_heads) % 2:
        raise ValueError(f"num_heads: {rows} rows do not split into {num_heads} heads of an even size")
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def hf_name(gguf_name: str) -> str | None:
    """The decoder's key for a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None for a name it does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    return None


def state_dict(file: GGUFFile, config: DecoderConfig | None = None) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, under the decoder's keys, Q and K rows unpermuted.

    Everything that can be checked without reading a weight is checked first: the inventory
    against the config (``check_tensors``: names, layers, shapes) and every tensor's type, so a
    bad file fails at once with nothing dequantized. A NaN or infinite weight or scale fails as
    it is dequantized, naming the tensor. Each failure is a ``GGUFError`` naming the file.
    """
    if config is None:
        config = decoder_config(file)  # checks the inventory too
    else:
        check_tensors(file, config)
    for t in file.tensors.values():
        if t.type not in SUPPORTED_TYPES:
            raise _fail(file.path, f"tensor {t.name!r} is stored as {t.type}, which labkit does not "
                                   f"dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
    out: dict[str, torch.Tensor] = {}
    for t in file.tensors.values():
        try:
            weight = torch.from_numpy(dequantize(t))
        except ValueError as err:
            raise _fail(file.path, str(err)) from err
        if t.name.endswith("attn_q.weight"):
            weight = unpermute_rope_rows(weight, config.num_attention_heads)
        elif t.name.endswith("attn_k.weight"):
            weight = unpermute_rope_rows(weight, config.num_key_value_heads)
        out[hf_name(t.name)] = weight
    return out


# ---- the tokenizer ----------------------------------------------------------------------------------

# llama.cpp's split for the 'smollm' pre-tokenizer (src/llama-vocab.cpp): every digit alone,
# then GPT-2's rule (contractions, letters, numbers, punctuation, spaces).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_PRE_TOKENIZER_SPLITS = {"smollm": [r"\p{N}", _GPT2_SPLIT], "gpt2": [_GPT2_SPLIT], "default": [_GPT2_SPLIT]}
_CONTROL = 3  # tokenizer.ggml.token_type of a special token such as <|im_end|>
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def _tokenizer_metadata(file: GGUFFile) -> dict[str, Any]:
    """The tokenizer's fields, each checked: the vocabulary, merges, token types, special ids, template."""
    meta, path = file.metadata, file.path
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise _fail(path, f"tokenizer.ggml.model is {_describe(kind)}; labkit rebuilds only byte-level BPE "
                          f"tokenizers ('gpt2', as SmolLM2 and Llama 3 use)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in _PRE_TOKENIZER_SPLITS:
        raise _fail(path, f"tokenizer.ggml.pre is {_describe(pre)}; labkit knows the split rules of "
                          f"{sorted(_PRE_TOKENIZER_SPLITS)}")
    tokens = _token_list(file)
    if tokens is None:
        raise _fail(path, "tokenizer.ggml.tokens (the vocabulary) is missing")
    merges = meta.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list) or not all(type(m) is str and " " in m for m in merges):
        bad = merges if not isinstance(merges, list) else next(m for m in merges if type(m) is not str or " " not in m)
        raise _fail(path, f"tokenizer.ggml.merges must be an array of strings 'left right', found {_describe(bad)}")
    types = meta.get("tokenizer.ggml.token_type", np.zeros(len(tokens), np.int32))
    if not (isinstance(types, np.ndarray) and types.dtype.kind in "iu" and types.shape == (len(tokens),)):
        raise _fail(path, f"tokenizer.ggml.token_type must be an array of {len(tokens):,} integers (one per token), "
                          f"got {_describe(types)}")
    special = {}
    for key in _SPECIAL_IDS:
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and (type(i) is not int or not 0 <= i < len(tokens)):
            raise _fail(path, f"tokenizer.ggml.{key} must be a token id in [0, {len(tokens):,}), got {_describe(i)}")
        special[key] = None if i is None else tokens[i]
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise _fail(path, f"tokenizer.chat_template must be a string, got {_describe(template)}")
    return {"pre": pre, "tokens": tokens, "merges": merges, "special": special, "template": template,
            "control": [tokens[i] for i in np.flatnonzero(types == _CONTROL)]}


def load_gguf_tokenizer(path: str | os.PathLike | GGUFFile):
    """The tokenizer written in a GGUF file, rebuilt with Hugging Face ``tokenizers``.

    A byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``, as SmolLM2's) is three
    things, all in the metadata: the vocabulary (``tokenizer.ggml.tokens``, id = position),
    the merges learnt in training (``tokenizer.ggml.merges``, best first) and the rule that
    first splits text into words (``tokenizer.ggml.pre``, named after llama.cpp's rules). Tokens
    whose ``token_type`` is 3 (control) are special: ``<|im_start|>`` stays one token. The
    chat template and the BOS/EOS ids come from the file too. Returns a transformers
    ``PreTrainedTokenizerFast``, so ``apply_chat_template`` and ``decode`` work as usual.

    Each field is checked first (a list of strings, merges ``"a b"``, special ids inside the
    vocabulary: an id of -1 would quietly pick the last token), and a merge the ``tokenizers``
    library refuses (its errors are bare ``Exception``) becomes a ``GGUFError`` naming the file.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    file = path if isinstance(path, GGUFFile) else read_gguf(path)
    fields = _tokenizer_metadata(file)
    tokens, special = fields["tokens"], fields["special"]
    try:
        merges = [tuple(m.split(" ", 1)) for m in fields["merges"]]
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    except Exception as err:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
        raise _fail(file.path, f"the tokenizer cannot be rebuilt from its vocabulary and merges: {err}") from err
    tok = Tokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_TOKENIZER_SPLITS[fields["pre"]]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=special["bos_token_id"], eos_token=special["eos_token_id"],
        unk_token=special["unknown_token_id"], pad_token=special["padding_token_id"],
        additional_special_tokens=fields["control"], chat_template=fields["template"],
        clean_up_tokenization_spaces=False)
