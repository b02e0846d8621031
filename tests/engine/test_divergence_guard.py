"""engine.divergence.DivergenceGuard on loss sequences: quiet on noise and on a falling loss, a
rollback verdict after K spiking windows or K non-finite steps in a row, naming where the bad
stretch began."""

from __future__ import annotations

import math
import random

import pytest

from engine.divergence import DivergenceConfig, DivergenceGuard


def feed(guard, losses, log_every=1, start=0, nonfinite=None):
    """Windows of ``log_every`` steps; returns (window index, verdict) of the first verdict."""
    for i, loss in enumerate(losses):
        first = start + i * log_every + 1
        verdict = guard.observe(first, first + log_every - 1, loss, (nonfinite or {}).get(i, 0))
        if verdict is not None:
            return i, verdict
    return None


def noisy_falling(n, seed=0):
    rng = random.Random(seed)
    return [6.0 * math.exp(-i / 300) + rng.gauss(0, 0.05) for i in range(n)]


def test_quiet_on_a_noisy_falling_loss():
    assert feed(DivergenceGuard(DivergenceConfig(enabled=True)), noisy_falling(2000)) is None


def test_k_spiking_windows_in_a_row_give_a_verdict_from_the_first():
    guard = DivergenceGuard(DivergenceConfig(enabled=True, bad_steps=3))
    losses = [*noisy_falling(100), 30.0, 31.0, 40.0]
    index, verdict = feed(guard, losses, log_every=10)
    assert index == 102
    assert verdict.first_bad_step == 100 * 10 + 1  # the first spiking window's first step
    assert "loss spike: 3 windows" in verdict.reason


def test_a_single_spike_that_recovers_is_forgiven():
    guard = DivergenceGuard(DivergenceConfig(enabled=True, bad_steps=2))
    losses = [*noisy_falling(100), 30.0, *noisy_falling(100, seed=1)[50:]]
    assert feed(guard, losses) is None


def test_no_spike_judged_during_warmup():
    guard = DivergenceGuard(DivergenceConfig(enabled=True, bad_steps=1, warmup=20))
    assert feed(guard, [6.0] * 5 + [60.0]) is None


def test_nonfinite_steps_in_a_row():
    guard = DivergenceGuard(DivergenceConfig(enabled=True, bad_steps=3))
    losses = [*noisy_falling(30), math.nan]
    index, verdict = feed(guard, losses, log_every=1, nonfinite={30: 3})
    assert index == 30 and verdict.first_bad_step == 31 - 3 + 1
    assert "3 non-finite steps in a row up to step 31" in verdict.reason
    # fewer than K: the engine skipped them, nothing to roll back
    assert (
        feed(DivergenceGuard(DivergenceConfig(enabled=True)), [6.0, math.nan], nonfinite={1: 2})
        is None
    )


@pytest.mark.parametrize(
    "bad", [{"bad_steps": 0}, {"window": 0}, {"spike_sigmas": 0}, {"lr_scale": 0}]
)
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match=r"train\.divergence"):
        DivergenceConfig(**bad)


def _run_with_faults(tmp_path, steps, faults, *extra):
    import json
    import subprocess

    from pretrain_support import REPO, env, make_shards, pretrain_command

    shards = make_shards(tmp_path / "data")
    run_dir = tmp_path / "run"
    command = pretrain_command(
        shards,
        run_dir,
        steps,
        "train.checkpoint_every=2",
        f"train.inject_nonfinite_at=[{','.join(map(str, faults))}]",
        "train.divergence.enabled=true",
        "train.divergence.bad_steps=3",
        *extra,
    )
    proc = subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True)
    status = json.loads((run_dir / "status.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "tensorboard" / "metrics.jsonl").open()]
    return proc, status, rows, run_dir


@pytest.mark.integration
def test_a_real_run_rolls_back_past_injected_nonfinite_steps_and_completes(tmp_path):
    """Steps 7-9 of a real pretraining run made non-finite: the guard rolls back to the
    checkpoint of step 6, skips those steps' data, halves the learning rate, sets the diverged
    checkpoint of step 8 aside, logs it (TensorBoard, status.json) and completes."""
    proc, status, rows, run_dir = _run_with_faults(
        tmp_path, 14, [7, 8, 9], "train.divergence.lr_scale=0.5"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rolled back to step 6, skipping the data of steps 7-9" in proc.stderr
    assert status["state"] == "completed" and status["step"] == 14
    (event,) = status["rollbacks"]
    assert (event["at_step"], event["to_step"], event["lr_factor"]) == (9, 6, 0.5)
    assert (run_dir / "checkpoints" / "step_00000008.diverged-1" / "COMPLETE.json").is_file()
    assert any(r.get("divergence/rollbacks") == 1.0 for r in rows)
    lr = {}
    for r in rows:  # the last value logged for each step: after the rollback
        if "optim/lr" in r:
            lr[r["step"]] = r["optim/lr"]
    first = next(r["optim/lr"] for r in rows if r["step"] == 7 and "optim/lr" in r)
    assert lr[7] == pytest.approx(first / 2)
    assert all(math.isfinite(r["loss/total"]) for r in rows if r["step"] > 9 and "loss/total" in r)


@pytest.mark.integration
def test_the_run_stops_with_a_clear_error_after_max_rollbacks(tmp_path):
    proc, status, _, _ = _run_with_faults(
        tmp_path, 16, [7, 8, 9, 11, 12, 13], "train.divergence.max_rollbacks=1"
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "after 1 rollback(s) (train.divergence.max_rollbacks=1): the run stops" in proc.stderr
    assert status["state"] == "failed" and "max_rollbacks" in status["reason"]
