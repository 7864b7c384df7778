"""What a quantized KV cache costs in quality, measured on the real model (appendix A3).

The formats themselves (codes, scales, bytes per token) are ``labkit.memory.formats``. Here:

* ``calibrate_kv_scales``: per-tensor scales (vLLM's ``k_scale``, ``v_scale``) measured on sample
  text, as the tools that write fp8 checkpoints measure them (``AmaxObserver`` records each layer's
  max |K| and max |V|);
* ``relative_error``: how much a format loses on given K or V values;
* ``next_token_loss``: the model's loss on held-out text, teacher-forced through a quantized paged
  cache, and ``greedy_agreement``: how long greedy decoding stays on the 16-bit cache's track.
"""

from __future__ import annotations

import torch

from ..checks import check_flag, check_int, check_token_ids
from ..memory.blocks import blocks_needed
from ..memory.formats import KVQuant, dequantize_pool, write_quantized
from ..model.decoder import causal_attention
from .paged import PagedKVCache


class AmaxObserver:
    """A cache that stores nothing: it records max |K| and max |V| of every layer, then attends plainly.

    ``Decoder.forward`` asks a cache only for ``attend`` (and ``seq_len``), so this is all it takes to
    measure what a per-tensor scale must cover.
    """

    seq_len = 0

    def __init__(self, num_layers: int):
        self.k_amax = [0.0] * check_int("num_layers", num_layers, 1)
        self.v_amax = [0.0] * num_layers

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k_amax[layer_idx] = max(self.k_amax[layer_idx], float(k.abs().max()))
        self.v_amax[layer_idx] = max(self.v_amax[layer_idx], float(v.abs().max()))
        return causal_attention(q, k, v)


@torch.no_grad()
def calibrate_kv_scales(model, token_ids: list[int], q: KVQuant) -> tuple[list[float], list[float]]:
    """Per-tensor scales from sample text: each layer's max |K| and max |V| over ``token_ids``, over qmax.

    What a checkpoint's k_scale and v_scale are: measured once, offline, on text like the text to
    be served. Values larger than these in other text are clamped. ``q``: the per-tensor scheme the
    scales are for (``labkit.memory.formats.kv_quant("int8_per_tensor")``), whose qmax they divide by.
    """
    check_scheme(q, per_tensor=True)
    check_model_tokens(model, token_ids, 1)
    observer = AmaxObserver(model.config.num_hidden_layers)
    device = model.lm_head.weight.device
    model(torch.tensor([list(token_ids)], device=device), cache=observer)
    fix = lambda a: a / q.qmax if a > 0 else 1.0  # noqa: E731 - an all-zero layer keeps vLLM's default
    return [fix(a) for a in observer.k_amax], [fix(a) for a in observer.v_amax]


def check_scheme(q: object, per_tensor: bool = False) -> KVQuant:
    """``q`` if it is a :class:`KVQuant` (per tensor, with ``per_tensor``), else ValueError naming q."""
    if not isinstance(q, KVQuant):
        raise ValueError(f"q must be a KVQuant, e.g. formats.kv_quant('int8_per_tensor'), got {q!r}")
    if per_tensor and q.scales != "tensor":
        raise ValueError(f"q must be a per-tensor scheme (its scales are what is calibrated), got {q.name}")
    return q


def check_model_tokens(model, token_ids: object, min_len: int) -> tuple[int, ...]:
    """``token_ids`` as a tuple of at least ``min_len`` ids below the model's vocab_size, else ValueError."""
    ids = check_token_ids("token_ids", token_ids, min_len)
    vocab = model.config.vocab_size
    if ids and max(ids) >= vocab:
        raise ValueError(f"token_ids must be < {vocab} (the model's vocab_size), found {max(ids)}")
    return ids


def relative_error(x: torch.Tensor, q: KVQuant, block_size: int = 16) -> float:
    """‖dequantize(quantize(x)) − x‖ / ‖x‖ for K or V values x [tokens, Hkv, D] written in order into
    fresh blocks (per-tensor scales from x's own max |x|): how much a scheme loses on these values.

    ``x`` must hold at least one token and only finite values: one inf would make the ratio NaN.
    """
    check_scheme(q)
    if not (isinstance(x, torch.Tensor) and x.dim() == 3 and x.is_floating_point() and x.shape[0] >= 1):
        raise ValueError(f"x must be a floating-point tensor [tokens >= 1, num_kv_heads, head_dim], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if not bool(x.isfinite().all()):
        raise ValueError("x must hold finite values only (a NaN or inf makes the error NaN)")
    block_size = check_int("block_size", block_size, 1)
    tokens, heads, d = x.shape
    num_blocks = blocks_needed(tokens, block_size)
    data, scale = q.empty_pool(num_blocks, block_size, heads, d, x.device)
    if q.scales == "tensor":
        scale.fill_(float(x.abs().max()) / q.qmax or 1.0)
    write_quantized(x, data, scale, torch.arange(tokens, device=x.device), q)
    back = dequantize_pool(data, scale, q, torch.float64).reshape(-1, heads, d)[:tokens]
    return float((back - x.double()).norm() / x.double().norm().clamp_min(1e-30))



TEXTS = {"calibration": "gardiner_1921_preface.txt", "held_out": "gardiner_1921_chapter1.txt"}


def sample_text(name: str) -> str:
    """A public-domain passage shipped with labkit (``labkit/data/README.md`` says which):
    ``"calibration"`` (per-tensor scales are measured on it) or ``"held_out"`` (loss is measured on it)."""
    if name not in TEXTS:
        raise ValueError(f"name must be one of {sorted(TEXTS)}, got {name!r}")
    from importlib import resources

    return resources.files("labkit").joinpath("data", TEXTS[name]).read_text(encoding="utf-8")


@torch.no_grad()
def next_token_loss(model, token_ids: list[int], kv_cache_dtype: str = "auto", *, dtype: torch.dtype = torch.bfloat16,
                    kv_scales: tuple[list[float], list[float]] | None = None, chunk: int = 512, block_size: int = 16,
                    use_triton: bool = False) -> float:
    """Mean cross-entropy (nats per token) of each token given all before it, teacher-forced through a
    paged cache of ``kv_cache_dtype`` whose attention computes in ``dtype``.

    The text goes in ``chunk`` tokens at a time (the chunked prefill of appendix A1): each chunk's K/V are
    written to the cache first and every query reads them back from it, so every prediction sees
    the stored, quantized K/V of all earlier tokens and of its own position, as a decode step does.
    Every argument is checked first: ``token_ids`` at least 2 ids below vocab_size, ``chunk`` and
    ``block_size`` >= 1; the cache checks ``kv_cache_dtype`` and ``dtype``.
    """
    token_ids = list(check_model_tokens(model, token_ids, 2))
    chunk = check_int("chunk", chunk, 1)
    block_size = check_int("block_size", block_size, 1)
    use_triton = check_flag("use_triton", use_triton)
    n = len(token_ids)
    device = model.lm_head.weight.device
    cache = PagedKVCache(model.config, blocks_needed(n, block_size), block_size, dtype=dtype, device=device,
                         use_triton=use_triton, kv_cache_dtype=kv_cache_dtype)
    if kv_scales is not None:
        cache.set_scales(*kv_scales)
    total = 0.0
    for start in range(0, n - 1, chunk):
        ids = list(token_ids[start : start + chunk])
        targets = torch.tensor(token_ids[start + 1 : start + 1 + len(ids)], device=device)
        logits = model(torch.tensor([ids], device=device), cache=cache)[0, : len(targets)]
        total += float(torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum"))
    return total / (n - 1)


def first_divergence(reference: list[int], tokens: list[int]) -> int:
    """The index of the first token where ``tokens`` differs from ``reference``; their common length
    when one is a prefix of the other (no divergence)."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return min(len(reference), len(tokens))


def greedy_agreement(references: list[list[int]], outputs: list[list[int]]) -> tuple[float, float]:
    """How long greedy decoding stays on the reference's track: ``(share, mean first divergence)``.

    ``share``: the tokens before each output's first divergence, over all reference tokens (1.0:
    every output identical). After a divergence the two texts condition on different tokens, so
    later matches say little; they are not counted. ``mean first divergence``: its position,
    averaged over the prompts, counting an output that never diverges as its full length. Every
    reference must hold at least one token id; an output may be empty.
    """
    if not isinstance(references, (list, tuple)) or not isinstance(outputs, (list, tuple)) \
            or len(references) != len(outputs) or not references:
        raise ValueError(f"references and outputs must be equally long, non-empty lists, got "
                         f"{type(references).__name__} and {type(outputs).__name__} of "
                         f"{len(references) if hasattr(references, '__len__') else '?'} and "
                         f"{len(outputs) if hasattr(outputs, '__len__') else '?'}")
    # a reference of no tokens has nothing to agree with (and would divide by zero)
    references = [check_token_ids(f"references[{i}]", r, 1) for i, r in enumerate(references)]
    outputs = [check_token_ids(f"outputs[{i}]", o) for i, o in enumerate(outputs)]
    firsts = [first_divergence(r, o) for r, o in zip(references, outputs)]
    return sum(firsts) / sum(len(r) for r in references), sum(firsts) / len(firsts)
