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
