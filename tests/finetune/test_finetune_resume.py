"""Fine-tuning survives preemption: checkpoints every N steps and on SIGTERM / a time budget,
an exact resume (same batches, dropout and evaluation history as an uninterrupted run), the
best-dev release kept across a resume, and a sweep that skips finished runs. Real processes,
real signals, ``python -m finetune`` as users run it (LRA ListOps on generated data)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_prep.listops import write_splits
from engine.checkpoint import CheckpointStore
from engine.metrics import read_jsonl, read_scalars

pytestmark = pytest.mark.integration  # runs the stages end to end

REPO = Path(__file__).resolve().parents[2]
STEPS = 12

TINY = [
    "model.hidden_size=32",
    "model.embedding_size=32",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "model.hidden_dropout_prob=0.1",
    "model.attention_probs_dropout_prob=0.1",
    "engine.precision=fp32",
    "engine.backend=torch",
    "engine.micro_batch_size=8",
    f"schedule.total_steps={STEPS}",
    "schedule.warmup_steps=2",
    "train.eval_every=3",
    "train.log_every=1",
    "data.max_length=40",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("listops")
    write_splits(root, {"train": 96, "val": 24, "test": 24}, min_length=5, max_length=30, seed=0)
    return root


def _args(data: Path, run_dir: Path, *extra: str) -> list[str]:
    args = ["lra", "--task", "listops", "--data", str(data), *TINY]
    return [*args, f"train.run_dir={run_dir}", *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def _finetune(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "finetune", *args]
    return subprocess.run(
        cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _start(args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "finetune", *args]
    return subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _logged_step(run_dir: Path) -> int:
    path = run_dir / "seed_0" / "tensorboard" / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _logged_step(run_dir) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach the step in time"
        time.sleep(0.05)


def _results(run_dir: Path) -> dict:
    return json.loads((run_dir / "seed_0" / "results.json").read_text())


def _assert_same_run(a: Path, b: Path) -> None:
    """Same evaluation history and best step (1e-6), same best-dev weights (1e-6)."""
    ra, rb = _results(a), _results(b)
    assert ra["best_step"] == rb["best_step"]
    assert [h["step"] for h in ra["history"]] == [h["step"] for h in rb["history"]]
    for ha, hb in zip(ra["history"], rb["history"]):
        for split in ("val", "test"):
            assert ha[split]["accuracy"] == pytest.approx(hb[split]["accuracy"], abs=1e-6)
    wa = load_file(str(a / "seed_0" / "best" / "model.safetensors"))
    wb = load_file(str(b / "seed_0" / "best" / "model.safetensors"))
    assert sorted(wa) == sorted(wb)
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=1e-6, rtol=0)
    la, lb = read_jsonl(a / "seed_0/tensorboard"), read_jsonl(b / "seed_0/tensorboard")
    for step in range(1, STEPS + 1):  # the resumed run's losses are the uninterrupted run's
        assert la[step]["train/loss"] == pytest.approx(lb[step]["train/loss"], abs=1e-6), step


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("a") / "run"
    proc = _finetune(_args(data, run_dir, "train.keep_checkpoints=true"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_kill_at_a_random_step_then_resume_matches_the_uninterrupted_run(
    data, uninterrupted, tmp_path
):
    """SIGKILL (no chance to save) at a random step with a checkpoint every step; the re-run
    resumes from the last checkpoint and ends exactly where the uninterrupted run ended."""
    run_dir = tmp_path / "run"
    kill_at = random.Random(os.getpid()).randint(2, STEPS - 2)
    args = _args(data, run_dir, "train.checkpoint_every=1", "train.keep_last=2")
    proc = _start(args)
    _wait_for_step(proc, run_dir, kill_at)
    proc.kill()
    proc.communicate()
    found = CheckpointStore(run_dir / "seed_0" / "checkpoints").resolve()
    assert found is not None, "the kill left no loadable checkpoint"
    resumed = _finetune(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr + resumed.stdout
    _assert_same_run(uninterrupted, run_dir)
    assert not (run_dir / "seed_0" / "checkpoints").exists()  # discarded once finished
    # TensorBoard shows one value per step: the killed attempt's later events are purged.
    steps = [step for step, _ in read_scalars(run_dir / "seed_0" / "tensorboard")["train/loss"]]
    assert steps == list(range(1, STEPS + 1))


def test_sigterm_and_time_budget_stop_with_exit_75_and_resume_exactly(
    data, uninterrupted, tmp_path
):
    """SIGTERM mid-run: a checkpoint at the next step, exit 75, no results yet. A time budget
    does the same. Each re-run resumes; the end is the uninterrupted run's."""
    run_dir = tmp_path / "run"
    args = _args(data, run_dir, "train.checkpoint_every=0")
    proc = _start(args)
    _wait_for_step(proc, run_dir, 4)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "stopped at step" in err and "signal SIGTERM" in err
    assert not (run_dir / "seed_0" / "results.json").exists()
    stopped_at = CheckpointStore(run_dir / "seed_0" / "checkpoints").complete_steps()
    assert len(stopped_at) == 1 and 4 <= stopped_at[0] < STEPS

    budget = _finetune([*args, "train.time_budget_minutes=0.00001"])
    assert budget.returncode == 75, budget.stderr[-3000:]
    assert "time budget" in budget.stderr
    steps = CheckpointStore(run_dir / "seed_0" / "checkpoints").complete_steps()
    assert steps[-1] == stopped_at[0] + 1  # one more step, then the budget stopped it

    final = _finetune(args)
    assert final.returncode == 0, final.stderr[-3000:]
    _assert_same_run(uninterrupted, run_dir)


def test_a_sweep_skips_finished_runs_and_refuses_another_config(data, uninterrupted, tmp_path):
    """Re-submitting a sweep: the finished seed is read back, not trained again; a changed
    config in the same run_dir is refused (exit 2) before any work, and nothing is lost."""
    before = (uninterrupted / "seed_0" / "results.json").read_text()
    again = _finetune(_args(data, uninterrupted, "train.keep_checkpoints=true"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "finished before; skipping" in again.stdout
    assert (uninterrupted / "seed_0" / "results.json").read_text() == before
    # A resumable setting may change (it does not alter what the run computes).
    relaxed = _finetune(_args(data, uninterrupted, "train.checkpoint_every=5"))
    assert relaxed.returncode == 0 and "skipping" in relaxed.stdout, relaxed.stderr[-3000:]

    changed = _finetune(_args(data, uninterrupted, "optimizer.lr=0.5"))
    assert changed.returncode == 2, changed.stderr[-3000:]
    assert "another config" in changed.stderr and "optimizer.lr" in changed.stderr
    assert (uninterrupted / "seed_0" / "results.json").read_text() == before
