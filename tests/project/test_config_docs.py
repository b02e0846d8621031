"""docs/config.md is generated from the config dataclasses (scripts/gen_config_docs.py): the
committed page equals a fresh rendering, every user-facing field has a docstring, every link
inside the page lands on a heading, and the docstring reader handles inheritance."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import typing
from pathlib import Path

import pytest

from model.typed_config import config_sections, field_docs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_config_docs.py"


@pytest.fixture(scope="module")
def gen():
    return importlib.import_module("scripts.gen_config_docs")


def test_committed_page_is_up_to_date(gen):
    committed = (ROOT / "docs" / "config.md").read_text()
    if committed != gen.render():
        pytest.fail(
            "docs/config.md is out of date with the config dataclasses: run "
            "`python scripts/gen_config_docs.py` to update it (and commit the result)"
        )


def test_check_mode_reports_a_stale_page(gen, tmp_path, capsys):
    page = tmp_path / "config.md"
    page.write_text("old\n")
    assert gen.main(["--check", "--out", str(page)]) == 1
    assert "run python scripts/gen_config_docs.py" in capsys.readouterr().err
    assert gen.main(["--out", str(page)]) == 0
    assert gen.main(["--check", "--out", str(page)]) == 0


def _leaf_fields(gen, cls, seen):
    """(class, field name) of every field that is not a section, below ``cls``."""
    if cls in seen:
        return
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    for sub in config_sections(cls).values():  # e.g. the attention families' settings
        yield from _leaf_fields(gen, sub, seen)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        sub = gen.section_class(cls, f.name, hints[f.name])
        if sub is None:
            yield cls, f.name
        else:
            yield from _leaf_fields(gen, sub, seen)


def test_every_config_field_has_a_docstring(gen):
    seen: set[type] = set()
    missing = [
        f"{cls.__module__}.{cls.__qualname__}.{name}"
        for root in gen.ROOTS
        for cls, name in _leaf_fields(gen, root.cls, seen)
        if name not in field_docs(cls)
    ]
    assert not missing, (
        f"config fields without a docstring under them (docs/config.md needs one): {missing}"
    )


def test_every_link_in_the_page_lands_on_a_heading(gen):
    text = gen.render()
    headings = {gen.anchor(h) for h in re.findall(r"(?m)^#+ (.+)$", text)}
    links = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert links and links <= headings, sorted(links - headings)


def test_pages_sections_name_every_recipe_key(gen):
    text = gen.render()
    for key in ("engine.zero_stage", "optimizer.lr", "train.run_dir"):
        section, name = key.split(".")
        assert f"### pretrain: `{section}`" in text
        assert f"| `{name}` |" in text
    assert "| `attention` | str | `softmax` |" in text  # EncoderConfig's own default


@dataclasses.dataclass
class _Base:
    a: int = 1
    """The base's a."""
    b: str = "x"
    c: float = 0.5
    """The base's c,
    on two lines."""


@dataclasses.dataclass
class _Child(_Base):
    c: float = 1.5
    """The child's c."""
    d: bool = True
    """The child's d."""


def test_field_docs_reads_attribute_docstrings_with_inheritance():
    assert field_docs(_Child) == {
        "a": "The base's a.",
        "c": "The child's c.",
        "d": "The child's d.",
    }
    assert field_docs(_Base)["c"] == "The base's c,\non two lines."
