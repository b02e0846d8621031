"""The command line every generated docs page shares: ``python scripts/gen_<page>.py`` writes
the page, ``--check`` exits 1 when the committed page differs from a fresh render (the drift
tests run the same comparison)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def page_main(
    argv: Sequence[str] | None,
    description: str,
    output: Path,
    render: Callable[[str], str],
    command: str,
) -> int:
    """``render`` gets the page as it is ("" when there is none: a page generated between
    markers keeps the rest)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    parser.add_argument(
        "--out", "--page", type=Path, default=output, help=f"the page ({output.name})"
    )
    args = parser.parse_args(argv)
    current = args.out.read_text() if args.out.is_file() else ""
    text = render(current)
    if args.check:
        if current != text:
            print(f"{args.out} is out of date: run {command} to update it", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0
