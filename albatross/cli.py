"""``albatross <command> [args ...]``: one command for every stage, installed by ``pip install``
(``[project.scripts]`` in pyproject.toml). Each command hands its arguments, unchanged, to the
stage's own command line, so ``albatross pretrain --config r.yaml x=1`` is ``python -m pretrain
--config r.yaml x=1`` (same options, same help, same exit codes), and the ``python -m`` forms
keep working. ``albatross bench NAME [--] [args ...]`` runs the benchmark ``python -m
bench.bench_NAME`` of the source tree (an editable install or a clone) with Python.

Under a launcher, e.g. ``torchrun --nproc_per_node 2 --no-python albatross pretrain ...``.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROG = "albatross"


@dataclass(frozen=True)
class Command:
    module: str
    """The module whose ``main(argv)`` runs the stage (``python -m <form>``)."""
    form: str
    """Its ``python -m`` form."""
    summary: str


COMMANDS: dict[str, Command] = {
    "data-prep": Command(
        "data_prep.__main__",
        "data_prep",
        "tokenizer, shards, finalize, inspect, listops: the pretraining data",
    ),
    "pretrain": Command("pretrain.__main__", "pretrain", "pretrain an encoder from a recipe"),
    "export": Command(
        "pretrain.export",
        "pretrain.export",
        "a release or a Hugging Face directory from a run's checkpoint",
    ),
    "finetune": Command(
        "finetune.__main__",
        "finetune",
        "GLUE and Long Range Arena fine-tuning, their summaries, LRA shards",
    ),
    "slurm": Command(
        "slurm.launcher", "slurm", "submit (or --local / --dry-run) a stage as a Slurm job"
    ),
    "study": Command(
        "study.cli",
        "study",
        "plan, run (here or on Slurm), status and report a paper's table (configs/studies/)",
    ),
}
BENCH_SUMMARY = "run a benchmark script of bench/ (albatross bench: the list)"


def _usage() -> str:
    width = max(len(name) for name in [*COMMANDS, "bench"])
    lines = [
        f"usage: {PROG} <command> [args ...]",
        "",
        "ALBERT-style encoders: data preparation, pretraining, export, fine-tuning, Slurm and",
        "benchmarks in one command. Each command takes the arguments of its `python -m` form",
        f"(shown in brackets) and `{PROG} <command> --help` shows them.",
        "",
        "commands:",
    ]
    for name, command in COMMANDS.items():
        lines.append(f"  {name:<{width}}  {command.summary} [python -m {command.form}]")
    lines.append(f"  {'bench':<{width}}  {BENCH_SUMMARY}")
    lines += [
        "",
        "options:",
        "  -h, --help  show this help and exit",
        "  --version   show the version and exit",
    ]
    return "\n".join(lines)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("albatross")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def stage_main(name: str) -> Callable[[list[str]], int]:
    """The ``main(argv)`` of command ``name`` (imported now: only the stage asked for)."""
    return importlib.import_module(COMMANDS[name].module).main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(_usage(), file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help", "help"):
        if name == "help" and rest:  # albatross help pretrain
            return main([rest[0], "--help"])
        print(_usage())
        return 0
    if name == "--version":
        print(f"{PROG} {_version()}")
        return 0
    if name == "bench":
        return bench(rest)
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, [*COMMANDS, "bench"], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return _error(f"unknown command {name!r}{hint} (see {PROG} --help)")
    status = stage_main(name)(rest)
    return int(status or 0)


# ----------------------------------------------------------------------------- bench


def bench_dir() -> Path | None:
    """``bench/`` of the source tree this package runs from (None in a non-editable install:
    the benchmarks are scripts of the repository, not part of the package)."""
    here = Path(__file__).resolve().parents[1] / "bench"
    return here if here.is_dir() else None


def bench_scripts(root: Path) -> dict[str, Path]:
    """Benchmark name -> script: ``bench_<name>.py`` (name with dashes; underscores and the
    file name are accepted too) and ``<name>.sh``."""
    scripts = {p.stem.removeprefix("bench_").replace("_", "-"): p for p in root.glob("bench_*.py")}
    scripts.update({p.stem.replace("_", "-"): p for p in root.glob("*.sh")})
    return dict(sorted(scripts.items()))


def _first_line(path: Path) -> str:
    """The first line of a script's docstring (or its first comment), without importing it."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".py":
        try:
            doc = ast.get_docstring(ast.parse(text))
        except SyntaxError:
            doc = None
        return (doc or "").strip().splitlines()[0] if doc else ""
    for line in text.splitlines()[1:]:
        if line.startswith("#") and line.strip("# ").strip():
            return line.strip("# ").strip()
    return ""


def _bench_usage(scripts: dict[str, Path]) -> str:
    width = max((len(name) for name in scripts), default=0)
    lines = [
        f"usage: {PROG} bench NAME [--] [args ...]",
        "",
        "Runs python -m bench.bench_NAME (or bench/NAME.sh) of the source tree with this Python,",
        "the arguments after NAME going to the script (`--` before them is optional);",
        f"`{PROG} bench NAME --help` shows its options. Results and how to read them:",
        "docs/benchmarks.md.",
        "",
        "benchmarks:",
    ]
    lines += [f"  {name:<{width}}  {_first_line(path)}" for name, path in scripts.items()]
    return "\n".join(lines)


def bench(argv: list[str]) -> int:
    """``albatross bench``: the list; ``albatross bench NAME [--] args``: run one."""
    root = bench_dir()
    if root is None:
        return _error(
            "the benchmarks are scripts of the source tree (bench/), not of the installed "
            "package: run them from a clone (pip install -e . there)"
        )
    scripts = bench_scripts(root)
    if not argv or argv[0] in ("-h", "--help"):
        print(_bench_usage(scripts))
        return 0
    name, rest = argv[0], argv[1:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    key = name.removesuffix(".py").removesuffix(".sh").removeprefix("bench_").replace("_", "-")
    script = scripts.get(key)
    if script is None:
        close = difflib.get_close_matches(key, list(scripts), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return _error(
            f"no benchmark {name!r}{hint} (valid: {', '.join(scripts)}; {PROG} bench lists them)"
        )
    if script.suffix != ".py":
        return subprocess.call(["bash", str(script), *rest])
    # the package `bench` of the source tree, importable from any folder
    path = os.pathsep.join(p for p in (str(root.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.call([sys.executable, "-m", f"bench.{script.stem}", *rest], env=env)


def run() -> None:
    """The ``albatross`` console script: ``main``, then the process ends without Python's
    interpreter teardown (``engine/process_exit.py``)."""
    from engine.process_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    run()
