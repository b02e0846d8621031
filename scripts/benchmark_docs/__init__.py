"""The figures of docs/benchmarks.md and of README.md's results block, computed from the result
files in ``bench/results/`` (``scripts/gen_benchmark_docs.py`` puts them into the prose of
``scripts/benchmarks.src.md``).

``figures(results)`` returns ``{"section.name": text}``: markdown tables, the command, machine
and date behind each result, single numbers the prose quotes, and the verdicts (met / not met)
that follow from them. Nothing here is a measurement: every number comes from a result file.
"""

from __future__ import annotations

from pathlib import Path

from benchmark_docs import cpu, gpu, paths, reports
from benchmark_docs.reports import README_BLOCK
from benchmark_docs.util import Results, prefixed

__all__ = ["README_BLOCK", "figures"]


def figures(results: Path) -> dict[str, str]:
    """Every figure of the page and the README block: ``{"section.name": text}``."""
    res = Results(results)
    out: dict[str, str] = {}
    for module in (cpu, gpu, paths, reports):
        for name, fn in module.SECTIONS.items():
            out.update(prefixed(name, fn(res)))
    return out
