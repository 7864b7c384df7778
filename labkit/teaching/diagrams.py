"""Diagrams of the book's ideas, drawn from numbers a chapter has just computed.

A diagram here is not decoration: its boxes are counted from a real run (how many prompt tokens,
how many decode steps, how many layers), so it changes when the run does.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from ..checks import check_choice, check_int

PREFILL_COLOUR, DECODE_COLOUR = "#4c72b0", "#dd8452"


def _arrow(ax, start, end, text="", **kw) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, color="0.25",
                                 lw=1.4, **kw))
    if text:
        ax.text((start[0] + end[0]) / 2, max(start[1], end[1]) + 0.35, text, ha="center", va="bottom",
                fontsize=9)


def prefill_decode_diagram(prompt_tokens: list[int], decode_tokens: list[int], num_layers: int):
    """The article's Fig. 1: prompt tokens -> prefill -> KV cache -> decode and append.

    ``prompt_tokens``: the prompt's ids, prefilled in one pass. ``decode_tokens``: the tokens fed
    by the decode steps, one per step, in order. ``num_layers``: rows of the cache; each cell of
    the cache is one layer's K and V for one position. Returns the figure.
    """
    if not prompt_tokens:
        raise ValueError("prompt_tokens must hold at least 1 token, got none")
    check_int("num_layers", num_layers, 1)
    n_prompt, n_decode = len(prompt_tokens), len(decode_tokens)
    fig, ax = plt.subplots(figsize=(11, 3.6))
    cell = 0.42

    # 1. the prompt, as token boxes
    for i, tok in enumerate(prompt_tokens):
        ax.add_patch(Rectangle((i * cell, 4.2), cell * 0.9, cell * 0.9, fc="white", ec=PREFILL_COLOUR))
        ax.text(i * cell + cell * 0.45, 4.2 + cell * 0.45, str(tok), ha="center", va="center", fontsize=6.5)
    ax.text(0, 4.95, f"prompt: {n_prompt} tokens", fontsize=10, weight="bold")

    # 2. the cache: one row per layer, one column per position
    x0, y0 = 0, 0.6
    total = n_prompt + n_decode
    for layer in range(num_layers):
        for pos in range(total):
            colour = PREFILL_COLOUR if pos < n_prompt else DECODE_COLOUR
            ax.add_patch(Rectangle((x0 + pos * cell, y0 + layer * cell), cell * 0.9, cell * 0.9,
                                   fc=colour, ec="white", alpha=0.9))
        ax.text(x0 - 0.1, y0 + layer * cell + cell * 0.45, f"layer {layer}", ha="right", va="center",
                fontsize=7.5)
    ax.text(x0, y0 - 0.45, f"KV cache: {num_layers} layers × {total} positions, one K and one V in each cell",
            fontsize=9)
    _arrow(ax, (n_prompt * cell / 2, 4.15), (n_prompt * cell / 2, y0 + num_layers * cell + 0.05))
    ax.text(n_prompt * cell / 2 + 0.12, 3.55, "prefill: all prompt tokens in one pass,\n"
            "every layer stores their K, V\nand the last position gives token 1", fontsize=8.5, va="center")

    # 3. decode: one token in, it reads the whole cache and appends one column
    right = x0 + total * cell
    dx = right + 1.1
    ax.add_patch(Rectangle((dx, 1.1), 3.2, 1.3, fc="#fbe9dc", ec=DECODE_COLOUR))
    ax.text(dx + 1.6, 1.75, f"decode: {n_decode} steps,\none token each:\nread every cached cell,\n"
            "then append its own", ha="center", va="center", fontsize=8.5)
    _arrow(ax, (dx, 1.6), (right + 0.05, 1.6), connectionstyle="arc3,rad=0.0")
    ax.text((right + dx) / 2, 1.25, "append 1\nposition", ha="center", va="top", fontsize=7.5)
    _arrow(ax, (right - total * cell / 2, y0 + num_layers * cell + 0.1), (dx + 1.6, 2.45),
           connectionstyle="arc3,rad=-0.25")
    ax.text(right + 0.3, 3.3, f"decode step k reads all\n{n_prompt} + k positions",
            fontsize=8, ha="left", va="bottom")
    ax.text(dx + 3.35, 1.75, "→ next token", va="center", fontsize=9)
    for colour, label in ((PREFILL_COLOUR, "stored by prefill"), (DECODE_COLOUR, "appended by decode")):
        y = 0.35 if colour == PREFILL_COLOUR else -0.1
        ax.add_patch(Rectangle((dx, y), 0.3, 0.3, fc=colour))
        ax.text(dx + 0.4, y + 0.15, label, va="center", fontsize=8.5)
    ax.set_xlim(-0.9, dx + 4.6)
    ax.set_ylim(-0.2, 5.3)
    fig.set_size_inches(min(14.0, 0.9 * (dx + 5.5)), 3.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("Fig. 1 of the article, drawn from this run: prefill builds the cache, "
                 "decode reads all of it and appends", fontsize=10)
    fig.tight_layout()
    return fig


# --- the roadmap: the article's Fig. 1 with one chapter's part highlighted ----------------------

HIGHLIGHT_COLOUR, OTHER_COLOUR = "#dd8452", "#eeeeee"

#: The parts of the roadmap, in drawing order: the article's Fig. 1 (prompt tokens -> prefill ->
#: KV blocks -> decode & append), the scheduler that chooses each step's work (§05), the server that
#: holds it all on a device (§06), and, beyond the article (Part II), the router that sends each
#: request to one of N such servers, each with its own pool and prefix cache (07), the second tier
#: that keeps the blocks a pool evicts, and the second pool that decodes what the first prefilled (08).
ROADMAP_PARTS = {
    "prompt": "prompt tokens",
    "prefill": "prefill",
    "cache": "KV blocks",
    "decode": "decode & append",
    "scheduler": "scheduler: who runs this step",
    "server": "server on a device: pool, latency",
    "router": "router: which replica",
    "tier": "second tier: host memory, disk, another machine",
    "pool": "decode pool",
}

#: The parts beyond the article, and the first chapter whose roadmap draws each (later Part II
#: chapters draw them too; Part I and the appendices stay inside the article's one server).
DRAWN_FROM = {"router": "07", "tier": "08", "pool": "08"}

#: What each chapter and appendix is about, and which parts of the roadmap it works on.
ROADMAP_CHAPTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "01": ("why the cache grows", ("prefill", "cache", "decode")),
    "02": ("what each token costs", ("cache",)),
    "03": ("paged blocks", ("cache",)),
    "04": ("which prefixes can be shared", ("prompt", "prefill", "cache")),
    "05": ("capacity in the scheduler", ("scheduler",)),
    "06": ("from fitting to serving", ("server",)),
    "07": ("many replicas behind a router", ("router", "cache")),
    "08": ("moving the cache", ("cache", "tier", "pool")),
    "A1": ("the paged kernels (appendix to 03)", ("prefill", "decode")),
    "A2": ("vLLM's start-up log (appendix to 02, 06)", ("cache", "server")),
    "A3": ("fewer bytes per token (appendix to 02)", ("cache",)),
    "A4": ("the real vLLM on your CPU (appendix to A2, 05, 06)", ("scheduler", "server")),
    "A5": ("vLLM's scheduler (appendix to 05)", ("scheduler",)),
    "A6": ("measuring a server (appendix to 06)", ("server",)),
    "A7": ("a model in one file (appendix to 01)", ("prefill", "decode")),
    "C1": ("your own engine (the capstone of 01 to 06)", ("prefill", "cache", "decode", "scheduler")),
}

#: The book's parts. Part I follows the article (chapters 01 to 06, closed by the capstone C1);
#: Part II goes beyond it (chapters 07 and 08); each appendix deepens a chapter.
BOOK_PARTS = {"I": "Part I · the article", "II": "Part II · beyond the article", "A": "the appendices"}
PART_TWO_FROM = 7  #: the first chapter of Part II


def book_part(chapter: str) -> str:
    """The part ``chapter`` belongs to: "I", "II" or "A" (the keys of ``BOOK_PARTS``).

    ``chapter``: a key of ``ROADMAP_CHAPTERS``, or "00" (the start page, which opens Part I).
    """
    check_choice("chapter", chapter, ("00", *ROADMAP_CHAPTERS))
    if chapter[0] in "AC":  # the capstone closes Part I
        return "A" if chapter[0] == "A" else "I"
    return "II" if int(chapter) >= PART_TWO_FROM else "I"


def _drawn_parts(chapter: str) -> tuple[str, ...]:
    """The parts ``chapter``'s roadmap draws: all of them on the whole map ("00"); in Part II, the
    article's and those beyond it from the chapter that brings each in (``DRAWN_FROM``: the router from
    07, the second tier and the decode pool from 08); Part I and its appendices stay inside the
    article's one server."""
    if chapter == "00":
        return tuple(ROADMAP_PARTS)
    part_two = book_part(chapter) == "II"
    return tuple(p for p in ROADMAP_PARTS
                 if p not in DRAWN_FROM or (part_two and int(chapter) >= int(DRAWN_FROM[p])))


def _box(ax, part: str, x: float, y: float, w: float, h: float, chapter: str, *, frame: bool = False) -> None:
    """One part of the roadmap, lit when ``chapter`` works on it, with the chapters that do.

    A stage of the pipeline has its name inside and its chapters under it; a ``frame`` (the
    scheduler, the server) has both along its top edge, so the stages inside stay readable.
    """
    lit = chapter in ROADMAP_CHAPTERS and part in ROADMAP_CHAPTERS[chapter][1]  # "00": the map, nothing lit
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", gid=part,
                                fc=HIGHLIGHT_COLOUR if lit else OTHER_COLOUR, ec="0.3", lw=1.6 if lit else 0.8,
                                alpha=0.55 if frame else 1.0))
    # the capstone runs every part: the labels name the chapters and appendices that teach one
    covering = "  ".join(c for c, (_, parts) in ROADMAP_CHAPTERS.items() if part in parts and c[0] != "C")
    weight = "bold" if lit else "normal"
    if frame:
        ax.text(x + 0.15, y + h - 0.12, ROADMAP_PARTS[part], ha="left", va="top", fontsize=9, weight=weight)
        ax.text(x + w - 0.15, y + h - 0.12, covering, ha="right", va="top", fontsize=7.5, color="0.3")
    else:
        ax.text(x + w / 2, y + h / 2, ROADMAP_PARTS[part], ha="center", va="center", fontsize=9, weight=weight)
        ax.text(x + w / 2, y - 0.1, covering, ha="center", va="top", fontsize=7.5, color="0.3")


def roadmap(chapter: str):
    """The book on one figure: the article's Fig. 1 pipeline, with ``chapter``'s part highlighted.

    The pipeline is the article's: the prompt's tokens are *prefilled* in one pass, which writes
    their keys and values into *KV blocks*; each *decode* step reads all the blocks and appends one
    token's K and V. Around it sit the scheduler, which picks each step's requests and tokens
    (chapter 05), and the server, which carves the blocks out of a device and is judged by its
    latencies (chapter 06). Under each part (at the top right of a frame) are the chapters and
    appendices that work on it.

    Part II goes beyond the article, and its figures (and the whole map, "00") draw where it goes:
    a *router* in front of N copies of that server, the *replicas*, each with its own pool and its
    own prefix cache (chapter 07); from chapter 08, a *second tier* under the KV blocks (host memory,
    disk, another machine) that keeps what the pool evicts and reloads it, and a second pool, the
    *decode pool*, that receives the K/V the first pool prefilled over a link. Part I's figures stay
    inside the one server.

    ``chapter``: "01" to "08", "A1" to "A7" or "C1" (the capstone), or "00" for the whole map with
    nothing highlighted. Returns the figure.
    """
    check_choice("chapter", chapter, ("00", *ROADMAP_CHAPTERS))
    drawn = _drawn_parts(chapter)
    cluster, moving = "router" in drawn, "tier" in drawn
    fig, ax = plt.subplots(figsize=(14.6, 5.4) if moving else (11.6, 4.0) if cluster else (9, 3.2))
    if cluster:  # replicas 1 to N-1 behind replica 0, each a server with its own pool and prefix cache
        for k, label in ((2, "replica N−1"), (1, "replica 1")):
            ax.add_patch(FancyBboxPatch((0.3 * k, 0.3 * k), 10.0, 3.3, boxstyle="round,pad=0.02,rounding_size=0.08",
                                        fc="white", ec="0.55", lw=0.8, ls="--"))
            ax.text(0.3 * k + 9.85, 0.3 * k + 3.15, label, ha="right", va="center", fontsize=7, color="0.35")
        ax.text(1.0, 3.95, "N replicas, each with its own pool and its own prefix cache", ha="left",
                va="bottom", fontsize=8, color="0.35")
    _box(ax, "server", 0.0, 0.0, 10.0, 3.3, chapter, frame=True)
    _box(ax, "scheduler", 0.25, 0.2, 9.5, 2.65, chapter, frame=True)
    stages = [("prompt", 0.5), ("prefill", 2.75), ("cache", 5.0), ("decode", 7.75)]
    for part, x in stages:
        _box(ax, part, x, 0.9, 1.75, 0.9, chapter)
    for (_, x0), (_, x1) in zip(stages[:-1], stages[1:]):
        _arrow(ax, (x0 + 1.8, 1.5), (x1 - 0.05, 1.5))
    ax.text(7.25, 1.56, "read all", ha="center", va="bottom", fontsize=7.5)
    _arrow(ax, (7.7, 1.12), (6.8, 1.12))  # decode writes its token's K and V back into the blocks
    ax.text(7.25, 1.06, "append 1", ha="center", va="top", fontsize=7.5)
    if cluster:  # the router, in front: each request goes to one replica, and finds only that one's cache
        _box(ax, "router", -2.6, 1.05, 1.9, 1.2, chapter)
        _arrow(ax, (-3.5, 1.65), (-2.65, 1.65))
        ax.text(-3.45, 1.72, "requests", ha="left", va="bottom", fontsize=7.5)
        for k, (y0, y1) in enumerate(((1.65, 1.65), (2.0, 3.45), (2.2, 3.75))):
            _arrow(ax, (-0.65, y0), (0.3 * k - 0.05, y1))
        ax.text(-1.65, 0.75, "each request to one\nreplica: only its cache\ncan hold the prefix", ha="center",
                va="top", fontsize=7.5)
        ax.set_xlim(-3.6, 10.7)
        ax.set_ylim(-0.1, 4.25)
    else:
        ax.set_xlim(-0.1, 10.1)
        ax.set_ylim(-0.1, 3.4)
    if moving:  # the second tier under the KV blocks, and the decode pool beside the (prefill) replicas
        _box(ax, "tier", 3.6, -1.75, 4.55, 0.8, chapter)
        _arrow(ax, (4.97, 1.02), (4.25, -0.92))  # both beside the chapters under the KV blocks
        ax.text(4.35, -0.2, "evict", ha="right", va="center", fontsize=7.5)
        _arrow(ax, (7.55, -0.92), (6.8, 0.98))
        ax.text(7.35, -0.2, "reload\n(or compute again)", ha="left", va="center", fontsize=7.5)
        for k in (2, 1):  # the decode pool's other replicas, behind its first
            ax.add_patch(FancyBboxPatch((12.2 + 0.2 * k, 0.9 + 0.2 * k), 2.4, 1.3,
                                        boxstyle="round,pad=0.02,rounding_size=0.08", fc="white", ec="0.55",
                                        lw=0.8, ls="--"))
        _box(ax, "pool", 12.2, 0.9, 2.4, 1.3, chapter)
        _arrow(ax, (10.05, 1.55), (12.15, 1.55))
        ax.text(11.4, 1.62, "K/V of the prefilled\nprompt, over a link", ha="center", va="bottom", fontsize=7.5)
        ax.text(11.4, 1.45, "from the prefill pool\nto the decode pool", ha="center", va="top", fontsize=7.5,
                color="0.35")
        ax.set_xlim(-3.6, 15.2)
        ax.set_ylim(-2.2, 4.25)
    ax.axis("off")
    if chapter == "00":
        ax.set_title("The book on one figure: the article's pipeline, the chapters on each part, and Part II's "
                     "router in front of N replicas, second tier and decode pool", fontsize=10)
    else:
        name, _ = ROADMAP_CHAPTERS[chapter]
        kind = {"A": "Appendix", "C": "Capstone"}.get(chapter[0], "Chapter")
        where = ("beyond the article's pipeline, its parts highlighted" if cluster
                 else "its part of the article's pipeline, highlighted")
        ax.set_title(f"{kind} {chapter} · {name}: {where}", fontsize=10)
    fig.tight_layout()
    return fig
