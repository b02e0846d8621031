"""The commands of the README and of the guides a new user follows (getting started -> data ->
pretraining -> GLUE submission -> Hub export) are checked against the code: every fenced ``bash`` block of those
pages is split into command lines, and each line is dispatched on its program.

* ``albatross ... --help`` / ``python -m ... --help`` and ``python -m pretrain ... --print-config``
  are **run**, in-process (they do no work);
* every other command of the project (``albatross X``, ``python -m X``, under ``torchrun`` /
  ``srun``, and the stage arguments after ``sbatch slurm/<stage>.sbatch``) is **parsed** by the
  stage's real argument parser (``scripts/gen_cli_docs.py``'s ``parser_for``); a pretraining
  command's recipe and overrides are then resolved into the typed config, and a GLUE or LRA
  command's recipe too (unknown keys and bad values fail), without training;
* ``bash <script>`` must name a script of the repository, ``pip install -e '.[x]'`` an extra of
  pyproject.toml, and every ``configs/...yaml``, ``slurm/...sbatch`` and ``scripts/...`` a
  command names must exist;
* other programs (``hf``, ``tensorboard``, ``curl``, ...) must be in ``EXTERNAL``, the tools a user
  has; their arguments are not checked. An inline script (``python - <<'PY'``) is skipped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = (
    "../README.md",
    "getting-started.md",
    "data.md",
    "pretraining.md",
    "glue.md",
    "hub.md",
)
"""Under docs/; the README's commands (install, the two commands, the Slurm quick start, the
studies) too."""
EXTERNAL = {
    ".", "source", "cd", "ls", "export", "tar", "curl", "hf", "tensorboard", "mkdocs", "wandb",
    "sinfo", "sacct", "squeue", "scancel",
}  # fmt: skip
PYTHON_TOOLS = {"venv", "pip", "zipfile"}
"""``python -m`` modules of Python or pip, not of the project."""
LAUNCHERS = {"torchrun", "srun", "deepspeed"}
PATH_RE = re.compile(r"(?<![\w/.-])((?:configs|slurm|scripts)/[\w./-]+\.(?:yaml|sbatch|sh|py))")


def _gen_cli():
    return importlib.import_module("scripts.gen_cli_docs")


GEN = _gen_cli()


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def command_lines(block: str) -> list[str]:
    """The block's command lines: continuations joined, heredoc bodies dropped, comments and
    blank lines left out."""
    out, current, heredoc = [], "", None
    for line in block.splitlines():
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        match = re.search(r"<<-?\s*'?(\w+)'?", line)
        if match:
            heredoc = match.group(1)
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1].strip() + " "
            continue
        current += line.strip()
        if current.strip() and not current.strip().startswith("#"):
            out.append(current.strip())
        current = ""
    return out


def split_commands(line: str) -> list[list[str]]:
    """``a && b ; c`` -> [[a...], [b...], [c...]]; ``X=$(cmd)`` -> cmd."""
    sub = re.match(r"^\s*[A-Za-z_]\w*=\$\((.*)\)\s*(#.*)?$", line)
    if sub:
        line = sub.group(1)
    tokens = shlex.split(line, comments=True)
    commands, current = [], []
    for token in tokens:
        if token in ("&&", ";", "||"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    return [c for c in commands if c]


class Checked:
    """What the checks did, for the summary line."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.parsed: list[str] = []
        self.external: list[str] = []
        self.skipped: list[str] = []


def _run_main(main, argv: list[str], what: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
    assert status in (0, None), f"{what} exited {status}:\n{err.getvalue()}"


def _parse(module: str, argv: list[str], what: str):
    parser = GEN.parser_for(module)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{what}: the arguments do not parse ({e.code}):\n{err.getvalue()}")


def check_stage(module: str, argv: list[str], what: str, checked: Checked) -> None:
    """A command of the project: ``module`` is the ``python -m`` form (``pretrain``, ...)."""
    import importlib

    from albatross.cli import COMMANDS

    module = module.removesuffix(".__main__")
    main_module = {c.form: c.module for c in COMMANDS.values()}.get(module, module)
    if "--help" in argv or "-h" in argv:
        main = importlib.import_module(main_module).main
        _run_main(main, argv, what)
        checked.ran.append(what)
        return
    args = _parse(main_module, argv, what)
    if module == "pretrain":
        from pretrain.__main__ import config_from_args

        if args.print_config:
            from pretrain.__main__ import main

            _run_main(main, argv, what)
            checked.ran.append(what)
            return
        try:
            config_from_args(args)
        except ValueError as e:
            pytest.fail(f"{what}: the recipe does not resolve: {e}")
    elif module == "finetune" and args.suite in ("glue", "lra"):
        _check_finetune_recipe(args, what)
    elif module == "slurm":
        from slurm.cli import make_spec

        make_spec(argv)
    elif module == "study":
        assert (ROOT / args.spec).is_file(), f"{what}: no study spec {args.spec}"
    checked.parsed.append(what)


def _check_finetune_recipe(args, what: str) -> None:
    from engine.recipe import build_config, load_recipe

    try:
        if args.suite == "glue":
            from finetune.glue.run import CONFIGS, GlueConfig
            from finetune.glue.tasks import SCORED_TASKS

            tasks = SCORED_TASKS if args.task == "all" else (args.task,)
            for task in tasks:
                recipe = args.config or CONFIGS / f"{task}.yaml"
                build_config(GlueConfig, load_recipe(recipe, [f"task={task}", *args.overrides]))
        else:
            from finetune.lra.run import LraConfig, recipe_path

            recipe = args.config or recipe_path(args.task, args.protocol, args.family)
            build_config(LraConfig, load_recipe(recipe, [f"task={args.task}", *args.overrides]))
    except ValueError as e:
        pytest.fail(f"{what}: the recipe does not resolve: {e}")


SBATCH_STAGES = {
    "pretrain.sbatch": "pretrain",
    "finetune.sbatch": "finetune",
    "data_prep.sbatch": "data_prep",
}


def check_command(tokens: list[str], what: str, checked: Checked) -> None:
    while tokens and re.match(r"^[A-Za-z_]\w*=", tokens[0]):  # VAR=value cmd
        tokens = tokens[1:]
    if not tokens:
        return
    program, rest = tokens[0], tokens[1:]
    if program == "albatross":
        if not rest or rest[0] in ("--help", "-h", "--version"):
            from albatross.cli import main

            _run_main(main, rest or ["--help"], what)
            checked.ran.append(what)
        elif rest[0] == "bench":
            checked.skipped.append(what)
        else:
            from albatross.cli import COMMANDS

            assert rest[0] in COMMANDS, f"{what}: no command albatross {rest[0]}"
            check_stage(COMMANDS[rest[0]].form, rest[1:], what, checked)
    elif program in ("python", "python3"):
        if rest[:1] == ["-"]:  # an inline script (heredoc)
            checked.skipped.append(what)
        elif rest[:1] == ["-m"]:
            if rest[1] in PYTHON_TOOLS:
                checked.external.append(what)
            else:
                check_stage(rest[1], rest[2:], what, checked)
        else:
            assert (ROOT / rest[0]).is_file(), f"{what}: no script {rest[0]}"
            checked.external.append(what)
    elif program in LAUNCHERS:
        if "--no-python" in rest:
            i = rest.index("--no-python")
            return check_command(rest[i + 1 :], what, checked)
        i = rest.index("-m") if "-m" in rest else rest.index("python") + 1
        check_command(["python", *rest[i:]], what, checked)
    elif program == "bash":
        assert (ROOT / rest[0]).is_file(), f"{what}: no script {rest[0]}"
        checked.external.append(what)
    elif program == "pip":
        _check_pip(rest, what)
        checked.external.append(what)
    elif program == "sbatch":
        scripts = [t for t in rest if t.endswith(".sbatch")]
        assert scripts, f"{what}: no sbatch script"
        assert (ROOT / scripts[0]).is_file(), f"{what}: no script {scripts[0]}"
        stage = SBATCH_STAGES[Path(scripts[0]).name]
        args = rest[rest.index(scripts[0]) + 1 :]
        if stage == "finetune" and any(t.startswith("--array") for t in rest):
            args = _array_element(args)
        check_stage(stage, args, what, checked)
    else:
        assert program in EXTERNAL, (
            f"{what}: {program!r} is not a command of the project; if users have it, add it to "
            "EXTERNAL in tests/project/test_docs_commands.py"
        )
        checked.external.append(what)


def _array_element(args: list[str]) -> list[str]:
    """What slurm/finetune.sbatch runs for one element of an array (it adds the element's task,
    seed, learning rate or family from SWEEP_*; any will do for parsing)."""
    if args[:1] == ["glue"]:
        return [*args, "--task", "rte", "--seeds", "0", "--lrs", "1e-5", "--no-summary"]
    if args[:1] == ["lra"]:
        return ["lra", "--task", "listops", "--family", "softmax", "--no-summary", *args[1:]]
    return args


def _check_pip(args: list[str], what: str) -> None:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for arg in args:
        match = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
        if match:
            for extra in match.group(1).split(","):
                assert extra in extras, f"{what}: no extra {extra!r} in pyproject.toml"
        assert not re.match(r"albatross\[", arg), f"{what}: extras come from the clone: .[x]"


def _page_commands(page: str) -> list[tuple[str, list[str]]]:
    text = (ROOT / "docs" / page).read_text()
    found = []
    for block in bash_blocks(text):
        for line in command_lines(block):
            for path in PATH_RE.findall(line):
                assert (ROOT / path).exists(), (
                    f"{page}: `{line}` names {path}, which does not exist"
                )
            found += [(f"{page}: {line}", tokens) for tokens in split_commands(line)]
    return found


@pytest.mark.parametrize("page", PAGES)
def test_every_command_of_the_page_checks(page, capsys):
    commands = _page_commands(page)
    assert commands, f"{page} has no bash commands"
    checked = Checked()
    for what, tokens in commands:
        check_command(tokens, what, checked)
    assert checked.ran or checked.parsed
    with capsys.disabled():  # what was run, parsed, or left to the tools it names
        print(
            f"\n{page}: {len(checked.ran)} run, {len(checked.parsed)} parsed, "
            f"{len(checked.external)} other tools or scripts, {len(checked.skipped)} skipped"
        )


def test_the_checks_catch_mistakes():
    checked = Checked()
    with pytest.raises(pytest.fail.Exception, match="does not resolve"):
        check_command(
            shlex.split("python -m pretrain --config configs/pretrain/debug.yaml optimizer.lrr=1"),
            "typo",
            checked,
        )
    with pytest.raises(pytest.fail.Exception, match="do not parse"):
        check_command(shlex.split("python -m data_prep shards --no-such-flag"), "flag", checked)
    with pytest.raises(pytest.fail.Exception, match="does not resolve"):
        check_command(
            shlex.split("python -m finetune glue --task rte --data d --init i train.nope=1"),
            "glue",
            checked,
        )
    with pytest.raises(AssertionError, match="not a command of the project"):
        check_command(["frobnicate", "x"], "tool", checked)
    with pytest.raises(AssertionError, match="no extra"):
        check_command(shlex.split("pip install -e '.[nope]'"), "extra", checked)


def test_command_lines_join_continuations_and_skip_heredocs():
    block = "python - <<'PY'\nimport x\nPY\nalbatross pretrain \\\n    --config c.yaml  # note\n# a comment\n"
    assert command_lines(block) == [
        "python - <<'PY'",
        "albatross pretrain --config c.yaml  # note",
    ]
    assert split_commands("a=$(sbatch --parsable x.sbatch)") == [
        ["sbatch", "--parsable", "x.sbatch"]
    ]
    assert split_commands("python3 -m venv .venv && . .venv/bin/activate") == [
        ["python3", "-m", "venv", ".venv"],
        [".", ".venv/bin/activate"],
    ]
