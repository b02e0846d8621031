"""Generates docs/cli.md, the command-line reference, from the commands' own argparse parsers.

    python scripts/gen_cli_docs.py            # rewrite docs/cli.md
    python scripts/gen_cli_docs.py --check    # exit 1 if docs/cli.md is out of date

Every command of ``albatross`` (``albatross.cli.COMMANDS``) and the other ``python -m`` tools the
docs use are read from the parser the command itself builds: its ``build_parser()`` where the
module has one, else the parser its ``main`` builds, taken at the moment ``main`` parses (nothing
runs). Each argument is rendered from the parser's actions (option strings, metavar, choices,
default, help), not from argparse's help text, whose layout changes between Python versions.
``tests/project/test_cli_docs.py`` regenerates the page and compares, so a new option shows up here or
the test fails. ``tests/project/test_docs_commands.py`` parses the commands of the guides with the same
parsers (``parser_for``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the project importable
    sys.path.insert(0, str(ROOT))

from albatross import cli  # noqa: E402
from scripts.docs_page import page_main  # noqa: E402

OUTPUT = ROOT / "docs" / "cli.md"
COMMAND = "python scripts/gen_cli_docs.py"


@dataclass(frozen=True)
class Tool:
    """A ``python -m`` command that ``albatross`` does not wrap, documented here too."""

    module: str
    summary: str


TOOLS = (
    Tool("model.hub.hf_import", "a local Hugging Face ALBERT directory -> a release"),
    Tool("engine.reshard", "a ZeRO checkpoint -> DeepSpeed's universal checkpoint, ahead of time"),
    Tool("finetune.lra.mini", "the CPU mini-LRA: every family on two generated tasks"),
    Tool("finetune.lra.baselines", "an LRA task's trivial baselines"),
)


class _Parsed(Exception):
    """Raised in place of parsing: carries the parser ``main`` built."""


def captured_parser(main: Callable[[list[str]], object]) -> argparse.ArgumentParser:
    """The parser ``main`` builds, taken when it starts parsing, before anything else runs."""

    def grab(self, args=None, namespace=None):
        raise _Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", grab):
        try:
            main(["--help"])
        except _Parsed as caught:
            return caught.args[0]
    raise RuntimeError(f"{main.__module__}.main did not parse its arguments")


def parser_for(module_name: str) -> argparse.ArgumentParser:
    """The argument parser of ``python -m module_name`` (or of the module ``main`` lives in)."""
    module = importlib.import_module(module_name)
    if module_name == "slurm.launcher":  # its main parses with slurm.cli's parser
        module = importlib.import_module("slurm.cli")
    if hasattr(module, "build_parser"):
        return module.build_parser()
    if module_name == "pretrain.__main__":
        return captured_parser(module.parse_args)
    return captured_parser(module.main)


# ----------------------------------------------------------------------------- rendering


def _escape(text: str) -> str:
    """Text for a Markdown table cell: pipes, HTML-like <names> and emphasis stars escaped
    outside code spans, one line."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            part = part.replace("\\", "\\\\").replace("*", "\\*").replace("<", "&lt;")
        out.append(part.replace("|", "\\|"))
    return "".join(out)


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest if not action.option_strings else action.dest.upper()


def _form(action: argparse.Action) -> str:
    """How the argument is written: ``--seeds SEEDS [SEEDS ...]``, ``overrides ...``."""
    name = ", ".join(action.option_strings) if action.option_strings else ""
    if action.nargs == 0:
        return name
    mv = _metavar(action)
    value = {
        None: mv,
        "?": f"[{mv}]",
        "*": f"[{mv} ...]",
        "+": f"{mv} [{mv} ...]",
        argparse.REMAINDER: "...",
    }.get(action.nargs, " ".join([mv] * action.nargs) if isinstance(action.nargs, int) else mv)
    return f"{name} {value}".strip()


def _default(action: argparse.Action) -> str:
    default = action.default
    if action.nargs == 0 or default in (None, argparse.SUPPRESS) or default == []:
        return ""
    if isinstance(default, (list, tuple)):
        default = " ".join(str(d) for d in default)
    return f"`{default}`"


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        params = {**vars(action), "prog": prog}
        params["default"] = action.default
        with contextlib.suppress(KeyError, TypeError, ValueError):  # a literal % in the help
            text = text % params
    return _escape(text)


def _group_title(parser: argparse.ArgumentParser, group) -> str:
    if group is parser._positionals:
        return "arguments"
    if group is parser._optionals:
        return "options"
    return group.title or "options"


def _table(parser: argparse.ArgumentParser) -> list[str]:
    lines: list[str] = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if action.help == argparse.SUPPRESS:
                continue
            required = " (required)" if action.required and action.option_strings else ""
            form = f"`{_form(action)}`{required}"
            rows.append(f"| {form} | {_default(action)} | {_help(action, parser.prog)} |")
        if rows:
            lines += [
                f"*{_group_title(parser, group)}*",
                "",
                "| argument | default | what |",
                "|---|---|---|",
                *rows,
                "",
            ]
    return lines


def _description(text: str | None) -> list[str]:
    if not text:
        return []
    return ["```text", inspect.cleandoc(text), "```", ""]


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _render_parser(title: str, same_as: str, parser: argparse.ArgumentParser, level: int):
    lines = [f"{'#' * level} `{title}`", ""]
    if same_as:
        lines += [f"The same as `{same_as}`.", ""]
    lines += _description(parser.description)
    lines += _table(parser)
    if parser.epilog:
        lines += [_escape(parser.epilog), ""]
    sub = _subcommands(parser)
    if sub is None:
        return lines
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    lines += ["| subcommand | what |", "|---|---|"]
    for name in sub.choices:
        anchor = _anchor(f"{title} {name}")
        lines.append(f"| [`{name}`](#{anchor}) | {_escape(helps.get(name, ''))} |")
    lines.append("")
    for name, child in sub.choices.items():
        child_same = f"{same_as} {name}" if same_as else ""
        lines += _render_parser(f"{title} {name}", child_same, child, level + 1)
    return lines


def _anchor(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def render() -> str:
    lines = [
        "# Command line",
        "",
        f"<!-- generated by {COMMAND} from the commands' parsers: do not edit -->",
        "",
        "Every stage is a subcommand of `albatross` (installed with the project) and a",
        "`python -m` module that takes exactly the same arguments. Each command's `--help`",
        "prints what is below. Dotted `key=value` overrides of a recipe are described in",
        "[Configuration](config.md). Exit codes: 0 done, 2 a mistake in the arguments, the",
        "config or the data (nothing was started), 1 a failure; fine-tuning exits 75 when it",
        "stopped with a checkpoint ([Troubleshooting](troubleshooting.md)).",
        "",
        "```text",
        cli._usage(),
        "```",
        "",
        "| command | what |",
        "|---|---|",
    ]
    for name, command in cli.COMMANDS.items():
        lines.append(
            f"| [`albatross {name}`](#{_anchor('albatross ' + name)}) | "
            f"{_escape(command.summary)} |"
        )
    lines.append(f"| `albatross bench` | {_escape(cli.BENCH_SUMMARY)} |")
    for tool in TOOLS:
        lines.append(f"| [`python -m {tool.module}`](#{_anchor('python -m ' + tool.module)}) | "
                     f"{_escape(tool.summary)} |")  # fmt: skip
    lines.append("")
    for name, command in cli.COMMANDS.items():
        parser = parser_for(command.module)
        lines += _render_parser(f"albatross {name}", f"python -m {command.form}", parser, 2)
    lines += [
        "## `albatross bench`",
        "",
        "`albatross bench` lists the benchmarks of `bench/` (a clone or an editable install);",
        "`albatross bench NAME [--] [args ...]` runs `python -m bench.bench_NAME` with the",
        "arguments after NAME; `albatross bench NAME --help` shows its options.",
        "",
    ]
    for tool in TOOLS:
        lines += _render_parser(f"python -m {tool.module}", "", parser_for(tool.module), 2)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return page_main(
        argv, "Generate docs/cli.md from the parsers.", OUTPUT, lambda _page: render(), COMMAND
    )


if __name__ == "__main__":
    sys.exit(main())
