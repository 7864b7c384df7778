"""labkit.model.gguf against hostile files: a table of crafted files and a seeded mutation fuzz.

Model files come from the internet, so the reader is tested as an attacker would test it:

* **the table** (``ROWS``): one crafted file per row, each breaking one rule (a count past the end
  of the file, arrays nested 500 deep, an alignment of 0, ``head_count = "2"``, a file claiming
  100,000 layers, a NaN scale, a merge of unknown tokens ...). Each row names the call
  (``from_pretrained`` or ``load_gguf_tokenizer``) and a fragment of the reason; the error must be
  a ``GGUFError`` (a ``ValueError``) whose message names the file. A few rows are odd but
  harmless files that must load (a metadata array of 6 x 10**8 bytes, read lazily).
* **the fuzz**: ``FUZZ_CASES`` seeded mutations of three small valid files (bit flips, byte
  writes, truncations, inserted and deleted bytes, and every integer field of the header - counts,
  lengths, value types, dims, tensor types, offsets - overwritten with edge values). Each must load
  or raise a ``ValueError`` naming the file.

Every case of both runs in one worker subprocess (``python tests/test_gguf_malformed.py --worker``)
whose address space is capped (``RLIMIT_AS``, 1 GiB above what it holds after a warm-up load), with
a per-case alarm; each case is timed and its peak resident memory growth measured (the kernel's
high-water mark, reset before the case through ``/proc/self/clear_refs``). Every case must take at
most ``MAX_SECONDS`` of CPU time (CPU time, so that a busy shared machine does not fail the test;
the alarm stops a case after ``10 * MAX_SECONDS`` of wall time) and grow by at most
``MAX_GROWTH_MB``; a worker that crashes is reported with the case it was running.

The files are written by ``gguf_parts`` below, a GGUF writer of a few lines that writes whatever it
is told (counts that lie, a key twice, a tensor of 0 dimensions); a test checks that ggml-org's
reader reads its valid files as labkit does. The weights are quantized by ggml-org's ``gguf``.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

pytest.importorskip("gguf")  # ggml-org's package quantizes the seeds' weights and reads them back

MAX_SECONDS = 1.0
MAX_GROWTH_MB = 100.0
FUZZ_CASES = 600
FUZZ_SEED = 31
AS_HEADROOM = 1 << 30  # the worker's address-space cap above what it maps after its warm-up

# GGUF metadata value types (gguf_type in ggml's gguf.h)
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q", F64: "d"}
TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "BF16": 30}


# ---- a GGUF writer that writes what it is told ---------------------------------------------------------


class Hole(int):
    """``n`` zero bytes left as a hole in a sparse file: a 600 MB array that costs no disk."""


class Raw(list):
    """A metadata value given as its encoded parts (bytes and Holes), written as is."""


def enc_str(s: str | bytes) -> bytes:
    b = s if isinstance(s, bytes) else s.encode()
    return struct.pack("<Q", len(b)) + b


def enc(kind: int, value) -> list:
    """A metadata value's parts. ``ARR`` takes ``(item_kind, items)`` or ``(item_kind, items, count)``."""
    if isinstance(value, Raw):
        return list(value)
    if kind == STR:
        return [enc_str(value)]
    if kind == ARR:
        item, items = value[0], value[1]
        count = value[2] if len(value) > 2 else len(items)
        return [struct.pack("<IQ", item, count)] + [p for x in items for p in enc(item, x)]
    return [struct.pack("<" + FMT[kind], value)]


def size(parts: list) -> int:
    return sum(p if isinstance(p, Hole) else len(p) for p in parts)


@dataclass
class T:
    """A tensor to write: ``shape`` in PyTorch order; ``dims``/``type_id``/``offset`` override the info."""

    name: str
    shape: tuple[int, ...]
    kind: str
    data: bytes
    dims: list[int] | None = None
    type_id: int | None = None
    offset: int | None = None


def gguf_parts(meta: list, tensors: list[T], *, version: int = 3, align: int = 32, n_kv: int | None = None,
               n_tensors: int | None = None, magic: bytes = b"GGUF") -> list:
    """A GGUF file as parts: the header (magic, version, counts, metadata, tensor infos), then the data."""
    parts = [magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(meta) if n_kv is None else n_kv)]
    for key, kind, value in meta:
        parts += [enc_str(key) + struct.pack("<I", kind)] + enc(kind, value)
    at = 0
    for t in tensors:
        dims = list(reversed(t.shape)) if t.dims is None else t.dims
        parts.append(enc_str(t.name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
                     + struct.pack("<IQ", TYPE_IDS[t.kind] if t.type_id is None else t.type_id,
                                   at if t.offset is None else t.offset))
        at += -(-len(t.data) // align) * align
    parts.append(bytes(-size(parts) % align))
    for t in tensors:
        parts.append(t.data + bytes(-len(t.data) % align))
    return parts


def write_parts(path: Path, parts: list) -> Path:
    with open(path, "wb") as f:
        for p in parts:
            if isinstance(p, Hole):
                f.seek(p, os.SEEK_CUR)
            else:
                f.write(p)
        f.truncate()
    return path


# ---- a small valid model: the seed of every row ---------------------------------------------------------

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *"abcdefghijklmnopqrstuvwxyz", "Ġ", "ab", "Ġa"]
MERGES = ["a b", "Ġ a"]
TOKEN_TYPES = [3, 3, 3] + [1] * (len(TOKENS) - 3)
DEFAULT_TYPES = {"token_embd": "Q8_0", "attn_q": "F16", "attn_k": "BF16", "attn_v": "Q4_0", "attn_output": "Q4_1",
                 "ffn_gate": "Q4_1", "ffn_up": "Q8_0", "ffn_down": "Q4_1", "output": "Q8_0"}


def tensor_bytes(x: np.ndarray, kind: str) -> bytes:
    """``x`` stored as ``kind``, quantized by ggml-org's gguf package (the reference)."""
    import gguf

    if kind == "F32":
        return x.astype(np.float32).tobytes()
    if kind == "F16":
        return x.astype(np.float16).tobytes()
    return gguf.quants.quantize(x.astype(np.float32), gguf.GGMLQuantizationType[kind]).tobytes()


@dataclass
class Model:
    """A llama GGUF model as metadata rows and tensors, edited row by row by the table."""

    meta: list = field(default_factory=list)
    tensors: list[T] = field(default_factory=list)

    def set(self, key: str, kind: int, value) -> "Model":
        rows = [r for r in self.meta if r[0] != key]
        index = next((i for i, r in enumerate(self.meta) if r[0] == key), len(rows))
        rows.insert(index, (key, kind, value))
        return replace(self, meta=rows)

    def drop(self, key: str) -> "Model":
        return replace(self, meta=[r for r in self.meta if r[0] != key],
                       tensors=[t for t in self.tensors if t.name != key])

    def add(self, key: str, kind: int, value) -> "Model":  # even a key already there
        return replace(self, meta=[*self.meta, (key, kind, value)])

    def tensor(self, name: str, **changes) -> "Model":
        return replace(self, tensors=[replace(t, **changes) if t.name == name else t for t in self.tensors])

    def add_tensor(self, t: T) -> "Model":
        return replace(self, tensors=[*self.tensors, t])

    def parts(self, **kwargs) -> list:
        return gguf_parts(self.meta, self.tensors, **kwargs)


def model(*, layers: int = 1, hidden: int = 32, heads: int = 2, kv: int = 1, head_dim: int = 16, ffn: int = 32,
          tied: bool = False, types: dict[str, str] | None = None, seed: int = 0) -> Model:
    """A valid llama GGUF model with SmolLM2's tokenizer fields and a 32-token byte-level BPE vocabulary."""
    rng = np.random.default_rng(seed)
    types = {**DEFAULT_TYPES, **(types or {})}
    vocab = len(TOKENS)
    meta = [("general.architecture", STR, "llama"), ("llama.block_count", U32, layers),
            ("llama.context_length", U32, 256), ("llama.embedding_length", U32, hidden),
            ("llama.feed_forward_length", U32, ffn), ("llama.attention.head_count", U32, heads),
            ("llama.attention.head_count_kv", U32, kv), ("llama.rope.freq_base", F32, 10000.0),
            ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5), ("llama.vocab_size", U32, vocab),
            ("llama.rope.dimension_count", U32, head_dim), ("tokenizer.ggml.model", STR, "gpt2"),
            ("tokenizer.ggml.pre", STR, "smollm"), ("tokenizer.ggml.tokens", ARR, (STR, TOKENS)),
            ("tokenizer.ggml.token_type", ARR, (I32, TOKEN_TYPES)), ("tokenizer.ggml.merges", ARR, (STR, MERGES)),
            ("tokenizer.ggml.bos_token_id", U32, 1), ("tokenizer.ggml.eos_token_id", U32, 2),
            ("tokenizer.ggml.unknown_token_id", U32, 0), ("tokenizer.ggml.padding_token_id", U32, 2),
            ("tokenizer.chat_template", STR, "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                                             "{% endfor %}")]

    def t(name: str, shape: tuple[int, ...], kind: str) -> T:
        x = rng.standard_normal(shape) * 0.2 + (1.0 if len(shape) == 1 else 0.0)
        return T(name, shape, kind, tensor_bytes(x, kind))

    q, k = heads * head_dim, kv * head_dim
    tensors = [t("token_embd.weight", (vocab, hidden), types["token_embd"])]
    for i in range(layers):
        p = f"blk.{i}."
        tensors += [t(p + "attn_norm.weight", (hidden,), "F32"), t(p + "attn_q.weight", (q, hidden), types["attn_q"]),
                    t(p + "attn_k.weight", (k, hidden), types["attn_k"]),
                    t(p + "attn_v.weight", (k, hidden), types["attn_v"]),
                    t(p + "attn_output.weight", (hidden, q), types["attn_output"]),
                    t(p + "ffn_norm.weight", (hidden,), "F32"),
                    t(p + "ffn_gate.weight", (ffn, hidden), types["ffn_gate"]),
                    t(p + "ffn_up.weight", (ffn, hidden), types["ffn_up"]),
                    t(p + "ffn_down.weight", (hidden, ffn), types["ffn_down"])]
    tensors.append(t("output_norm.weight", (hidden,), "F32"))
    if not tied:
        tensors.append(t("output.weight", (vocab, hidden), types["output"]))
    return Model(meta, tensors)


SEED = model()
F32_ONLY = {k: "F32" for k in DEFAULT_TYPES}


def poke(name: str, at: int, value: bytes) -> Callable[[Model], Model]:
    """Overwrite bytes ``at`` in tensor ``name``'s data (a NaN scale, an infinite weight)."""
    def change(m: Model) -> Model:
        t = next(t for t in m.tensors if t.name == name)
        return m.tensor(name, data=t.data[:at] + value + t.data[at + len(value):])
    return change


def nested(depth: int) -> Raw:
    """An array of an array of ... ``depth`` deep, the innermost an empty array of u8."""
    return Raw([struct.pack("<IQ", ARR, 1) * (depth - 1) + struct.pack("<IQ", U8, 0)])


def seed_bytes() -> bytes:
    return b"".join(SEED.parts())


def cut(keep: int) -> list:
    """The seed's first ``keep`` bytes."""
    return [seed_bytes()[:keep]]


# ---- the table -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """``parts()`` builds the file; ``call`` is "model" (from_pretrained) or "tokenizer"
    (load_gguf_tokenizer); ``reason`` a fragment of the message, or None for a file that must load."""

    label: str
    parts: Callable[[], list]
    reason: str | None
    call: str = "model"


def edit(*steps: Callable[[Model], Model], base: Model | None = None, **kwargs) -> Callable[[], list]:
    """A row's file: ``base`` (the seed) changed by each step, written with ``gguf_parts(**kwargs)``."""
    def build() -> list:
        m = base or SEED
        for step in steps:
            m = step(m)
        return m.parts(**kwargs)
    return build


def meta(key: str, kind: int, value) -> Callable[[Model], Model]:
    return lambda m: m.set(key, kind, value)


def drop(key: str) -> Callable[[Model], Model]:
    return lambda m: m.drop(key)


NOT_INT = "must be an integer >= 1"
BIG_ARRAY = 600_000_000

ROWS = [
    # -- the file and its header
    Row("empty file", lambda: [b""], "not a GGUF file"),
    Row("another magic", lambda: [b"GGML" + seed_bytes()[4:]], "not a GGUF file"),
    Row("a zip file", lambda: [b"PK\x03\x04" + bytes(60)], "not a GGUF file"),
    Row("version 1", edit(version=1), "GGUF version 1"),
    Row("version 4", edit(version=4), "GGUF version 4"),
    Row("big-endian version", edit(version=3 << 24), "big-endian"),
    Row("cut after the magic", lambda: cut(6), "cannot be read"),
    Row("cut inside the counts", lambda: cut(20), "cannot be read"),
    Row("cut inside the metadata", lambda: cut(300), "cannot be read"),
    Row("cut inside the tensor infos", lambda: cut(header_fields(seed_bytes())[1] - 20),
        "cannot be read"),
    Row("cut inside the tensor data", lambda: cut(len(seed_bytes()) - 100), "truncated"),
    Row("metadata count 2**64-1", edit(n_kv=2**64 - 1), "claims"),
    Row("metadata count one too many", edit(n_kv=len(SEED.meta) + 1), "cannot be read"),
    Row("tensor count 2**64-1", edit(n_tensors=2**64 - 1), "labkit reads at most 65,536"),
    Row("tensor count 65,537", edit(n_tensors=65_537), "labkit reads at most 65,536"),
    Row("tensor count 60,000 in a small file", edit(n_tensors=60_000), "claims"),
    Row("a key of length 2**64-1", lambda: [b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**64 - 1) + bytes(40)],
        "a string needs 18,446,744,073,709,551,615 bytes at byte 32"),
    Row("a key that is not UTF-8", edit(lambda m: replace(m, meta=[(b"\xff\xfe", U8, 1), *m.meta])), "utf-8"),
    Row("a value type 13", edit(lambda m: m.add("x.unknown", 13, Raw([b"\x00"]))), "unknown metadata value type 13"),
    Row("an array of item type 13", edit(meta("x.unknown", ARR, Raw([struct.pack("<IQ", 13, 1)]))),
        "unknown array item type 13"),
    Row("an array of 2**62 u8", edit(meta("x.big", ARR, Raw([struct.pack("<IQ", U8, 2**62)]))), "needs"),
    Row("an array of 2**40 strings", edit(meta("x.big", ARR, Raw([struct.pack("<IQ", STR, 2**40)]))), "claims"),
    Row("an array of 2**60 arrays", edit(meta("x.big", ARR, Raw([struct.pack("<IQ", ARR, 2**60)]))), "claims"),
    Row("a string of 2**63 bytes in an array", edit(meta("x.s", ARR, Raw([struct.pack("<IQQ", STR, 1, 2**63)]))),
        "runs past the end"),
    Row("arrays nested 500 deep", edit(meta("x.nested", ARR, nested(500))), "nested more than 8 deep"),
    Row("arrays nested 9 deep", edit(meta("x.nested", ARR, nested(9))), "nested more than 8 deep"),
    Row("2**19 + 1 strings (a sparse file)",
        edit(meta("x.strings", ARR, Raw([struct.pack("<IQ", STR, 2**19 + 1), Hole(8 * (2**19 + 1))]))),
        "more than 524,288 strings and arrays"),
    Row("a string of 2**24 + 1 bytes (a sparse file)",
        edit(meta("x.text", STR, Raw([struct.pack("<Q", 2**24 + 1), Hole(2**24 + 1)]))),
        "strings would hold more than 16,777,216 bytes"),
    Row("two strings of 2**23 + 1 bytes in an array (a sparse file)",
        edit(meta("x.texts", ARR, Raw([struct.pack("<IQQ", STR, 2, 2**23 + 1), Hole(2**23 + 1),
                                       struct.pack("<Q", 2**23 + 1), Hole(2**23 + 1)]))),
        "strings would hold more than 16,777,216 bytes"),
    Row("a key twice", edit(lambda m: m.add("llama.block_count", U32, 1)), "'llama.block_count' appears twice"),
    Row("a tensor name twice", edit(lambda m: m.add_tensor(m.tensors[1])), "'blk.0.attn_norm.weight' appears twice"),
    Row("alignment 0", edit(meta("general.alignment", U32, 0)), "power of two"),
    Row("alignment 3", edit(meta("general.alignment", U32, 3)), "power of two"),
    Row("alignment 48", edit(meta("general.alignment", U32, 48)), "power of two"),
    Row("alignment -32", edit(meta("general.alignment", I32, -32)), "power of two"),
    Row("alignment '32'", edit(meta("general.alignment", STR, "32")), "power of two"),
    Row("alignment True", edit(meta("general.alignment", BOOL, True)), "power of two"),
    Row("alignment 2**62", edit(meta("general.alignment", U64, 2**62)), "truncated"),
    Row("n_dims 0", edit(lambda m: m.tensor("blk.0.attn_norm.weight", dims=[])), "has 0 dimensions"),
    Row("n_dims 5", edit(lambda m: m.tensor("blk.0.attn_norm.weight", dims=[32, 1, 1, 1, 1])), "has 5 dimensions"),
    Row("n_dims 2**32-1", lambda: [seed_bytes().replace(b"output_norm.weight\x01\x00\x00\x00",
                                                         b"output_norm.weight\xff\xff\xff\xff")],
        "4294967295 dimensions"),
    Row("a dimension of 0", edit(lambda m: m.tensor("blk.0.attn_norm.weight", dims=[0])), "at least 1"),
    Row("dims whose product overflows int64", edit(lambda m: m.tensor("output_norm.weight", dims=[2**32, 2**32])),
        "overflow int64"),
    Row("a dimension of 2**64-1", edit(lambda m: m.tensor("output_norm.weight", dims=[2**64 - 1])),
        "overflow int64"),
    Row("10**12 elements", edit(lambda m: m.tensor("output_norm.weight", dims=[10**6, 10**6])), "truncated"),
    Row("an offset not aligned", edit(lambda m: m.tensor("output_norm.weight", offset=4)),
        "not a multiple of the alignment 32"),
    Row("an offset past the end", edit(lambda m: m.tensor("output_norm.weight", offset=2**40)), "truncated"),
    Row("Q4_1 rows of 48", edit(lambda m: m.tensor("blk.0.ffn_gate.weight", dims=[48, 16])),
        "Q4_1 with rows of 48 weights, not a multiple of its block of 32"),
    Row("Q8_0 rows of 40", edit(lambda m: m.tensor("token_embd.weight", dims=[40, 16])),
        "Q8_0 with rows of 40 weights"),
    Row("Q4_0 rows of 16", edit(lambda m: m.tensor("blk.0.attn_v.weight", dims=[16, 32])),
        "Q4_0 with rows of 16 weights"),
    Row("tensor type 99", edit(lambda m: m.tensor("blk.0.ffn_up.weight", type_id=99)), "stored as type 99"),
    Row("tensor type Q5_0", edit(lambda m: m.tensor("blk.0.ffn_up.weight", type_id=6)), "stored as Q5_0"),
    # -- the metadata the decoder needs
    Row("architecture qwen3", edit(meta("general.architecture", STR, "qwen3")), "general.architecture is 'qwen3'"),
    Row("architecture missing", edit(drop("general.architecture")), "general.architecture is ''"),
    Row("block_count 100,000 in a 1-layer file", edit(meta("llama.block_count", U32, 100_000)),
        "llama.block_count is 100,000, but its tensors are named for 1 layer (blk.0 to blk.0)"),
    Row("block_count 2**40", edit(meta("llama.block_count", U64, 2**40)), "llama.block_count is 1,099,511,627,776"),
    Row("block_count 2 in a 1-layer file", edit(meta("llama.block_count", U32, 2)),
        "llama.block_count is 2, but its tensors are named for 1 layer"),
    Row("block_count 1 in a 2-layer file", edit(meta("llama.block_count", U32, 1), base=model(layers=2)),
        "llama.block_count is 1, but its tensors are named for 2 layers (blk.0 to blk.1)"),
    Row("block_count 0", edit(meta("llama.block_count", U32, 0)), f"'llama.block_count' {NOT_INT}"),
    Row("block_count missing", edit(drop("llama.block_count")), "'llama.block_count' is missing"),
    Row("block_count '1'", edit(meta("llama.block_count", STR, "1")), "(a string)"),
    Row("513 layers, all there", edit(base=model(layers=513, hidden=2, heads=1, kv=1, head_dim=2, ffn=1,
                                                  types=F32_ONLY)),
        "labkit builds at most 512"),
    Row("layer blk.01", edit(lambda m: replace(m, tensors=[replace(t, name=t.name.replace("blk.0.", "blk.01."))
                                                            for t in m.tensors])),
        "named for 1 layer (blk.1 to blk.1)"),
    Row("head_count 0 and no key_length", edit(meta("llama.attention.head_count", U32, 0)),
        f"'llama.attention.head_count' {NOT_INT}, got 0"),
    Row("head_count inf", edit(meta("llama.attention.head_count", F32, float("inf"))), "got inf (a float)"),
    Row("head_count an array", edit(meta("llama.attention.head_count", ARR, (U32, [2]))), "got an array of 1"),
    Row("head_count '2'", edit(meta("llama.attention.head_count", STR, "2")), "got '2' (a string)"),
    Row("head_count 2.7", edit(meta("llama.attention.head_count", F32, 2.7)), "(a float)"),
    Row("head_count 2.0", edit(meta("llama.attention.head_count", F64, 2.0)), "got 2.0 (a float)"),
    Row("head_count True", edit(meta("llama.attention.head_count", BOOL, True)), "got True (a bool)"),
    Row("head_count 3, attn_q rows not divisible", edit(meta("llama.attention.head_count", U32, 3)),
        "does not divide by llama.attention.head_count 3"),
    Row("head_count 4 with key_length 16: attn_q too small",
        edit(meta("llama.attention.head_count", U32, 4), meta("llama.attention.key_length", U32, 16)),
        "tensor 'blk.0.attn_q.weight' has shape (32, 32); the GGUF file's metadata implies (64, 32)"),
    Row("head_count_kv 3 (heads 2)", edit(meta("llama.attention.head_count_kv", U32, 3)),
        "num_attention_heads (2) must be a multiple of num_key_value_heads (3)"),
    Row("head_count_kv 0", edit(meta("llama.attention.head_count_kv", U32, 0)), NOT_INT),
    Row("embedding_length 2**40", edit(meta("llama.embedding_length", U64, 2**40), drop("llama.rope.dimension_count")),
        "'token_embd.weight' has shape (32, 32); the GGUF file's metadata implies (32, 1099511627776)"),
    Row("embedding_length NaN", edit(meta("llama.embedding_length", F32, float("nan"))), "got nan (a float)"),
    Row("feed_forward_length '32'", edit(meta("llama.feed_forward_length", STR, "32")), "(a string)"),
    Row("feed_forward_length 64: ffn tensors too small", edit(meta("llama.feed_forward_length", U32, 64)),
        "'blk.0.ffn_gate.weight' has shape (32, 32); the GGUF file's metadata implies (64, 32)"),
    Row("context_length -1", edit(meta("llama.context_length", I32, -1)), NOT_INT),
    Row("rms epsilon NaN", edit(meta("llama.attention.layer_norm_rms_epsilon", F32, float("nan"))),
        "must be a finite number > 0, got nan"),
    Row("rms epsilon 0", edit(meta("llama.attention.layer_norm_rms_epsilon", F32, 0.0)), "finite number > 0"),
    Row("rms epsilon '1e-5'", edit(meta("llama.attention.layer_norm_rms_epsilon", STR, "1e-5")), "(a string)"),
    Row("rms epsilon missing", edit(drop("llama.attention.layer_norm_rms_epsilon")), "is missing"),
    Row("rope.freq_base inf", edit(meta("llama.rope.freq_base", F32, float("inf"))), "finite number > 0, got inf"),
    Row("rope.freq_base -1", edit(meta("llama.rope.freq_base", F32, -1.0)), "finite number > 0"),
    Row("key_length 15 (odd)", edit(meta("llama.attention.key_length", U32, 15), drop("llama.rope.dimension_count")),
        "head_dim must be an even"),
    Row("value_length 8", edit(meta("llama.attention.value_length", U32, 8)), "value_length 8 differs"),
    Row("rope.dimension_count 8", edit(meta("llama.rope.dimension_count", U32, 8)), "RoPE must rotate the whole"),
    Row("rope.scaling.type yarn", edit(meta("llama.rope.scaling.type", STR, "yarn")), "'yarn' (a string) is not"),
    Row("rope.scaling.type an array", edit(meta("llama.rope.scaling.type", ARR, (STR, ["none"]))), "an array"),
    Row("expert_count 8", edit(meta("llama.expert_count", U32, 8)), "mixture-of-experts"),
    Row("expert_count '8'", edit(meta("llama.expert_count", STR, "8")), "'llama.expert_count' must be an integer"),
    Row("vocab_size 33, 32 tokens", edit(meta("llama.vocab_size", U32, 33)), "lists 32 tokens"),
    Row("no vocab_size, no tokens", edit(drop("llama.vocab_size"), drop("tokenizer.ggml.tokens")),
        "'llama.vocab_size' is missing"),
    Row("no vocab_size, tokens a string", edit(drop("llama.vocab_size"), meta("tokenizer.ggml.tokens", STR, "abc")),
        "tokenizer.ggml.tokens must be a non-empty array of strings"),
    Row("token_embd of 16 rows", edit(lambda m: m.tensor("token_embd.weight", dims=[32, 16])),
        "'token_embd.weight' has shape (16, 32); the GGUF file's metadata implies (32, 32)"),
    Row("a tensor missing", edit(drop("blk.0.ffn_up.weight")), "lacks tensor 'blk.0.ffn_up.weight'"),
    Row("a tensor of a layer past block_count",
        edit(lambda m: m.add_tensor(replace(m.tensors[1], name="blk.1.attn_norm.weight"))), "named for 2 layers"),
    Row("an unknown tensor", edit(lambda m: m.add_tensor(replace(m.tensors[1], name="foo.weight"))),
        "'foo.weight' is not part of the Llama decoder"),
    Row("a bias tensor", edit(lambda m: m.add_tensor(replace(m.tensors[1], name="blk.0.attn_q.bias"))),
        "'blk.0.attn_q.bias' is not part"),
    Row("rope_freqs.weight", edit(lambda m: m.add_tensor(replace(m.tensors[1], name="rope_freqs.weight"))),
        "RoPE frequency factors"),
    Row("eos_token_id 99", edit(meta("tokenizer.ggml.eos_token_id", U32, 99)), "eos_token_id must be a token id"),
    Row("eos_token_id -1", edit(meta("tokenizer.ggml.eos_token_id", I32, -1)), "in [0, 32), got -1"),
    # -- weights that would make every output NaN (refused, naming the tensor)
    Row("NaN in a Q8_0 scale", edit(poke("token_embd.weight", 34, b"\x00\x7e")),
        "'token_embd.weight' holds 1 NaN or infinite block scales"),
    Row("inf in a Q4_1 scale", edit(poke("blk.0.ffn_gate.weight", 0, b"\x00\x7c")),
        "'blk.0.ffn_gate.weight' holds 1 NaN or infinite block scales"),
    Row("NaN in a Q4_1 minimum", edit(poke("blk.0.attn_output.weight", 2, b"\x00\x7e")),
        "'blk.0.attn_output.weight' holds 1 NaN or infinite block minimums"),
    Row("inf in a Q4_0 scale", edit(poke("blk.0.attn_v.weight", 18, b"\x00\xfc")), "block scales"),
    Row("NaN in an F32 norm", edit(poke("blk.0.ffn_norm.weight", 4, struct.pack("<f", float("nan")))),
        "'blk.0.ffn_norm.weight' holds 1 NaN or infinite weights"),
    Row("inf in an F16 weight", edit(poke("blk.0.attn_q.weight", 0, b"\x00\x7c")),
        "'blk.0.attn_q.weight' holds 1 NaN"),
    Row("NaN in a BF16 weight", edit(poke("blk.0.attn_k.weight", 2, b"\xc0\x7f")), "'blk.0.attn_k.weight' holds 1"),
    # -- the tokenizer's metadata
    Row("tokens missing", edit(drop("tokenizer.ggml.tokens")), "tokenizer.ggml.tokens (the vocabulary) is missing",
        "tokenizer"),
    Row("tokens a string", edit(meta("tokenizer.ggml.tokens", STR, "abc")),
        "tokenizer.ggml.tokens must be a non-empty array of strings, got 'abc' (a string)", "tokenizer"),
    Row("tokens integers", edit(meta("tokenizer.ggml.tokens", ARR, (U32, list(range(32))))),
        "got an array of 32 uint32", "tokenizer"),
    Row("tokens empty", edit(meta("tokenizer.ggml.tokens", ARR, (STR, [])), drop("tokenizer.ggml.token_type")),
        "non-empty array of strings", "tokenizer"),
    Row("merges integers", edit(meta("tokenizer.ggml.merges", ARR, (I32, [1, 2]))),
        "merges must be an array of strings 'left right', found an array of 2 int32", "tokenizer"),
    Row("merges a string", edit(meta("tokenizer.ggml.merges", STR, "a b")), "merges must be", "tokenizer"),
    Row("a merge without a space", edit(meta("tokenizer.ggml.merges", ARR, (STR, ["ab"]))), "found 'ab'",
        "tokenizer"),
    Row("a merge of unknown tokens", edit(meta("tokenizer.ggml.merges", ARR, (STR, ["x7 y7"]))),
        "cannot be rebuilt from its vocabulary and merges: Error while initializing BPE", "tokenizer"),
    Row("bos_token_id past the vocabulary", edit(meta("tokenizer.ggml.bos_token_id", U32, 32)),
        "bos_token_id must be a token id in [0, 32), got 32", "tokenizer"),
    Row("bos_token_id -1", edit(meta("tokenizer.ggml.bos_token_id", I32, -1)), "got -1", "tokenizer"),
    Row("bos_token_id '1'", edit(meta("tokenizer.ggml.bos_token_id", STR, "1")), "got '1' (a string)", "tokenizer"),
    Row("padding_token_id 2**64-1", edit(meta("tokenizer.ggml.padding_token_id", U64, 2**64 - 1)),
        "padding_token_id must be", "tokenizer"),
    Row("token_type too short", edit(meta("tokenizer.ggml.token_type", ARR, (I32, [1, 1]))),
        "token_type must be an array of 32 integers", "tokenizer"),
    Row("token_type strings", edit(meta("tokenizer.ggml.token_type", ARR, (STR, ["1"] * 32))),
        "token_type must be", "tokenizer"),
    Row("tokenizer model llama (SentencePiece)", edit(meta("tokenizer.ggml.model", STR, "llama")),
        "tokenizer.ggml.model is 'llama'", "tokenizer"),
    Row("tokenizer pre an array", edit(meta("tokenizer.ggml.pre", ARR, (STR, ["smollm"])))
        , "tokenizer.ggml.pre is an array", "tokenizer"),
    Row("tokenizer pre qwen2", edit(meta("tokenizer.ggml.pre", STR, "qwen2")), "tokenizer.ggml.pre is 'qwen2'",
        "tokenizer"),
    Row("chat template an integer", edit(meta("tokenizer.chat_template", U32, 7)),
        "tokenizer.chat_template must be a string", "tokenizer"),
    # -- odd but harmless: these must load
    Row("the seed", edit(), None),
    Row("the seed's tokenizer", edit(), None, "tokenizer"),
    Row("tied embeddings, two layers", edit(base=model(layers=2, tied=True)), None),
    Row("alignment 64", edit(meta("general.alignment", U32, 64), align=64), None),
    Row("arrays nested 8 deep", edit(meta("x.nested", ARR, nested(8))), None),
    Row("the most a header may hold: 2**19 - 256 strings of 16 bytes", edit(meta("x.strings", ARR, Raw(
        [struct.pack("<IQ", STR, 2**19 - 256), (struct.pack("<Q", 16) + bytes(16)) * (2**19 - 256)]))), None),
    Row("a 6e8-element u8 array (sparse file)",
        edit(meta("x.big", ARR, Raw([struct.pack("<IQ", U8, BIG_ARRAY), Hole(BIG_ARRAY)]))), None),
    Row("a 6e8-element u8 array, tokenizer",
        edit(meta("x.big", ARR, Raw([struct.pack("<IQ", U8, BIG_ARRAY), Hole(BIG_ARRAY)]))), None, "tokenizer"),
]


# ---- the worker: every case in one subprocess, under a memory cap ----------------------------------------


class CaseTimeout(BaseException):
    """Raised by the per-case alarm; a BaseException, so no ``except Exception`` swallows it."""


def _status_kb(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak RSS (VmHWM) starts again from here
        return True
    except OSError:
        return False


def worker(warm_up: str) -> None:
    """Read jobs (JSON lines: id, path, calls) from stdin; write one JSON line per job to stdout."""
    from labkit.model import gguf as lg, gguf_decoder
    from labkit.model.pretrained import from_pretrained

    calls = {"model": from_pretrained, "tokenizer": gguf_decoder.load_gguf_tokenizer}
    for _ in range(2):  # imports, threads and allocator arenas in place before the cap and the clock
        from_pretrained(warm_up)
        gguf_decoder.load_gguf_tokenizer(warm_up)
        lg._read_gguf.cache_clear()
    cap = _status_kb("VmSize") * 1024 + AS_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))

    def alarm(*_):
        raise CaseTimeout()

    signal.signal(signal.SIGALRM, alarm)
    out = sys.stdout
    for line in sys.stdin:
        job = json.loads(line)
        out.write(json.dumps({"start": job["id"]}) + "\n")
        out.flush()
        results = []
        before = _status_kb("VmRSS")
        exact = _reset_peak()
        max_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0, cpu0 = time.perf_counter(), time.process_time()
        signal.setitimer(signal.ITIMER_REAL, 10 * MAX_SECONDS)
        for call in job["calls"]:
            try:
                loaded = calls[call](job["path"])
                del loaded
                results.append({"call": call, "outcome": "ok"})
            except BaseException as err:  # noqa: BLE001: everything is reported, and judged by the test
                results.append({"call": call, "outcome": type(err).__name__,
                                "value_error": isinstance(err, ValueError),
                                "gguf_error": isinstance(err, getattr(lg, "GGUFError", ())),
                                "message": str(err)[:2000]})
                if isinstance(err, CaseTimeout):
                    break
        signal.setitimer(signal.ITIMER_REAL, 0)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
        if exact:
            growth_kb = _status_kb("VmHWM") - before
        else:  # no clear_refs: the growth above the process's earlier peak (a lower bound)
            growth_kb = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - max_before)
        lg._read_gguf.cache_clear()  # no file stays mapped into the next case
        out.write(json.dumps({"id": job["id"], "results": results, "seconds": seconds, "cpu_seconds": cpu_seconds,
                              "growth_mb": growth_kb / 1024, "exact_peak": exact}) + "\n")
        out.flush()


def run_in_worker(jobs: list[dict], warm_up: Path, timeout: float) -> tuple[dict, str, str | None]:
    """Run ``jobs`` in a fresh worker; returns results by id, a crash report ("" if none), and the id
    of the case the worker was running when it stopped."""
    import labkit

    env = dict(os.environ)
    root = str(Path(labkit.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen([sys.executable, __file__, "--worker", str(warm_up)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate("".join(json.dumps(j) + "\n" for j in jobs), timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        stderr = f"the worker ran past {timeout} s\n" + stderr
    results, started = {}, None
    for line in stdout.splitlines():
        msg = json.loads(line)
        if "start" in msg:
            started = msg["start"]
        else:
            results[msg["id"]] = msg
    crash = ""
    if len(results) < len(jobs):
        crash = (f"the worker stopped (exit {proc.returncode}) in case {started!r} after {len(results)} of "
                 f"{len(jobs)} cases:\n{stderr[-3000:]}")
    return results, crash, started if crash else None


@pytest.fixture(scope="module")
def seed_path(tmp_path_factory) -> Path:
    return write_parts(tmp_path_factory.mktemp("seed") / "seed.gguf", SEED.parts())


def check_budget(result: dict) -> list[str]:
    """What a case did wrong on time and memory."""
    faults = []
    if result["cpu_seconds"] > MAX_SECONDS:
        faults.append(f"took {result['cpu_seconds']:.2f} s of CPU time (limit {MAX_SECONDS} s; "
                      f"{result['seconds']:.2f} s of wall time)")
    if result["growth_mb"] > MAX_GROWTH_MB:
        faults.append(f"grew by {result['growth_mb']:.0f} MB (limit {MAX_GROWTH_MB:.0f} MB)")
    return faults


# ---- the table's test --------------------------------------------------------------------------------------


def test_the_table_is_big_and_its_labels_unique():
    assert len(ROWS) >= 60 and len({r.label for r in ROWS}) == len(ROWS)
    assert sum(r.reason is None for r in ROWS) >= 5  # and some odd files must load


@pytest.mark.parametrize("i", range(len(ROWS)), ids=[r.label for r in ROWS])
def test_each_bad_file_is_refused_naming_it_and_the_reason(worker_run, i):
    row, result = ROWS[i], worker_run["results"].get(f"row {i}")
    assert result is not None, worker_run["crash"]
    (outcome,) = result["results"]
    if row.reason is None:
        assert outcome["outcome"] == "ok", outcome
    else:
        assert outcome["outcome"] == "GGUFError" and outcome["gguf_error"] and outcome["value_error"], outcome
        assert f"GGUF file {worker_run['paths'][f'row {i}']!r}: " in outcome["message"], outcome["message"]
        assert row.reason in outcome["message"], outcome["message"]
    assert not check_budget(result), check_budget(result)


# ---- the fuzz -------------------------------------------------------------------------------------------------


def header_fields(data: bytes) -> tuple[list[tuple[int, int, str]], int]:
    """(offset, width, what) of every integer field of a well-formed GGUF header, and where it ends.

    Written apart from labkit's reader: the counts, every string length, every value type, array
    item types and counts, integer values, and each tensor's n_dims, dims, type and offset.
    """
    fields = [(4, 4, "version"), (8, 8, "tensor count"), (16, 8, "metadata count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    at = 24

    def string(what: str) -> None:
        nonlocal at
        fields.append((at, 8, f"{what} length"))
        at += 8 + struct.unpack_from("<Q", data, at)[0]

    def value(kind: int, what: str) -> None:
        nonlocal at
        if kind == STR:
            string(what)
        elif kind == ARR:
            item, n = struct.unpack_from("<IQ", data, at)
            fields.extend([(at, 4, f"{what} item type"), (at + 4, 8, f"{what} count")])
            at += 12
            for _ in range(n):
                value(item, f"{what}[]")
        else:
            width = struct.calcsize(FMT[kind])
            if kind not in (F32, F64, BOOL):
                fields.append((at, width, f"{what} value"))
            at += width

    for _ in range(n_kv):
        key_at = at
        string("key")
        key = data[key_at + 8:at].decode()
        kind = struct.unpack_from("<I", data, at)[0]
        fields.append((at, 4, f"{key} type"))
        at += 4
        value(kind, key)
    for _ in range(n_tensors):
        name_at = at
        string("tensor name")
        name = data[name_at + 8:at].decode()
        n_dims = struct.unpack_from("<I", data, at)[0]
        fields.append((at, 4, f"{name} n_dims"))
        at += 4
        fields.extend((at + 8 * d, 8, f"{name} dim {d}") for d in range(n_dims))
        at += 8 * n_dims
        fields.extend([(at, 4, f"{name} type"), (at + 4, 8, f"{name} offset")])
        at += 12
    return fields, at


def edge_values(old: int, width: int, rng: random.Random) -> int:
    top = 1 << (8 * width)
    choices = [0, 1, 2, 3, 4, 7, 8, 9, 13, 31, 32, 33, 63, 64, 255, 256, 4096, 2**31 - 1, 2**31, 2**32 - 1,
               2**32, 2**62, 2**63 - 1, 2**63, top // 2 - 1, top // 2, top - 1, top - 2, old + 1, old - 1,
               old * 2, old << 8, old << 20, old >> 1, rng.randrange(top)]
    return rng.choice(choices) % top


def mutate(data: bytes, fields: list, header_end: int, rng: random.Random) -> tuple[bytes, str]:
    """One to three mutations, most of them in the header; returns the bytes and what was done."""
    buf, done = bytearray(data), []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        where = rng.randrange(min(header_end, len(buf)) or 1) if rng.random() < 0.8 else rng.randrange(len(buf) or 1)
        op = rng.choice(["field", "field", "field", "flip", "flip", "byte", "truncate", "insert", "delete"])
        if op == "field":
            at, width, what = rng.choice(fields)
            if at + width > len(buf):
                continue
            old = int.from_bytes(buf[at:at + width], "little")
            new = edge_values(old, width, rng)
            buf[at:at + width] = new.to_bytes(width, "little")
            done.append(f"{what} at {at}: {old} -> {new}")
        elif op == "flip" and where < len(buf):
            bit = rng.randrange(8)
            buf[where] ^= 1 << bit
            done.append(f"flip bit {bit} of byte {where}")
        elif op == "byte" and where < len(buf):
            buf[where] = rng.randrange(256)
            done.append(f"byte {where} = {buf[where]}")
        elif op == "truncate":
            del buf[where:]
            done.append(f"truncate to {where}")
        elif op == "insert":
            extra = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            buf[where:where] = extra
            done.append(f"insert {extra.hex()} at {where}")
        elif op == "delete":
            n = rng.randint(1, 8)
            del buf[where:where + n]
            done.append(f"delete {n} bytes at {where}")
    return bytes(buf), "; ".join(done) or "none"


def fuzz_seeds() -> dict[str, bytes]:
    """Three small valid files: the table's seed, a tied two-layer file in F32/Q8_0, and a file
    written by ggml-org's GGUFWriter (the reference writer)."""
    import tempfile

    import gguf

    seeds = {"seed": b"".join(SEED.parts()),
             "tied": b"".join(model(layers=2, tied=True, hidden=32, ffn=32, seed=1,
                                    types={**F32_ONLY, "token_embd": "Q8_0", "ffn_up": "Q8_0"}).parts())}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "w.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        for key, kind, value in SEED.meta:
            if key == "general.architecture":
                continue
            if kind == ARR:
                w.add_array(key, list(value[1]))
            else:
                w.add_key_value(key, value, gguf.GGUFValueType(kind))
        for t in SEED.tensors:
            qtype = gguf.GGMLQuantizationType[t.kind]
            data = np.frombuffer(t.data, np.uint8).reshape(t.shape[0] if len(t.shape) > 1 else 1, -1)
            if t.kind in ("F32", "F16"):
                data = data.view(np.float32 if t.kind == "F32" else np.float16).reshape(t.shape)
            w.add_tensor(t.name, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        seeds["gguf-py"] = path.read_bytes()
    return seeds


def test_the_writer_here_writes_what_ggml_reads(seed_path):
    """The seeds are valid GGUF files to ggml-org's reader, which reads them as labkit does."""
    import gguf

    from labkit.model import gguf as lg

    for name, data in fuzz_seeds().items():
        path = write_parts(seed_path.parent / f"check-{name}.gguf", [data])
        ref, ours = gguf.GGUFReader(path), lg.read_gguf(path)
        assert [t.name for t in ref.tensors] == list(ours.tensors), name
        for t in ref.tensors:
            np.testing.assert_array_equal(np.asarray(t.data).view(np.uint8).reshape(-1),
                                          ours.tensors[t.name].raw.reshape(-1))
        assert ref.fields["tokenizer.ggml.tokens"].contents() == TOKENS
        assert ours.metadata["tokenizer.ggml.token_type"].tolist() == TOKEN_TYPES
        fields, end = header_fields(data)
        assert end <= ref.data_offset < end + 32 and len(fields) > 100


def fuzz_jobs(folder: Path) -> tuple[list[dict], dict[str, str]]:
    """``FUZZ_CASES`` mutated files written to ``folder``: the jobs, and what each case did (to report it)."""
    seeds = {name: (data, *header_fields(data)) for name, data in fuzz_seeds().items()}
    names, jobs, described = sorted(seeds), [], {}
    for i in range(FUZZ_CASES):
        rng = random.Random(FUZZ_SEED * 1_000_003 + i)
        name = names[i % len(names)]
        data, fields, end = seeds[name]
        mutated, what = mutate(data, fields, end, rng)
        path = write_parts(folder / f"case{i:04d}.gguf", [mutated])
        jobs.append({"id": f"fuzz {i}", "path": str(path.resolve()), "calls": ["model", "tokenizer"]})
        described[f"fuzz {i}"] = f"case {i} (seed file {name!r}, random.Random({FUZZ_SEED * 1_000_003 + i})): {what}"
    return jobs, described


@pytest.fixture(scope="module")
def worker_run(tmp_path_factory, seed_path) -> dict:
    """The table's files and the fuzz's, all run in one worker (its start-up, torch and transformers
    imported, costs more than every case together)."""
    folder = tmp_path_factory.mktemp("cases")
    jobs = []
    for i, row in enumerate(ROWS):
        path = write_parts(folder / f"row{i:03d}.gguf", row.parts())
        jobs.append({"id": f"row {i}", "path": str(path.resolve()), "calls": [row.call]})
    fuzz, described = fuzz_jobs(folder)
    t0 = time.perf_counter()
    results, crash, stopped_in = run_in_worker(jobs + fuzz, seed_path, timeout=300)
    crash += f"\n{described[stopped_in]}" if stopped_in in described else ""
    return {"results": results, "crash": crash, "paths": {j["id"]: j["path"] for j in jobs + fuzz},
            "fuzz": fuzz, "described": described, "seconds": time.perf_counter() - t0}


def test_mutated_files_load_or_are_refused_fast_and_small(worker_run):
    results, described = worker_run["results"], worker_run["described"]
    faults, reasons, loaded, done = [], set(), 0, []
    for job in worker_run["fuzz"]:
        result = results.get(job["id"])
        if result is None:
            continue
        done.append(result)
        for outcome in result["results"]:
            if outcome["outcome"] == "ok":
                loaded += 1
            elif not outcome.get("value_error") or f"{job['path']!r}" not in outcome["message"]:
                faults.append(f"{described[job['id']]}: {outcome['call']} raised {outcome['outcome']}: "
                              f"{outcome.get('message', '')[:300]}")
            else:
                reasons.add(re.sub(r"[\d,]+", "N", outcome["message"].split(": ", 1)[1])[:40])
        faults += [f"{described[job['id']]}: {f}" for f in check_budget(result)]
    slowest = max((r["cpu_seconds"] for r in done), default=0.0)
    slowest_wall = max((r["seconds"] for r in done), default=0.0)
    biggest = max((r["growth_mb"] for r in done), default=0.0)
    print(f"\nfuzz: {len(done)} of {FUZZ_CASES} cases, {sum(r['seconds'] for r in done):.1f} s in all "
          f"(the worker: {worker_run['seconds']:.1f} s with the table and its start-up); {loaded} calls loaded; "
          f"{len(reasons)} distinct reasons; slowest case {slowest:.3f} s of CPU ({slowest_wall:.3f} s of wall time); largest growth {biggest:.1f} MB")
    assert not worker_run["crash"], worker_run["crash"]
    assert not faults, "\n".join(faults[:20])
    assert len(done) == FUZZ_CASES
    assert loaded > 0 and len(reasons) >= 20  # the fuzz reaches deep into the reader, not only the magic


# ---- in-process checks of what the table cannot see ----------------------------------------------------------


def test_a_huge_block_count_is_refused_before_anything_is_built_or_dequantized(tmp_path, monkeypatch):
    from labkit.model import gguf as lg, gguf_decoder, pretrained

    path = write_parts(tmp_path / "deep.gguf", SEED.set("llama.block_count", U32, 100_000).parts())
    built, dequantized = [], []
    monkeypatch.setattr(pretrained, "Decoder", lambda *a, **k: built.append(a))
    monkeypatch.setattr(gguf_decoder, "dequantize", lambda t: dequantized.append(t.name))
    with pytest.raises(lg.GGUFError, match="llama.block_count is 100,000") as err:
        pretrained.from_pretrained(path)
    assert built == [] and dequantized == []
    assert isinstance(err.value, ValueError) and err.value.path == path.resolve()
    assert err.value.reason.startswith("llama.block_count is 100,000, but its tensors are named for 1 layer")


def test_shapes_are_checked_before_anything_is_dequantized(tmp_path, monkeypatch):
    from labkit.model import gguf as lg, gguf_decoder

    wide = lg.read_gguf(write_parts(tmp_path / "wide.gguf", SEED.set("llama.feed_forward_length", U32, 64).parts()))
    seed = lg.read_gguf(write_parts(tmp_path / "seed.gguf", SEED.parts()))
    dequantized = []
    monkeypatch.setattr(gguf_decoder, "dequantize", lambda t: dequantized.append(t.name))
    with pytest.raises(lg.GGUFError, match=r"ffn_gate.weight' has shape \(32, 32\); the GGUF file's metadata implies"):
        gguf_decoder.state_dict(wide)
    config = gguf_decoder.decoder_config(seed)  # a config given by the caller is checked against the file too
    with pytest.raises(lg.GGUFError, match=r"implies \(48, 32\)"):
        gguf_decoder.state_dict(seed, replace(config, intermediate_size=48))
    assert dequantized == []


def test_unpermute_refuses_rows_that_do_not_split_into_heads():
    import torch

    from labkit.model import gguf_decoder

    with pytest.raises(ValueError, match="num_heads: 32 rows do not split into 3 heads"):
        gguf_decoder.unpermute_rope_rows(torch.zeros(32, 4), 3)
    with pytest.raises(ValueError, match="of an even size"):
        gguf_decoder.unpermute_rope_rows(torch.zeros(6, 4), 2)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2])
