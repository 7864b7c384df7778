"""The capstone's checks: the reader's pieces, found in their notebooks, run in lockstep with labkit's.

``pieces_from_notebooks(folder)`` reads the four build-it pieces (01's ``decode_step``, 03's ``Pager``, 04's
``cached_tokens``, 05's ``plan_step``) from the reader's saved chapter notebooks: the cell that defines each,
with the notebook's imports. A piece still the stub (a body that only raises ``NotImplementedError``), or a
notebook not there, leaves its seam to labkit, and one line says so.

``lockstep(pieces)`` wraps each of the reader's pieces so that every call also asks labkit's piece the same
question, on the same inputs, and raises ``PieceMismatch`` at the first answer that differs: it
names the piece, the step and the request (and the layer and position of an attention step), and shows
both answers. A ``Pager`` may pick other blocks than labkit's; it is held to the same free counts and
refusals, and to slots in blocks no other sequence holds (``build_it``'s own replay rule).

``WRONG_PIECES``: four mistakes that a careless test lets through, one per seam, which the capstone (in
``solutions/``) and the tests put in place of the right piece to show each one caught and named.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, Callable

import torch

from ..caches.stepwise import decode_step
from ..memory.prefix import hash_chain
from ..serving.engine import Engine
from ..serving.pieces import Pager as LabkitPager, Pieces, plan_rows
from ..serving.request import Request
from .build_it import _slot_problem

__all__ = ["PIECES", "pieces_from_notebooks", "lockstep", "PieceMismatch", "serve", "report", "WRONG_PIECES"]

#: seam -> (the chapter notebook's name pattern, what the piece is, in words)
PIECES: dict[str, tuple[str, str]] = {
    "decode_step": ("01_*.ipynb", "chapter 01's attention step, decode_step"),
    "Pager": ("03_*.ipynb", "chapter 03's Pager"),
    "cached_tokens": ("04_*.ipynb", "chapter 04's cached_tokens"),
    "plan_step": ("05_*.ipynb", "chapter 05's plan_step"),
}


def _is_stub(node: ast.AST) -> bool:
    """A function whose body (past a docstring) only raises NotImplementedError; a class with such a method."""
    if isinstance(node, ast.ClassDef):
        return any(_is_stub(n) for n in node.body if isinstance(n, ast.FunctionDef))
    body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])


def _load(notebook: Path, name: str) -> tuple[Any, str]:
    """``(piece, '')`` from the cell of ``notebook`` that defines ``name``, or ``(None, why not)``."""
    cells = [("".join(c["source"]) if isinstance(c["source"], list) else c["source"])
             for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    imports, found = [], None
    for source in cells:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        imports += [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        found = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name),
                     found)
    if found is None:
        return None, f"no cell of {notebook.name} defines {name}"
    if _is_stub(found):
        return None, "still the stub"
    namespace: dict[str, Any] = {}
    for node in imports:  # the notebook's imports, as its cells made them
        try:
            exec(compile(ast.Module([node], []), notebook.name, "exec"), namespace)
        except Exception:  # noqa: BLE001 (an import the piece does not need may fail here)
            pass
    exec(compile(ast.Module([found], []), notebook.name, "exec"), namespace)
    return namespace[name], ""


def pieces_from_notebooks(folder: str | Path = ".") -> tuple[Pieces, list[str]]:
    """The reader's pieces from the chapter notebooks saved in ``folder``, and one line per seam saying
    whose piece runs there. Save a notebook after editing it: this reads the file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"folder must be a folder holding the chapter notebooks, got {str(folder)!r}")
    found, lines = {}, []
    for name, (pattern, what) in PIECES.items():
        notebook = next(iter(sorted(folder.glob(pattern))), None)
        piece, why = (None, f"no {pattern} in {folder}") if notebook is None else _load(notebook, name)
        found[name] = piece
        lines.append(f"{what}: yours, from {notebook.name}" if piece is not None else
                     f"{what}: labkit's in its place ({why})")
    return Pieces(**found), lines


def serve(engine: Engine, workload: list[tuple[int, Any, list[int], int]]) -> dict[Any, Request]:
    """Run ``workload`` on ``engine`` to the end: each ``(step, name, prompt_ids, max_new_tokens)`` arrives
    just before that step (1 is the first), as a user's request reaches a server between two steps.
    Returns every ``Request`` by name: ``output_token_ids``, ``num_cached_tokens`` (its first admission's hit)."""
    if not workload or any(type(w) is not tuple or len(w) != 4 or type(w[0]) is not int or w[0] < 1 for w in workload):
        raise ValueError("workload must be a non-empty list of (step >= 1, name, prompt_ids, max_new_tokens)")
    pending, requests = sorted(workload, key=lambda w: w[0]), {}
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= len(engine.stats) + 1:
            _, name, prompt, limit = pending.pop(0)
            requests[name] = engine.add_request(prompt, limit, request_id=name)
        engine.step()
    return requests


def report(engine: Engine) -> list[tuple[str, str]]:
    """What each piece did in ``engine``'s run (an ``Engine`` with ``pieces``), as ``(piece, what)`` rows."""
    stats, cfg = engine.stats, engine.model.config
    tokens = sum(s.scheduled_tokens for s in stats)
    return [
        ("decode_step (01)", f"{tokens * cfg.num_hidden_layers:,} calls: {tokens} tokens x {cfg.num_hidden_layers} layers"),
        ("Pager (03)", f"{engine.scheduler.pool.blocks_taken} blocks handed out, a pool of {engine.scheduler.num_blocks}"),
        ("cached_tokens (04)", f"{sum(s.prefix_hit_tokens for s in stats)} prompt tokens hit at first admission, "
                               f"{sum(s.preempted_hit_tokens for s in stats)} re-found after a preemption"),
        ("plan_step (05)", f"{len(stats)} steps, {sum(s.preemptions for s in stats)} preemption(s)"),
    ]


class PieceMismatch(AssertionError):
    """A piece answered otherwise than labkit's: ``piece``, ``where`` (step, request, ...), both answers."""

    def __init__(self, piece: str, where: dict, got: str, expected: str):
        self.piece, self.where, self.got, self.expected = piece, dict(where), got, expected
        at = ", ".join(f"{k} {v!r}" for k, v in where.items() if k != "chunks")
        super().__init__(f"{piece} differs from labkit's at {at}:\n  yours:    {got}\n  labkit's: {expected}")


def lockstep(pieces: Pieces) -> Pieces:
    """``pieces`` with each of the reader's wrapped to be checked against labkit's at every call
    (``PieceMismatch`` at the first difference); a seam left ``None`` stays labkit's, unchecked."""
    if not isinstance(pieces, Pieces):
        raise ValueError(f"pieces must be labkit.serving.pieces.Pieces, got {type(pieces).__name__}")
    own, where = Pieces.labkit(), pieces.where
    wrap: dict[str, Callable[[Any, Any, dict], Any]] = {
        "decode_step": _checked_step, "Pager": _checked_pager, "cached_tokens": _checked_hits,
        "plan_step": _checked_plan}
    return Pieces(**{name: None if getattr(pieces, name) is None else
                     wrap[name](getattr(pieces, name), getattr(own, name), where) for name in PIECES}, where=where)


def _checked_step(yours: Callable, labkit: Callable, where: dict) -> Callable:
    def decode_step(k_cache, v_cache, q, k, v, inv_freq):
        want = labkit(k_cache, v_cache, q, k, v, inv_freq)  # labkit's never writes into its inputs
        got = yours(k_cache, v_cache, q, k, v, inv_freq.clone())
        problem = _step_problem(got, want)
        if problem:
            at = {"step": where.get("step"), "request": where.get("chunks", [None] * 99)[where.get("sequence", 0)],
                  "layer": where.get("layer"), "position": where.get("position")}
            raise PieceMismatch(PIECES["decode_step"][1], at, *problem)
        return got
    return decode_step


def _step_problem(got: Any, want: tuple) -> tuple[str, str] | None:
    """What differs between the step's answer and labkit's: the shapes, then the appended K/V rows and ``out``
    (within 1e-3 relative, 1e-4 absolute), compared in one pass; None when they agree."""
    if type(got) is not tuple or len(got) != 3 or not all(isinstance(t, torch.Tensor) for t in got):
        return f"{type(got).__name__}, not (k_cache, v_cache, out)", "(k_cache, v_cache, out)"
    labels = ("k_cache", "v_cache", "out")
    for label, g, w in zip(labels, got, want):
        if g.shape != w.shape:
            return f"{label} of shape {tuple(g.shape)}", f"{label} of shape {tuple(w.shape)}"
    parts = [(got[0][-1], want[0][-1]), (got[1][-1], want[1][-1]), (got[2], want[2])]  # what this step added
    g = torch.cat([x.flatten().float() for x, _ in parts])
    w = torch.cat([y.flatten().float() for _, y in parts])
    bad = ((g - w).abs() > 1e-4 + 1e-3 * w.abs()).nonzero()
    if not len(bad):
        return None
    i, sizes = int(bad[0]), [x.numel() for x, _ in parts]
    part = 0 if i < sizes[0] else 1 if i < sizes[0] + sizes[1] else 2
    what = ["k_cache's new row", "v_cache's new row", "out"][part]
    return (f"{what}: {g[i].item():+.5f} at flat index {i - sum(sizes[:part])}",
            f"{what}: {w[i].item():+.5f} (off by up to {(g - w).abs().max().item():.2e})")


def _checked_hits(yours: Callable, labkit: Callable, where: dict) -> Callable:
    def cached_tokens(token_ids, block_size, key, cached):
        want = labkit(token_ids, block_size, key, cached)
        got = yours(list(token_ids), block_size, key, set(cached))
        if got != want or type(got) is not int:
            raise PieceMismatch(PIECES["cached_tokens"][1], where,
                                f"{got!r} tokens cached of {len(token_ids)}", f"{want} tokens cached")
        return got
    return cached_tokens


def _checked_plan(yours: Callable, labkit: Callable, where: dict) -> Callable:
    def plan_step(running, waiting, free_blocks, token_budget, block_size):
        want = labkit(list(running), list(waiting), free_blocks, token_budget, block_size)
        got = yours([tuple(r) for r in running], [tuple(w) for w in waiting], free_blocks, token_budget, block_size)
        plain = ([tuple(p) for p in got[0]], list(got[1])) if type(got) is tuple and len(got) == 2 else got
        if plain != want:
            names = [n for n, *_ in list(running) + list(waiting)]
            seen = [n for n in names if _role(plain, n) != _role(want, n)]
            raise PieceMismatch(PIECES["plan_step"][1], {"step": where.get("step"), "request": seen[0] if seen else None},
                                f"planned, preempted = {plain!r}", f"planned, preempted = {want!r} (rows: running "
                                f"{list(running)}, waiting {list(waiting)}, {free_blocks} free blocks)")
        return got
    return plan_step


def _role(plan: Any, name: Any) -> Any:
    """What ``plan`` does with request ``name``: its tokens, 'preempted', or None."""
    try:
        planned, preempted = plan
        return "preempted" if name in preempted else dict(planned).get(name)
    except (TypeError, ValueError):
        return "?"


def _checked_pager(yours: type, labkit: type, where: dict) -> type:
    class CheckedPager:
        """The reader's ``Pager`` with labkit's beside it, fed the same calls."""

        def __init__(self, num_blocks: int, block_size: int):
            self.yours, self.labkit = yours(num_blocks, block_size), LabkitPager(num_blocks, block_size)
            self.shape, self.tokens, self.blocks = (num_blocks, block_size), {}, {}

        def _fail(self, call: str, got: str, expected: str):
            raise PieceMismatch(PIECES["Pager"][1], {"step": where.get("step"), "request": where.get("request"),
                                                     "call": call}, got, expected)

        def append(self, seq_id, n):
            call, want = f"append({seq_id!r}, {n})", self.labkit.append(seq_id, n)
            got = self.yours.append(seq_id, n)
            if want is None or got is None:
                if (want is None) != (got is None):
                    self._fail(call, repr(got), "None (too few free blocks)" if want is None else f"{n} slots")
            elif problem := _slot_problem(got, seq_id, n, self.shape[1], self.shape[0], self.tokens, self.blocks):
                self._fail(call, problem.replace("gave", "it gave", 1), "slots in blocks that no other sequence holds")
            self._same_free(call)
            return got

        def free(self, seq_id):
            self.labkit.free(seq_id)
            self.yours.free(seq_id)
            self.tokens.pop(seq_id, None), self.blocks.pop(seq_id, None)
            self._same_free(f"free({seq_id!r})")

        def num_free(self):
            return self.yours.num_free()

        def _same_free(self, call: str):
            got, want = self.yours.num_free(), self.labkit.num_free()
            if got != want:
                self._fail(call, f"num_free() = {got!r} after it", f"num_free() = {want}")
    return CheckedPager


# --------------------------------------------------------------------------- four wrong pieces


class PeekingPager:
    """Chapter 03's ``Pager`` with one mistake: it takes new blocks from the top of its free list without
    removing them. Its free count is right; the next sequence gets the same blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size, self.free_ids, self.taken, self.tables = block_size, list(range(num_blocks)), 0, {}

    def num_free(self) -> int:
        return len(self.free_ids) - self.taken

    def append(self, seq_id: Any, n: int) -> list[int] | None:
        blocks, tokens = self.tables.get(seq_id, ([], 0))
        new = -(-(tokens + n) // self.block_size) - len(blocks)
        if new > self.num_free():
            return None
        blocks, self.taken = blocks + self.free_ids[len(self.free_ids) - new:], self.taken + new  # left in the list
        self.tables[seq_id] = (blocks, tokens + n)
        return [blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(tokens, tokens + n)]

    def free(self, seq_id: Any) -> None:
        self.taken -= len(self.tables.pop(seq_id)[0])


def counting_on(token_ids: list[int], block_size: int, key: Any, cached: Any) -> int:
    """Chapter 04's ``cached_tokens`` with one mistake: no stop at a miss, so a named block counts after a gap."""
    usable = token_ids[:(len(token_ids) - 1) // block_size * block_size]
    return sum(block_size for name in hash_chain(usable, block_size, key) if name in cached)  # no break


def oldest_first(running: list, waiting: list, free_blocks: int, token_budget: int, block_size: int) -> tuple:
    """Chapter 05's ``plan_step`` with one mistake: a running request that does not fit preempts the oldest."""
    return plan_rows(running, waiting, free_blocks, token_budget, block_size, victim=0)


def unscaled(k_cache, v_cache, q, k, v, inv_freq):
    """Chapter 01's ``decode_step`` with one mistake: no 1/sqrt(D) (here ``q`` is scaled up by sqrt(D) first)."""
    return decode_step(k_cache, v_cache, q * q.shape[-1] ** 0.5, k, v, inv_freq)


#: seam -> a wrong piece for it
WRONG_PIECES: dict[str, Any] = {"Pager": PeekingPager, "cached_tokens": counting_on, "plan_step": oldest_first,
                                "decode_step": unscaled}
