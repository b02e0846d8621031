"""The documentation site builds in strict mode (mkdocs.yml: a broken link or anchor, or a page
left out of the navigation, fails), and the pages stand alone: no links out of the site but to
public URLs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip(
        "mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'"
    )
    pytest.importorskip(
        "material", reason="the docs extra is not installed: pip install -e '.[docs]'"
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "getting-started" / "index.html").is_file()
    assert (tmp_path / "site" / "cli" / "index.html").is_file()


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_links_stay_in_the_site_or_go_to_public_urls():
    bad = []
    for page in sorted(DOCS.glob("*.md")):
        for link in _links(page.read_text()):
            if link.startswith(("https://", "http://", "#", "mailto:")):
                continue
            if "://" in link or link.startswith(("/", "..")):
                bad.append(f"{page.name}: {link}")
    assert not bad, bad


def test_readme_links_land():
    text = (ROOT / "README.md").read_text()
    for link in _links(text):
        if link.startswith(("https://", "http://")):
            continue
        path = link.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README.md links to {link}, which does not exist"
    assert len(text.splitlines()) <= 250
    begin, end = "<!-- results:begin -->", "<!-- results:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end)


def test_pages_do_not_speak_of_how_the_work_was_done():
    """Users' pages describe the code as it is: no issue numbers, no shared working notes, no
    "pending" measurements. The hand-written pages; the generated ones (config.md, cli.md,
    attention.md, benchmarks.md) say what the code's docstrings and results say."""
    pattern = re.compile(
        r"\.\./shared|\bissue #?\d+|#\d{3,}\b|(GPU|time|timing) pending|pending a GPU|\bused to\b"
    )
    bad = []
    generated = {"config.md", "cli.md", "attention.md", "benchmarks.md"}
    pages = [p for p in sorted(DOCS.glob("*.md")) if p.name not in generated]
    for page in [ROOT / "README.md", *pages]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{page.name}:{n}: {line.strip()[:100]}")
    assert not bad, bad
