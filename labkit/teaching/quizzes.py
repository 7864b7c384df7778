"""The short quiz at the end of each chapter: its answers, and a line of feedback for each.

The questions are in the chapter; the answers are here, out of the reader's sight, with a
line that explains the right answer (printed when it is given, and in solutions/) and a line
for each wrong choice that says what it misses. A numeric answer is computed with labkit, as
every number in the book is, and accepted within its ``rel_tol``.

An answer of the wrong kind (a number for a multiple-choice question, a letter that is not one of
its choices, a string for a numeric one) gets a ❌ saying what kind was expected, and counts as
wrong. A quiz asked with something other than its question numbers is the chapter's bug: ValueError.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Question", "QUIZZES", "verdicts"]


@dataclass(frozen=True)
class Question:
    """One question: ``answer`` is a letter, or a function computing the number; ``why`` explains it;
    ``wrong`` says, for each other letter (or, for a number, each tempting wrong number), what that
    choice misses."""

    answer: str | Callable[[], float]
    why: str
    wrong: dict[str | float, str] = field(default_factory=dict)
    rel_tol: float = 0.0

    def expected(self) -> Any:
        return self.answer() if callable(self.answer) else self.answer

    @property
    def choices(self) -> tuple[str, ...]:
        """The letters of a multiple-choice question (the answer and each wrong one); () for a number."""
        return tuple(sorted({self.answer, *self.wrong})) if isinstance(self.answer, str) else ()


def _teaching_kib() -> float:
    from ..memory.capacity import TEACHING_MODEL

    return TEACHING_MODEL.bytes_per_token() / 1024


def _breakeven() -> float:
    from ..serving.sim.costmodel import CostModel

    return CostModel("teaching model", "RTX 4090 (24 GiB)").breakeven_batch(4096)


def _recompute() -> float:
    from .answers import _recompute_05

    return _recompute_05()[0]


QUIZZES: dict[str, list[Question]] = {
    "01_why_the_cache_grows": [
        Question("b", "each decode step attends over every cached position and its own: the read grows with the history.",
                 {"a": "the new token's K/V alone would ignore the context.", "c": "generated tokens are cached too."}),
        Question("a", "causal attention: position i never sees later tokens, so its K/V are final once computed.",
                 {"b": "frozen weights are not enough: bidirectional attention would change old K/V.",
                  "c": "the cached and recomputed outputs agree because the inputs agree, not because of softmax."}),
        Question(lambda: 1000 + 200 - 1, "the prompt's 1,000 positions and every reply token but the last, which is "
                                         "returned and never fed back: 1,199 (a plan reserves 1,200).",
                 {1200: "1,200 is the plan, prompt plus limit; the last reply token is never fed back (Exercise 1)."}),
        Question("b", "the cache holds activations (K and V) in the cache dtype; the weights' format does not enter.",
                 {"a": "4-bit weights shrink the file, not the K/V the model computes.",
                  "c": "the cache's element type is set by the cache dtype, not the weights'."}),
    ],
    "02_cost_per_token": [
        Question("b", "bytes per token = 2 × L × Hkv × D × b: twice the KV heads doubles it.",
                 {"a": "query heads do not enter the formula (the GQA mistake).",
                  "c": "the hidden size enters only through head_dim, held fixed here."}),
        Question("c", "the query heads are 4 times the KV heads, so each sequence is planned 4 times too big and "
                      "a quarter of what fits is admitted (section 4: 15 of 60).",
                 {"a": "a larger estimate per sequence admits fewer sequences, not more.",
                  "b": "the cache stores the KV heads only: counting the query heads overstates every sequence."}),
        Question("b", "the pool is the device minus what is set aside: 14 GiB instead of 7, so twice the sequences.",
                 {"a": "9 scales the seven with the whole device (31/24); the pool, what the 17 GiB leave, doubled.",
                  "c": "the 7 extra GiB all go to the pool."}),
        Question(_teaching_kib, "2 × 32 layers × 8 KV heads × 128 × 2 bytes = 131,072 bytes = 128 KiB."),
    ],
    "03_paging": [
        Question("b", "paging changes where K/V live and how much is held, not their size or what attention reads.",
                 {"a": "every position is stored at full precision.", "c": "every position is still read."}),
        Question(lambda: -33 % 16, "33 tokens take 3 blocks of 16 = 48 slots: 15 stay empty."),
        Question("a", "a bigger block wastes more of its last block but needs fewer block-table entries.",
                 {"b": "the tail waste grows with the block, up to block_size - 1 slots."}),
        Question("a", "first fit needs one contiguous hole; the free space is split between reservations.",
                 {"b": "a contiguous allocator has no block table."}),
    ],
    "04_prefix_reuse": [
        Question(lambda: (64 - 1) // 16 * 16, "the hit is capped at len - 1 = 63 tokens, in full blocks: 3 blocks, 48 "
                                                "tokens; the last prompt token is computed for its logits."),
        Question("b", "a block's name hashes its parent's name: a change renames its block and every block after.",
                 {"a": "the next block's name includes this one's.", "c": "blocks before the change keep their names."}),
        Question("a", "a hit skips prefill of the shared blocks and stores them once; decoding is unchanged.",
                 {"b": "every output token is still a decode step.", "c": "decode steps are not saved."}),
        Question("b", "RoPE rotates keys by position: the same tokens four places later have other keys.",
                 {"a": "the K/V depend on the position, not only on the tokens."}),
    ],
    "05_scheduler": [
        Question("b", "the article's pass skips a candidate whose blocks do not fit; a smaller one behind may fit.",
                 {"a": "the pass stops only when the token budget is spent."}),
        Question("b", "vLLM v1 preempts the last request of its running list, the latest admitted "
                      "(Scheduler.schedule: self.running.pop()), and puts it at the front of the waiting queue: "
                      "first come, first served keeps the earlier requests going. It need not lose the least "
                      "work: a new request with a long prompt can hold more computed tokens than an old one.",
                 {"a": "preempting the oldest would stall the requests that came first, against first come, "
                       "first served.",
                  "c": "length is not the rule; the order of admission is."}),
        Question(_recompute, "recompute drops every block: the prompt's 3 tokens and the 3 outputs are computed again."),
        Question("a", "admitting a long prompt by its first chunk in a tight pool gets it preempted halfway, "
                      "and its prompt computed twice.", {"b": "it costs no compute; it avoids wasted compute."}),
    ],
    "07_many_replicas": [
        Question("c", "round-robin never looks at the prompt: with many conversations interleaved, a follow-up lands "
                      "on whichever replica is next, the one holding its earlier turn about 1 time in N (here 1 in "
                      "4), and each prefix cache is private to its replica.",
                 {"a": "a replica's prefix cache is its own: the other replicas cannot serve its blocks.",
                  "b": "the next replica in turn is still the right one now and then, about 1 time in N."}),
        Question("b", "loads 10 and 200 are imbalanced (190 > 64 and 200 > 1.5 × 10): the router sends the request "
                      "to the least loaded replica, replica 0, whatever the match. A hit saves one prefill, but "
                      "behind 190 more unfinished requests the request would wait longer than the prefill takes.",
                 {"a": "the match decides only while the load is balanced; here both imbalance conditions hold.",
                  "c": "replica 2 (12) is busier than replica 0 (10): the least loaded is replica 0."}),
        Question("a", "a prefix cache serves whole blocks of identical tokens from the first one on: the block the "
                      "match ends in is computed again, and text that agrees up to a point can tokenize "
                      "differently where it stops agreeing. The cache can serve less than the text match says.",
                 {"b": "the cache names only full blocks of tokens: the partial block at the end is not served.",
                  "c": "the same text gives the same tokens up to where it differs, and those whole blocks hit."}),
    ],
    "08_moving_the_cache": [
        Question("b", "a reload moves bytes: H × bytes per token over the link, 4 times fewer with 8 KV heads than "
                      "with 32; recomputing is the same arithmetic for both. Llama-3-8B on an H100 over 100 Gb/s "
                      "RDMA: the reload pays from 977 tokens; with 4 times the bytes, from about 101,000.",
                 {"a": "more K/V per token is more bytes to move for the same arithmetic saved: the reload pays "
                       "later, not sooner.",
                  "c": "recomputing costs both the same, but reloading does not: it is bytes over the link."}),
        Question("a", "fp8 halves the bytes per token: a reload moves half the bytes, and the arithmetic of "
                      "recomputing does not change. From the NVMe drive on an H100 (Llama-3-8B) the break-even "
                      "falls from 10,970 tokens to 747.",
                 {"b": "fewer bytes make the reload cheaper, not dearer.",
                  "c": "the arithmetic is unchanged, but the reload is bytes over the link: half of them."}),
        Question("c", "the step that computes the last token reads all the weights anyway; below the ridge, 128 "
                      "more tokens ride along that read: prefix_recompute_seconds(128) is 0, where a reload over "
                      "PCIe 5.0 costs 0.28 ms.",
                 {"a": "4.8 ms is a 128-token step of its own, weight read included: the request pays that "
                       "read anyway, for its last token (the trap of the chapter's dotted line).",
                  "b": "a reload costs bytes and a latency (0.28 ms over PCIe 5.0); the extra of recomputing "
                       "128 tokens is nothing: every reload loses here."}),
        Question("b", "a slot nobody wrote holds whatever the pool held (zeros, or another request's K/V), and "
                      "nothing marks it: the decode engine attends over it as context and samples other tokens, "
                      "without an error. Claim only K/V written (vLLM PR #53314); labkit's hand_over refuses "
                      "while a step is in flight.",
                 {"a": "nothing checks the copied slots: K/V are numbers, and wrong numbers raise nothing.",
                  "c": "the decode engine computes only what was not claimed: claimed slots count as computed."}),
    ],
    "C1_your_own_engine": [
        Question("b", "a block's name hashes its parent's: once the document's blocks left with the first request, "
                      "a later block's name proves nothing about the blocks before it, so the hit stops at the gap.",
                 {"a": "the named blocks after the gap are real, but their parents' K/V are gone: the request "
                       "would attend over blocks it never computed.",
                  "c": "the pool had room; the hit is decided by names, before any block is taken."}),
        Question("a", "the step turns q and k itself, at the cache length; the model must not turn them first, "
                      "and a turn by 0 leaves them as they are.",
                 {"b": "the positions are not lost: the step takes them from the cache length.",
                  "c": "RoPE is needed: without it attention could not tell the order of the tokens."}),
        Question("a", "a block goes back to the Pager when the last request holding it finishes or is preempted, "
                      "and the Pager hands it out again: the count is of hand-outs, not of blocks.",
                 {"b": "the Pager never holds more than the pool: num_free() stays between 0 and 20.",
                  "c": "a block id means the same block in every layer: one block holds a token's K/V in all 30."}),
    ],
    "06_from_fit_to_serve": [
        Question("b", "ITL pools every interval, so one stall shows in its tail; TPOT averages it away per request.",
                 {"a": "TPOT is one mean per request: a single long gap is diluted."}),
        Question("a", "a decode step reads the weights once for the whole batch, each history once per sequence.",
                 {"b": "each sequence reads only its own history."}),
        Question(_breakeven, "weight bytes / (4,096 × 131,072 bytes): about 30 sequences.", rel_tol=0.05),
        Question("a", "in the small pool new requests wait for free blocks and preempted ones compute their history "
                      "again: all of that waiting comes before a request's first token.",
                 {"b": "a request that runs still gets a token every step: its intervals barely change.",
                  "c": "TPOT averages the intervals of a running request, and those barely change; the waiting "
                       "comes before the first token."}),
    ],
}


def _kind_problem(question: Question, given: Any) -> str:
    """'' when ``given`` is an answer of the question's kind, else what was expected."""
    if question.choices:
        if isinstance(given, str) and given.strip().lower() in question.choices:
            return ""
        return f"expected one of the letters {', '.join(map(repr, question.choices))}; got {given!r}"
    if isinstance(given, numbers.Real) and not isinstance(given, bool) and math.isfinite(given):
        return ""
    return f"expected a number; got {type(given).__name__} {given!r}"


def _matches(question: Question, given: Any) -> bool:
    """Whether ``given``, an answer of the question's kind, is right."""
    want = question.expected()
    if isinstance(want, str):
        return given.strip().lower() == want
    return math.isclose(float(given), float(want), rel_tol=question.rel_tol, abs_tol=1e-12)


def verdicts(chapter: str, answers: dict[int, Any]) -> tuple[list[str], int, int]:
    """One line per question of ``chapter``'s quiz for ``answers`` (question number -> answer), and
    the counts of wrong and unanswered questions."""
    if not isinstance(chapter, str) or chapter not in QUIZZES:
        raise ValueError(f"chapter must be one of {sorted(QUIZZES)}, got {chapter!r}")
    if type(answers) is not dict:
        raise ValueError(f"answers must be a dict {{question number: answer}}, got {type(answers).__name__}")
    count = len(QUIZZES[chapter])
    unknown = [k for k in answers if type(k) is not int or not 1 <= k <= count]
    if unknown:
        raise ValueError(f"answers must be keyed by the question numbers 1 to {count}, got {unknown[0]!r}")
    lines, wrong, open_ = [], 0, 0
    for number, question in enumerate(QUIZZES[chapter], start=1):
        given = answers.get(number)
        if given is None:
            open_ += 1
            lines.append(f"⏳ Question {number}: not answered yet.")
        elif problem := _kind_problem(question, given):
            wrong += 1
            lines.append(f"❌ Question {number}: {problem}.")
        elif _matches(question, given):
            lines.append(f"✅ Question {number}: {question.why}")
        else:
            wrong += 1
            key = given.strip().lower() if isinstance(given, str) else float(given)
            lines.append(f"❌ Question {number}: not {given!r}. "
                         + question.wrong.get(key, "Look again at the chapter's summary."))
    return lines, wrong, open_
