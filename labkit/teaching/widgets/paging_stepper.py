"""The paging stepper of chapter 03: requests arrive, grow and finish on a pool of blocks.

A small scripted workload runs on a real ``labkit.memory.paging.BlockAllocator`` with one
``BlockTable`` per request. Each step, new requests store their prompt, running ones
append one generated token, and finished ones hand their blocks back. ``simulate``
records a ``Snapshot`` after every step; ``draw_pool`` draws one snapshot (each
physical block with its owner, its logical index and its filled slots) and
``draw_block_tables`` draws the mapping from logical to physical blocks.

``PagingStepper`` is the widget: a step slider (and a play button) over the snapshots.
:func:`static_figure` shows a few steps side by side, the picture for readers without
a live kernel. The readout's elements carry CSS classes (``paging-readout``,
``paging-step``) so that a browser test can read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import clear_output, display
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from ...checks import check_int
from ...memory.paging import BlockAllocator, BlockTable, OutOfBlocksError


@dataclass(frozen=True)
class Request:
    """A request of the scripted workload: it arrives at ``arrival`` with ``prompt_len`` tokens
    and generates ``output_len`` more, one per step."""

    name: str
    arrival: int
    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        check_int("arrival", self.arrival, 0)
        check_int("prompt_len", self.prompt_len, 1)
        check_int("output_len", self.output_len, 0)


@dataclass
class Snapshot:
    """The pool after one step."""

    step: int
    owner: list[str | None]  # per physical block: the request that holds it
    logical: list[int | None]  # per physical block: its index in the owner's block table
    filled: list[int]  # per physical block: slots holding a token
    tables: dict[str, list[int]]  # request -> block table (physical ids, in logical order)
    lengths: dict[str, int]  # request -> tokens held
    events: list[str] = field(default_factory=list)

    @property
    def used_blocks(self) -> int:
        return sum(o is not None for o in self.owner)

    @property
    def used_slots(self) -> int:
        return sum(self.lengths.values())


DEFAULT_WORKLOAD = [
    Request("A", 0, 6, 9),
    Request("B", 1, 3, 4),
    Request("C", 2, 9, 6),
    Request("D", 6, 2, 9),
    Request("E", 9, 5, 3),
]
COLOURS = {name: f"C{i}" for i, name in enumerate("ABCDEFGHIJ")}


def simulate(workload: list[Request] = DEFAULT_WORKLOAD, num_blocks: int = 16, block_size: int = 4,
             max_steps: int = 40) -> list[Snapshot]:
    """Run the workload on a pool of ``num_blocks`` blocks; one snapshot per step until all finish.

    Step t: requests arriving at t store their prompt (waiting if the pool is short), every
    request admitted earlier appends one generated token, and a request that has generated ``output_len``
    tokens finishes and frees its blocks at the end of the step.
    """
    if not isinstance(workload, (list, tuple)) or not workload:
        raise ValueError("workload must be a non-empty list of Request")
    if not all(isinstance(r, Request) for r in workload):
        raise TypeError(f"workload must hold Request objects, got {[type(r).__name__ for r in workload]}")
    check_int("num_blocks", num_blocks, 1)
    check_int("block_size", block_size, 1)
    check_int("max_steps", max_steps, 1)
    names = [r.name for r in workload]
    if len(set(names)) != len(names):
        raise ValueError(f"workload request names must be unique, got {names}")
    allocator = BlockAllocator(num_blocks)
    tables: dict[str, BlockTable] = {}
    generated: dict[str, int] = {}
    waiting = sorted(workload, key=lambda r: r.arrival)
    snapshots: list[Snapshot] = []
    for step in range(max_steps):
        events, admitted = [], set()
        for req in [r for r in waiting if r.arrival <= step]:  # admit arrivals whose prompt fits
            table = BlockTable(block_size)
            try:
                table.append(req.prompt_len, allocator)
            except OutOfBlocksError:
                events.append(f"{req.name} waits: its {req.prompt_len}-token prompt needs "
                              f"{table.new_blocks_for(req.prompt_len)} blocks")
                continue
            waiting.remove(req)
            admitted.add(req.name)
            tables[req.name], generated[req.name] = table, 0
            events.append(f"{req.name} arrives: {req.prompt_len} prompt tokens in {len(table.block_ids)} blocks")
        for req in workload:  # running requests generate one token each
            if req.name not in tables or req.name in admitted or generated[req.name] >= req.output_len:
                continue
            table = tables[req.name]
            try:
                new_block = table.new_blocks_for(1) == 1
                table.append(1, allocator)
            except OutOfBlocksError:
                events.append(f"{req.name} stalls: no free block for its next token")
                continue
            generated[req.name] += 1
            if new_block:
                events.append(f"{req.name} fills its last block and takes block {table.block_ids[-1]}")
        snapshots.append(_snapshot(step, tables, num_blocks, events))
        for req in workload:  # finished requests return their blocks
            if req.name in tables and generated[req.name] >= req.output_len:
                n = len(tables[req.name].block_ids)
                tables.pop(req.name).release(allocator)
                del generated[req.name]
                snapshots[-1].events.append(f"{req.name} finishes and frees {n} blocks")
        if not waiting and not tables:
            snapshots.append(_snapshot(step + 1, tables, num_blocks, ["all requests finished"]))
            break
    return snapshots


def _snapshot(step: int, tables: dict[str, BlockTable], num_blocks: int, events: list[str]) -> Snapshot:
    owner: list[str | None] = [None] * num_blocks
    logical: list[int | None] = [None] * num_blocks
    filled = [0] * num_blocks
    for name, table in tables.items():
        for i, block_id in enumerate(table.block_ids):
            owner[block_id], logical[block_id] = name, i
            filled[block_id] = min(table.block_size, table.num_tokens - i * table.block_size)
    return Snapshot(step, owner, logical, filled, {n: list(t.block_ids) for n, t in tables.items()},
                    {n: t.num_tokens for n, t in tables.items()}, events)


def draw_pool(snapshot: Snapshot, ax: plt.Axes, block_size: int, per_row: int = 8) -> None:
    """The physical pool: one box per block, its filled slots coloured by owner, labelled owner[logical]."""
    num_blocks = len(snapshot.owner)
    rows = -(-num_blocks // per_row)
    for b in range(num_blocks):
        x, y = b % per_row, rows - 1 - b // per_row
        owner = snapshot.owner[b]
        ax.add_patch(Rectangle((x + 0.05, y + 0.1), 0.9, 0.8, fill=False, lw=1.2,
                               ec="black" if owner else "0.7"))
        if owner is not None:
            w = 0.9 / block_size
            for s in range(block_size):  # one thin cell per slot: filled or an empty tail slot
                ax.add_patch(Rectangle((x + 0.05 + s * w, y + 0.1), w, 0.55, lw=0.3, ec="white",
                                       fc=COLOURS.get(owner, "C9") if s < snapshot.filled[b] else "0.92"))
            ax.text(x + 0.9, y + 0.78, f"{owner}[{snapshot.logical[b]}]", ha="right", va="center", fontsize=9,
                    color=COLOURS.get(owner, "C9"), fontweight="bold")
        # The block id sits on the white strip above the slots, dark and bold: legible on any owner's colour.
        ax.text(x + 0.1, y + 0.78, str(b), ha="left", va="center", fontsize=10, fontweight="bold",
                color="black" if owner else "0.45")
    ax.set_xlim(0, per_row)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"step {snapshot.step}: {snapshot.used_blocks}/{num_blocks} blocks, "
                 f"{snapshot.used_slots}/{snapshot.used_blocks * block_size} slots used", fontsize=10)


def draw_block_tables(snapshot: Snapshot, ax: plt.Axes) -> None:
    """Each request's block table (top rows, logical order) with arrows down to the physical pool (bottom row)."""
    num_blocks = len(snapshot.owner)
    names = sorted(snapshot.tables)
    pool_y = -1.6
    for r, name in enumerate(names):
        y = len(names) - 1 - r
        colour = COLOURS.get(name, "C9")
        x0 = 1.5  # every table starts in the same column: logical block i sits above i
        ax.text(x0 - 0.2, y + 0.5, f"{name}", ha="right", va="center", fontsize=9, color=colour)
        for i, block_id in enumerate(snapshot.tables[name]):
            ax.add_patch(Rectangle((x0 + i + 0.05, y + 0.15), 0.9, 0.7, fc=colour, alpha=0.3, ec="black", lw=0.8))
            ax.text(x0 + i + 0.5, y + 0.5, str(i), ha="center", va="center", fontsize=9, fontweight="bold")
            ax.add_patch(FancyArrowPatch((x0 + i + 0.5, y + 0.15), (block_id + 0.5, pool_y + 0.85),
                                         arrowstyle="-|>", mutation_scale=7, lw=0.7, color=colour))
    for b in range(num_blocks):
        owner = snapshot.owner[b]
        ax.add_patch(Rectangle((b + 0.05, pool_y + 0.15), 0.9, 0.7, ec="black", lw=0.8,
                               fc=COLOURS.get(owner, "C9") if owner else "white", alpha=0.3 if owner else 1))
        ax.text(b + 0.5, pool_y + 0.5, str(b), ha="center", va="center", fontsize=9, fontweight="bold")
    ax.text(0, len(names) + 0.2, "block tables: logical block i of each request", fontsize=8)
    ax.text(0, pool_y - 0.35, "physical pool: block ids (white = free)", fontsize=8)
    ax.set_xlim(-0.2, max(num_blocks, 2 + max([len(t) for t in snapshot.tables.values()] + [0])))
    ax.set_ylim(pool_y - 0.6, len(names) + 0.6)
    ax.set_aspect("equal")
    ax.axis("off")


def static_figure(snapshots: list[Snapshot], steps: list[int], block_size: int, per_row: int = 8) -> Figure:
    """The pool at a few steps, one above the other (a row of boxes per ``per_row`` blocks)."""
    fig, axes = plt.subplots(len(steps), 1, figsize=(7, 2.1 * len(steps)))
    for ax, step in zip(list(axes) if len(steps) > 1 else [axes], steps):
        draw_pool(snapshots[step], ax, block_size, per_row)
    fig.suptitle("Blocks are taken as requests grow and return when they finish (simulated)", fontsize=11)
    fig.tight_layout()
    return fig


class PagingStepper:
    """Step through ``simulate(workload, num_blocks, block_size)``: ``PagingStepper().widget``."""

    def __init__(self, workload: list[Request] = DEFAULT_WORKLOAD, num_blocks: int = 16, block_size: int = 4):
        self.block_size = block_size
        self.snapshots = simulate(workload, num_blocks, block_size)
        last = len(self.snapshots) - 1
        self.slider = widgets.IntSlider(value=0, min=0, max=last, description="step", continuous_update=True)
        self.play = widgets.Play(value=0, min=0, max=last, interval=700, description="play")
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.readout = widgets.HTML()
        self.readout.add_class("paging-readout")
        self.plot = widgets.Output()
        self.slider.observe(lambda change: self.update(), names="value")
        self.widget = widgets.VBox([widgets.HBox([self.play, self.slider]), self.readout, self.plot])
        self.update()

    def readout_html(self, step: int) -> str:
        snap = self.snapshots[step]
        tables = "<br>".join(f"<b>{n}</b>: {snap.lengths[n]} tokens, block table {snap.tables[n]}"
                             for n in sorted(snap.tables)) or "(no request holds blocks)"
        events = "<br>".join(snap.events) or "(nothing new)"
        return (f"<div class='paging-step'>step {snap.step}: {snap.used_blocks} blocks in use</div>"
                f"<div>{events}</div><div style='margin-top:4px'>{tables}</div>")

    def update(self) -> None:
        step = self.slider.value
        self.readout.value = self.readout_html(step)
        with self.plot:
            clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(7, 2.4))
            draw_pool(self.snapshots[step], ax, self.block_size)
            display(fig)
            plt.close(fig)
