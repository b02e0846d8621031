"""docs/benchmarks.md and README.md's results block are generated from bench/results
(scripts/gen_benchmark_docs.py): the committed text equals a fresh rendering, a changed figure in
a result file changes both (and the check fails), every result file says how it was made, and
every link to the page lands on one of its headings."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_benchmark_docs.py"


@pytest.fixture(scope="module")
def gen():
    return importlib.import_module("scripts.gen_benchmark_docs")


def test_committed_page_and_readme_block_are_up_to_date(gen, capsys):
    if gen.main(["--check"]) != 0:
        pytest.fail(
            "docs/benchmarks.md or README.md's results block is out of date with bench/results: "
            f"run `python scripts/gen_benchmark_docs.py` ({capsys.readouterr().err.strip()})"
        )


def test_a_changed_figure_changes_the_page_and_the_block(gen, tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(gen.RESULTS, results)
    page, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    page.write_text(gen.PAGE.read_text())
    readme.write_text(gen.README.read_text())
    args = ["--results", str(results), "--page", str(page), "--readme", str(readme)]
    assert gen.main(["--check", *args]) == 0

    compiled = results / "gpu_h100_compiled" / "compiled" / "pretrain_gpu.json"
    data = json.loads(compiled.read_text())
    softmax = next(r for r in data["rows"] if r["family"] == "softmax")
    old = f"{1e3 * softmax['step_s']:.1f}"
    softmax["step_s"] *= 1.5  # one figure moves
    new = f"{1e3 * softmax['step_s']:.1f}"
    compiled.write_text(json.dumps(data))

    assert gen.main(["--check", *args]) == 1
    err = capsys.readouterr().err
    assert f"{page} is out of date: run python scripts/gen_benchmark_docs.py" in err
    assert f"{readme} is out of date" in err
    assert gen.main(args) == 0
    text, block = page.read_text(), readme.read_text()
    assert text != gen.PAGE.read_text()
    assert f"| softmax | {new} (" in text and f"| softmax | {old} (" not in text
    assert f"| softmax | {new} |" in block  # the README's table
    assert gen.main(["--check", *args]) == 0


def test_readme_without_markers_is_refused_by_name(gen, tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# albatross\n\nNo results block here.\n")
    page = tmp_path / "benchmarks.md"
    assert gen.main(["--readme", str(readme), "--page", str(page)]) == 2
    err = capsys.readouterr().err
    assert gen.BEGIN in err and gen.END in err
    assert readme.read_text() == "# albatross\n\nNo results block here.\n"
    assert not page.exists()


def test_only_the_text_between_the_markers_changes(gen):
    readme = f"# title\n\nbefore\n{gen.BEGIN}\nold\n{gen.END}\nafter\n"
    assert gen.replace_block(readme, f"{gen.BEGIN}\nnew\n{gen.END}") == (
        f"# title\n\nbefore\n{gen.BEGIN}\nnew\n{gen.END}\nafter\n"
    )


def test_a_placeholder_without_a_figure_is_an_error(gen):
    with pytest.raises(gen.DocsError, match=r"nothing\.here"):
        gen.fill("a {{ nothing.here }} b", {"x.y": "1"}, "template")


def test_every_result_file_records_command_machine_and_date(gen):
    missing = []
    for path in sorted(gen.RESULTS.rglob("*.json")):
        data = json.loads(path.read_text())
        lacks = [k for k in ("command", "machine", "date") if not data.get(k)]
        if lacks:
            missing.append(f"{path.relative_to(ROOT)}: {', '.join(lacks)}")
    assert not missing, missing


def _anchor(heading: str) -> str:
    """The anchor MkDocs and GitHub give a heading: lower case, punctuation dropped."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_to_the_page_land_on_its_headings(gen):
    text = gen.PAGE.read_text()
    headings = {_anchor(h) for h in re.findall(r"(?m)^#+ (.+)$", text)}
    inside = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert inside <= headings, sorted(inside - headings)
    outside: dict[str, set[str]] = {}
    places = [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "configs").rglob("*.yaml"),
    ]
    for package in ("engine", "model", "pretrain", "finetune", "data_prep", "bench", "study"):
        places += (ROOT / package).rglob("*.py")
    for path in places:
        for anchor in re.findall(r"benchmarks\.md#([\w-]+)", path.read_text()):
            outside.setdefault(anchor, set()).add(str(path.relative_to(ROOT)))
    wrong = {a: sorted(p) for a, p in outside.items() if a not in headings}
    assert not wrong, wrong


def test_the_page_reads_as_the_current_state(gen):
    text = gen.PAGE.read_text().lower()
    for word in (r"\bpending\b", r"\bused to\b", r"\bcall \d", r"\bbudget\b", r"\bnow\b",
                 r"\bbefore\s*/\s*after\b"):  # fmt: skip
        assert not re.search(word, text), word
