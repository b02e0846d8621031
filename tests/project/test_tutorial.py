"""docs/tutorial.md, run as a new user runs it: every ``bash`` block of the page, in order, as
one ``bash -euo pipefail`` script in a fresh directory (``configs/`` linked from the clone),
with the project's Python first on ``PATH``. Two things of the outside world stand in:

* ``hf download nyu-mll/glue`` is served by an ``hf`` on ``PATH`` that copies the requested
  files from a local copy of the dataset in the Hub's layout (``<config>/<split>-00000-of-00001
  .parquet``, written with ``datasets``' own ``to_parquet``; tests/finetune/test_glue_hub_layouts.py);
* ``hf upload`` (an account and the network) is the one command left out; the test checks that
  it is the only one.

Then what the page promises is checked: the release, the zip with the server's file at its top
level, the summary, the Hub export that ``transformers`` loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_docs_commands import bash_blocks

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "tutorial.md"
NOT_RUN = ("hf upload ",)
"""Lines of the page the test leaves out (they need an account and the network)."""

HF_STAND_IN = """#!{python}
# `hf download REPO --repo-type dataset --local-dir DIR [--include GLOB ...]` from a local copy
import argparse, fnmatch, shutil
from pathlib import Path
MIRROR = {mirror!r}
p = argparse.ArgumentParser()
p.add_argument("command", choices=["download"])
p.add_argument("repo", choices=["nyu-mll/glue"])
p.add_argument("--repo-type", choices=["dataset"], required=True)
p.add_argument("--local-dir", required=True)
p.add_argument("--include", action="append", default=[])
a = p.parse_args()
for f in Path(MIRROR).rglob("*"):
    rel = f.relative_to(MIRROR).as_posix()
    if f.is_file() and (not a.include or any(fnmatch.fnmatch(rel, g) for g in a.include)):
        (Path(a.local_dir) / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, Path(a.local_dir) / rel)
"""


def page_script() -> tuple[str, list[str]]:
    """The page's bash blocks as one script, and the lines left out."""
    lines, left_out = [], []
    for block in bash_blocks(PAGE.read_text()):
        for line in block.splitlines():
            if line.startswith(NOT_RUN):
                left_out.append(line)
            else:
                lines.append(line)
    return "\n".join(lines) + "\n", left_out


def test_the_tutorial_runs_from_a_parquet_corpus_to_a_glue_zip_and_a_hub_export(tmp_path):
    from test_glue_hub_layouts import SPEC_BIG, write_layout

    mirror = write_layout(tmp_path / "hub-glue", "parquet")
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "hf").write_text(HF_STAND_IN.format(python=sys.executable, mirror=str(mirror)))
    (tools / "hf").chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs")
    script, left_out = page_script()
    assert left_out == ["hf upload your-name/tisa-demo hub/tisa ."], left_out
    env = dict(
        os.environ,
        PATH=os.pathsep.join([str(tools), str(Path(sys.executable).parent), os.environ["PATH"]]),
        PYTHONPATH=str(ROOT),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="2",
    )
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]

    assert (work / "releases" / "tisa" / "config.json").is_file()
    with zipfile.ZipFile(work / "runs" / "glue" / "submission.zip") as zf:
        assert zf.namelist() == ["RTE.tsv"]  # at the archive's top level, as the server wants
        rows = zf.read("RTE.tsv").decode().splitlines()
    assert rows[0] == "index\tprediction"
    assert len(rows) - 1 == len(SPEC_BIG["rte"]["test"][2])
    assert {r.split("\t")[1] for r in rows[1:]} <= {"entailment", "not_entailment"}
    assert "GLUE submission" in log and "missing" in log  # the summary names the other files
    assert (work / "hub" / "tisa" / "modeling_albatross.py").is_file()
    assert "'token_str'" in proc.stdout  # the fill-mask pipeline's answer, printed
