"""Stop requests: the signals a cluster sends before it ends a job, and a wall-clock budget.

Slurm sends ``SIGTERM`` at a time limit or preemption (``KillWait`` seconds before ``SIGKILL``)
and, with ``#SBATCH --signal=USR1@<seconds>``, ``SIGUSR1`` that many seconds earlier; submitit
asks for ``SIGUSR2`` (its checkpoint-and-requeue signal). All three are stop requests. The
handlers only set a flag; the training loop looks at it between steps (``StopWatch.check``),
all ranks agree with one all-reduce, save a checkpoint and leave. Nothing happens inside the
handler itself, so a signal never interrupts a half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterable
from types import FrameType

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")


class StopWatch:
    """Records stop signals and measures a wall-clock budget.

    budget_seconds: stop once this much time has passed since construction (None: no budget).
    """

    def __init__(self, budget_seconds: float | None = None, signals: Iterable[str] = STOP_SIGNALS):
        self.start = time.monotonic()
        self.budget_seconds = budget_seconds
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        for name in signals:
            signum = getattr(signal, name, None)
            if signum is None:  # e.g. SIGUSR1 on Windows
                continue
            # ValueError outside the main thread: signals cannot be caught there.
            with contextlib.suppress(ValueError):
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    @property
    def budget_exceeded(self) -> bool:
        return self.budget_seconds is not None and self.elapsed >= self.budget_seconds

    def local_flags(self) -> list[float]:
        """[signal received, budget exceeded] on this rank, as floats for an all-reduce."""
        return [float(self.received is not None), float(self.budget_exceeded)]

    def restore(self) -> None:
        """Puts the previous handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
