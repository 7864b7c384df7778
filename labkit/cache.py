"""A contiguous KV cache that grows as tokens are processed (chapter 01).

During *prefill* the model processes the whole prompt at once and every layer
stores the prompt's keys and values. During *decode* each step feeds a single
new token: its query attends over everything stored, then its own K and V are
appended. Earlier positions never see later tokens (causal attention), so the
stored K and V never change: they can be kept instead of recomputed.

The price is memory: per layer, K and V of shape [batch, seq_len, Hkv, D].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_int
from .model import Decoder, DecoderConfig, causal_attention


class KVCache:
    """Per-layer K and V tensors [batch, seq_len, num_key_value_heads, head_dim], grown by concatenation.

    Implements the one method ``Decoder.forward`` asks of a cache: ``attend``.
    """

    def __init__(self, config: DecoderConfig):
        self.config = config
        self.k: list[torch.Tensor | None] = [None] * config.num_hidden_layers
        self.v: list[torch.Tensor | None] = [None] * config.num_hidden_layers

    @property
    def seq_len(self) -> int:
        """Tokens stored so far (read from the last layer, which is written last)."""
        last = self.k[-1]
        return 0 if last is None else last.shape[1]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append this layer's new K, V; attend ``q`` over every stored position."""
        cfg = self.config
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < cfg.num_hidden_layers:
            raise ValueError(f"layer_idx must be an integer in [0, {cfg.num_hidden_layers - 1}], got {layer_idx!r}")
        expected = (cfg.num_key_value_heads, cfg.head_dim)
        if k.dim() != 4 or tuple(k.shape[2:]) != expected or k.shape != v.shape:
            raise ValueError(f"k and v must be [batch, new, {expected[0]}, {expected[1]}], "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        stored = self.k[layer_idx]
        if stored is not None and stored.shape[0] != k.shape[0]:
            raise ValueError(f"k and v must have the cache's batch size {stored.shape[0]}, got {k.shape[0]}")
        if self.k[layer_idx] is None:
            self.k[layer_idx], self.v[layer_idx] = k, v
        else:
            self.k[layer_idx] = torch.cat([self.k[layer_idx], k], dim=1)
            self.v[layer_idx] = torch.cat([self.v[layer_idx], v], dim=1)
        return causal_attention(q, self.k[layer_idx], self.v[layer_idx])

    @property
    def nbytes(self) -> int:
        """Bytes held by all stored K and V tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


@dataclass
class Generation:
    """Greedy generation: the new tokens and the logits that chose each of them."""

    tokens: list[int]
    logits: torch.Tensor  # [max_new_tokens, vocab_size]
    cache_tokens: int  # positions held in the KV cache at the end (0 without a cache)


@torch.no_grad()
def generate(model: Decoder, prompt_ids: list[int], max_new_tokens: int, use_cache: bool = True) -> Generation:
    """Greedy decoding of one sequence.

    With ``use_cache`` the prompt is prefilled once and every later step feeds one
    token. Without it, every step recomputes the whole sequence from scratch: the
    same tokens, at a cost that grows with the square of the length.
    """
    check_int("max_new_tokens", max_new_tokens, 1)
    if len(prompt_ids) < 1:
        raise ValueError("prompt_ids must hold at least one token")
    device = model.lm_head.weight.device
    cache = KVCache(model.config) if use_cache else None
    tokens = list(prompt_ids)
    feed = tokens  # prefill: the whole prompt
    all_logits = []
    for _ in range(max_new_tokens):
        ids = torch.tensor([feed], device=device)
        logits = model(ids, cache=cache)[0, -1]
        all_logits.append(logits)
        tokens.append(int(logits.argmax()))
        feed = tokens[-1:] if use_cache else tokens  # decode: one token, or everything again
    return Generation(tokens[len(prompt_ids):], torch.stack(all_logits), cache.seq_len if cache else 0)
