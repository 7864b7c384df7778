"""A small Llama-architecture decoder (chapter 01).

Everything a Llama-family model does per token:

* ``RMSNorm`` before attention and before the MLP,
* rotary position embeddings (RoPE) applied to queries and keys,
* grouped-query attention (GQA): ``num_attention_heads`` query heads share
  ``num_key_value_heads`` K/V heads, so the KV cache stores only the KV heads,
* a SwiGLU MLP.

Config field names and ``state_dict`` keys follow a Hugging Face Llama
checkpoint (``model.layers.0.self_attn.q_proj.weight`` ...), so real weights
load as they are: ``labkit.model.pretrained.from_pretrained(path)`` reads a Hugging Face folder or
a GGUF file (``labkit.model.gguf``) into this class. (The loader lives there, not here: this module
knows nothing of files, and ``labkit.model.pretrained`` imports it, never the reverse. On a CPU in
float32 the loader then prepares the model for serving, ``labkit.model.fused``; ``prepare=False`` keeps
the modules of this file.) Two relatives
need one small addition each, and both are here: Llama 3.1/3.2's *scaled* RoPE (``rope_scaling`` of type
``llama3``, in ``rope_inv_freq``) and Qwen2's bias on the q, k and v projections
(``qkv_bias``). Anything else a config asks for is refused by
``DecoderConfig.from_dict`` with a ``ValueError`` naming the field, never
silently mis-computed.

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

from ..checks import check_flag, check_int, check_number, parse_stop_token_ids


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
    tie_word_embeddings: bool = False  # lm_head reuses embed_tokens' matrix (SmolLM2, Llama 3.2 1B)
    rope_scaling: dict[str, Any] | None = None  # Llama 3.1/3.2: {"rope_type": "llama3", "factor": 32.0, ...}
    qkv_bias: bool = False  # Qwen2: the q, k and v projections add a bias
    eos_token_id: int | list[int] | None = None  # the token(s) that end a reply; a config may list several

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
        check_number("rope_theta", self.rope_theta, 0, strict=True, finite=True)  # kept as given (int or float)
        check_number("rms_norm_eps", self.rms_norm_eps, 0, strict=True, finite=True)
        check_flag("tie_word_embeddings", self.tie_word_embeddings)  # bool("no") would tie the matrices
        check_flag("qkv_bias", self.qkv_bias)
        if self.rope_scaling is not None:
            _check_llama3_scaling(self.rope_scaling)
        parse_stop_token_ids(self.eos_token_id)  # labkit's one parser of stop ids

    @property
    def group_size(self) -> int:
        """How many query heads share one KV head (1 = multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "DecoderConfig":
        """Build from a Hugging Face ``config.json`` dict (Llama or Qwen2); unknown keys are ignored.

        Supported: ``model_type`` "llama" (``LlamaForCausalLM``: plain RoPE, Llama 3.1's
        "llama3" RoPE scaling, tied embeddings) and "qwen2" (``Qwen2ForCausalLM``: the same
        plus a bias on q, k and v). What this decoder does not compute is refused with a
        ``ValueError`` naming the config field, since ignoring it would change the outputs:
        another RoPE type, sliding-window layers, mixture-of-experts, other projection
        biases, activations other than SiLU. The RoPE fields come in two spellings: older
        configs have ``rope_theta`` and ``rope_scaling`` at the top, transformers 5 writes
        one ``rope_parameters`` dict; both are read.
        """
        for name in _MOE_FIELDS:
            if config.get(name):
                raise ValueError(f"{name}={config[name]!r}: mixture-of-experts layers are not supported")
        model_type = config.get("model_type", "llama")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(f"model_type={model_type!r} is not supported: only 'llama' (LlamaForCausalLM) "
                             f"and 'qwen2' (Qwen2ForCausalLM)")
        if config.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported: every layer must attend to the whole "
                             "sequence (sliding-window layers keep only the last `sliding_window` tokens)")
        if any(t != "full_attention" for t in config.get("layer_types") or []):
            raise ValueError(f"layer_types={config['layer_types']!r}: only 'full_attention' layers are supported")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias must be false: Llama's attention_bias also adds a bias "
                             "to o_proj, which this decoder does not have (Qwen2's q/k/v bias is supported)")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {config['hidden_act']!r}")
        if config.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor={config['partial_rotary_factor']!r}: RoPE must rotate the "
                             f"whole head (1.0)")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in known}
        kwargs["rope_theta"], kwargs["rope_scaling"] = _rope_fields(config)
        kwargs["qkv_bias"] = model_type == "qwen2" or bool(config.get("qkv_bias"))  # to_dict's own spelling
        if kwargs.get("num_key_value_heads") is None and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # no GQA
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_fields(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either spelling of a config's RoPE fields."""
    rope = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = rope.get("rope_theta", config.get("rope_theta", DecoderConfig.rope_theta))
    # older configs say "type", newer "rope_type"; a rope_scaling dict, when given, decides
    rope_type = next((d[k] for d in (scaling, rope) for k in ("rope_type", "type") if d.get(k)), "default")
    params = {k: v for k, v in {**rope, **scaling}.items() if k not in ("rope_theta", "rope_type", "type")}
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported, only 'default' (plain RoPE) "
                         f"and 'llama3' (Llama 3.1/3.2)")
    params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return theta, {"rope_type": "llama3", **{k: params.get(k) for k in _LLAMA3_KEYS}}


def _check_llama3_scaling(scaling: Any) -> None:
    """ValueError unless ``scaling`` is a complete, sensible "llama3" rope_scaling dict."""
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
        raise ValueError(f"rope_scaling must be None or a dict with rope_type 'llama3', got {scaling!r}")
    for key in _LLAMA3_KEYS:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope_scaling[{key!r}] must be a number > 0, got {value!r}")
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(f"rope_scaling: high_freq_factor ({scaling['high_freq_factor']}) must exceed "
                         f"low_freq_factor ({scaling['low_freq_factor']})")


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
    _check_attention_inputs(q, k, v, scale)
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


def _check_attention_inputs(q: object, k: object, v: object, scale: object) -> None:
    """ValueError unless q [batch, q_len, Hq, D] and k, v [batch, kv_len, Hkv, D] fit ``causal_attention``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor [batch, {'q_len' if name == 'q' else 'kv_len'}, "
                             f"heads, head_dim], got {getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"v must have k's shape and dtype [batch, kv_len, heads, head_dim] {tuple(k.shape)} "
                         f"{k.dtype}, got {tuple(v.shape)} {v.dtype}")
    b, q_len, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or hq % k.shape[2] or k.shape[1] < q_len or q.dtype != k.dtype:
        raise ValueError(f"q [batch, q_len, heads, head_dim] {tuple(q.shape)} {q.dtype} does not fit k "
                         f"{tuple(k.shape)} {k.dtype}: same batch, head_dim and dtype, heads a multiple of k's, "
                         f"kv_len >= q_len")
    if scale is not None:
        check_number("scale", scale, 0, strict=True, finite=True)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: DecoderConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """How fast each of the head_dim / 2 rotated pairs turns: ``rope_theta ** (-2i / head_dim)`` radians per position.

    Llama 3.1 stretches RoPE to a longer context ("llama3" ``rope_scaling``, computed as
    transformers' ``_compute_llama3_parameters`` does). A pair's *wavelength* is
    ``2 pi / inv_freq`` positions. Pairs that turn fast (wavelength under
    ``original_max_position_embeddings / high_freq_factor``) encode local order and are
    kept; pairs that turn slowly (wavelength over ``original / low_freq_factor``) turn
    ``factor`` times slower still, so positions beyond the original context look like ones
    seen in training; pairs in between blend the two smoothly.
    """
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d)
    if cfg.rope_scaling is None:
        return inv_freq
    s = cfg.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)  # 0 at the slow end, 1 at the fast end
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    in_between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(in_between, blended, slowed)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [..., head_dim] for integer ``positions`` (Llama's half-split layout)."""
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
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
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
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a labkit.model.decoder.DecoderConfig (DecoderConfig.from_dict for a dict), "
                            f"got {type(config).__name__}")
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def random(cls, config: DecoderConfig | None = None, seed: int = 0) -> "Decoder":
        """A seeded random model: the book's offline default. Runs in seconds on a CPU."""
        config = DecoderConfig() if config is None else config
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be None or a labkit.model.decoder.DecoderConfig, got {type(config).__name__}")
        gen = torch.Generator().manual_seed(check_int("seed", seed, 0))
        model = cls(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                else:  # a scale that keeps activations O(1) and attention not uniform
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        return model.eval()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: AttentionCache | None = None, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for every input position, or only at ``logits_indices``.

        input_ids: int [batch, seq]. positions: int [batch, seq]; by default they
        continue from ``cache.seq_len`` (0 without a cache). cache: None for a full
        pass over the whole sequence, else an object with ``attend`` (see the module docstring).
        logits_indices: int [n], positions along ``seq`` whose logits are wanted (vLLM's name);
        the result is then [batch, n, vocab]. A serving engine samples one token per request, at
        the last token of its chunk: the vocabulary projection is the largest matrix of a small
        model (49,152 x 576 for SmolLM2), and computing it at every prompt token is wasted work.
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
        elif not isinstance(positions, torch.Tensor) or positions.shape != input_ids.shape \
                or positions.dtype not in (torch.int32, torch.int64) or int(positions.min()) < 0:
            raise ValueError(f"positions must be an integer tensor >= 0 of the shape of input_ids "
                             f"{tuple(input_ids.shape)}, got {getattr(positions, 'dtype', type(positions).__name__)} "
                             f"{tuple(getattr(positions, 'shape', ()))}")
        cfg = self.config
        cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg, input_ids.device))
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache)
        if logits_indices is not None:
            x = x[:, logits_indices]
        return self.lm_head(self.model.norm(x))


# The checks of the functions that run a Decoder (the caches' ``generate`` functions): a ValueError
# naming the argument before any work.

def check_config(config: object) -> DecoderConfig:
    if not isinstance(config, DecoderConfig):
        raise ValueError(f"config must be a labkit.model.decoder.DecoderConfig, got {type(config).__name__}")
    return config


def check_decoder(model: object) -> Decoder:
    if not isinstance(model, Decoder):
        raise ValueError(f"model must be a labkit.model.decoder.Decoder, got {type(model).__name__}")
    return model


def check_vocab(tokens: tuple[int, ...], vocab_size: int, name: str = "prompt_ids") -> None:
    """Every id must name a row of the embedding table: [0, vocab_size)."""
    if tokens and max(tokens) >= vocab_size:
        bad = next(t for t in tokens if t >= vocab_size)
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size - 1}] (the model's vocab_size is "
                         f"{vocab_size}), found {bad}")
