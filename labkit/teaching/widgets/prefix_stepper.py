"""The prefix-cache stepper of chapter 04: requests arrive, share, copy on write, finish, get evicted.

:func:`story` runs a short script of events on a real :class:`labkit.memory.prefix.PrefixCache`
(bookkeeping only, no tensors) and records a :class:`Snapshot` after each event: every
pool block's reference count and whether the cache names it, and every live sequence's
block table. :func:`draw_snapshot` draws one snapshot: the pool as a row of blocks
(colour = state, number = reference count) and each sequence as a row of logical blocks
with a line to the physical block it points at.

:class:`PrefixStepper` is the widget (a slider over the steps, a caption with the
counters). :func:`static_figure` draws a few chosen steps side by side, the picture
for readers without a live kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ...memory.paging import BlockAllocator
from ...memory.prefix import CachedBlockTable, PrefixCache, PrefixCacheStats

# Block states and their colours (matplotlib's default cycle, so the book looks the same everywhere).
STATE_COLOURS = {
    "free": "#ffffff",
    "free, cached": "#b5dfb0",
    "in use": "#9ecae1",
    "shared (ref > 1)": "#ff7f0e",
}


@dataclass(frozen=True)
class Snapshot:
    """The cache after one event of the story."""

    caption: str
    short: str  # a few words, for the static figure's panel titles
    ref_counts: tuple[int, ...]
    cached: tuple[bool, ...]
    tables: tuple[tuple[str, tuple[int, ...], int], ...]  # (name, block ids, num_tokens)
    copies: tuple[tuple[int, int], ...] = ()               # copy-on-write pairs of this event
    evicted: tuple[int, ...] = ()                          # blocks whose name was dropped by this event
    evicted_held: tuple[str, ...] = ()                     # what each evicted block's name stood for
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    evicted_blocks: int = 0                                # evictions so far

    def state(self, block_id: int) -> str:
        ref = self.ref_counts[block_id]
        if ref == 0:
            return "free, cached" if self.cached[block_id] else "free"
        return "shared (ref > 1)" if ref > 1 else "in use"


def story(num_blocks: int = 8, block_size: int = 4) -> list[Snapshot]:
    """The chapter's script, run on a real ``PrefixCache`` (token ids stand for words).

    A and B read the same 8-token report and ask different questions; A forks a second
    sample A' that copies the shared tail on its first write; everyone finishes; a long
    unrelated request C evicts the least recently used cached blocks; D asks about the report again.

    An eviction is about a block's *content*, not its id: the free queue hands out block ids
    again and again, so the same physical block can be evicted twice, holding different
    tokens each time. ``Snapshot.evicted_held`` says what each evicted block held.
    """
    cache = PrefixCache(BlockAllocator(num_blocks), block_size)
    report = [101, 102, 103, 104, 105, 106, 107, 108]
    tables: dict[str, CachedBlockTable] = {}
    sequences: dict[str, list[int]] = {"the report": report}  # every sequence's tokens, kept after it finishes
    snaps: list[Snapshot] = []

    def names() -> dict[int, str]:
        return {b: name.block_hash for b, name in cache.allocator.names.items()}

    def held(token_ids: tuple[int, ...]) -> str:
        """Where a named block's tokens come from, e.g. "tokens 5-8 of the report" (1-based positions)."""
        for name, seq in sequences.items():
            for i in range(0, len(seq) - len(token_ids) + 1, block_size):
                if tuple(seq[i:i + len(token_ids)]) == token_ids:
                    return f"tokens {i + 1}-{i + len(token_ids)} of {name}"
        return f"tokens {list(token_ids)}"

    def record(short: str, caption: str, action: Callable[[], tuple[tuple, str]]) -> None:
        names_before, evictions_before = names(), cache.allocator.num_evictions
        contents_before = {b: cache.allocator.names[b].token_ids for b in names_before}
        copies, note = action()
        after = names()
        # evicted: a block whose name was dropped (it may carry a new name already)
        evicted = tuple(b for b in sorted(names_before) if after.get(b) != names_before[b])
        if len(evicted) != cache.allocator.num_evictions - evictions_before:
            raise RuntimeError(f"the cache counted {cache.allocator.num_evictions - evictions_before} evictions, "
                               f"the names show {len(evicted)}")
        a = cache.allocator
        snaps.append(Snapshot(
            caption + note, short, tuple(a.ref_counts), tuple(b in a.names for b in range(a.num_blocks)),
            tuple((name, tuple(t.block_ids), t.num_tokens) for name, t in tables.items()),
            tuple(copies), evicted, tuple(held(contents_before[b]) for b in evicted), replace(cache.stats),
            a.num_evictions))

    def arrive(name: str, prompt: list[int]) -> Callable[[], tuple[tuple, str]]:
        def go() -> tuple[tuple, str]:
            table, hit = cache.allocate(prompt)
            cache.stats.record(len(prompt), hit)  # one admission, one lookup
            cache.cache_full_blocks(table)  # prefill done: its full blocks get names
            tables[name], sequences[name] = table, list(prompt)
            return (), f": {hit} of {len(prompt)} prompt tokens found in the cache"
        return go

    def fork(parent: str, child: str) -> Callable[[], tuple[tuple, str]]:
        def go() -> tuple[tuple, str]:
            tables[child], sequences[child] = cache.fork(tables[parent]), list(sequences[parent])
            return (), ""
        return go

    def append(name: str, tokens: list[int]) -> Callable[[], tuple[tuple, str]]:
        def go() -> tuple[tuple, str]:
            copies = cache.append(tables[name], tokens)
            sequences[name] += tokens
            cache.cache_full_blocks(tables[name])
            return tuple(copies), ""
        return go

    def finish(*who: str) -> Callable[[], tuple[tuple, str]]:
        def go() -> tuple[tuple, str]:
            for name in who:
                cache.release(tables.pop(name))
            return (), ""
        return go

    record("empty pool", "empty pool", lambda: ((), ""))
    record("A arrives", "A arrives: report + question", arrive("A", report + [1, 2, 3]))
    record("B shares the report", "B arrives: same report, another question", arrive("B", report + [4, 5, 6]))
    record("A' forks from A", "A' forks from A (a second sample): every block shared, even A's partly filled tail",
           fork("A", "A'"))
    record("A' copies the shared tail", "A' writes a token into the shared tail: copy-on-write gives it a "
           "private copy", append("A'", [7]))
    record("A finishes", "A finishes: its references drop; the report blocks stay (B and A' hold them)",
           finish("A"))
    record("all finish, blocks stay cached", "B and A' finish: nothing is in use, the report's blocks stay cached",
           finish("B", "A'"))
    record("C evicts LRU cached blocks", "C arrives with unrelated text; the pool is short, so least recently "
           "used cached blocks are evicted", arrive("C", list(range(200, 228))))
    record("C finishes", "C finishes", finish("C"))
    record("D reuses what survived", "D asks about the report again (C evicted its second block)",
           arrive("D", report + [9, 9]))
    return snaps


def draw_snapshot(ax: plt.Axes, snap: Snapshot, *, title: str | None = None) -> None:
    """Pool blocks on top (colour = state, number = reference count); sequences below, pointing at them."""
    n = len(snap.ref_counts)
    rows = max(len(snap.tables), 1)
    pool_y = rows + 0.6
    for b in range(n):
        edge = "red" if b in snap.evicted else "black"
        ax.add_patch(Rectangle((b, pool_y), 0.9, 0.8, facecolor=STATE_COLOURS[snap.state(b)], edgecolor=edge,
                               linewidth=2.5 if b in snap.evicted else 1.0, zorder=2))
        ax.text(b + 0.45, pool_y + 0.4, str(snap.ref_counts[b]), ha="center", va="center", fontsize=9, zorder=3)
        ax.text(b + 0.45, pool_y + 1.0, str(b), ha="center", va="center", fontsize=7, color="0.4")
    ax.text(-0.3, pool_y + 0.4, "pool\n(refs)", ha="right", va="center", fontsize=8)
    for src, dst in snap.copies:
        ax.annotate("", xy=(dst + 0.45, pool_y + 0.85), xytext=(src + 0.45, pool_y + 0.85),
                    arrowprops=dict(arrowstyle="->", color="red", connectionstyle="arc3,rad=-0.4"))
    for row, (name, block_ids, num_tokens) in enumerate(snap.tables):
        y = rows - 1 - row
        ax.text(-0.3, y + 0.35, name, ha="right", va="center", fontsize=9)
        for logical, b in enumerate(block_ids):
            x = logical * 1.0
            ax.add_patch(Rectangle((x, y), 0.9, 0.7, facecolor="0.93", edgecolor="0.3", zorder=2))
            ax.text(x + 0.45, y + 0.35, str(b), ha="center", va="center", fontsize=8, zorder=3)
            ax.plot([x + 0.45, b + 0.45], [y + 0.7, pool_y], color="0.6", linewidth=0.7, zorder=1)
    if snap.evicted:  # say what the red outlines mean where they appear
        lines = ["red outline: evicted now (name dropped, block reused)"]
        lines += [f"block {b} held {what}" for b, what in zip(snap.evicted, snap.evicted_held)]
        ax.text(n / 2, -0.25, "\n".join(lines), ha="center", va="top", fontsize=8, color="red", linespacing=1.3)
    ax.set_xlim(-1.6, n + 0.2)
    ax.set_ylim(-0.3 - 0.42 * (1 + len(snap.evicted)) if snap.evicted else -0.2, pool_y + 1.3)
    ax.axis("off")
    ax.set_title(title if title is not None else snap.caption, fontsize=9, wrap=True)


def _legend(fig: Figure) -> None:
    handles = [Patch(facecolor=c, edgecolor="black", label=s) for s, c in STATE_COLOURS.items()]
    handles.append(Patch(facecolor="white", edgecolor="red", linewidth=2.5, label="evicted now"))
    handles.append(Patch(facecolor="0.93", edgecolor="0.3", label="block table entry (physical id)"))
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)


def static_figure(snaps: list[Snapshot], steps: list[int]) -> Figure:
    """A few steps of the story side by side (the widget's static twin)."""
    cols = 2
    rows = -(-len(steps) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(11, 2.6 * rows + 0.4), squeeze=False)
    for ax, step in zip(axes.flat, steps):
        draw_snapshot(ax, snaps[step], title=f"step {step}: {snaps[step].short}")
    for ax in list(axes.flat)[len(steps):]:
        ax.axis("off")
    fig.suptitle("Blocks are shared by reference, copied on write, and kept cached until evicted", fontsize=11)
    _legend(fig)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    return fig


def caption_text(snap: Snapshot) -> str:
    """The counters under the picture: hits and misses in tokens, evictions in blocks."""
    s = snap.stats
    evicted = "".join(f"\nevicted now: block {b}, which held {what}"
                      for b, what in zip(snap.evicted, snap.evicted_held))
    return (f"{snap.caption}\n"
            f"prompt tokens hit {s.hits}, computed {s.queries - s.hits} (hit rate {s.hit_rate:.0%}); "
            f"blocks evicted so far {snap.evicted_blocks}; copies this step {list(snap.copies)}{evicted}")


class PrefixStepper:
    """Step through the story: a slider picks the event, the picture and counters follow."""

    def __init__(self, snaps: list[Snapshot] | None = None):
        import ipywidgets as widgets

        self.snaps = snaps if snaps is not None else story()
        self.slider = widgets.IntSlider(value=0, min=0, max=len(self.snaps) - 1, description="step",
                                        continuous_update=False)
        self.caption = widgets.HTML()
        self.plot = widgets.Output()
        self.slider.observe(lambda change: self._update(), names="value")
        self.box = widgets.VBox([self.slider, self.caption, self.plot])
        self._update()

    def _update(self) -> None:
        from IPython.display import clear_output, display

        snap = self.snaps[self.slider.value]
        self.caption.value = "<pre class='prefix-caption'>" + caption_text(snap) + "</pre>"
        with self.plot:
            clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(7, 3.2))
            draw_snapshot(ax, snap)
            _legend(fig)
            fig.tight_layout(rect=(0, 0.13, 1, 1))
            display(fig)
            plt.close(fig)

    def _repr_mimebundle_(self, **kwargs):
        return self.box._repr_mimebundle_(**kwargs)
