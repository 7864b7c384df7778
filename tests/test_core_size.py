"""The core a learner reads stays small (issue 28): nano-vllm shows a whole engine in about 1,200
lines, with a block manager of about 120 and a scheduler of about 90. labkit's docstrings teach, so
its goals are looser, but they hold: a new rule replaces an old one, and a variant (reservations,
forking, priority, skip-ahead) lives in a module beside the core, not inside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LABKIT = Path(__file__).resolve().parent.parent / "labkit"


def lines(module: str) -> int:
    """Lines of ``labkit/<module>.py`` (``module`` a path inside labkit, such as ``memory/paging``)."""
    return len((LABKIT / f"{module}.py").read_text().splitlines())


def class_lines(module: str, name: str) -> int:
    tree = ast.parse((LABKIT / f"{module}.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return node.end_lineno - node.lineno + 1


CORE = ("memory/blocks", "memory/paging", "memory/prefix", "serving/scheduler")


@pytest.mark.parametrize("what, size, goal", [
    ("the core: block arithmetic, allocator and block tables, prefix cache, scheduler",
     lambda: sum(lines(m) for m in CORE), 1000),
    ("serving/scheduler.py", lambda: lines("serving/scheduler"), 400),
    ("the Scheduler class", lambda: class_lines("serving/scheduler", "Scheduler"), 180),
    ("the PrefixCache class", lambda: class_lines("memory/prefix", "PrefixCache"), 160),
    ("serving/sim/simulator.py", lambda: lines("serving/sim/simulator"), 450),
])
def test_the_core_stays_within_its_size(what, size, goal):
    assert size() <= goal, f"{what}: {size()} lines, over the goal of {goal}"


def test_the_core_holds_no_variant():
    """No name in the core's code belongs to a variant: they reach it through its one hook."""
    tree = ast.parse((LABKIT / "serving" / "scheduler.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} \
        | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} \
        | {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    for variant in ("priority", "fork", "allocation", "reserved_tokens", "advance_decodes", "skip_ahead"):
        assert variant not in names, variant
