"""How long one engine step takes: a roofline cost model (chapter 06).

A serving engine runs in *steps* (iterations). In each step the GPU runs the
model once over every token scheduled for it: one token for each decoding
sequence, a chunk of prompt for each prefilling one. Two things bound the time
of that step:

* **memory traffic**: the weights are read once per step, however many
  sequences share it, and every scheduled sequence reads its whole KV history
  (and writes the K/V of its new tokens);
* **arithmetic**: about 2 operations per weight per token (a multiply and an
  add), plus attention, whose work grows with each token's context.

The roofline model says a step takes as long as the slower of the two:

    step_time = max(bytes / memory_bandwidth, flops / peak_flops) + overhead

Decode steps are almost always on the memory side (few tokens, many bytes);
long prefills on the compute side. That single ``max`` is enough to show the
chapter's two effects: more concurrent sequences spread the weight read over
more tokens, and multiply the history read.

Device figures are **datasheet** numbers (peak dense bf16 tensor throughput,
memory bandwidth), which real kernels do not reach: the model gives a lower
bound on time, good for comparing settings, not for promising latencies. The
``overhead`` (kernel launches, the scheduler's own time) is an assumption,
labelled as one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...checks import check_flag, check_int, check_number
from ...memory.capacity import PRESETS, ModelShape
from ...units import GiB

__all__ = ["Device", "DEVICES", "ModelCost", "MODEL_COSTS", "CostModel", "get_device", "get_model_cost"]


# --------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class Device:
    """An accelerator as its datasheet describes it.

    ``memory_bytes`` is the capacity the datasheet states (the physical memory; what a
    program can allocate is lower, see ``DEVICES``), ``memory_bandwidth`` in
    bytes per second (decimal: 1 TB/s = 10**12 B/s, as datasheets write it) and
    ``peak_flops`` the dense (no sparsity) bf16/fp16 tensor-core rate with fp32
    accumulation, in operations per second.
    """

    name: str
    memory_bytes: float
    memory_bandwidth: float
    peak_flops: float
    source: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for name in ("memory_bytes", "memory_bandwidth", "peak_flops"):  # an infinite rate would make time 0
            check_number(name, getattr(self, name), 0, strict=True, finite=True)

    @property
    def ridge_point(self) -> float:
        """Operations per byte at which a kernel stops being memory-bound (peak_flops / bandwidth)."""
        return self.peak_flops / self.memory_bandwidth


# Datasheet figures. Capacities are the datasheets' "80 GB" / "24 GB", read here as binary
# GiB (memory chips come in binary sizes). That is the physical capacity: the memory a
# program can allocate is lower (the driver and CUDA context take some, and so does ECC
# where it is enabled), so a real engine sizes its pool from the free memory it measures.
DEVICES: dict[str, Device] = {d.name: d for d in [
    Device("H100 SXM", 80 * GiB, 3.35e12, 989.4e12,
           source="NVIDIA H100 datasheet: 80 GB HBM3, 3.35 TB/s, BF16 tensor 1,979 TFLOPS with sparsity "
                  "(989.4 dense)"),
    Device("A100 80GB SXM", 80 * GiB, 2.039e12, 312e12,
           source="NVIDIA A100 datasheet: 80 GB HBM2e, 2,039 GB/s, BF16 tensor 312 TFLOPS (624 with sparsity)"),
    Device("L4", 24 * GiB, 300e9, 121e12,
           source="NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, BF16 tensor 242 TFLOPS with sparsity (121 dense)"),
    Device("RTX 4090 (24 GiB)", 24 * GiB, 1008e9, 165.2e12,
           source="NVIDIA Ada (AD102) whitepaper, RTX 4090: 24 GB GDDR6X, 1,008 GB/s, BF16 tensor with FP32 "
                  "accumulate 165.2 TFLOPS dense"),
]}


def get_device(name: str) -> Device:
    """A device preset by name; ValueError listing the names when it is unknown."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {sorted(DEVICES)}, got {name!r}")
    return DEVICES[name]


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelCost:
    """What a model costs per step beyond its cache: its weights and its arithmetic.

    ``shape`` is chapter 02's :class:`labkit.memory.capacity.ModelShape` (the cache side).
    The other fields are the Llama-style ``config.json`` numbers that size the
    weight matrices. Per layer a decoder holds the attention projections
    (q and o: ``hidden × heads × head_dim`` each; k and v: ``hidden × kv_heads ×
    head_dim`` each) and a gated MLP (three ``hidden × intermediate`` matrices);
    around the layers sit the embedding and the output head (``vocab × hidden``
    each, one matrix when ``tie_word_embeddings``). Norms and biases are left
    out: under 0.1% of the weights.
    """

    shape: ModelShape
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    source: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.shape, ModelShape):
            raise TypeError(f"shape must be a labkit.memory.capacity.ModelShape, got {type(self.shape).__name__}")
        for name in ("hidden_size", "intermediate_size", "vocab_size"):
            check_int(name, getattr(self, name), 1)
        check_flag("tie_word_embeddings", self.tie_word_embeddings)

    @property
    def num_attention_heads(self) -> int:
        return self.shape.num_attention_heads or self.shape.num_kv_heads

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (attention projections + gated MLP)."""
        s, h = self.shape, self.hidden_size
        attention = 2 * h * self.num_attention_heads * s.head_dim + 2 * h * s.num_kv_heads * s.head_dim
        return attention + 3 * h * self.intermediate_size

    @property
    def num_params(self) -> int:
        """All weights: the layers, the embedding and (unless tied) the output head."""
        heads = 1 if self.tie_word_embeddings else 2
        return self.shape.num_layers * self.layer_params + heads * self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights, stored in the cache's element type (bf16: 2 bytes)."""
        return self.num_params * self.shape.dtype_bytes

    @property
    def flops_per_token(self) -> int:
        """Matrix-multiply operations per token outside attention: 2 per weight it is multiplied by.

        The embedding is a table lookup, not a multiply, so it is not counted;
        the output head is.
        """
        return 2 * (self.shape.num_layers * self.layer_params + self.vocab_size * self.hidden_size)

    @property
    def attention_flops_per_pair(self) -> int:
        """Operations of one (query token, cached token) pair over all layers and query heads.

        Scores ``q · k`` and the weighted sum ``p · v`` are each ``head_dim``
        multiply-adds per query head: ``2 × 2 × heads × head_dim`` per layer.
        """
        return 4 * self.shape.num_layers * self.num_attention_heads * self.shape.head_dim


_LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, vocab_size=128256)

MODEL_COSTS: dict[str, ModelCost] = {m.shape.name: m for m in [
    ModelCost(PRESETS["teaching model"], **_LLAMA3_8B,
              source="assumed: the article gives only the cache shape; its 32 layers, 8 KV heads, head dim 128 "
                     "are Llama-3-8B's, so the weights are taken from Llama-3-8B's config.json"),
    ModelCost(PRESETS["Llama-3-8B"], **_LLAMA3_8B, source="meta-llama/Meta-Llama-3-8B config.json"),
    ModelCost(PRESETS["Llama-3-70B"], hidden_size=8192, intermediate_size=28672, vocab_size=128256,
              source="meta-llama/Meta-Llama-3-70B config.json"),
    ModelCost(PRESETS["Mistral-7B-v0.1"], hidden_size=4096, intermediate_size=14336, vocab_size=32000,
              source="mistralai/Mistral-7B-v0.1 config.json (the cost model ignores its sliding window)"),
    ModelCost(PRESETS["Qwen2.5-7B"], hidden_size=3584, intermediate_size=18944, vocab_size=152064,
              source="Qwen/Qwen2.5-7B config.json"),
    ModelCost(PRESETS["Gemma-2-9B"], hidden_size=3584, intermediate_size=14336, vocab_size=256000,
              tie_word_embeddings=True,
              source="google/gemma-2-9b config.json (the cost model ignores its sliding-window layers)"),
]}


def get_model_cost(name: str) -> ModelCost:
    """A model preset by name (chapter 02's names); ValueError listing the names when it is unknown."""
    if name not in MODEL_COSTS:
        raise ValueError(f"model must be one of {sorted(MODEL_COSTS)}, got {name!r}")
    return MODEL_COSTS[name]


# --------------------------------------------------------------------------- the roofline


@dataclass(frozen=True)
class StepCost:
    """The roofline's verdict on one step: its time and which side bound it."""

    time_s: float
    bytes_moved: float
    flops: float
    memory_time_s: float
    compute_time_s: float

    @property
    def bound(self) -> str:
        return "memory" if self.memory_time_s >= self.compute_time_s else "compute"


class CostModel:
    """Roofline time of an engine step for one model on one device.

    A step is described by what each scheduled sequence does: it already has
    ``context_len`` tokens in the cache and computes ``new_tokens`` more (1 for a
    decode, a chunk for a prefill). Then

    * bytes = weights + Σ (context_len + new_tokens) × bytes_per_token
      (read the history, write the new K/V),
    * flops = flops_per_token × Σ new_tokens + attention_flops_per_pair × Σ pairs,
      where a sequence's new token at position p attends to p + 1 cached tokens,
      so its chunk makes ``new × context + new × (new + 1) / 2`` pairs,

    and the step takes ``max(bytes / bandwidth, flops / peak) + overhead_s``.
    """

    def __init__(self, model: str | ModelCost = "teaching model", device: str | Device = "RTX 4090 (24 GiB)",
                 overhead_s: float = 0.0):
        self.model = get_model_cost(model) if isinstance(model, str) else model
        self.device = get_device(device) if isinstance(device, str) else device
        if not isinstance(self.model, ModelCost):
            raise TypeError(f"model must be a ModelCost or one of {sorted(MODEL_COSTS)}, got {type(model).__name__}")
        if not isinstance(self.device, Device):
            raise TypeError(f"device must be a Device or one of {sorted(DEVICES)}, got {type(device).__name__}")
        if not isinstance(overhead_s, (int, float)) or isinstance(overhead_s, bool) \
                or not 0 <= overhead_s < float("inf"):
            raise ValueError(f"overhead_s must be a finite number of seconds >= 0, got {overhead_s!r}")
        self.overhead_s = float(overhead_s)
        self.kv_bytes_per_token = self.model.shape.bytes_per_token()
        # Computed once: a simulation asks for step times hundreds of thousands of times.
        self.weight_bytes = self.model.weight_bytes
        self.flops_per_token = self.model.flops_per_token
        self.attention_flops_per_pair = self.model.attention_flops_per_pair

    def __repr__(self) -> str:
        return (f"CostModel({self.model.shape.name!r} on {self.device.name!r}, "
                f"overhead {self.overhead_s * 1e3:g} ms per step)")

    # The three sums below are all a step needs; the simulator keeps them up to date cheaply.
    def time_from_sums(self, num_new_tokens: int, num_context_tokens: int, num_pairs: float) -> float:
        """Step time from Σ new_tokens, Σ context_len and Σ attention pairs over the scheduled sequences."""
        if num_new_tokens == 0:
            return 0.0
        moved = self.weight_bytes + (num_context_tokens + num_new_tokens) * self.kv_bytes_per_token
        flops = self.flops_per_token * num_new_tokens + self.attention_flops_per_pair * num_pairs
        return max(moved / self.device.memory_bandwidth, flops / self.device.peak_flops) + self.overhead_s

    def times_from_sums(self, num_new_tokens: int, num_context_tokens: np.ndarray, num_pairs: np.ndarray) -> np.ndarray:
        """``time_from_sums`` for many steps at once (arrays of Σ context_len and Σ pairs)."""
        moved = self.model.weight_bytes + (np.asarray(num_context_tokens, dtype=np.float64) + num_new_tokens) \
            * self.kv_bytes_per_token
        flops = self.model.flops_per_token * num_new_tokens \
            + self.model.attention_flops_per_pair * np.asarray(num_pairs, dtype=np.float64)
        return np.maximum(moved / self.device.memory_bandwidth, flops / self.device.peak_flops) + self.overhead_s

    def step(self, work: list[tuple[int, int]]) -> StepCost:
        """The cost of one step; ``work`` holds ``(context_len, new_tokens)`` per scheduled sequence."""
        for i, (context_len, new_tokens) in enumerate(work):
            if context_len < 0 or new_tokens < 1:
                raise ValueError(f"work[{i}] must be (context_len >= 0, new_tokens >= 1), "
                                 f"got {(context_len, new_tokens)}")
        new = sum(n for _, n in work)
        context = sum(c for c, _ in work)
        pairs = sum(n * c + n * (n + 1) / 2 for c, n in work)
        moved = self.model.weight_bytes + (context + new) * self.kv_bytes_per_token if work else 0.0
        flops = self.model.flops_per_token * new + self.model.attention_flops_per_pair * pairs
        memory_time = moved / self.device.memory_bandwidth
        compute_time = flops / self.device.peak_flops
        time = max(memory_time, compute_time) + (self.overhead_s if work else 0.0)
        return StepCost(time, moved, flops, memory_time, compute_time)

    def decode_step_time(self, batch_size: int, context_len: int) -> float:
        """One decode step of ``batch_size`` sequences that each hold ``context_len`` tokens."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if not isinstance(context_len, int) or context_len < 0:
            raise ValueError(f"context_len must be an integer >= 0, got {context_len!r}")
        return self.time_from_sums(batch_size, batch_size * context_len, batch_size * (context_len + 1))

    def prefill_time(self, prompt_len: int, chunk: int | None = None) -> float:
        """Time to prefill one prompt alone, in chunks of ``chunk`` tokens (default: one step)."""
        if not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"prompt_len must be an integer >= 1, got {prompt_len!r}")
        chunk = prompt_len if chunk is None else chunk
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
        total, done = 0.0, 0
        while done < prompt_len:
            n = min(chunk, prompt_len - done)
            total += self.time_from_sums(n, done, n * done + n * (n + 1) / 2)
            done += n
        return total

    def breakeven_batch(self, context_len: int) -> float:
        """The decode batch at which the history read equals the weight read.

        Below it, adding a sequence costs little (the weights dominate); above
        it, every sequence adds its own history to every step.
        """
        return self.model.weight_bytes / max(1, context_len * self.kv_bytes_per_token)

    def memory_bound_step(self, num_new_tokens: int, num_context_tokens: int) -> float:
        """The memory side alone (for teaching plots)."""
        moved = self.model.weight_bytes + (num_context_tokens + num_new_tokens) * self.kv_bytes_per_token
        return moved / self.device.memory_bandwidth

