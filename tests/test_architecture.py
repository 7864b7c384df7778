"""labkit's folders are its architecture, and its imports run one way (issue 37).

Every import in labkit is read from the source, at the top of a module and inside functions alike
(a lazy import is still a dependency), and checked against the layers ``labkit/__init__.py`` lists:
a module may import its own subpackage, the layers before its own and the two base modules, never a
later layer; no module imports itself back through others (no circle); ``labkit.teaching`` sits on
top, and nothing outside it imports it. Every name is imported from the module that defines it, in
labkit and in the book, tests, benchmarks and tools alike: no module keeps an old path alive.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LABKIT = ROOT / "labkit"
# The layers, in order: each may import the ones before it (labkit/__init__.py's table).
LAYERS = ["base", "model", "memory", "kernels", "caches", "serving", "vllm_bridge", "teaching"]
BASE = {"labkit.checks", "labkit.units"}
MAX_LINES = 700
# The root's own API: where labkit runs (``labkit.kernels.device``), for every notebook's first cell.
ROOT_API = {"DEVICE", "RUNTIME", "describe", "device", "__version__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(LABKIT.rglob("*.py"))}


def layer(module: str) -> str:
    if module == "labkit" or module in BASE:
        return "base"
    return module.split(".")[1]


def defined_names(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level (inside top-level ``if`` and ``try`` blocks too)."""
    names: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.If):
                walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body)
                for handler in node.handlers:
                    walk(handler.body)

    walk(tree.body)
    return names


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """Every ``import`` of a labkit module in ``path``: (line, module, names imported from it)."""
    here = module_name(path) if path.is_relative_to(LABKIT) else ""
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "labkit" or module.startswith("labkit."):
                found.append((node.lineno, module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "labkit"]
    return found


def edges(path: Path) -> list[tuple[int, str]]:
    """The labkit modules ``path`` depends on: a ``from pkg import sub`` of a submodule is ``pkg.sub``."""
    out = []
    for line, module, names in imports(path):
        subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
        out += [(line, s) for s in subs] if subs else [(line, module)]
    return out


GRAPH = {m: sorted({t for _, t in edges(p) if t != m}) for m, p in MODULES.items()}


def test_every_module_is_seen():
    assert {"labkit.serving.scheduler", "labkit.memory.prefix", "labkit.kernels.paged_attention",
            "labkit.teaching.exercises", "labkit.vllm_bridge.driver"} <= set(MODULES)
    assert GRAPH["labkit.serving.scheduler"], "the scheduler's imports were not read"


def find_circle(graph: dict[str, list[str]]) -> list[str] | None:
    """A circle of imports, as the modules along it, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in graph.get(m, []):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (circle := visit(t)):
                return circle
        path.pop()
        state[m] = 2
        return None

    for m in graph:
        if m not in state and (circle := visit(m)):
            return circle
    return None


def test_no_module_imports_itself_back():
    circle = find_circle(GRAPH)
    assert circle is None, "an import circle: " + " -> ".join(circle)


def test_the_circle_finder_finds_a_circle():
    """The test above can fail: the finder reports a circle through a lazy import, as the old layout had."""
    assert find_circle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_circle({"a": ["b"], "b": ["c"], "c": []}) is None
    lazy = ast.parse("def f():\n    from .kernels import x\n")
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(lazy))  # imports() walks function bodies too


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "labkit"))
def test_imports_run_down_the_layers(module):
    """A module imports its own layer, earlier layers and the base, never a later layer."""
    mine = LAYERS.index(layer(module))
    for line, target in edges(MODULES[module]):
        if target == "labkit":
            continue
        assert target in MODULES, f"{module}:{line} imports {target}, which does not exist"
        assert LAYERS.index(layer(target)) <= mine, \
            f"{module}:{line} imports {target}: layer {layer(target)!r} comes after {layer(module)!r}"


def test_nothing_outside_teaching_imports_it():
    for module, path in MODULES.items():
        if layer(module) != "teaching":
            assert not [t for _, t in edges(path) if layer(t) == "teaching"], module


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_700_lines(module):
    n = len(MODULES[module].read_text().splitlines())
    assert n <= MAX_LINES, f"{module}: {n} lines, over {MAX_LINES}: split it by job"


def test_all_lists_only_what_the_module_defines():
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        listed = next((ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                       and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)), [])
        assert not set(listed) - defined_names(tree), f"{module}.__all__ re-exports {set(listed) - defined_names(tree)}"


def sources() -> list[Path]:
    """Every Python file of the repository that may import labkit: labkit, the book, tests, benchmarks, tools."""
    return sorted(p for folder in ("labkit", "book", "tests", "benchmarks", "tools", "site")
                  for p in (ROOT / folder).rglob("*.py"))


def test_every_name_comes_from_where_it_is_defined():
    """``from labkit.x import name``: ``name`` is defined in ``labkit.x`` (or is its submodule), nowhere else."""
    defined = {m: defined_names(ast.parse(p.read_text())) for m, p in MODULES.items()}
    wrong = []
    for path in sources():
        for line, module, names in imports(path):
            if module not in MODULES:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: no module {module}")
                continue
            for name in names:
                if f"{module}.{name}" in MODULES or name in defined[module]:
                    continue
                if module == "labkit" and name in ROOT_API:
                    continue
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {module} does not define {name}")
    assert not wrong, "\n".join(wrong)
