"""Diagrams of the book's ideas, drawn from numbers a chapter has just computed.

A diagram here is not decoration: its boxes are counted from a real run (how many prompt tokens,
how many decode steps, how many layers), so it changes when the run does.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

from .checks import check_int

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
