"""CITATION.cff is CFF 1.2.0 with the keys the format requires and the three methods' papers
under references; LICENSE is the Apache License 2.0 that pyproject.toml and CITATION.cff name.
(The file also passes `cffconvert --validate`, the format's reference validator.)"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def citation() -> dict:
    return yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))


def test_citation_has_the_required_keys():
    cff = citation()
    assert cff["cff-version"] == "1.2.0"
    for key in ("message", "title", "authors", "license"):
        assert cff[key], key
    assert all("name" in a or "family-names" in a for a in cff["authors"])


def test_citation_references_the_three_methods_papers():
    refs = {r["title"].strip(): r for r in citation()["references"]}
    expected = {
        "The Case for Translation-Invariant Self-Attention in Transformer-Based Language Models": (
            "2106.01950",
            {"Wennberg", "Henter"},
        ),
        "Manifold-Preserving Transformers are Effective for Short-Long Range Encoding": (
            "2310.14206",
            {"Sengupta", "Akhtar", "Chakraborty"},
        ),
        "Linear Self-Attention Approximation via Trainable Feedforward Kernel": (
            "2211.04076",
            {"Yorsh", "Kovalenko"},
        ),
    }
    for title, (arxiv, names) in expected.items():
        ref = refs[title]
        assert {a["family-names"] for a in ref["authors"]} == names, title
        assert isinstance(ref["year"], int) and ref["doi"] and ref["type"] == "conference-paper"
        assert any(arxiv in i["value"] for i in ref["identifiers"]), title


def test_citation_references_the_protocols_the_recipes_follow():
    """ALBERT (pretraining), GLUE, LRA, Skyformer's LRA recipe, Amos et al.'s self-pretraining;
    and the software's own preferred citation."""
    cff = citation()
    arxiv = {
        i["value"].rsplit("/", 1)[-1]
        for r in cff["references"]
        for i in r.get("identifiers", [])
        if "arxiv.org" in i["value"]
    }
    protocols = {"1909.11942", "1804.07461", "2011.04006", "2111.00035", "2310.02980"}
    assert protocols <= arxiv, protocols - arxiv
    assert len(cff["references"]) == 3 + len(protocols)
    assert cff["preferred-citation"]["type"] == "software"
    assert cff["preferred-citation"]["title"].strip() == cff["title"].strip()


def test_license_is_apache_2_everywhere():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("Copyright 2026 the albatross authors\n")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    sections = re.findall(r"(?m)^   (\d)\. ", text)
    assert sections == [str(i) for i in range(1, 10)]  # the nine sections, none left out
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'(?m)^license = "Apache-2.0"$', pyproject)
    assert citation()["license"] == "Apache-2.0"
