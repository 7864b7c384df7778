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
package, the reference reader. ``labkit.model.gguf_decoder`` turns what a file holds into the book's
decoder (its config, its weights, its tokenizer), and ``labkit.model.pretrained.from_pretrained``
puts them together.

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
* the tensor inventory against the config (``gguf_decoder.check_tensors``): every ``blk.N`` layer present,
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
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "read_gguf", "dequantize", "SUPPORTED_TYPES"]


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
                    f"got {describe_value(alignment)}")
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


def describe_value(value: Any) -> str:
    """A short description of a metadata value for a message (never the whole of a big array)."""
    if isinstance(value, np.ndarray):
        return f"an array of {value.size:,} {value.dtype}"
    if isinstance(value, list):
        return f"an array of {len(value):,} item{'' if len(value) == 1 else 's'}"
    text = repr(value)
    kind = {bool: "a bool", int: "an integer", float: "a float", str: "a string"}.get(type(value), type(value).__name__)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({kind})"


# ---- dequantization -------------------------------------------------------------------------------


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
