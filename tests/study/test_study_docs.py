"""docs/studies.md's generated tables (scripts/gen_study_docs.py) match the shipped specs, the
committed study reports and the benchmark throughput: the committed page equals a fresh
rendering, and a changed figure changes the page."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_study_docs.py"


@pytest.fixture(scope="module")
def gen():
    return importlib.import_module("scripts.gen_study_docs")


def test_committed_page_is_up_to_date(gen):
    if gen.main(["--check"]) != 0:
        pytest.fail("docs/studies.md is out of date: run `python scripts/gen_study_docs.py`")


def test_a_changed_report_changes_the_page(gen, tmp_path, monkeypatch, capsys):
    page = tmp_path / "studies.md"
    page.write_text((ROOT / "docs" / "studies.md").read_text())
    assert gen.main(["--check", "--page", str(page)]) == 0
    reports = tmp_path / "reports"
    reports.mkdir()
    (committed,) = gen.REPORTS.glob("transject-lra-*.json")
    data = json.loads(committed.read_text())
    data["ours"][0]["aggregate"] += 1.0  # one figure moves
    (reports / committed.name).write_text(json.dumps(data))
    monkeypatch.setattr(gen, "REPORTS", reports)
    assert gen.main(["--check", "--page", str(page)]) == 1
    assert "run python scripts/gen_study_docs.py" in capsys.readouterr().err
