"""Fused projections: the decoder as a serving engine runs it, one multiply where chapter 01's makes two or three.

Chapter 01's attention multiplies its input by three matrices, ``q_proj``, ``k_proj`` and
``v_proj``; its MLP by two, ``gate_proj`` and ``up_proj``, before ``down_proj``. Each group reads the
same input, so its weights can be stacked by rows into one matrix, and one multiply computes them all::

    [q | k | v] = x @ [W_q; W_k; W_v]^T          [gate | up] = x @ [W_gate; W_up]^T

The arithmetic is the same, each output element the same dot product (summed in another order, as
another kernel of the library may choose); what changes is the number of multiplies a step makes, and each one on a CPU pays a fixed cost (a call, a pass over the input
rows, a pass of the library over its tiles). For SmolLM2-135M's 30 layers a step makes 121 instead
of 211. vLLM builds its Llama this way: ``LlamaAttention.qkv_proj`` is a ``QKVParallelLinear`` and
``LlamaMLP.gate_up_proj`` a ``MergedColumnParallelLinear`` (``vllm/model_executor/models/llama.py``),
and its loader stacks a checkpoint's ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
into them (``LlamaModel.hf_to_vllm_mapper``, ``orig_to_new_stacked``).

``fuse(model)`` does the same to a loaded ``Decoder``, in place: each layer's ``self_attn`` becomes a
``FusedAttention`` and its ``mlp`` a ``FusedMLP``. The attention also rotates the query and key heads
in one call (``rotate``: chapter 01's ``apply_rope`` in fewer operations), and the norms become
``FusedRMSNorm`` (the same arithmetic in fewer operations). The model's ``state_dict``
keeps the checkpoint's names (``q_proj.weight`` and the others are rows of the stacked weight, mapped
back when saved and stacked when loaded), the tied embedding is untouched, and ``unfuse(model)`` gives
back chapter 01's modules.

Why fewer operations matter on a CPU: every PyTorch operation costs a few microseconds of dispatch
before any arithmetic, more when the weights a step streams through the caches have just pushed out
the interpreter's own data, and a decode step of SmolLM2 is thousands of them. vLLM's CPU backend
runs the rotary embedding, the cache write and attention as C++ kernels; its norms and activation
are PyTorch operations, as here.

``prepare(model)`` is what the engine runs on a CPU: fused, then every multiply prepacked for oneDNN
(``labkit.model.prepack``), as vLLM's CPU backend prepares a model once after loading it. The
results equal the plain model's up to the order of float32 sums: ``tests/test_fused.py`` holds a fused
or prepared model as close to the float64 model as the plain float32 one is, within a factor of 2.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import prepack as packing
from .decoder import MLP, Attention, Decoder, DecoderConfig, RMSNorm, causal_attention, check_decoder

__all__ = ["FusedAttention", "FusedMLP", "FusedRMSNorm", "fuse", "unfuse", "is_fused", "can_prepare", "prepare",
           "unprepare", "is_prepared"]


def stack(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose weight (and bias) rows are ``parts``' weights (and biases), in order."""
    first = parts[0].weight
    bias = parts[0].bias is not None
    with torch.device("meta"):
        fused = nn.Linear(first.shape[1], sum(p.out_features for p in parts), bias=bias)
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=first.requires_grad)
        if bias:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=first.requires_grad)
    return fused


def split(fused: nn.Linear, sizes: list[int]) -> list[nn.Linear]:
    """The plain layers back from a stacked one: ``sizes`` rows each, copies of its rows."""
    weights = fused.weight.detach().split(sizes)
    biases = fused.bias.detach().split(sizes) if fused.bias is not None else [None] * len(sizes)
    parts = []
    for w, b in zip(weights, biases):
        with torch.device("meta"):
            part = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        part.weight = nn.Parameter(w.clone(), requires_grad=fused.weight.requires_grad)
        if b is not None:
            part.bias = nn.Parameter(b.clone(), requires_grad=fused.weight.requires_grad)
        parts.append(part)
    return parts


class _Stacked(nn.Module):
    """A module whose stacked layers save and load under the checkpoint's names.

    ``stacked`` maps each stacked layer's name to its parts' names, in row order, and ``sizes`` its
    rows per part. ``state_dict()`` splits ``qkv_proj.weight`` into ``q_proj.weight``, ``k_proj.weight``,
    ``v_proj.weight`` (views of its rows); ``load_state_dict`` stacks them again before loading.
    """

    stacked: dict[str, tuple[str, ...]]
    sizes: dict[str, list[int]]

    def __init__(self) -> None:
        super().__init__()
        self.register_state_dict_post_hook(_split_when_saved)
        self.register_load_state_dict_pre_hook(_stack_when_loaded)


def _split_when_saved(module: _Stacked, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for fused, parts in module.stacked.items():
        for kind in ("weight", "bias"):
            value = state_dict.pop(f"{prefix}{fused}.{kind}", None)
            if value is not None:
                for name, rows in zip(parts, value.split(module.sizes[fused])):
                    state_dict[f"{prefix}{name}.{kind}"] = rows


def _stack_when_loaded(module: _Stacked, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                       missing_keys: list, *args) -> None:
    for fused, parts in module.stacked.items():
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name in parts]
            present = [k for k in keys if k in state_dict]
            if len(present) == len(keys):
                state_dict[f"{prefix}{fused}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])
            elif present:  # the stacked rows cannot be loaded in part: the missing parts are named
                missing_keys.extend(k for k in keys if k not in state_dict)
                for k in present:
                    state_dict.pop(k)


class FusedRMSNorm(RMSNorm):
    """Chapter 01's ``RMSNorm`` in five operations: ``x / sqrt(eps + sum(x^2) / D) * weight``, the mean and the
    epsilon in one ``addcmul``. vLLM's CPU backend runs chapter 01's formula as PyTorch operations
    (``ir.ops.rms_norm``'s native implementation, ``vllm/ir/ops/layernorm.py``), the residual added in the
    same call (``fused_add_rms_norm``). Half types keep chapter 01's float32 path."""

    def __init__(self, plain: RMSNorm):
        with torch.device("meta"):
            super().__init__(plain.weight.shape[0], plain.eps)
        self.weight = w = plain.weight
        self.register_buffer("eps_tensor", torch.tensor(plain.eps, dtype=w.dtype, device=w.device), persistent=False)
        self.register_buffer("inverse_size", torch.tensor(1 / w.shape[0], dtype=w.dtype, device=w.device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float16, torch.bfloat16) or x.dtype != self.weight.dtype:
            return super().forward(x)
        mean_square = torch.addcmul(self.eps_tensor, (x * x).sum(-1, keepdim=True), self.inverse_size)
        return x * torch.rsqrt(mean_square) * self.weight

    def unfused(self) -> RMSNorm:
        with torch.device("meta"):
            plain = RMSNorm(self.weight.shape[0], self.eps)
        plain.weight = self.weight
        return plain


@functools.lru_cache(maxsize=1)
def rotation_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate``'s cos and signed sin, shaped for the heads: made once per forward pass (every layer is
    handed the same two tensors, and the cache holds them, so their identity cannot be reused)."""
    half = cos.shape[-1] // 2
    return cos[:, :, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, :, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Chapter 01's ``apply_rope`` in three operations: ``x cos + roll(x) (sign sin)``.

    Rolling the last dimension by half makes ``(x[D/2:], x[:D/2])``; with the first half's sine
    negated that is ``(-x[D/2:], x[:D/2]) sin``, the rotated pairs. vLLM's CPU backend rotates q and k in
    place with one C++ kernel (``RotaryEmbedding.forward_cpu`` calls ``ops.rotary_embedding``,
    ``vllm/model_executor/layers/rotary_embedding/base.py``).
    """
    if x.dtype in (torch.float16, torch.bfloat16):  # half types rotate in float32, as apply_rope does
        return rotate(x.float(), cos, sin).to(x.dtype)
    cos, signed_sin = rotation_tables(cos, sin)
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)


class FusedAttention(_Stacked):
    """Chapter 01's ``Attention`` with q, k and v computed by one multiply (vLLM's ``QKVParallelLinear``)."""

    def __init__(self, plain: Attention):
        super().__init__()
        self.cfg, self.layer_idx = plain.cfg, plain.layer_idx
        self.stacked = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
        self.sizes = {"qkv_proj": [plain.q_proj.out_features, plain.k_proj.out_features,
                                   plain.v_proj.out_features]}
        self.qkv_proj = stack([plain.q_proj, plain.k_proj, plain.v_proj])
        self.o_proj = plain.o_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        b, s, _ = x.shape
        d, hq, hkv = self.cfg.head_dim, self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        qkv = self.qkv_proj(x).view(b, s, hq + 2 * hkv, d)
        qk = rotate(qkv[:, :, :hq + hkv], cos, sin)  # the query and key heads rotated together
        q, k, v = qk[:, :, :hq], qk[:, :, hq:], qkv[:, :, hq + hkv:]
        out = causal_attention(q, k, v) if cache is None else cache.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(b, s, -1))

    def unfused(self) -> Attention:
        with torch.device("meta"):
            plain = Attention(self.cfg, self.layer_idx)
        plain.q_proj, plain.k_proj, plain.v_proj = split(self.qkv_proj, self.sizes["qkv_proj"])
        plain.o_proj = self.o_proj
        return plain


class FusedMLP(_Stacked):
    """Chapter 01's ``MLP`` with gate and up computed by one multiply (vLLM's ``MergedColumnParallelLinear``)."""

    def __init__(self, plain: MLP, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.stacked = {"gate_up_proj": ("gate_proj", "up_proj")}
        self.sizes = {"gate_up_proj": [plain.gate_proj.out_features, plain.up_proj.out_features]}
        self.gate_up_proj = stack([plain.gate_proj, plain.up_proj])
        self.down_proj = plain.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def unfused(self) -> MLP:
        with torch.device("meta"):
            plain = MLP(self.cfg)
        plain.gate_proj, plain.up_proj = split(self.gate_up_proj, self.sizes["gate_up_proj"])
        plain.down_proj = self.down_proj
        return plain


def _slots(model: Decoder) -> list[tuple[nn.Module, str]]:
    """Every (parent, name) whose module ``fuse`` replaces: each layer's norms, attention and MLP; the last norm."""
    names = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    return [(layer, name) for layer in model.model.layers for name in names] + [(model.model, "norm")]


def fuse(model: Decoder) -> int:
    """Fuse ``model`` in place: q/k/v and gate/up each one multiply, norms and RoPE in fewer operations; returns
    how many modules were replaced (4 per layer and the last norm; 0 when already fused).

    Raises ``ValueError`` for anything but a ``Decoder``.
    """
    check_decoder(model)
    plain = {Attention: FusedAttention, MLP: lambda m: FusedMLP(m, model.config), RMSNorm: FusedRMSNorm}
    count = 0
    for parent, name in _slots(model):
        module = getattr(parent, name)
        if type(module) in plain:
            setattr(parent, name, plain[type(module)](module))
            count += 1
    return count


def unfuse(model: Decoder) -> int:
    """Give ``model`` back chapter 01's modules (copies of the stacked rows); returns how many were replaced."""
    check_decoder(model)
    count = 0
    for parent, name in _slots(model):
        module = getattr(parent, name)
        if isinstance(module, (FusedAttention, FusedMLP, FusedRMSNorm)):
            setattr(parent, name, module.unfused())
            count += 1
    return count


def is_fused(model: Decoder) -> bool:
    """Whether any module of ``model`` is fused."""
    check_decoder(model)
    return any(isinstance(m, (FusedAttention, FusedMLP, FusedRMSNorm)) for m in model.modules())


def can_prepare(model: Decoder) -> bool:
    """Whether ``prepare`` changes ``model``: every parameter float32 on the CPU, and oneDNN available."""
    check_decoder(model)
    return packing.available() and all(p.device.type == "cpu" and p.dtype == torch.float32
                                       for p in model.parameters())


def prepare(model: Decoder) -> bool:
    """Prepare ``model`` in place as the engine runs it on a CPU: fused (``fuse``), then prepacked
    (``labkit.model.prepack.prepack``). Only a float32 model on the CPU is prepared (``can_prepare``); any
    other is left as it is and False is returned. Preparing a prepared model changes nothing.
    ``unprepare`` gives back chapter 01's modules.
    """
    if not can_prepare(model):
        return False
    fuse(model)
    packing.prepack(model)
    return True


def unprepare(model: Decoder) -> None:
    """Undo ``prepare``: plain ``nn.Linear`` layers, chapter 01's attention and MLP."""
    check_decoder(model)
    packing.unpack(model)
    unfuse(model)


def is_prepared(model: Decoder) -> bool:
    """Whether ``model`` is fused and packed (``prepare`` ran on it)."""
    return is_fused(model) and packing.is_packed(model)
