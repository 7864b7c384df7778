"""A small Llama-architecture decoder (chapter 01).

Everything a Llama-family model does per token, in about 200 lines:

* ``RMSNorm`` before attention and before the MLP,
* rotary position embeddings (RoPE) applied to queries and keys,
* grouped-query attention (GQA): ``num_attention_heads`` query heads share
  ``num_key_value_heads`` K/V heads, so the KV cache stores only the KV heads,
* a SwiGLU MLP.

Config field names and ``state_dict`` keys follow a Hugging Face Llama
checkpoint (``model.layers.0.self_attn.q_proj.weight`` ...), so real
Llama-family weights in Hugging Face format load with
``Decoder(DecoderConfig.from_dict(config_json)).load_state_dict(state_dict)``
(plain RoPE only: Llama 3.1's scaled RoPE is refused, not silently mis-computed).

Attention is where the KV cache lives. ``Decoder.forward`` takes an optional
``cache`` object with one method, ``cache.attend(layer_idx, q, k, v)``: it stores
the new keys and values of that layer and returns the attention output against
*all* stored positions. Chapter 01's contiguous cache and chapter 03's paged
cache are two implementations of that one method.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .checks import check_int


@dataclass
class DecoderConfig:
    """Shape of the decoder, with the field names of a Llama ``config.json``."""

    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads, as Llama does
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            check_int(name, getattr(self, name), 1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}): each KV head serves a whole group of query heads")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must divide evenly by num_attention_heads "
                                 f"({self.num_attention_heads}) when head_dim is not given")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be an even integer >= 2 (RoPE rotates pairs), got {self.head_dim!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")

    @property
    def group_size(self) -> int:
        """How many query heads share one KV head (1 = multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "DecoderConfig":
        """Build from a Llama-style ``config.json`` dict; unknown keys are ignored.

        Features this small decoder does not implement are refused rather than
        silently ignored, since they would change the outputs: scaled RoPE (Llama 3.1's
        ``rope_scaling``), projection biases, and activations other than SiLU. Newer
        configs keep the RoPE base in ``rope_parameters``; both spellings are read.
        """
        rope = dict(config.get("rope_parameters") or {})
        scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling:
            raise ValueError(f"rope_scaling={scaling!r} is not supported: only plain RoPE (rope_type 'default')")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias must be false: this decoder has no projection biases")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {config['hidden_act']!r}")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in known}
        if "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        if kwargs.get("num_key_value_heads") is None and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # no GQA
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class AttentionCache(Protocol):
    """What ``Decoder.forward`` needs from a KV cache."""

    seq_len: int

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store ``k, v`` [batch, new, Hkv, D] for this layer; return attention of ``q`` [batch, new, Hq, D]
        over every stored position, causally, shaped like ``q``."""
        ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Plain attention of the last ``q.shape[1]`` positions over all ``k.shape[1]`` positions.

    q: [batch, q_len, Hq, D]; k, v: [batch, kv_len, Hkv, D] with kv_len >= q_len.
    Query i sits at absolute position ``kv_len - q_len + i`` and may see keys up to it.
    GQA: each KV head is repeated for its group of query heads. ``scale`` defaults to
    1/sqrt(D). Half-precision inputs take their softmax in float32; float64 stays float64,
    so this is also the book's high-precision reference.
    """
    q_len, kv_len = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
    k_pos = torch.arange(kv_len, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(v.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [..., head_dim] for integer ``positions`` (Llama's half-split layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq  # [..., head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of x [batch, seq, heads, D] by each position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache: AttentionCache | None) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.cfg.head_dim
        q = apply_rope(self.q_proj(x).view(b, s, -1, d), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, s, -1, d), cos, sin)
        v = self.v_proj(x).view(b, s, -1, d)
        out = causal_attention(q, k, v) if cache is None else cache.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """Holds the parts under the ``model.`` prefix of a Llama checkpoint."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    """A Llama-style decoder. ``model(input_ids)`` returns logits [batch, seq, vocab_size]."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def random(cls, config: DecoderConfig | None = None, seed: int = 0) -> "Decoder":
        """A seeded random model: the book's offline default. Runs in seconds on a CPU."""
        config = config or DecoderConfig()
        gen = torch.Generator().manual_seed(seed)
        model = cls(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                else:  # a scale that keeps activations O(1) and attention not uniform
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        return model.eval()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: AttentionCache | None = None) -> torch.Tensor:
        """Logits for every input position.

        input_ids: int [batch, seq]. positions: int [batch, seq]; by default they
        continue from ``cache.seq_len`` (0 without a cache). cache: None for a full
        pass over the whole sequence, else an object with ``attend`` (see the module docstring).
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
                torch.int32, torch.int64):
            raise ValueError(f"input_ids must be an integer tensor [batch, seq], got "
                             f"{getattr(input_ids, 'dtype', type(input_ids))} {tuple(getattr(input_ids, 'shape', ()))}")
        b, s = input_ids.shape
        if s < 1:
            raise ValueError("input_ids must hold at least one token (seq >= 1)")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size - 1}] (vocab_size)")
        if positions is None:
            start = cache.seq_len if cache is not None else 0
            positions = torch.arange(start, start + s, device=input_ids.device).expand(b, s)
        elif positions.shape != input_ids.shape:
            raise ValueError(f"positions must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(positions.shape)}")
        cfg = self.config
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache)
        return self.lm_head(self.model.norm(x))
