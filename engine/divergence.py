"""The divergence guard: tells when a run's loss has diverged, so the loop rolls back.

A run diverges two ways: its loss turns non-finite (the engine already skips such steps one by
one, but a state that keeps producing them does not recover by itself), or it spikes (a loss far
above its recent level, the start of a blow-up in large-batch pretraining). The guard watches the
values the loop logs, which are read at each logging step without an extra synchronisation
(``train.log_every`` steps a window, the window's mean loss), and says "roll back" after
``bad_steps`` non-finite steps in a row or ``bad_steps`` spiking windows in a row.

A spike is a window whose loss lies ``spike_sigmas`` standard deviations above the running mean
of the earlier good windows (an exponential moving average over about ``window`` of them) and
at least ``spike_min_ratio`` above that mean: the first condition adapts to the loss's own
noise, the second keeps a loss that hardly moves from flagging its tiny fluctuations. Spikes are
not judged in the first ``warmup`` windows of a process, while the running statistics settle;
the statistics hold good windows only, so they stay valid across a rollback.

What the loop then does (``engine/loop.py``): load the newest complete checkpoint older than the
first bad window, skip the batches of the steps it rolls back over (the data that led there is
not seen again), optionally scale the learning rate by ``lr_scale``, log the rollback to the
trackers and the status file, and stop with ``DivergenceError`` after ``max_rollbacks``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class DivergenceError(RuntimeError):
    """The run kept diverging after ``max_rollbacks`` rollbacks (or had nothing to roll back
    to); the message says where and what to try."""


@dataclass
class DivergenceConfig:
    """``train.divergence``: roll back to the last good checkpoint when the loss diverges."""

    enabled: bool = False
    """Watch the loss and roll back when it diverges (off: non-finite steps are skipped, and
    ``train.max_nonfinite_in_a_row`` of them in a row stop the run)."""
    bad_steps: int = 3
    """Non-finite steps in a row, or spiking logging windows in a row, that make a rollback."""
    spike_sigmas: float = 6.0
    """A window is a spike when its loss exceeds the running mean by this many running
    standard deviations ..."""
    spike_min_ratio: float = 0.2
    """... and by at least this fraction of the running mean."""
    window: int = 50
    """The running mean and variance average over about this many logging windows (an
    exponential moving average with span ``window``)."""
    warmup: int = 20
    """Logging windows at the start of a process before spikes are judged."""
    max_rollbacks: int = 3
    """Rollbacks a run may make; the next divergence stops it with an error."""
    lr_scale: float = 1.0
    """The learning rate is multiplied by this after each rollback (1: unchanged; 0.5 halves
    it for the rest of the run)."""

    def __post_init__(self) -> None:
        if self.bad_steps < 1 or self.window < 1 or self.warmup < 0 or self.max_rollbacks < 0:
            raise ValueError(
                "train.divergence: bad_steps and window must be >= 1, warmup and "
                f"max_rollbacks >= 0 (got {self.bad_steps}, {self.window}, {self.warmup}, "
                f"{self.max_rollbacks})"
            )
        if not (self.spike_sigmas > 0 and self.spike_min_ratio >= 0 and self.lr_scale > 0):
            raise ValueError(
                "train.divergence: spike_sigmas and lr_scale must be > 0, spike_min_ratio >= 0"
            )


@dataclass
class Verdict:
    """A divergence: roll back to a checkpoint older than ``first_bad_step``."""

    first_bad_step: int
    reason: str


class DivergenceGuard:
    """Fed each logging window's mean loss and the run of non-finite steps at its end; returns
    a ``Verdict`` when the run has diverged."""

    def __init__(self, cfg: DivergenceConfig):
        self.cfg = cfg
        self.mean = 0.0
        self.var = 0.0
        self.seen = 0  # good windows in the statistics
        self.bad_windows = 0
        self.first_bad_step: int | None = None

    def observe(self, first_step: int, last_step: int, loss: float, nonfinite_run: int):
        """The window of steps ``first_step..last_step``: its mean ``loss`` and the non-finite
        steps in a row at its end. Returns a ``Verdict`` or None."""
        cfg = self.cfg
        if nonfinite_run >= cfg.bad_steps:
            return Verdict(
                last_step - nonfinite_run + 1,
                f"{nonfinite_run} non-finite steps in a row up to step {last_step}",
            )
        if not math.isfinite(loss):  # the window's mean: non-finite steps, fewer than K
            return None
        std = math.sqrt(max(self.var, 0.0))
        spike = (
            self.seen >= cfg.warmup
            and loss > self.mean + cfg.spike_sigmas * std
            and loss > self.mean * (1.0 + cfg.spike_min_ratio)
        )
        if spike:
            self.bad_windows += 1
            if self.first_bad_step is None:
                self.first_bad_step = first_step
            if self.bad_windows >= cfg.bad_steps:
                return Verdict(
                    self.first_bad_step,
                    f"loss spike: {self.bad_windows} windows in a row up to step {last_step} "
                    f"above {self.mean:.4g} + {cfg.spike_sigmas:g} x {std:.3g} (last {loss:.4g})",
                )
            return None
        self.bad_windows, self.first_bad_step = 0, None
        alpha = 2.0 / (cfg.window + 1.0)
        if self.seen == 0:
            self.mean, self.var = loss, 0.0
        else:
            delta = loss - self.mean
            self.mean += alpha * delta
            self.var = (1.0 - alpha) * (self.var + alpha * delta * delta)
        self.seen += 1
        return None

    def rolled_back(self) -> None:
        """After a rollback: the bad run is over; the statistics (of good windows only) stay."""
        self.bad_windows, self.first_bad_step = 0, None
