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
"""

from __future__ import annotations

import functools
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .model import DecoderConfig

__all__ = ["GGUFFile", "GGUFTensor", "read_gguf", "dequantize", "decoder_config", "state_dict",
           "load_gguf_tokenizer", "SUPPORTED_TYPES"]

QK = 32  # weights per quantization block, for Q4_0, Q4_1 and Q8_0
# bytes per block of 32 weights: the float16 scale(s), then the numbers
BLOCK_BYTES = {"Q4_0": 2 + QK // 2, "Q4_1": 2 + 2 + QK // 2, "Q8_0": 2 + QK}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as stored: its GGUF ``type``, its ``shape`` as PyTorch orders it
    (rows, columns: ``[out_features, in_features]`` for a linear layer), and its raw bytes
    (``raw``: one row of the stored type per line, still quantized)."""

    name: str
    type: str
    shape: tuple[int, ...]
    raw: np.ndarray

    @property
    def num_bytes(self) -> int:
        return 0 if self.raw is None else int(self.raw.nbytes)


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file read: its path, its metadata by key, its tensors by name (still quantized)."""

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


def _fail(path: Path, why: str) -> ValueError:
    return ValueError(f"GGUF file {str(path)!r}: {why}")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file: metadata and tensor infos now, tensor bytes memory-mapped (read on use).

    Raises ``ValueError`` naming the file and the reason for a file that is missing, is not a
    GGUF file, or is cut short (a tensor's bytes would lie past the end of the file). A file
    read once is kept while it is unchanged on disk (same size and modification time).
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


class _Cursor:
    """Reads GGUF's little-endian fields one after the other from a byte buffer."""

    def __init__(self, buf: np.ndarray):
        self.buf, self.at = buf, 0

    def scalar(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buf, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        if self.at + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = self.buf[self.at:self.at + n].tobytes().decode("utf-8")
        self.at += n
        return text

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind != 9:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self.scalar("I"), self.scalar("Q")
        if item in _NUMPY:  # numbers: one read for the whole array
            width = np.dtype(_NUMPY[item]).itemsize
            if self.at + count * width > len(self.buf):
                raise ValueError("an array runs past the end of the file")
            out = np.frombuffer(self.buf, _NUMPY[item], count, self.at).tolist()
            self.at += count * width
            return out
        return [self.value(item) for _ in range(count)]


@functools.lru_cache(maxsize=4)
def _read_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    """Parse the header (metadata, tensor infos); tensor bytes stay in the memory-mapped file."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise _fail(path, "not a GGUF file (it does not start with the magic bytes 'GGUF')")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buf)
    cur.at = 4
    try:
        version = cur.scalar("I")
        if version not in (2, 3):
            raise _fail(path, f"GGUF version {version}; labkit reads versions 2 and 3")
        num_tensors, num_kv = cur.scalar("Q"), cur.scalar("Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("I"))
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
            infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        if isinstance(err, ValueError) and str(err).startswith("GGUF file"):
            raise
        raise _fail(path, f"truncated or damaged: its header cannot be read ({err})") from err
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.at // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, type_id, offset in infos:
        kind = GGML_TYPES.get(type_id, f"type {type_id}")
        shape = tuple(int(n) for n in reversed(dims))  # GGUF lists the fastest axis first
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        raw = None
        if kind in TYPE_SIZES:  # the bytes of a type labkit cannot read are never touched
            block_bytes, per_block = TYPE_SIZES[kind]
            row_bytes = shape[-1] // per_block * block_bytes
            start, end = data_start + offset, data_start + offset + rows * row_bytes
            if end > size:
                raise _fail(path, f"truncated: tensor {name!r} needs bytes up to {end:,}, the file ends at {size:,}")
            raw = buf[start:end].reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(name, kind, shape, raw)
    return GGUFFile(path, metadata, tensors)


def _blocks(raw: np.ndarray, kind: str) -> np.ndarray:
    """The raw bytes as one line per block of 32 weights."""
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1, BLOCK_BYTES[kind])


def _dequantize_blocks(raw: np.ndarray, kind: str) -> np.ndarray:
    """float32 weights, 32 per block, in storage order."""
    b = _blocks(raw, kind)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n_blocks, 1]: the block's scale
    if kind == "Q8_0":
        q = b[:, 2:].view(np.int8).astype(np.float32)
        return d * q
    packed = b[:, 4:] if kind == "Q4_1" else b[:, 2:]
    # 16 bytes hold 32 numbers: the low nibbles are weights 0..15, the high nibbles 16..31
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
    if kind == "Q4_0":
        return d * (q - 8.0)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)  # Q4_1: the block's minimum
    return d * q + m


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's weights as a float32 array of ``tensor.shape``.

    Supported types: F32, F16, BF16, Q8_0, Q4_0, Q4_1 (``SUPPORTED_TYPES``); any other
    raises ``ValueError`` naming the tensor and its type.
    """
    kind, raw = tensor.type, tensor.raw
    if kind in FLOAT_TYPES:
        out = np.asarray(raw).view(FLOAT_TYPES[kind]).astype(np.float32)
    elif kind == "BF16":  # bfloat16 is the top half of a float32
        out = (np.asarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif kind in BLOCK_BYTES:
        out = _dequantize_blocks(raw, kind)
    else:
        raise ValueError(f"tensor {tensor.name!r} is stored as {kind}, which labkit does not dequantize "
                         f"(supported: {', '.join(SUPPORTED_TYPES)})")
    return out.reshape(tensor.shape)


def _meta(file: GGUFFile, key: str, *, required: bool = True, default: Any = None) -> Any:
    arch = file.architecture
    full = f"{arch}.{key}"
    if full not in file.metadata:
        if required:
            raise _fail(file.path, f"metadata {full!r} is missing")
        return default
    return file.metadata[full]


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
    ``llama.rope.freq_base``                    ``rope_theta``
    ``llama.attention.layer_norm_rms_epsilon``  ``rms_norm_eps``
    ``llama.context_length``                    ``max_position_embeddings``
    ``llama.vocab_size`` (or the token list)    ``vocab_size``
    ``llama.rope.scaling.*``, ``rope_freqs``     refused: scaled RoPE is read from config.json only
    no ``output.weight`` tensor                 ``tie_word_embeddings``
    ``tokenizer.ggml.eos_token_id``             ``eos_token_id``
    ==========================================  ==========================
    """
    if file.architecture != "llama":
        raise _fail(file.path, f"general.architecture is {file.architecture!r}; labkit's decoder computes "
                               f"only 'llama' (Llama, SmolLM2, Mistral without sliding windows)")
    if _meta(file, "expert_count", required=False):
        raise _fail(file.path, "llama.expert_count is set: mixture-of-experts layers are not supported")
    heads = int(_meta(file, "attention.head_count"))
    hidden = int(_meta(file, "embedding_length"))
    vocab = _meta(file, "vocab_size", required=False)
    if vocab is None:
        vocab = len(file.metadata.get("tokenizer.ggml.tokens", []))
    head_dim = int(_meta(file, "attention.key_length", required=False, default=hidden // heads))
    rope_dim = _meta(file, "rope.dimension_count", required=False, default=head_dim)
    if int(rope_dim) != head_dim:
        raise _fail(file.path, f"llama.rope.dimension_count is {rope_dim}, head_dim is {head_dim}: "
                               f"RoPE must rotate the whole head")
    if _meta(file, "rope.scaling.type", required=False, default="none") not in ("none", None):
        raise _fail(file.path, f"llama.rope.scaling.type {_meta(file, 'rope.scaling.type')!r} is not supported")
    if "rope_freqs.weight" in file.tensors:  # Llama 3.1's scaling is stored as factors per frequency
        raise _fail(file.path, "the file stores RoPE frequency factors (rope_freqs.weight, Llama 3.1 scaling), "
                               "which labkit's GGUF reader does not read; load the safetensors checkpoint instead")
    eos = file.metadata.get("tokenizer.ggml.eos_token_id")
    return DecoderConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(_meta(file, "feed_forward_length")),
        num_hidden_layers=int(_meta(file, "block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_meta(file, "attention.head_count_kv", required=False, default=heads)),
        head_dim=head_dim,
        rope_theta=float(_meta(file, "rope.freq_base", required=False, default=10000.0)),
        rms_norm_eps=float(_meta(file, "attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_meta(file, "context_length")),
        tie_word_embeddings="output.weight" not in file.tensors,
        eos_token_id=None if eos is None else int(eos))


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo the row order llama.cpp gives Q and K weights.

    Hugging Face's Llama rotates dimension ``i`` of a head with dimension ``i + D/2``
    (``rotate_half``); llama.cpp rotates neighbours ``2i`` and ``2i + 1``. Its converter
    therefore reorders each head's rows from ``[0, 1, ..., D/2-1 | D/2, ..., D-1]`` to
    ``[0, D/2, 1, D/2+1, ...]`` so that the same weights give the same model under its RoPE.
    Reading the file back for the Hugging Face layout, each head's rows are put back.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


# GGUF tensor names -> the decoder's (Hugging Face Llama) state_dict keys
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


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

    Every tensor type is checked before any is dequantized, so an unsupported one fails at
    once with nothing half-done. An unknown tensor name raises ``ValueError`` naming it.
    """
    config = config or decoder_config(file)
    for t in file.tensors.values():
        if t.type not in SUPPORTED_TYPES:
            raise _fail(file.path, f"tensor {t.name!r} is stored as {t.type}, which labkit does not "
                                   f"dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
        if hf_name(t.name) is None:
            raise _fail(file.path, f"tensor {t.name!r} is not part of a Llama decoder labkit computes")
    out: dict[str, torch.Tensor] = {}
    for t in file.tensors.values():
        weight = torch.from_numpy(dequantize(t))
        if t.name.endswith("attn_q.weight"):
            weight = unpermute_rope_rows(weight, config.num_attention_heads)
        elif t.name.endswith("attn_k.weight"):
            weight = unpermute_rope_rows(weight, config.num_key_value_heads)
        out[hf_name(t.name)] = weight
    return out


# llama.cpp's split for the 'smollm' pre-tokenizer (src/llama-vocab.cpp): every digit alone,
# then GPT-2's rule (contractions, letters, numbers, punctuation, spaces).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_PRE_TOKENIZER_SPLITS = {"smollm": [r"\p{N}", _GPT2_SPLIT], "gpt2": [_GPT2_SPLIT], "default": [_GPT2_SPLIT]}
_CONTROL = 3  # tokenizer.ggml.token_type of a special token such as <|im_end|>


def load_gguf_tokenizer(path: str | os.PathLike | GGUFFile):
    """The tokenizer written in a GGUF file, rebuilt with Hugging Face ``tokenizers``.

    A byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``, as SmolLM2's) is three
    things, all in the metadata: the vocabulary (``tokenizer.ggml.tokens``, id = position),
    the merges learnt in training (``tokenizer.ggml.merges``, best first) and the rule that
    first splits text into words (``tokenizer.ggml.pre``, named after llama.cpp's rules). Tokens
    whose ``token_type`` is 3 (control) are special: ``<|im_start|>`` stays one token. The
    chat template and the BOS/EOS ids come from the file too. Returns a transformers
    ``PreTrainedTokenizerFast``, so ``apply_chat_template`` and ``decode`` work as usual.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    file = path if isinstance(path, GGUFFile) else read_gguf(path)
    meta = file.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise _fail(file.path, f"tokenizer.ggml.model is {kind!r}; labkit rebuilds only byte-level BPE "
                               f"tokenizers ('gpt2', as SmolLM2 and Llama 3 use)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise _fail(file.path, f"tokenizer.ggml.pre is {pre!r}; labkit knows the split rules of "
                               f"{sorted(_PRE_TOKENIZER_SPLITS)}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_TOKENIZER_SPLITS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", []))
    special = [t for t, kind in zip(tokens, types) if kind == _CONTROL]

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return None if i is None else tokens[int(i)]

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"),
        additional_special_tokens=special, chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False)
    return wrapped
