"""docs/cli.md (scripts/gen_cli_docs.py, from the commands' parsers) and docs/attention.md
(scripts/gen_attention_docs.py, from the docstrings of model/attention/) are generated: the
committed pages equal a fresh rendering, every command and option is on the page, and a new
option changes it."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from albatross import cli

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    return importlib.import_module(f"scripts.{name}")


@pytest.fixture(scope="module")
def gen_cli():
    return _load("gen_cli_docs")


@pytest.fixture(scope="module")
def gen_attention():
    return _load("gen_attention_docs")


def test_cli_page_is_up_to_date(gen_cli):
    if gen_cli.main(["--check"]) != 0:
        pytest.fail("docs/cli.md is out of date: run `python scripts/gen_cli_docs.py`")


def test_attention_page_is_up_to_date(gen_attention):
    if gen_attention.main(["--check"]) != 0:
        pytest.fail("docs/attention.md is out of date: run `python scripts/gen_attention_docs.py`")


def test_every_command_and_option_is_on_the_page(gen_cli):
    page = gen_cli.render()
    for name, command in cli.COMMANDS.items():
        assert f"## `albatross {name}`" in page
        parser = gen_cli.parser_for(command.module)
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help") and action.help != argparse.SUPPRESS:
                    assert option in page, (name, option)
    for sub in ("glue", "glue-summary", "lra", "lra-summary", "lra-shards", "compare"):
        assert f"### `albatross finetune {sub}`" in page
    assert "`--print-config`" in page and "`--executor {local,slurm}`" in page


def test_a_new_option_changes_the_page(gen_cli, monkeypatch, tmp_path):
    page = tmp_path / "cli.md"
    assert gen_cli.main(["--out", str(page)]) == 0
    assert gen_cli.main(["--check", "--out", str(page)]) == 0
    real = gen_cli.parser_for

    def with_new_option(module):
        parser = real(module)
        if module == "pretrain.__main__":
            parser.add_argument("--brand-new", help="an option added to the code")
        return parser

    monkeypatch.setattr(gen_cli, "parser_for", with_new_option)
    assert gen_cli.main(["--check", "--out", str(page)]) == 1
    assert "`--brand-new BRAND_NEW`" in gen_cli.render()


def test_captured_parser_runs_nothing(gen_cli):
    """The parser of a command whose main builds it is taken before main does any work."""
    ran = []

    def main(argv):
        parser = argparse.ArgumentParser(prog="x")
        parser.add_argument("--flag")
        parser.parse_args(argv)
        ran.append(True)

    parser = gen_cli.captured_parser(main)
    assert parser.prog == "x" and not ran


def test_attention_page_holds_every_hook(gen_attention):
    import dataclasses

    from model.attention.base import AttentionFamily

    page = gen_attention.render()
    for f in dataclasses.fields(AttentionFamily):
        assert f"* **`{f.name}`**" in page
    assert "def forward(self, q_BHNh: Tensor" in page
