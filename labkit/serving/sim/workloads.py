"""Synthetic serving workloads: who arrives when, with how long a prompt and answer (chapter 06).

A capacity formula says how many sequences *fit*; how fast they are *served*
depends on the traffic. A workload here is a list of :class:`RequestSpec`: an
arrival time, the prompt's token ids and how many tokens the answer will have.

* **Arrivals** follow a Poisson process: independent requests at an average
  ``arrival_rate`` per second, so the gaps between them are exponential.
* **Lengths** are drawn from a log-normal distribution. Real prompt and answer
  lengths are positive and right-skewed: most are short, a few are very long
  (ShareGPT conversations run from a few tokens to thousands). A log-normal has
  exactly that shape with two parameters; we fix its *mean* to the dataset
  means the PagedAttention paper reports (ShareGPT 161.31 prompt / 337.99
  output tokens, Alpaca 19.31 / 58.45) and choose its *spread* ``sigma``
  ourselves (the paper shows histograms, not parameters): an assumption, stated.
  Each length is clipped to ``max_prompt_len`` / ``max_output_len`` (1,024 for
  ShareGPT-like), so a request fits a 2,048-token context: the book's choice, not
  a property of the paper's traces. vLLM's serving benchmark does something
  different: it *drops* ShareGPT samples (it never clips them) whose prompt or
  output is under 4 tokens, whose prompt is over 1,024 tokens, or whose prompt
  plus output is over 2,048 (``vllm/benchmarks/datasets/datasets.py:
  is_valid_sequence``, called by ``ShareGPTDataset.sample``; vLLM 0.33.0). Clipping
  piles long samples up at the limit; dropping removes them. So our lengths are
  not vLLM's benchmark lengths.
* **Shared prefixes**: a share of requests can start with the same document
  (the same token ids), the case chapter 04's prefix cache serves.

Token ids are random, except that requests sharing a prefix share its ids
exactly: reuse needs the *identical* token prefix, not similar text.
Everything is seeded: the same arguments give the same workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ...checks import check_int, check_number, check_token_ids
from ...model.pretrained import chat_token_ids
from .percentiles import QUANTILES, percentile

__all__ = ["RequestSpec", "check_specs", "check_rng", "LengthProfile", "SHAREGPT", "ALPACA", "PROFILES",
           "poisson_arrivals", "make_workload", "sharegpt_like", "alpaca_like", "long_document_questions",
           "distinct_short_requests", "length_stats", "chat_requests"]

VOCAB_SIZE = 32000


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: when it arrives, its prompt, and how long its answer will be.

    ``arrival_time`` is in seconds on the workload's clock, finite and >= 0 (the first request of a
    Poisson workload arrives at 0). ``output_len`` plays the part of the moment the model emits its
    end-of-sequence token: the simulator stops the request after that many new tokens.
    ``prefix_len`` is how many leading prompt tokens it shares with other requests.
    Every field is checked here, when the spec is built, so that no loop that waits for an arrival
    (the simulator's, ``serve_in_real_time``'s) ever sees a NaN, infinite or negative time.
    """

    request_id: int
    arrival_time: float
    prompt_token_ids: list[int] = field(repr=False)
    output_len: int
    prefix_len: int = 0

    def __post_init__(self) -> None:
        check_int("request_id", self.request_id, 0)
        check_number("arrival_time", self.arrival_time, 0, finite=True)
        check_token_ids("prompt_token_ids", self.prompt_token_ids, min_len=1)
        check_int("output_len", self.output_len, 1)
        if check_int("prefix_len", self.prefix_len, 0) > len(self.prompt_token_ids):
            raise ValueError(f"prefix_len must be in [0, {len(self.prompt_token_ids)}] (the prompt's length), "
                             f"got {self.prefix_len}")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def check_specs(name: str, specs: object) -> list[RequestSpec]:
    """``specs`` as a list: a list or tuple of at least one ``RequestSpec``, else ValueError naming ``name``."""
    if not isinstance(specs, (list, tuple)) or not specs:
        raise ValueError(f"{name} must be a list of at least one RequestSpec, got {specs!r:.60}")
    bad = next((s for s in specs if not isinstance(s, RequestSpec)), None)
    if bad is not None:
        raise ValueError(f"{name} must hold RequestSpec objects, got {type(bad).__name__}")
    return list(specs)


@dataclass(frozen=True)
class LengthProfile:
    """Log-normal prompt and output lengths with given means, clipped to ``[1, max_len]``.

    The means are the targets; ``sigma_*`` is the spread of ``log(length)``.
    """

    name: str
    prompt_mean: float
    output_mean: float
    prompt_sigma: float
    output_sigma: float
    max_prompt_len: int = 1024
    max_output_len: int = 1024
    source: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        for name in ("prompt_mean", "output_mean", "prompt_sigma", "output_sigma"):
            value = check_number(name, getattr(self, name), 0, strict=True)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name, mean in (("max_prompt_len", self.prompt_mean), ("max_output_len", self.output_mean)):
            if check_int(name, getattr(self, name), 1) < mean:
                raise ValueError(f"{name} must be at least the mean it clips ({mean}), got {getattr(self, name)}")

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` prompt lengths and ``n`` output lengths (int64 arrays)."""
        check_int("n", n, 0)
        check_rng(rng)
        prompts = _lognormal_lengths(n, self.prompt_mean, self.prompt_sigma, self.max_prompt_len, rng)
        outputs = _lognormal_lengths(n, self.output_mean, self.output_sigma, self.max_output_len, rng)
        return prompts, outputs


SHAREGPT = LengthProfile(
    "ShareGPT-like", prompt_mean=161.31, output_mean=337.99, prompt_sigma=1.0, output_sigma=0.9,
    source="means from the PagedAttention paper (Kwon et al. 2023, ShareGPT); log-normal spreads assumed; "
           "prompt and output each clipped to 1,024 so a request fits a 2,048-token context (the book's "
           "choice; vLLM's benchmark instead drops samples with prompt or output < 4, prompt > 1,024 "
           "or prompt + output > 2,048 tokens)")
ALPACA = LengthProfile(
    "Alpaca-like", prompt_mean=19.31, output_mean=58.45, prompt_sigma=0.6, output_sigma=0.8,
    source="means from the PagedAttention paper (Kwon et al. 2023, Alpaca); log-normal spreads assumed")
PROFILES = {p.name: p for p in (SHAREGPT, ALPACA)}


def check_rng(rng: object) -> np.random.Generator:
    """``rng`` if it is a NumPy ``Generator``, else TypeError: the seeded source of every draw here."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), "
                        f"got {type(rng).__name__}")
    return rng


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _clipped_lognormal_mean(mu: float, sigma: float, upper: float) -> float:
    """E[min(X, upper)] for X ~ LogNormal(mu, sigma): the mean after clipping long samples."""
    log_upper = math.log(upper)
    below = math.exp(mu + sigma**2 / 2) * _normal_cdf((log_upper - mu - sigma**2) / sigma)
    return below + upper * (1.0 - _normal_cdf((log_upper - mu) / sigma))


def _mu_for_mean(mean: float, sigma: float, upper: float) -> float:
    """The log-mean ``mu`` whose clipped log-normal has the given mean (bisection)."""
    lo, hi = -10.0, math.log(upper) + 10 * sigma
    for _ in range(100):
        mid = (lo + hi) / 2
        if _clipped_lognormal_mean(mid, sigma, upper) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _lognormal_lengths(n: int, mean: float, sigma: float, upper: int, rng: np.random.Generator) -> np.ndarray:
    # Rounding to whole tokens shifts the mean by well under one token; clipping is accounted for.
    mu = _mu_for_mean(mean, sigma, upper)
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), 1, upper).astype(np.int64)


def poisson_arrivals(num_requests: int, arrival_rate: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (seconds) of a Poisson process: exponential gaps of mean ``1 / arrival_rate``.

    The first request arrives at time 0.
    """
    num_requests = check_int("num_requests", num_requests, 0)
    arrival_rate = check_number("arrival_rate", arrival_rate, 0, strict=True)
    gaps = check_rng(rng).exponential(1.0 / arrival_rate, size=num_requests)
    if num_requests:
        gaps[0] = 0.0
    return np.cumsum(gaps)


def make_workload(num_requests: int, arrival_rate: float, lengths: LengthProfile | str = SHAREGPT, *,
                  shared_prefix_len: int = 0, prefix_share: float = 0.0, num_prefixes: int = 1, seed: int = 0,
                  vocab_size: int = VOCAB_SIZE) -> list[RequestSpec]:
    """A seeded workload of ``num_requests`` Poisson arrivals.

    Each request's own prompt and output lengths come from ``lengths``. A share
    ``prefix_share`` of the requests (chosen at random) put a common document of
    ``shared_prefix_len`` tokens in front of their own prompt: one of
    ``num_prefixes`` different documents, picked at random.
    """
    if isinstance(lengths, str):
        if lengths not in PROFILES:
            raise ValueError(f"lengths must be one of {sorted(PROFILES)} or a LengthProfile, got {lengths!r}")
        lengths = PROFILES[lengths]
    if not isinstance(lengths, LengthProfile):
        raise TypeError(f"lengths must be a LengthProfile or one of {sorted(PROFILES)}, got {type(lengths).__name__}")
    check_int("seed", seed, 0)
    num_requests = check_int("num_requests", num_requests, 0)
    arrival_rate = check_number("arrival_rate", arrival_rate, 0, strict=True)
    shared_prefix_len = check_int("shared_prefix_len", shared_prefix_len, 0)
    num_prefixes = check_int("num_prefixes", num_prefixes, 1)
    vocab_size = check_int("vocab_size", vocab_size, 2)
    if isinstance(prefix_share, bool) or not isinstance(prefix_share, (int, float)) or not 0 <= prefix_share <= 1:
        raise ValueError(f"prefix_share must be a number in [0, 1], got {prefix_share!r}")
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(num_requests, arrival_rate, rng)
    prompt_lens, output_lens = lengths.sample(num_requests, rng)
    shares = rng.random(num_requests) < prefix_share
    documents = [rng.integers(1, vocab_size, size=shared_prefix_len).tolist() for _ in range(num_prefixes)]
    which = rng.integers(0, num_prefixes, size=num_requests)
    # One draw for all private prompt tokens keeps generation fast for 10,000 requests.
    private = rng.integers(1, vocab_size, size=int(prompt_lens.sum())).tolist()
    requests, start = [], 0
    for i in range(num_requests):
        own = private[start:start + int(prompt_lens[i])]
        start += int(prompt_lens[i])
        prefix = documents[which[i]] if shares[i] else []
        requests.append(RequestSpec(i, float(arrivals[i]), prefix + own, int(output_lens[i]), len(prefix)))
    return requests


def sharegpt_like(num_requests: int, arrival_rate: float, seed: int = 0) -> list[RequestSpec]:
    """Chat-like traffic: ShareGPT-like lengths, no shared prefix."""
    return make_workload(num_requests, arrival_rate, SHAREGPT, seed=seed)


def alpaca_like(num_requests: int, arrival_rate: float, seed: int = 0) -> list[RequestSpec]:
    """Instruction-like traffic: short Alpaca-like prompts and answers, no shared prefix."""
    return make_workload(num_requests, arrival_rate, ALPACA, seed=seed)


# Questions about a document and their answers: short (an assumption, like the spreads above).
QUESTIONS = LengthProfile("questions about a document", prompt_mean=32, output_mean=128, prompt_sigma=0.5,
                          output_sigma=0.6, max_prompt_len=256, max_output_len=512,
                          source="assumed: short questions, paragraph-long answers")
SHORT = LengthProfile("distinct short requests", prompt_mean=48, output_mean=48, prompt_sigma=0.5,
                      output_sigma=0.6, max_prompt_len=256, max_output_len=256,
                      source="assumed: short, unrelated prompts and answers")


def long_document_questions(num_requests: int, arrival_rate: float, document_len: int = 4096,
                            num_documents: int = 1, seed: int = 0) -> list[RequestSpec]:
    """Many questions about a few long documents: every prompt starts with one of ``num_documents``
    documents of ``document_len`` tokens, then a short question."""
    return make_workload(num_requests, arrival_rate, QUESTIONS, shared_prefix_len=document_len, prefix_share=1.0,
                         num_prefixes=num_documents, seed=seed)


def distinct_short_requests(num_requests: int, arrival_rate: float, seed: int = 0) -> list[RequestSpec]:
    """Many short requests that share nothing."""
    return make_workload(num_requests, arrival_rate, SHORT, seed=seed)


def length_stats(requests: list[RequestSpec]) -> dict[str, float]:
    """Mean and p50/p90/p99 of prompt and output lengths: keep them beside every latency figure."""
    check_specs("requests", requests)
    prompts = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.output_len for r in requests])
    stats: dict[str, float] = {}
    for name, values in (("prompt", prompts), ("output", outputs)):
        stats[f"{name}_mean"] = float(values.mean())
        for q in QUANTILES:
            stats[f"{name}_p{q}"] = percentile(values, q)
    return stats


# --------------------------------------------------------------------------- appendix A6: real chat requests

CHAT_SYSTEM = "You are a helpful assistant. Answer in one short sentence."
CHAT_ASKS = ["What is the capital of France?", "Name three primary colours.", "What does a CPU do?",
             "How do you say hello in Spanish?", "Why is the sky blue?", "Who wrote Hamlet?",
             "What is water made of?", "How far away is the Moon?", "What is a GPU?", "Why do cats purr?",
             "What is DNA?", "What is gravity?", "What is a volcano?", "Why do leaves fall?"]


def chat_requests(tokenizer) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """Appendix A6's test workload on the real model: 14 short chat questions (token ids from
    ``tokenizer``'s chat template) with replies of 8 to 24 tokens (seeded). The first 6 arrive at once,
    to compare two token budgets on; the other 8 arrive as a Poisson stream at 5 requests/s, to test the
    fitted simulator's prediction on. Neither set is what the simulator is fitted to (A6 fits it to the
    chosen steps of ``labkit.serving.sim.measure.measure_step_grid``)."""
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise TypeError(f"tokenizer must be a transformers tokenizer with a chat template "
                        f"(labkit.model.pretrained.load_tokenizer), got {type(tokenizer).__name__}")
    chat = [chat_token_ids(tokenizer, [{"role": "system", "content": CHAT_SYSTEM}, {"role": "user", "content": q}])
            for q in CHAT_ASKS]
    lengths = np.random.default_rng(0).integers(8, 25, len(CHAT_ASKS)).tolist()
    arrivals = poisson_arrivals(8, 5.0, np.random.default_rng(1))
    fit_specs = [RequestSpec(i, 0.0, chat[i], lengths[i]) for i in range(6)]
    test_specs = [RequestSpec(i, float(arrivals[i - 6]), chat[i], lengths[i]) for i in range(6, 14)]
    return fit_specs, test_specs
