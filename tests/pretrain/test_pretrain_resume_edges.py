"""Resuming pretraining in the awkward cases: a damaged ``latest``, a resume that fails, fewer
steps than the checkpoint, a moved run directory and moved shards, another number of processes.
Each failed on the old code (a crash without fallback, a lost "completed", an unrelated error,
a refusal, a traceback with exit 1). Plain single-process runs of ``python -m pretrain``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pretrain_support import REPO, base_overrides, env, make_shards, torchrun_cmd

from data_prep.format import sha256_file
from engine.metrics import read_jsonl

pytestmark = pytest.mark.integration  # runs the stages end to end

CONFIG = str(REPO / "configs/pretrain/debug.yaml")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("data"))


def _single_env() -> dict[str, str]:
    return {k: v for k, v in env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def _overrides(shards: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        *base_overrides(shards, run_dir, steps),
        "engine.backend=torch",
        "engine.zero_stage=0",
        "train.checkpoint_every=2",
        "train.keep_last=5",
    ]


def _pretrain(shards: Path, run_dir: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pretrain", "--config", CONFIG]
    cmd += [*_overrides(shards, run_dir, steps), *extra]
    return subprocess.run(
        cmd, cwd=REPO, env=_single_env(), capture_output=True, text=True, timeout=300
    )


def _status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


@pytest.fixture
def finished(shards, tmp_path) -> Path:
    """A completed 4-step run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path / "run"
    proc = _pretrain(shards, run_dir, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _status(run_dir)["state"] == "completed"
    return run_dir


def test_a_damaged_latest_falls_back_to_the_previous_checkpoint(shards, finished):
    """A file of `latest` with the wrong size: the old code raised outside the fallback."""
    victim = finished / "checkpoints" / "step_00000004" / "rank_00000.pt"
    victim.write_bytes(victim.read_bytes()[:-10])
    proc = _pretrain(shards, finished, 6)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "falling back" in proc.stderr and "step_00000004" in proc.stderr
    assert "resumed from" in proc.stderr
    assert "step_00000002" in proc.stderr.split("resumed from")[1].splitlines()[0]
    assert _status(finished)["state"] == "completed" and _status(finished)["step"] == 6


def test_a_failed_resume_keeps_the_completed_status(shards, finished):
    for directory in (finished / "checkpoints").glob("step_*"):
        rank_file = directory / "rank_00000.pt"
        rank_file.write_bytes(rank_file.read_bytes()[:-10])  # every checkpoint unusable
    proc = _pretrain(shards, finished, 8)
    assert proc.returncode != 0
    assert "no usable checkpoint" in proc.stderr
    assert _status(finished)["state"] == "completed" and _status(finished)["step"] == 4


def test_steps_below_the_checkpoint_are_a_clear_error(shards, finished):
    before = (finished / "status.json").read_text()
    proc = _pretrain(shards, finished, 3)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train.steps=3 is below the step of the checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (finished / "status.json").read_text() == before


def test_a_moved_run_dir_and_moved_shards_resume(shards, finished, tmp_path):
    moved_run = tmp_path / "elsewhere" / "run"
    moved_shards = tmp_path / "elsewhere" / "shards"
    moved_run.parent.mkdir()
    shutil.move(finished, moved_run)
    shutil.copytree(shards, moved_shards)
    proc = _pretrain(moved_shards, moved_run, 6)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr
    assert _status(moved_run)["step"] == 6


def test_shards_with_other_content_are_refused(shards, finished, tmp_path):
    """Identity is content: other shards under a new path are another run's data."""
    other = make_shards(tmp_path / "other_data")  # the same recipe: made to differ below
    manifest = json.loads((other / "manifest.json").read_text())
    tokens = other / (manifest["shards"][0]["name"] + ".tokens.npy")
    array = np.load(tokens)
    array[:5] = array[5:10]
    np.save(tokens, array)
    manifest["shards"][0]["sha256"][tokens.name] = sha256_file(tokens)
    (other / "manifest.json").write_text(json.dumps(manifest))
    proc = _pretrain(other, finished, 6)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "data_identity.shards_sha256" in proc.stderr


def test_a_number_of_processes_that_cannot_keep_the_global_batch_is_a_clear_error(shards, finished):
    """The global batch (4 x 1 x 1 process) is the invariant of a resume on another number of
    processes: 2 processes cannot keep it with micro-batches of 4."""
    cmd = torchrun_cmd(2, "-m", "pretrain", "--config", CONFIG, *_overrides(shards, finished, 6))
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "2 processes cannot keep the global batch of 4 sequences" in proc.stderr
    # Each worker exited 2 (a config/input error) with that one line; torchrun reports it.
    assert "exitcode  : 2" in proc.stderr or "exitcode: 2" in proc.stderr, proc.stderr[-3000:]
    assert _status(finished)["state"] == "completed"


@pytest.mark.slow
def test_resume_after_the_first_diagnostics_is_exact(shards, tmp_path):
    """The diagnostics' model copy was initialised from the global RNG when first needed, so
    a resumed run (which builds it again) drew dropout from another stream afterwards: the
    losses left the uninterrupted run's a few steps after the next diagnostics. Found by
    bench/bench_kill_resume.py."""
    extra = ("train.diagnostics_every=4", "model.hidden_dropout_prob=0.1")
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    for run_dir, steps in ((whole, 12), (halves, 6), (halves, 12)):
        proc = _pretrain(shards, run_dir, steps, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = read_jsonl(whole / "tensorboard"), read_jsonl(halves / "tensorboard")
    assert [a[s]["loss/mlm"] for s in range(1, 13)] == [b[s]["loss/mlm"] for s in range(1, 13)]
