"""What each token costs: the byte formula of the KV cache, and how many sequences fit (chapter 02).

Every layer of a decoder stores, for every token it has seen, one key vector and
one value vector per *KV head*. So one token costs

    bytes_per_token = 2 × num_layers × num_kv_heads × head_dim × dtype_bytes

(the 2 is K and V) and a sequence of ``length`` tokens costs ``length`` times that.
With grouped-query attention (GQA) several query heads share one KV head, so the
formula takes ``num_kv_heads``, never the number of query heads.

Everything else in this module builds on that one line:

* :class:`ModelShape` holds the four numbers of a real model, read from its
  ``config.json`` (:data:`PRESETS`, built by :meth:`ModelShape.from_config` from the
  excerpts in :data:`PRESET_CONFIGS`), with the longest context the model was
  built for (``max_position_embeddings``), and the
  article's teaching model (:data:`TEACHING_MODEL`: 32 layers, 8 KV heads,
  head dim 128, 2 bytes: 128 KiB per token).
* :func:`shard` gives the share of one device when a model is split: tensor
  parallelism splits the KV heads (and replicates them when there are more
  devices than KV heads), pipeline parallelism splits the layers.
* :func:`sequences_that_fit` turns a device's memory into a number of sequences.

Three extensions go **beyond the article**, whose formula assumes an unquantized
cache without sliding windows: an 8-bit cache (``dtype_bytes=1``; with its scales and int4,
:func:`kv_bytes_per_token`, appendix A3), sliding-window
layers that keep at most ``sliding_window`` tokens, and a latent cache (DeepSeek's
multi-head latent attention, MLA) that stores one compressed vector per token and
layer instead of separate K and V, so it has no factor 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..checks import check_bytes, check_int
from .formats import kv_quant

__all__ = [
    "DTYPE_BYTES", "element_size", "bytes_per_token", "cache_bytes",
    "ModelShape", "TEACHING_MODEL", "PRESET_CONFIGS", "PRESETS", "kv_heads_per_device", "pipeline_stages", "shard",
    "kv_bytes_per_token", "kv_cache_bytes", "kv_pool_bytes", "sequences_that_fit",
]

# Bytes per element of the cache for the dtype names found in config.json files and torch.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    # 8-bit caches (beyond the article): vLLM's kv_cache_dtype="fp8" and int8 schemes. One byte per
    # element is the whole cost only with per-tensor scales (vLLM's "fp8"); per-token-head variants
    # add scales inside every page (see labkit.vllm_bridge.predict.page_size_bytes).
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}


def element_size(dtype: str | torch.dtype | int) -> int:
    """Bytes per cache element: ``"bfloat16" -> 2``, ``torch.float32 -> 4``, ``1 -> 1``."""
    if isinstance(dtype, torch.dtype):
        if dtype is torch.bool or dtype.is_complex:
            raise ValueError(f"dtype must be a real number type for K/V (e.g. torch.bfloat16), got {dtype}")
        return dtype.itemsize
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.").lower()
        if key not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} (or a torch.dtype), got {dtype!r}")
        return DTYPE_BYTES[key]
    return check_int("dtype_bytes", dtype, 1)


def _resolve_dtype_bytes(dtype_bytes: int | None, dtype: str | torch.dtype | None) -> int:
    if (dtype_bytes is None) == (dtype is None):
        raise ValueError("give exactly one of dtype_bytes (an integer >= 1) or dtype (a name or torch.dtype)")
    return element_size(dtype if dtype is not None else dtype_bytes)


# --------------------------------------------------------------------------- the formula


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int | None = None, *,
                    dtype: str | torch.dtype | None = None) -> int:
    """KV-cache bytes of one token: ``2 × num_layers × num_kv_heads × head_dim × dtype_bytes``.

    Give the element size either as ``dtype_bytes`` (an integer) or as ``dtype``
    (``"bfloat16"``, ``torch.float16`` ...). ``num_kv_heads`` is the number of
    *KV* heads: with GQA it is smaller than the number of query heads.

    >>> bytes_per_token(32, 8, 128, 2)   # the article's teaching model
    131072
    """
    b = _resolve_dtype_bytes(dtype_bytes, dtype)
    num_layers = check_int("num_layers", num_layers, 1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
    head_dim = check_int("head_dim", head_dim, 1)
    return 2 * num_layers * num_kv_heads * head_dim * b


def cache_bytes(length: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int | None = None,
                *, dtype: str | torch.dtype | None = None) -> int:
    """KV-cache bytes of one sequence holding ``length`` tokens: ``length × bytes_per_token``.

    ``length`` counts the tokens *in the cache* (prompt plus tokens generated so
    far); for capacity planning take the prompt plus the most tokens it may generate.
    """
    length = check_int("length", length, 0)
    return length * bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes, dtype=dtype)


# --------------------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model that decide its KV-cache size, and where they come from.

    ``num_layers``, ``num_kv_heads``, ``head_dim`` and ``dtype_bytes`` are the
    article's L, Hkv, D and b. The other fields describe extensions beyond the
    article:

    * ``sliding_window`` and ``sliding_layers``: the layers (by index) that attend
      only to the last ``sliding_window`` tokens, so they keep at most that many;
    * ``latent``: a multi-head latent attention (MLA) cache. Each layer stores one
      latent vector of ``head_dim`` elements per token (the compressed K/V plus the
      decoupled RoPE key), shared by all heads: ``num_kv_heads`` is 1 and there is
      no factor 2.

    ``num_attention_heads`` (query heads) is kept only to show the GQA mistake; with
    GQA each KV head serves a whole group of query heads, so it must be a multiple
    of ``num_kv_heads``.

    ``max_position_embeddings`` is the longest context the model was built for, as
    its ``config.json`` states it (``None`` when unknown). The formula gives bytes
    for any length; :meth:`beyond_context` says when a length is past that limit.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    num_attention_heads: int | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = field(default=(), repr=False)
    latent: bool = False
    source: str = field(default="", repr=False)
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            check_int(name, getattr(self, name), 1)
        if self.num_attention_heads is not None:
            heads = check_int("num_attention_heads", self.num_attention_heads, 1)
            if heads % self.num_kv_heads:
                raise ValueError(f"num_attention_heads must be a multiple of num_kv_heads ({self.num_kv_heads}): "
                                 f"each KV head serves a whole group of query heads, got {heads}")
        if self.max_position_embeddings is not None:
            check_int("max_position_embeddings", self.max_position_embeddings, 1)
        if self.latent and self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads must be 1 for a latent (MLA) cache, got {self.num_kv_heads}")
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, 1)
        bad = [i for i in self.sliding_layers if not isinstance(i, int) or not 0 <= i < self.num_layers]
        if bad or len(set(self.sliding_layers)) != len(self.sliding_layers):
            raise ValueError(f"sliding_layers must hold distinct layer indices in [0, {self.num_layers - 1}], "
                             f"got {bad or list(self.sliding_layers)}")
        if self.sliding_layers and self.sliding_window is None:
            raise ValueError("sliding_layers needs a sliding_window (an integer >= 1)")

    @property
    def kv_factor(self) -> int:
        """2 when K and V are stored separately; 1 for a latent (MLA) cache."""
        return 1 if self.latent else 2

    def bytes_per_token_per_layer(self) -> int:
        """Bytes one token adds to one layer: ``kv_factor × num_kv_heads × head_dim × dtype_bytes``."""
        return self.kv_factor * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_token(self) -> int:
        """Bytes of one token over every layer (the article's formula; windows not applied)."""
        return self.num_layers * self.bytes_per_token_per_layer()

    def cache_bytes(self, length: int, apply_window: bool = True) -> int:
        """Bytes of one sequence of ``length`` cached tokens.

        Sliding-window layers keep at most ``sliding_window`` tokens (beyond the
        article; ``apply_window=False`` gives the article's plain formula).
        """
        length = check_int("length", length, 0)
        windowed = len(self.sliding_layers) if apply_window else 0
        kept = min(length, self.sliding_window) if windowed else length
        per_layer = self.bytes_per_token_per_layer()
        return ((self.num_layers - windowed) * length + windowed * kept) * per_layer

    def beyond_context(self, length: int) -> bool:
        """True when ``length`` tokens exceed ``max_position_embeddings`` (False when it is unknown).

        The bytes of such a request are still what the formula says; the model
        just was not built (or trained) to attend over that many positions.
        """
        length = check_int("length", length, 0)
        return self.max_position_embeddings is not None and length > self.max_position_embeddings

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one cache block of ``block_size`` token slots (chapter 03's unit)."""
        return check_int("block_size", block_size, 1) * self.bytes_per_token()

    def query_head_mistake(self) -> int:
        """Bytes per token if one wrongly used the query heads instead of the KV heads."""
        if self.num_attention_heads is None:
            raise ValueError(f"{self.name} has no num_attention_heads to make the mistake with")
        return 2 * self.num_layers * self.num_attention_heads * self.head_dim * self.dtype_bytes

    def with_dtype(self, dtype: str | torch.dtype | int) -> "ModelShape":
        """The same model with another cache element type, e.g. an 8-bit cache (``"fp8"``)."""
        return replace(self, dtype_bytes=element_size(dtype))

    @classmethod
    def from_config(cls, config: dict[str, Any], *, name: str = "", dtype: str | torch.dtype | int | None = None,
                    source: str = "") -> "ModelShape":
        """Read the cache shape from a Llama-style ``config.json`` dict.

        Uses ``num_hidden_layers``, ``num_key_value_heads`` (default: as many as
        ``num_attention_heads``, i.e. no GQA), ``head_dim`` (default ``hidden_size //
        num_attention_heads``) and ``torch_dtype`` (or ``dtype``), and
        ``max_position_embeddings`` when present.

        The cache's element type is the ``dtype`` argument when given. Otherwise it is
        the checkpoint's, except that a **float32 checkpoint is served in 16 bits**
        (2 bytes): vLLM's ``dtype="auto"`` downcasts float32 weights to the platform's
        preferred type, bfloat16 on GPUs that support it and float16 on older ones
        (vLLM 0.33.0, ``config/model.py: _resolve_auto_dtype``), and the cache takes the
        model's dtype. Gemma 2's files are float32: this reads them as a bf16 cache, as
        served. Pass ``dtype="float32"`` for a cache kept in float32.

        Also understood: ``sliding_window`` with
        ``layer_types`` (Gemma-2 style) or ``use_sliding_window``, and DeepSeek's
        ``kv_lora_rank`` + ``qk_rope_head_dim`` (a latent MLA cache).
        """
        for key in ("num_hidden_layers", "num_attention_heads"):
            if key not in config:
                raise ValueError(f"config must have {key!r} (an integer >= 1)")
        num_layers = check_int("num_hidden_layers", config["num_hidden_layers"], 1)
        num_heads = check_int("num_attention_heads", config["num_attention_heads"], 1)
        kv_heads = config.get("num_key_value_heads")
        if kv_heads is None:  # no GQA: one KV head per query head
            kv_heads = num_heads
        head_dim = config.get("head_dim")
        if head_dim is None:
            head_dim = check_int("hidden_size", config.get("hidden_size"), 1) // num_heads
        if dtype is None:
            dtype = config.get("torch_dtype") or config.get("dtype")
            if dtype is None:
                raise ValueError("config has no torch_dtype: pass dtype= (e.g. 'bfloat16' or 2)")
            if element_size(dtype) == 4:  # vLLM's dtype "auto": a float32 checkpoint is served in 16 bits
                dtype = "bfloat16"
        kwargs: dict[str, Any] = {}
        if config.get("kv_lora_rank"):  # DeepSeek-V2/V3: multi-head latent attention
            kwargs.update(latent=True)
            kv_heads = 1
            head_dim = check_int("kv_lora_rank", config["kv_lora_rank"], 1) + check_int(
                "qk_rope_head_dim", config.get("qk_rope_head_dim", 0), 0)
        window = config.get("sliding_window")
        if window and config.get("use_sliding_window", True):
            types = config.get("layer_types")
            if types:
                layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
            elif config.get("model_type") == "gemma2":  # older Gemma-2 configs: even layers are local
                layers = tuple(range(0, num_layers, 2))
            else:  # Mistral style: every layer uses the window
                layers = tuple(range(num_layers))
            kwargs.update(sliding_window=window, sliding_layers=layers)
        return cls(name=name or config.get("_name_or_path", "") or "model", num_layers=num_layers,
                   num_kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=element_size(dtype),
                   num_attention_heads=None if kwargs.get("latent") else num_heads, source=source,
                   max_position_embeddings=config.get("max_position_embeddings"), **kwargs)


# The article's teaching model (§02). It matches no particular checkpoint.
TEACHING_MODEL = ModelShape("teaching model", num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2,
                            num_attention_heads=32, source="the article, §02 (a model for arithmetic only)")

# Excerpts of each model's config.json on the Hugging Face Hub: the keys that decide the
# cache, transcribed by hand from the public files named in "_name_or_path" (this book
# cannot download them). PRESETS below is built from them by ModelShape.from_config, so
# the presets go through the same parsing path as any config.json a reader loads.
PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "Llama-3-8B": {"_name_or_path": "meta-llama/Meta-Llama-3-8B", "model_type": "llama", "hidden_size": 4096,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 8192, "torch_dtype": "bfloat16"},
    "Llama-3-70B": {"_name_or_path": "meta-llama/Meta-Llama-3-70B", "model_type": "llama", "hidden_size": 8192,
                    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "max_position_embeddings": 8192, "torch_dtype": "bfloat16"},
    "Mistral-7B-v0.1": {"_name_or_path": "mistralai/Mistral-7B-v0.1", "model_type": "mistral", "hidden_size": 4096,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "sliding_window": 4096, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"},
    "Qwen2.5-7B": {"_name_or_path": "Qwen/Qwen2.5-7B", "model_type": "qwen2", "hidden_size": 3584,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "sliding_window": 131072, "use_sliding_window": False, "max_position_embeddings": 131072,
                   "torch_dtype": "bfloat16"},
    "Gemma-2-9B": {"_name_or_path": "google/gemma-2-9b", "model_type": "gemma2", "hidden_size": 3584,
                   "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                   "sliding_window": 4096, "max_position_embeddings": 8192, "torch_dtype": "float32"},
    "DeepSeek-V3": {"_name_or_path": "deepseek-ai/DeepSeek-V3", "model_type": "deepseek_v3", "hidden_size": 7168,
                    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                    "max_position_embeddings": 163840, "torch_dtype": "bfloat16"},
}

_PRESET_NOTES = {
    "Mistral-7B-v0.1": "the window applies to every layer",
    "Qwen2.5-7B": "the base model's file; use_sliding_window is false, so no layer uses the window; "
                  "max_position_embeddings 131,072 as two independent transcriptions of the file agree; "
                  "the Instruct model's file says 32,768",
    "Gemma-2-9B": "the file does not list which layers are local: even layers local, odd global, as in "
                  "transformers' Gemma2Config layer_types; checkpoint stored in float32, cache assumed bf16 as served",
    "DeepSeek-V3": "MLA: one latent vector of kv_lora_rank + qk_rope_head_dim elements per token and layer",
}


def _preset(name: str) -> ModelShape:
    """A preset read from its config.json excerpt, with a 2-byte (bf16) cache as served (said explicitly)."""
    config = PRESET_CONFIGS[name]
    keys = ", ".join(f"{k} {v}" for k, v in config.items() if not k.startswith("_") and k != "model_type")
    note = f" ({_PRESET_NOTES[name]})" if name in _PRESET_NOTES else ""
    source = f"{config['_name_or_path']} config.json, transcribed: {keys}{note}"
    return ModelShape.from_config(config, name=name, dtype="bfloat16", source=source)


# The presets: the teaching model, then real shapes read from the excerpts above.
PRESETS: dict[str, ModelShape] = {TEACHING_MODEL.name: TEACHING_MODEL} | {
    name: _preset(name) for name in PRESET_CONFIGS}


# --------------------------------------------------------------------------- sharding


def kv_heads_per_device(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each device stores under tensor parallelism over ``tensor_parallel_size`` devices.

    vLLM's rule, the one this book uses everywhere (``labkit.vllm_bridge.predict`` calls this function).
    vLLM 0.33.0's ``QKVParallelLinear`` (``model_executor/layers/linear.py``) builds the K
    and V projections with ``divide``, which asserts an exact division:

    * at most as many devices as KV heads: the heads are split evenly, so
      ``tensor_parallel_size`` must divide ``num_kv_heads``;
    * more devices than KV heads: a head cannot be cut, so each device holds one whole
      head, *replicated* on ``tensor_parallel_size // num_kv_heads`` devices; then
      ``tensor_parallel_size`` must be a multiple of ``num_kv_heads``.

    8 KV heads on 5 devices fit neither case, and vLLM refuses to build the model. (Its
    ``ModelConfig.get_num_kv_heads`` alone, ``max(1, heads // tp)``, would say 1: it
    assumes the division was checked.)
    """
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
    tp = check_int("tensor_parallel_size", tensor_parallel_size, 1)
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"tensor_parallel_size must divide num_kv_heads ({num_kv_heads}) when it is smaller "
                             f"(vLLM's QKVParallelLinear splits whole heads), got {tp}")
        return num_kv_heads // tp
    if tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size must be a multiple of num_kv_heads ({num_kv_heads}) when it is "
                         f"larger (vLLM's QKVParallelLinear replicates whole heads), got {tp}")
    return 1


def pipeline_stages(num_layers: int, pipeline_parallel_size: int) -> list[range]:
    """The layers of each pipeline stage: contiguous ranges whose sizes differ by at most one.

    Split as vLLM splits them (``vllm/distributed/utils.py: get_pp_indices``, vLLM 0.33.0,
    without ``VLLM_PP_LAYER_PARTITION``): every stage gets ``num_layers //
    pipeline_parallel_size`` layers and the remainder goes one layer each to the stages just
    *before* the last (the last stage also holds the final norm and the output head).
    61 layers on 4 stages: 15, 15, 16, 15. ``labkit.vllm_bridge.predict.get_pp_indices`` reads its ranges here.
    """
    num_layers = check_int("num_layers", num_layers, 1)
    pp = check_int("pipeline_parallel_size", pipeline_parallel_size, 1)
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size must be in [1, {num_layers}] (num_layers), got {pp}")
    sizes = [num_layers // pp] * pp
    for s in range(num_layers % pp):
        sizes[-2 - s] += 1
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def shard(shape: ModelShape, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> ModelShape:
    """The share of the busiest device when ``shape`` runs on ``tensor_parallel_size × pipeline_parallel_size`` devices.

    Its ``bytes_per_token()`` and ``cache_bytes(length)`` are per device. Tensor
    parallelism divides the KV heads (see :func:`kv_heads_per_device`; a latent MLA
    cache has one "head" and is therefore replicated on every device); pipeline
    parallelism gives each stage a contiguous range of layers.
    """
    if not isinstance(shape, ModelShape):
        raise TypeError(f"shape must be a ModelShape, got {type(shape).__name__}")
    heads = kv_heads_per_device(shape.num_kv_heads, tensor_parallel_size)
    stages = pipeline_stages(shape.num_layers, pipeline_parallel_size)

    # The busiest stage: the most layers, then the fewest windowed ones (they hold fewer tokens).
    busiest = max(stages, key=lambda s: (len(s), -sum(i in s for i in shape.sliding_layers)))
    sliding = tuple(i - busiest.start for i in shape.sliding_layers if i in busiest)
    return replace(shape, name=f"{shape.name} (TP={tensor_parallel_size}, PP={pipeline_parallel_size}, one device)",
                   num_layers=len(busiest), num_kv_heads=heads, sliding_layers=sliding,
                   sliding_window=shape.sliding_window if sliding else None,
                   num_attention_heads=None)


# --------------------------------------------------------------------------- fewer bytes per element


def kv_bytes_per_token(shape: ModelShape, kv_cache_dtype: str = "auto", block_size: int = 16) -> float:
    """Bytes per token of ``shape`` with its cache stored as ``kv_cache_dtype`` (appendix A3).

    "auto" is the formula above with ``shape.dtype_bytes``. A quantized scheme of
    :mod:`labkit.memory.formats` keeps the formula with b = 1 (fp8, int8) or 0.5 (int4, two codes per
    byte) and adds its float32 scales: none per token for per-tensor scales (8 bytes per layer
    in all), 4 bytes per head per ``block_size`` tokens per block, 4 bytes per 32 elements per
    group. Llama-3-8B at 8-bit: exactly half of bf16 (64 KiB) with per-tensor scales; 1/512 more
    with per-block scales of 16 tokens; 1/8 more (64 KiB + 8 KiB) with scales per group of 32. At
    4-bit the same group scales are a quarter more than the codes (32 KiB + 8 KiB).
    """
    kq = kv_quant(kv_cache_dtype)
    if kq is None:
        return float(shape.bytes_per_token())
    return kq.bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, block_size, shape.kv_factor)


def kv_cache_bytes(shape: ModelShape, length: int, kv_cache_dtype: str = "auto", block_size: int = 16) -> int:
    """Bytes of one sequence of ``length`` tokens of ``shape`` stored as ``kv_cache_dtype`` (the article's
    formula: windows are not applied). Per-block scales count whole blocks."""
    kq = kv_quant(kv_cache_dtype)
    if kq is None:
        return shape.cache_bytes(length, apply_window=False)
    return kq.cache_bytes(length, shape.num_layers, shape.num_kv_heads, shape.head_dim, block_size, shape.kv_factor)


# --------------------------------------------------------------------------- capacity


def kv_pool_bytes(device_bytes: float, reserved_bytes: float) -> float:
    """Memory left for the KV cache: the device (> 0 bytes) minus weights, workspace and any reserve."""
    device_bytes = check_bytes("device_bytes", device_bytes, positive=True)
    reserved_bytes = check_bytes("reserved_bytes", reserved_bytes)
    if reserved_bytes > device_bytes:
        raise ValueError(f"reserved_bytes must be in [0, device_bytes={device_bytes:,}], got {reserved_bytes:,}")
    return device_bytes - reserved_bytes


def sequences_that_fit(bytes_per_sequence: int, device_bytes: float, reserved_bytes: float) -> int:
    """How many whole sequences of ``bytes_per_sequence`` fit in the KV pool of one device.

    The pool is ``device_bytes - reserved_bytes`` (weights, activations workspace,
    a safety margin). Block-table overhead and latency goals are not counted:
    fitting in memory is not the same as being served fast enough.
    """
    bytes_per_sequence = check_int("bytes_per_sequence", bytes_per_sequence, 1)
    return int(kv_pool_bytes(device_bytes, reserved_bytes) // bytes_per_sequence)
