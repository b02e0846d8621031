"""Files written by the previous version of albatross, pinned in tests/fixtures/previous (made by
tests/fixtures/make_previous_version.py with that version's code; expected.json names its
commit): today's code resumes its preempted pretraining run directory, computing the same losses
the old code computed when it continued the run, and loads its release with the same outputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.make_previous_version import PROBE_IDS, overrides
from pretrain_support import REPO, env

PINNED = Path(__file__).resolve().parents[1] / "fixtures" / "previous"
EXPECTED = json.loads((PINNED / "expected.json").read_text())


@pytest.mark.integration
def test_resumes_a_run_directory_of_the_previous_version(tmp_path):
    shutil.copytree(PINNED / "data", tmp_path / "data")
    shutil.copytree(PINNED / "run", tmp_path / "run")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", *overrides(tmp_path / "data", run_dir, steps=4)],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr + proc.stdout and "step_00000002" in proc.stderr
    rows = (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()
    got = {r["step"]: r["loss/total"] for r in map(json.loads, rows) if "loss/total" in r}
    for step, loss in EXPECTED["losses"].items():
        assert got[int(step)] == pytest.approx(loss, rel=1e-5), (step, got)


def test_loads_a_release_of_the_previous_version():
    from model.hub.release import load_release

    model = load_release(PINNED / "run" / "release").eval()
    ids = torch.tensor(PROBE_IDS)
    with torch.no_grad():
        out = model.encoder(ids, (ids != 0).long()).last_hidden_state
    torch.testing.assert_close(out, torch.tensor(EXPECTED["logits"]), rtol=1e-5, atol=1e-5)
