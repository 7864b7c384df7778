"""Mooncake's public conversation trace, read into the simulator's requests (chapter 07).

Kimi's Mooncake team published request traces with their FAST '25 paper (Qin et al., "Mooncake:
Trading More Storage for Less Computation"; github.com/kvcache-ai/Mooncake, ``FAST25-release/``,
Apache-2.0). labkit ships the conversation trace, gzipped and unchanged
(``labkit/data/mooncake_conversation_trace.jsonl.gz``): 12,031 requests from one hour of Kimi's
chat service. A line is one request::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is its arrival in milliseconds; ``hash_ids`` name its prompt's 512-token blocks, the
last one possibly partial. The ids are prefix names, as a block hash chain's are: two prompts whose
first ``k`` ids are equal share their first ``k`` blocks of tokens. The text itself is not published.

**Tokens from ids.** ``read_mooncake_trace`` turns each request into a ``RequestSpec`` whose prompt
has ``input_length`` token ids, built block by block from the ids (``block_token_ids``): equal ids
give equal tokens and different ids different tokens, in every aligned run of two or more tokens.
So labkit's own hash chain, at 512 tokens a block or at any even block size that divides 512 (the
book's 16 among them), finds exactly the reuse the trace encodes, no more and no less
(``tests/test_cluster.py`` checks both).

**The paper's Fig. 9** plots the prefix-cache hit rate against the cache's capacity in tokens, for
one LRU cache that sees the requests in order and nothing else. ``lru_hit_rates`` computes that
curve from the ids alone; ``FIG9_CONVERSATION`` holds the paper's own curve for this workload.
"""

from __future__ import annotations

import gzip
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ...checks import check_int, check_number
from .workloads import VOCAB_SIZE, RequestSpec

__all__ = ["TRACE_PATH", "TRACE_BLOCK_SIZE", "TraceRequest", "read_trace", "block_token_ids", "trace_prompt",
           "conversation_key", "sample_conversations", "read_mooncake_trace", "trace_reuse", "lru_hit_rates", "FIG9_CONVERSATION", "FIG9_SOURCE"]

TRACE_PATH = Path(__file__).resolve().parents[2] / "data" / "mooncake_conversation_trace.jsonl.gz"
TRACE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's traces

# The paper's Fig. 9, "Conversation" curve: (cache capacity in tokens, hit rate). Read off the figure's
# vector paths in Mooncake-FAST25.pdf (page 11): the x axis placed by its 10^4 and 10^9 ticks, the y axis by
# the centres of its 0.0 and 0.6 labels, so each value is good to about +-0.003.
FIG9_CONVERSATION: tuple[tuple[float, float], ...] = (
    (1e4, 0.047), (1e5, 0.075), (1e6, 0.089), (2e6, 0.122), (4e6, 0.217), (5e6, 0.249), (8e6, 0.302),
    (1e7, 0.328), (5e7, 0.400), (1e8, 0.403), (5e8, 0.403), (1e9, 0.403))
FIG9_SOURCE = ("Qin et al., Mooncake (FAST '25), Fig. 9, the Conversation curve, read off the PDF's vector paths "
               "(about +-0.003)")


@dataclass(frozen=True)
class TraceRequest:
    """One line of a Mooncake trace, checked: arrival ``timestamp_ms``, ``input_length`` and
    ``output_length`` in tokens, and ``hash_ids``, one per ``block_size`` tokens of the prompt (the last
    one may cover a partial block, so ``len(hash_ids) == ceil(input_length / block_size)``)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _parse(line: str, where: str, block_size: int) -> TraceRequest:
    try:
        raw = json.loads(line)
        ids = tuple(raw["hash_ids"])
        req = TraceRequest(float(raw["timestamp"]), raw["input_length"], raw["output_length"], ids)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{where}: not a trace request ({err})") from None
    check_number(f"{where} timestamp", req.timestamp_ms, 0, finite=True)
    check_int(f"{where} input_length", req.input_length, 1)
    check_int(f"{where} output_length", req.output_length, 1)
    if set(map(type, ids)) != {int} or min(ids) < 0:
        raise ValueError(f"{where} hash_ids must be a non-empty list of integers >= 0")
    if len(ids) != -(-req.input_length // block_size):
        raise ValueError(f"{where}: {len(ids)} hash_ids for {req.input_length} tokens; blocks of {block_size} "
                         f"need {-(-req.input_length // block_size)}")
    return req


def read_trace(path: str | Path | None = None, *, block_size: int = TRACE_BLOCK_SIZE,
               limit: int | None = None) -> list[TraceRequest]:
    """The requests of a Mooncake-format trace (``.jsonl`` or ``.jsonl.gz``; default: the shipped
    conversation trace), in file order, the first ``limit`` of them. Each line is checked; a bad one is
    a ValueError naming its line number. ``block_size``: tokens per hash id (512 in Mooncake's traces)."""
    check_int("block_size", block_size, 1)
    if limit is not None:
        check_int("limit", limit, 1)
    path = Path(TRACE_PATH if path is None else path)
    if not path.is_file():
        raise ValueError(f"path must be a trace file, {str(path)!r} is not a file")
    opener = gzip.open if path.suffix == ".gz" else open
    requests: list[TraceRequest] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(requests) == limit:
                break
            if line.strip():
                requests.append(_parse(line, f"{path.name} line {number}", block_size))
    if not requests:
        raise ValueError(f"path {str(path)!r} holds no requests")
    return requests


def block_token_ids(hash_id: int, block_size: int = TRACE_BLOCK_SIZE) -> list[int]:
    """The ``block_size`` token ids that stand for the block named ``hash_id``: the id written in base
    ``VOCAB_SIZE`` as two digits, repeated. Every aligned pair of tokens spells the id, so two different
    ids differ in every aligned run of two or more tokens (ids below ``VOCAB_SIZE ** 2``, about 10^9)."""
    check_int("hash_id", hash_id, 0)
    check_int("block_size", block_size, 1)
    if hash_id >= VOCAB_SIZE ** 2:
        raise ValueError(f"hash_id must be < {VOCAB_SIZE ** 2} (two tokens of {VOCAB_SIZE}), got {hash_id}")
    pair = [hash_id % VOCAB_SIZE, hash_id // VOCAB_SIZE]
    return (pair * (block_size // 2 + 1))[:block_size]


def trace_prompt(request: TraceRequest, block_size: int = TRACE_BLOCK_SIZE) -> list[int]:
    """The prompt's ``input_length`` token ids, block after block (``block_token_ids``)."""
    tokens: list[int] = []
    for h in request.hash_ids:
        tokens += block_token_ids(h, block_size)
    return tokens[:request.input_length]


def conversation_key(request: TraceRequest) -> int:
    """The id of the prompt's second block (its first, if it has one): the first block is mostly the
    service's system prompt, shared by thousands of requests; the second starts the conversation, and a
    later turn, which repeats the conversation so far, repeats it."""
    return request.hash_ids[1] if len(request.hash_ids) > 1 else request.hash_ids[0]


def sample_conversations(trace: Sequence[TraceRequest], one_in: int) -> list[TraceRequest]:
    """The requests of one conversation in ``one_in`` (those whose ``conversation_key`` is a multiple of
    ``one_in``), at their own times: 1/one_in of the load with the same turns and the same gaps between
    them, so the same reuse a conversation has with itself."""
    check_int("one_in", one_in, 1)
    return [r for r in trace if conversation_key(r) % one_in == 0]


def read_mooncake_trace(path: str | Path | None = None, block_size: int = TRACE_BLOCK_SIZE, *,
                        limit: int | None = None, one_in: int = 1, time_scale: float = 1.0,
                        max_output_len: int | None = None) -> list[RequestSpec]:
    """The trace as the simulator's ``RequestSpec`` list, the first ``limit`` lines, one conversation in
    ``one_in`` of them (``sample_conversations``): ``request_id`` its place in that list (from 0),
    ``arrival_time`` its timestamp in seconds times ``time_scale`` (2 spreads the same requests over
    twice the time: half the load), its prompt from ``trace_prompt`` and its ``output_length``, capped
    at ``max_output_len`` when given. ``prefix_len``: the tokens of its leading blocks that an earlier
    request of the trace also had (``trace_reuse``). ``block_size``: tokens per hash id."""
    check_number("time_scale", time_scale, 0, strict=True, finite=True)
    if max_output_len is not None:
        check_int("max_output_len", max_output_len, 1)
    trace = sample_conversations(read_trace(path, block_size=block_size, limit=limit), one_in)
    if not trace:
        raise ValueError(f"one_in={one_in} keeps no request of the {limit or 'whole'} trace")
    reused = trace_reuse(trace, block_size)
    cap = max_output_len or max(r.output_length for r in trace)
    return [RequestSpec(i, r.timestamp_ms / 1000 * time_scale, trace_prompt(r, block_size),
                        min(r.output_length, cap), prefix_len=reused[i])
            for i, r in enumerate(trace)]


def trace_reuse(trace: Sequence[TraceRequest], block_size: int = TRACE_BLOCK_SIZE) -> list[int]:
    """Per request, the prompt tokens it shares with an earlier request: its leading blocks whose ids
    appeared before, times ``block_size``, at most its ``input_length``. What a cache that never forgets
    could serve, before vLLM's rule that the last prompt token is always computed."""
    seen: set[int] = set()
    reused = []
    for r in trace:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen:
            k += 1
        reused.append(min(k * block_size, r.input_length))
        seen.update(r.hash_ids)
    return reused


def lru_hit_rates(trace: Sequence[TraceRequest], capacities_tokens: Sequence[float],
                  block_size: int = TRACE_BLOCK_SIZE) -> list[float]:
    """The paper's Fig. 9 on ``trace``: for each cache capacity (tokens), the share of prompt tokens found
    in one LRU prefix cache that sees the requests in order, with no time and no other memory.

    As vLLM's cache: a request hits its leading full blocks that the cache holds, leaving its last prompt
    token to compute; then its full blocks are the most recently used, the head most of all (vLLM frees
    a request's blocks tail first, so its tail goes first); the least recently used blocks go until the
    cache holds ``capacity // block_size`` blocks. A partial last block is never named.
    """
    if not isinstance(trace, (list, tuple)) or not trace or not all(isinstance(r, TraceRequest) for r in trace):
        raise ValueError("trace must be a non-empty list of TraceRequest (from read_trace)")
    if not isinstance(capacities_tokens, (list, tuple)) or not capacities_tokens:
        raise ValueError("capacities_tokens must be a non-empty list of capacities in tokens")
    check_int("block_size", block_size, 1)
    for c in capacities_tokens:
        check_number("capacities_tokens", c, block_size, finite=True)
    total = sum(r.input_length for r in trace)
    rates = []
    for capacity in capacities_tokens:
        cache: OrderedDict[int, None] = OrderedDict()
        limit, hits = int(capacity // block_size), 0
        for r in trace:
            full = r.input_length // block_size
            k = 0
            while k < (r.input_length - 1) // block_size and r.hash_ids[k] in cache:
                k += 1
            hits += k * block_size
            for h in reversed(r.hash_ids[:full]):  # the tail first: the head ends up most recent
                cache[h] = None
                cache.move_to_end(h)
            while len(cache) > limit:
                cache.popitem(last=False)
        rates.append(hits / total)
    return rates
