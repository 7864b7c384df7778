"""labkit.teaching.excerpts prints exact excerpts of labkit's code, and refuses markers that are gone."""

import inspect

import pytest

from labkit.kernels import triton_paged
from labkit.memory import blocks
from labkit.teaching.excerpts import excerpt, excerpt_lines


def test_excerpt_is_the_lines_between_the_markers(capsys):
    number, lines = excerpt_lines(blocks.blocks_needed, "def blocks_needed", "return")
    source, start = inspect.getsourcelines(blocks.blocks_needed)
    assert number == start and lines[0] == source[0]
    assert "return" in lines[-1] and all("return" not in l for l in lines[:-1])
    excerpt(blocks.blocks_needed, "def blocks_needed", "return")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# memory/blocks.py, line ")
    assert out[1].split(None, 1)[1] == "def blocks_needed" + source[0].split("def blocks_needed", 1)[1].rstrip()


def test_excerpt_reads_a_triton_kernel_dedented(capsys):
    excerpt(triton_paged.paged_decode_kernel, "tl.program_id(0)")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("# kernels/triton_paged.py, line ")
    assert out[1].split("  ", 1)[1].startswith("seq = tl.program_id(0)")  # no indentation left


def test_missing_markers_raise():
    with pytest.raises(ValueError, match="first="):
        excerpt_lines(blocks.blocks_needed, "no such line")
    with pytest.raises(ValueError, match="last="):
        excerpt_lines(blocks.blocks_needed, "def blocks_needed", "no such line")


def test_committed_result_finds_the_newest_benchmark_file_or_none(tmp_path, monkeypatch):
    """Issue 43: chapters read a benchmark's committed results through one helper."""
    import pytest

    from labkit.teaching.results import committed_result

    results = tmp_path / "repo" / "benchmarks" / "results"
    results.mkdir(parents=True)
    for name in ("vllm_cpu_2026-12-01.json", "vllm_cpu_2026-12-03.json", "vllm_cpu_2026-12-03.md"):
        (results / name).write_text("{}")
    (tmp_path / "repo" / "chapters").mkdir()
    monkeypatch.chdir(tmp_path / "repo" / "chapters")  # a notebook runs in chapters/
    assert committed_result("vllm_cpu_*.json") == results / "vllm_cpu_2026-12-03.json"
    assert committed_result("kernels_static.json") is None
    monkeypatch.chdir(tmp_path)  # no repository above: no results
    assert committed_result("vllm_cpu_*.json") is None
    for bad in ("", None, "results/vllm_cpu_*.json"):
        with pytest.raises(ValueError, match="pattern"):
            committed_result(bad)
