"""From a GGUF file to the book's decoder: its config, its weights and its tokenizer (chapter 01).

``labkit.model.gguf`` reads a file and checks every claim it makes about itself. This module turns
what it holds into what ``labkit.model.decoder`` computes with:

* ``decoder_config``: the metadata (``llama.block_count``, ``llama.attention.head_count_kv`` ...) as
  a ``DecoderConfig``, and ``check_tensors``: the tensor inventory against it, every layer present,
  nothing extra, every shape as the config implies, before anything is built or dequantized;
* ``state_dict``: the tensors dequantized to float32 under the decoder's (Hugging Face Llama) keys,
  with the row order llama.cpp gives Q and K undone (``unpermute_rope_rows``);
* ``load_gguf_tokenizer``: the byte-level BPE tokenizer rebuilt from the vocabulary and merges in the file.

Whatever fails raises ``GGUFError`` naming the file and the reason, and nothing half-built is returned.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np
import torch

from .decoder import DecoderConfig
from .gguf import MAX_LAYERS, SUPPORTED_TYPES, GGUFError, GGUFFile, dequantize, describe_value, read_gguf

__all__ = ["decoder_config", "check_tensors", "llama_tensor_shapes", "state_dict", "load_gguf_tokenizer"]


# ---- metadata -> DecoderConfig --------------------------------------------------------------------

_REQUIRED = object()


def _meta(file: GGUFFile, key: str, *, required: bool = True, default: Any = None) -> Any:
    full = f"{file.architecture}.{key}"
    if full not in file.metadata:
        if required:
            raise GGUFError(file.path, f"metadata {full!r} is missing")
        return default
    return file.metadata[full]


def _meta_int(file: GGUFFile, key: str, *, minimum: int = 1, default: Any = _REQUIRED) -> int:
    """An integer field: any GGUF integer type; a string, float, bool or array is refused, not coerced."""
    value = _meta(file, key, required=default is _REQUIRED, default=default)
    if type(value) is not int or value < minimum:
        raise GGUFError(file.path, f"metadata '{file.architecture}.{key}' must be an integer >= {minimum}, "
                        f"got {describe_value(value)}")
    return value


def _meta_float(file: GGUFFile, key: str, *, default: Any = _REQUIRED) -> float:
    """A float field (a GGUF float or integer): finite and > 0."""
    value = _meta(file, key, required=default is _REQUIRED, default=default)
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise GGUFError(file.path, f"metadata '{file.architecture}.{key}' must be a finite number > 0, "
                        f"got {describe_value(value)}")
    return float(value)


def _token_list(file: GGUFFile) -> list[str] | None:
    """``tokenizer.ggml.tokens`` when the file has it, checked to be a non-empty list of strings."""
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    if not isinstance(tokens, list) or not tokens or not all(type(t) is str for t in tokens):
        raise GGUFError(file.path, f"tokenizer.ggml.tokens must be a non-empty array of strings, "
                        f"got {describe_value(tokens)}")
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
        raise GGUFError(file.path, f"general.architecture is {file.architecture!r}; labkit's decoder computes "
                        f"only 'llama' (Llama, SmolLM2, Mistral without sliding windows)")
    if _meta_int(file, "expert_count", minimum=0, default=0):
        raise GGUFError(file.path, "llama.expert_count is set: mixture-of-experts layers are not supported")
    heads = _meta_int(file, "attention.head_count")
    kv_heads = _meta_int(file, "attention.head_count_kv", default=heads)
    hidden = _meta_int(file, "embedding_length")
    if "llama.attention.key_length" not in file.metadata and hidden % heads:
        raise GGUFError(file.path, f"llama.embedding_length {hidden} does not divide by llama.attention.head_count "
                        f"{heads}, and llama.attention.key_length (head_dim) is not given")
    head_dim = _meta_int(file, "attention.key_length", default=hidden // heads)
    if _meta_int(file, "attention.value_length", default=head_dim) != head_dim:
        raise GGUFError(file.path, f"llama.attention.value_length {_meta(file, 'attention.value_length')} differs "
                        f"from key_length {head_dim}: the decoder has one head_dim for K and V")
    if _meta_int(file, "rope.dimension_count", default=head_dim) != head_dim:
        raise GGUFError(file.path, f"llama.rope.dimension_count is {_meta(file, 'rope.dimension_count')}, head_dim "
                        f"is {head_dim}: RoPE must rotate the whole head")
    scaling = _meta(file, "rope.scaling.type", required=False, default="none")
    if not (isinstance(scaling, str) and scaling == "none"):
        raise GGUFError(file.path, f"llama.rope.scaling.type {describe_value(scaling)} is not supported")
    if "rope_freqs.weight" in file.tensors:  # Llama 3.1's scaling is stored as factors per frequency
        raise GGUFError(file.path, "the file stores RoPE frequency factors (rope_freqs.weight, Llama 3.1 scaling), "
                        "which labkit's GGUF reader does not read; load the safetensors checkpoint instead")
    tokens = _token_list(file)
    if "llama.vocab_size" in file.metadata or tokens is None:
        vocab = _meta_int(file, "vocab_size")
        if tokens is not None and len(tokens) != vocab:
            raise GGUFError(file.path, f"llama.vocab_size is {vocab:,} but tokenizer.ggml.tokens lists "
                            f"{len(tokens):,} tokens")
    else:
        vocab = len(tokens)
    eos = file.metadata.get("tokenizer.ggml.eos_token_id")
    if eos is not None and (type(eos) is not int or not 0 <= eos < vocab):
        raise GGUFError(file.path, f"tokenizer.ggml.eos_token_id must be a token id in [0, {vocab}), "
                        f"got {describe_value(eos)}")
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
        raise GGUFError(file.path, f"its metadata describes no decoder labkit can build: {err}") from err
    check_tensors(file, config)
    return config


# ---- the tensor inventory -------------------------------------------------------------------------

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
        raise GGUFError(file.path, f"llama.block_count is {n:,}, but its tensors are named for {held}")
    if n > MAX_LAYERS:
        raise GGUFError(file.path, f"{n:,} layers: labkit builds at most {MAX_LAYERS} (MAX_LAYERS)")
    expected = llama_tensor_shapes(config)
    missing = [name for name in expected if name not in file.tensors]
    if missing:
        raise GGUFError(file.path, f"lacks tensor {missing[0]!r} ({len(missing)} missing in all), which the "
                        f"metadata's decoder needs")
    unknown = [name for name in file.tensors if name not in expected]
    if unknown:
        raise GGUFError(file.path, f"tensor {unknown[0]!r} is not part of the Llama decoder its metadata describes "
                        f"({len(unknown)} unknown in all)")
    for name, shape in expected.items():
        if file.tensors[name].shape != shape:
            raise GGUFError(file.path, f"tensor {name!r} has shape {file.tensors[name].shape}; the GGUF file's "
                            f"metadata implies {shape}")


# ---- tensors -> the decoder's state_dict ----------------------------------------------------------


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
            raise GGUFError(file.path, f"tensor {t.name!r} is stored as {t.type}, which labkit does not "
                            f"dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
    out: dict[str, torch.Tensor] = {}
    for t in file.tensors.values():
        try:
            weight = torch.from_numpy(dequantize(t))
        except ValueError as err:
            raise GGUFError(file.path, str(err)) from err
        if t.name.endswith("attn_q.weight"):
            weight = unpermute_rope_rows(weight, config.num_attention_heads)
        elif t.name.endswith("attn_k.weight"):
            weight = unpermute_rope_rows(weight, config.num_key_value_heads)
        out[hf_name(t.name)] = weight
    return out


# ---- the tokenizer --------------------------------------------------------------------------------

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
        raise GGUFError(path, f"tokenizer.ggml.model is {describe_value(kind)}; labkit rebuilds only byte-level BPE "
                        f"tokenizers ('gpt2', as SmolLM2 and Llama 3 use)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in _PRE_TOKENIZER_SPLITS:
        raise GGUFError(path, f"tokenizer.ggml.pre is {describe_value(pre)}; labkit knows the split rules of "
                        f"{sorted(_PRE_TOKENIZER_SPLITS)}")
    tokens = _token_list(file)
    if tokens is None:
        raise GGUFError(path, "tokenizer.ggml.tokens (the vocabulary) is missing")
    merges = meta.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list) or not all(type(m) is str and " " in m for m in merges):
        bad = merges if not isinstance(merges, list) else next(m for m in merges if type(m) is not str or " " not in m)
        raise GGUFError(path, f"tokenizer.ggml.merges must be an array of strings 'left right', "
                        f"found {describe_value(bad)}")
    types = meta.get("tokenizer.ggml.token_type", np.zeros(len(tokens), np.int32))
    if not (isinstance(types, np.ndarray) and types.dtype.kind in "iu" and types.shape == (len(tokens),)):
        raise GGUFError(path, f"tokenizer.ggml.token_type must be an array of {len(tokens):,} integers "
                        f"(one per token), got {describe_value(types)}")
    special = {}
    for key in _SPECIAL_IDS:
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and (type(i) is not int or not 0 <= i < len(tokens)):
            raise GGUFError(path, f"tokenizer.ggml.{key} must be a token id in [0, {len(tokens):,}), "
                            f"got {describe_value(i)}")
        special[key] = None if i is None else tokens[i]
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise GGUFError(path, f"tokenizer.chat_template must be a string, got {describe_value(template)}")
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
        raise GGUFError(file.path, f"the tokenizer cannot be rebuilt from its vocabulary and merges: {err}") from err
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
