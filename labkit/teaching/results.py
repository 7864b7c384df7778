"""The benchmarks' committed results, as a notebook finds them.

A benchmark runs for minutes (or needs vLLM, or a GPU), so a chapter reads what it wrote to
``benchmarks/results/`` in the repository instead of running it. The notebook runs in ``chapters/``
or ``solutions/`` (or the repository's root); a labkit installed without the repository (Colab's
``pip install``) has no results, and the chapter says so instead of failing.
"""

from __future__ import annotations

from pathlib import Path


def committed_result(pattern: str) -> Path | None:
    """The last file, by name, of ``benchmarks/results/`` matching ``pattern`` (dated names sort in time),
    looked for from the working folder up; None where there is no repository."""
    if not isinstance(pattern, str) or not pattern or "/" in pattern:
        raise ValueError(f"pattern must be a file name pattern such as 'vllm_cpu_*.json', got {pattern!r}")
    for folder in (Path.cwd(), *Path.cwd().parents):
        found = sorted((folder / "benchmarks" / "results").glob(pattern))
        if found:
            return found[-1]
    return None
