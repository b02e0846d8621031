"""The ``albatross`` command (``albatross/cli.py``, installed by ``pip install`` as a console
script): ``--help`` lists every stage, ``albatross <command> --help`` is the stage's own help
(the same output as its ``python -m`` form), a real command (a tokenizer from the embedded
corpus) gives the same output and files as the ``python -m`` form, ``albatross bench`` lists
and runs the benchmark scripts. The executable is the one ``pip install -e .`` put beside
this Python (scripts/setup.sh installs it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from albatross import cli

REPO = Path(__file__).resolve().parents[2]
EXE = Path(sys.executable).parent / "albatross"

if not EXE.is_file():
    print(
        f"test_cli: no {EXE}: the project is not installed with pip in this environment "
        "(pip install -e . creates the albatross command); skipping the executable's tests",
        file=sys.stderr,
    )
_installed = pytest.mark.skipif(
    not EXE.is_file(), reason=f"no {EXE}: run pip install -e . (scripts/setup.sh does)"
)


def needs_exe(test):
    """Runs the installed executable in subprocesses (integration tier: a few seconds each)."""
    return pytest.mark.integration(_installed(test))


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="100", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)  # the installed package, as a user runs it
    return env


def _run(cmd: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def test_top_level_help_lists_every_command_once(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.split("commands:\n")[1].split("\n\n")[0].splitlines()]
    assert listed == [*cli.COMMANDS, "bench"]
    for name, command in cli.COMMANDS.items():
        assert f"python -m {command.form}]" in out, name
    assert cli.main([]) == 2  # no command: the usage, an error
    assert "usage: albatross <command>" in capsys.readouterr().err


def test_an_unknown_command_is_an_error_with_a_hint(capsys):
    assert cli.main(["pretrian"]) == 2
    assert "did you mean 'pretrain'?" in capsys.readouterr().err
    assert cli.main(["bench", "modle"]) == 2
    assert "did you mean 'model'?" in capsys.readouterr().err


def test_bench_lists_the_scripts(capsys):
    assert cli.main(["bench"]) == 0
    out = capsys.readouterr().out
    scripts = sorted((REPO / "bench").glob("bench_*.py"))
    assert scripts
    for script in scripts:
        name = script.stem.removeprefix("bench_").replace("_", "-")
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert len(line.split()) > 1, f"{name}: no description"
    assert "gpu-suite" in out


@needs_exe
@pytest.mark.parametrize("name", [*cli.COMMANDS])
def test_help_of_each_command_is_the_stages_own(name):
    command = cli.COMMANDS[name]
    ours = _run([str(EXE), name, "--help"])
    theirs = _run([sys.executable, "-m", command.form, "--help"])
    assert ours.returncode == theirs.returncode == 0, ours.stderr[-2000:]
    assert ours.stdout == theirs.stdout
    assert ours.stdout.startswith(f"usage: python -m {command.form}")


@needs_exe
def test_the_executable_help_and_version():
    proc = _run([str(EXE), "--help"])
    assert proc.returncode == 0 and "usage: albatross <command>" in proc.stdout
    proc = _run([str(EXE), "--version"])
    assert proc.returncode == 0 and proc.stdout.startswith("albatross ")
    proc = _run([str(EXE), "finetune", "glue", "--help"])  # a sub-subcommand's help too
    assert proc.returncode == 0 and "--task" in proc.stdout


@needs_exe
def test_a_real_command_matches_the_python_m_form(tmp_path):
    args = ["tokenizer", "--input", "embedded:40", "--vocab-size", "300", "--out", "tok"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ours = _run([str(EXE), "data-prep", *args], cwd=tmp_path / "a")
    theirs = _run([sys.executable, "-m", "data_prep", *args], cwd=tmp_path / "b")
    assert ours.returncode == theirs.returncode == 0, ours.stderr[-2000:]
    assert ours.stdout == theirs.stdout
    made = sorted(p.name for p in (tmp_path / "a" / "tok").iterdir())
    assert "tokenizer.json" in made
    assert made == sorted(p.name for p in (tmp_path / "b" / "tok").iterdir())
    for name in made:
        if name != "tokenizer.json":
            assert (tmp_path / "a" / "tok" / name).read_bytes() == (
                tmp_path / "b" / "tok" / name
            ).read_bytes(), name
    # The unigram trainer's scores vary in their last digits from run to run, and with them
    # the order of near-equal pieces (two runs of the python -m form differ alike): the same
    # pieces and special tokens.
    from tokenizers import Tokenizer

    a, b = (Tokenizer.from_file(str(tmp_path / d / "tok" / "tokenizer.json")) for d in "ab")
    assert set(a.get_vocab()) == set(b.get_vocab())
    specials = ("<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]")
    assert [a.token_to_id(t) for t in specials] == [b.token_to_id(t) for t in specials]
    # a seeded command: the same bytes
    args = ["listops", "--out", "lo", "--train", "20", "--val", "5", "--test", "5", "--quiet"]
    ours = _run([str(EXE), "data-prep", *args], cwd=tmp_path / "a")
    theirs = _run([sys.executable, "-m", "data_prep", *args], cwd=tmp_path / "b")
    assert ours.returncode == theirs.returncode == 0, ours.stderr[-2000:]
    timing = re.compile(r"[0-9.]+ s \([0-9.]+ ms/example\)")
    assert timing.sub("T", ours.stdout) == timing.sub("T", theirs.stdout)
    files = sorted(p.name for p in (tmp_path / "a" / "lo").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b" / "lo").iterdir()) and files
    for name in files:
        assert (tmp_path / "a" / "lo" / name).read_bytes() == (
            tmp_path / "b" / "lo" / name
        ).read_bytes(), name
    # a user mistake: the same message and exit code (2) as the python -m form
    ours = _run([str(EXE), "data-prep", *args], cwd=tmp_path / "a")
    theirs = _run([sys.executable, "-m", "data_prep", *args], cwd=tmp_path / "b")
    assert ours.returncode == theirs.returncode == 2
    assert ours.stderr == theirs.stderr


@needs_exe
def test_bench_runs_a_script_with_its_own_arguments():
    theirs = _run([sys.executable, "-m", "bench.bench_model", "--help"])
    for form in (["model", "--help"], ["model", "--", "--help"], ["bench_model.py", "--help"]):
        ours = _run([str(EXE), "bench", *form])
        assert ours.returncode == theirs.returncode == 0, ours.stderr[-2000:]
        assert ours.stdout == theirs.stdout


@needs_exe
def test_python_m_albatross_is_the_same_command():
    ours = _run([str(EXE), "--help"])
    theirs = _run([sys.executable, "-m", "albatross", "--help"])
    assert ours.stdout == theirs.stdout and ours.returncode == theirs.returncode == 0
