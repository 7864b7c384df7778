"""The contiguous KV cache and greedy generation (chapter 01).

During *prefill* the model processes the whole prompt at once and every layer stores the prompt's
keys and values. During *decode* each step feeds a single new token: its own K and V are appended
first, then its query attends over everything stored, itself included. Earlier positions never see
later tokens (causal attention), so the stored K and V never change: they can be kept instead of
recomputed. The price is memory: per layer, K and V of shape [batch, seq_len, Hkv, D].

``KVCache`` implements the one method ``Decoder.forward`` asks of a cache,
``attend(layer_idx, q, k, v)``; chapters 03 and 04 store the same K and V in a pool of blocks
(``labkit.caches.paged``, ``labkit.caches.prefix_cached``) behind the same method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..checks import check_flag, check_int, check_token_ids, parse_stop_token_ids
from ..model.decoder import Decoder, DecoderConfig, causal_attention, check_config, check_decoder, check_vocab


class KVCache:
    """Per-layer K and V tensors [batch, seq_len, num_key_value_heads, head_dim], grown by concatenation.

    Implements the one method ``Decoder.forward`` asks of a cache: ``attend``.
    """

    def __init__(self, config: DecoderConfig):
        check_config(config)
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
        kv_len = k.shape[1] + (0 if stored is None else stored.shape[1])
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[1] > kv_len \
                or tuple(q.shape[2:]) != (cfg.num_attention_heads, cfg.head_dim):
            raise ValueError(f"q must be [batch, q_len, {cfg.num_attention_heads}, {cfg.head_dim}] with k's batch "
                             f"{k.shape[0]} and q_len <= the {kv_len} positions stored, "
                             f"got {tuple(getattr(q, 'shape', ()))}")
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
def generate(model: Decoder, prompt_ids: list[int], max_new_tokens: int, use_cache: bool = True,
             eos_token_id: int | Sequence[int] | None = None) -> Generation:
    """Greedy decoding of one sequence.

    With ``use_cache`` the prompt is prefilled once and every later step feeds one
    token. Without it, every step recomputes the whole sequence from scratch: the
    same tokens, at a cost that grows with the square of the length. Generation stops
    after ``max_new_tokens``, or right after a token of ``eos_token_id`` (one id or several;
    None: never early), which is kept in the output as transformers' ``generate`` keeps it.
    """
    check_decoder(model)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_vocab(check_token_ids("prompt_ids", prompt_ids, 1), model.config.vocab_size)
    check_flag("use_cache", use_cache)
    stop = set(parse_stop_token_ids(eos_token_id, vocab_size=model.config.vocab_size))
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
        if tokens[-1] in stop:
            break
        feed = tokens[-1:] if use_cache else tokens  # decode: one token, or everything again
    return Generation(tokens[len(prompt_ids):], torch.stack(all_logits), cache.seq_len if cache else 0)
