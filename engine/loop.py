"""The training loop both stages run: pretraining (``pretrain.train.Trainer``) and fine-tuning
(``finetune.trainer.Finetuner``) are each a :class:`Stage` that :class:`RunLoop` drives.

The loop owns what every stage does the same way:

* resume: the newest usable checkpoint of the stage's store, loaded on every rank together
  (``engine.checkpoint.resume_collectively``; the stage restores its own state from it);
* the status file (``status.json``: ``"running"`` once resumed, the end state at the end);
* the trackers (TensorBoard, W&B, MLflow; rank 0) and the progress line, opened and closed;
* the step iteration, and the cadences of logging, evaluation and checkpoints;
* stop requests (SIGTERM, SIGUSR1, SIGUSR2 or the time budget, ``engine/signals.py``): every
  rank agrees with one all-reduce between steps, a checkpoint is saved and the run ends as
  ``"stopped"`` (the commands turn that into their requeue exit code).

A stage supplies one optimizer step, the logging of its window, its evaluation and the
save and restore of its own state in a checkpoint (engine, data position, counters). One
iteration, after the stage's ``train_step``::

    log (every log_every steps and at the last) -> evaluate (every eval_every steps; at the
    last with eval_at_end) -> the stage's after_step checks -> stop requests (checkpoint,
    stop) -> the interval checkpoint (every checkpoint_every steps)
"""

from __future__ import annotations

import contextlib
import gc
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from albatross.files import DiskFullError, disk_full_error, remove_tree
from engine import checkpoint as ckpt
from engine.divergence import DivergenceConfig, DivergenceError, DivergenceGuard, Verdict
from engine.metrics import Progress
from engine.signals import StopWatch
from engine.trackers import TrackerConfig, Trackers, open_trackers

ENDING_ERRORS = (DiskFullError, DivergenceError)
"""Errors whose message the loop writes into the status file as the reason a run failed (any
other error leaves ``"running"``: the traceback is the report)."""


class LoopEngine(Protocol):
    """What the loop needs of the engine (``engine.Engine`` has it): its collectives and the
    report of the first step."""

    def barrier(self) -> None: ...

    def any_rank(self, flag: bool) -> bool: ...

    def all_reduce_max(self, values: list[float]) -> list[float]: ...

    def first_step_report(self, seconds: float) -> str | None: ...


class Stage(ABC):
    """A training stage as :class:`RunLoop` drives it.

    Attributes a stage sets: ``engine`` (its collectives), ``store`` (where its checkpoints
    go), ``step`` (optimizer steps done; ``train_step`` advances it, ``restore_state`` sets
    it) and ``is_main`` (rank 0: writes the status file, trackers and messages)."""

    engine: LoopEngine
    store: ckpt.CheckpointStore
    step: int
    is_main: bool

    @abstractmethod
    def train_step(self, loop: RunLoop) -> None:
        """One optimizer step (all its micro-batches); adds 1 to ``step``."""

    @abstractmethod
    def log_step(self, loop: RunLoop) -> Mapping[str, float | str]:
        """The logging window's averages to ``loop.trackers`` at ``step``; starts a new window.
        Returns what the progress line shows."""

    @abstractmethod
    def save_state(self, staging: Path, reason: str) -> dict[str, Any]:
        """Collective: writes the stage's state (engine, data position, RNG, counters) into the
        checkpoint's ``staging`` directory; returns the metadata its seal records."""

    @abstractmethod
    def restore_state(self, path: Path, record: dict[str, Any]) -> None:
        """Loads the checkpoint in ``path`` (``record``: its ``COMPLETE.json``); raises to
        refuse it. Must overwrite everything an earlier, failed attempt loaded."""

    def begin(self, loop: RunLoop) -> None:  # noqa: B027 (optional hook)
        """After resuming, with the trackers open, before the first step: start-up messages,
        the data iterator, train mode."""

    def evaluate_now(self, loop: RunLoop) -> None:  # noqa: B027 (optional hook)
        """Evaluation at ``step`` (collective), at the loop's evaluation cadence."""

    def after_step(self, loop: RunLoop, checkpoint_due: bool) -> None:  # noqa: B027
        """The stage's own checks after each step's logging and evaluation, before stop
        requests are looked at (``checkpoint_due``: an interval checkpoint follows)."""

    def complete(self, loop: RunLoop, checkpoint: Path | None) -> None:  # noqa: B027
        """After the last step of a completed run (``checkpoint``: the final one, with
        ``checkpoint_at_end``), before the trackers close."""

    def status(self) -> dict[str, Any]:
        """The stage's fields of the final status file, after state, reason and steps."""
        return {}

    # The divergence guard's needs (``LoopConfig.divergence``); a stage without them cannot
    # use it.

    def health(self) -> Health:
        """The logging window just logged: its mean loss and the non-finite steps in a row
        at its end (values read by ``log_step``, no further synchronisation)."""
        raise NotImplementedError(f"{type(self).__name__} does not support the divergence guard")

    def skip_data(self, steps: int) -> None:
        """After a rollback's ``restore_state``: skip the batches of ``steps`` optimizer
        steps (the data that led to the divergence)."""
        raise NotImplementedError(f"{type(self).__name__} does not support the divergence guard")

    def scale_learning_rate(self, factor: float) -> None:
        """After a rollback's ``restore_state``: the schedule's learning rates times
        ``factor`` (relative to the configured ones) from now on."""
        raise NotImplementedError(f"{type(self).__name__} does not support the divergence guard")


@dataclass
class Health:
    """What the divergence guard reads of a stage after each logging step."""

    loss: float
    nonfinite_in_a_row: int


@dataclass
class LoopConfig:
    """How :class:`RunLoop` runs a stage."""

    name: str
    """The stage's name: the progress line's label and the prefix of the loop's messages."""
    run_dir: Path
    total_steps: int
    trackers: TrackerConfig
    tracker_config: Mapping[str, Any] | None = None
    """The run's config as the trackers record it (W&B run config, MLflow parameters)."""
    run_name: str | None = None
    """The trackers' default run name (None: the run directory's name)."""
    log_every: int = 10
    eval_every: int = 0
    """Steps between evaluations (0: none at a cadence)."""
    eval_at_start: bool = False
    """Evaluate before the first step of a fresh (not resumed) run."""
    eval_at_end: bool = False
    """Evaluate at the last step."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: only on a stop request, and at the end with
    ``checkpoint_at_end``)."""
    checkpoint_at_end: bool = False
    """A completed run ends with a checkpoint of its last step (the interval one counts);
    without it, no interval checkpoint is written at the last step either."""
    time_budget_minutes: float | None = None
    status_file: str | None = None
    """The status file's name in ``run_dir`` (None: none is written)."""
    progress_tty: bool | None = None
    """``Progress``'s ``force_tty`` (None: a bar when stderr is a terminal)."""
    divergence: DivergenceConfig | None = None
    """Roll back when the loss diverges (``engine/divergence.py``; None or not enabled:
    off)."""


@dataclass
class LoopOutcome:
    state: str
    """``"completed"``, or ``"stopped"`` (a stop request; a checkpoint was saved)."""
    reason: str
    """Why it stopped (``"signal SIGTERM"``, ``"time budget of 30 min"``); empty when it
    completed."""
    step: int
    resumed_from: Path | None


class RunLoop:
    """Runs ``stage`` to ``cfg.total_steps`` (module docstring). ``RunLoop(stage, cfg).run()``;
    during the run a stage reaches the trackers (``trackers``), the progress line (``say``),
    the checkpoint it resumed from (``resumed_from``) and saves a checkpoint out of cadence
    with ``save_checkpoint``."""

    def __init__(self, stage: Stage, cfg: LoopConfig):
        self.stage = stage
        self.cfg = cfg
        self.resumed_from: Path | None = None
        self.trackers: Trackers | None = None
        self.progress: Progress | None = None
        enabled = cfg.divergence is not None and cfg.divergence.enabled
        self.guard = DivergenceGuard(cfg.divergence) if enabled else None
        self.rollbacks: list[dict[str, Any]] = []
        """The rollbacks of the run so far (kept in every checkpoint's seal, so a resumed run
        counts the earlier ones)."""

    def say(self, message: str) -> None:
        """A message line on rank 0 that does not break the progress bar."""
        if self.progress is not None:
            self.progress.write(message)

    def save_checkpoint(self, reason: str) -> Path:
        """Collective: the stage's state at its step, sealed (``reason`` in the seal)."""
        stage = self.stage
        staging = stage.store.begin(stage.step)
        full: DiskFullError | None = None
        try:
            meta = stage.save_state(staging, reason)
            if self.rollbacks:
                meta["divergence_rollbacks"] = self.rollbacks
            return stage.store.commit(stage.step, meta)
        except (OSError, RuntimeError) as e:
            full = disk_full_error(e, stage.store.root, f"the checkpoint of step {stage.step}")
            if full is None:
                raise
        # A full disk. Raised here, past the handler: the writer's exception and its frames
        # hold the writer's open files, which free their space only once collected. `latest`
        # still names the previous complete checkpoint; the partial one goes.
        gc.collect()
        if stage.is_main:
            remove_tree(staging)
        raise full

    def _write_status(self, status: dict[str, Any]) -> None:
        if self.cfg.status_file is not None and self.stage.is_main:
            ckpt.write_json_atomically(self.cfg.run_dir / self.cfg.status_file, status)

    def run(self) -> LoopOutcome:
        """Collective: resume, train to the last step or a stop request, close. The final
        status is written when the run ends without an error (a crash leaves ``"running"``; an
        error of ``ENDING_ERRORS``, such as a full disk, writes ``"failed"`` and its message)."""
        stage, cfg = self.stage, self.cfg

        def restore(path: Path, record: dict[str, Any]) -> None:
            stage.restore_state(path, record)  # and the rollbacks before it, from its seal
            self.rollbacks = list(record.get("meta", {}).get("divergence_rollbacks", []))

        found = ckpt.resume_collectively(
            stage.store, restore, stage.engine.any_rank, checksums=stage.is_main
        )
        self.resumed_from = None if found is None else found[0]
        # Only now: a resume that fails leaves the previous status (e.g. "completed") as it
        # was; a stale "stopped" from an earlier attempt must not survive a later crash.
        self._write_status({"state": "running", "step": stage.step})
        self.trackers = open_trackers(
            cfg.trackers,
            cfg.run_dir,
            enabled=stage.is_main,
            purge_step=stage.step + 1 if self.resumed_from else None,
            config=cfg.tracker_config,
            run_name=cfg.run_name,
        )
        self.progress = Progress(
            cfg.total_steps,
            initial=min(stage.step, cfg.total_steps),
            enabled=stage.is_main,
            force_tty=cfg.progress_tty,
            log_every=cfg.log_every,
            desc=cfg.name,
        )
        stopwatch = StopWatch(
            None if cfg.time_budget_minutes is None else cfg.time_budget_minutes * 60
        )
        outcome = LoopOutcome("completed", "", stage.step, self.resumed_from)
        ended: str | None = None
        try:
            stage.begin(self)
            if cfg.eval_at_start and self.resumed_from is None:
                stage.evaluate_now(self)
            self._steps(stopwatch, outcome)
            if outcome.state == "completed":
                final = None
                if cfg.checkpoint_at_end:
                    final = stage.store.root / ckpt.tag_for(stage.step)
                    if not (final / ckpt.COMPLETE_FILE).is_file():
                        final = self.save_checkpoint("end")
                stage.complete(self, final)
            stage.engine.barrier()
        except BaseException as e:
            ended = "failed"
            if isinstance(e, ENDING_ERRORS):  # a known cause: the status file says it
                with contextlib.suppress(OSError):
                    self._write_status({"state": "failed", "reason": str(e), "step": stage.step})
            raise
        finally:
            self.progress.close()
            self.trackers.close(ended or outcome.state)
            stopwatch.restore()
        outcome.step = stage.step
        self._write_status(
            {
                "state": outcome.state,
                "reason": outcome.reason,
                "step": stage.step,
                "total_steps": cfg.total_steps,
                **({"rollbacks": self.rollbacks} if self.rollbacks else {}),
                **stage.status(),
            }
        )
        return outcome

    def _roll_back(self, verdict: Verdict) -> int:
        """Collective: the divergence guard's rollback (``engine/divergence.py``). Returns the
        step the run continues from."""
        stage, settings = self.stage, self.cfg.divergence
        assert settings is not None and self.trackers is not None
        failed_at = stage.step
        where = f"{verdict.reason}"
        if len(self.rollbacks) >= settings.max_rollbacks:
            raise DivergenceError(
                f"{where}, after {len(self.rollbacks)} rollback(s) (train.divergence."
                f"max_rollbacks={settings.max_rollbacks}): the run stops. Its checkpoints hold "
                "the last good state; try a lower learning rate (train.divergence.lr_scale, "
                "optimizer.lr) or a longer warm-up, then run the same command again"
            )
        good = [s for s in stage.store.complete_steps() if s < verdict.first_bad_step]
        if not good:
            raise DivergenceError(
                f"{where}: no complete checkpoint before step {verdict.first_bad_step} to roll "
                "back to (train.checkpoint_every sets how often they are written)"
            )
        target = good[-1]
        tag = ckpt.tag_for(target)
        record = stage.store.read_complete(tag, checksums=stage.is_main)
        stage.restore_state(stage.store.root / tag, record)
        stage.skip_data(failed_at - target)
        factor = settings.lr_scale ** (len(self.rollbacks) + 1)
        if settings.lr_scale != 1.0:
            stage.scale_learning_rate(factor)
        aside = stage.store.set_aside_after(target, f".diverged-{len(self.rollbacks) + 1}")
        self.guard.rolled_back()  # type: ignore[union-attr]
        if self.progress is not None:
            self.progress.rewind(target)
        event = {
            "at_step": failed_at,
            "to_step": target,
            "reason": verdict.reason,
            "skipped_steps_of_data": failed_at - target,
            "lr_factor": factor,
            "set_aside": aside,
        }
        self.rollbacks.append(event)
        self.trackers.scalars(
            failed_at,
            {
                "divergence/rollbacks": float(len(self.rollbacks)),
                "divergence/to_step": float(target),
            },
        )
        self._write_status({"state": "running", "step": target, "rollbacks": self.rollbacks})
        if stage.is_main:
            self.say(
                f"{self.cfg.name}: {verdict.reason}: rolled back to step {target}, skipping the "
                f"data of steps {target + 1}-{failed_at}"
                + (f", learning rate x{factor:g}" if factor != 1.0 else "")
                + f" (rollback {len(self.rollbacks)} of at most {settings.max_rollbacks})"
            )
        return target

    def _steps(self, stopwatch: StopWatch, outcome: LoopOutcome) -> None:
        """Steps until the last one or a stop request (``outcome`` then says which)."""
        stage, cfg = self.stage, self.cfg
        assert self.progress is not None
        total = cfg.total_steps
        first_started: float | None = time.perf_counter()  # this process's first step compiles
        logged_through = stage.step  # the last step of the last logging window
        while stage.step < total:
            stage.train_step(self)
            if first_started is not None:
                report = stage.engine.first_step_report(time.perf_counter() - first_started)
                first_started = None
                if report and stage.is_main:
                    self.say(f"{cfg.name}: {report}")
            step = stage.step
            if step % max(cfg.log_every, 1) == 0 or step == total:
                self.progress.update(step, stage.log_step(self))
                if self.guard is not None:
                    health = stage.health()
                    verdict = self.guard.observe(
                        logged_through + 1, step, health.loss, health.nonfinite_in_a_row
                    )
                    logged_through = step
                    if verdict is not None:
                        logged_through = self._roll_back(verdict)
                        continue
            if (cfg.eval_every and step % cfg.eval_every == 0) or (
                cfg.eval_at_end and step == total
            ):
                stage.evaluate_now(self)
            checkpoint_due = bool(
                cfg.checkpoint_every
                and step % cfg.checkpoint_every == 0
                and (step < total or cfg.checkpoint_at_end)
            )
            stage.after_step(self, checkpoint_due)
            signal_flag, budget_flag = stage.engine.all_reduce_max(stopwatch.local_flags())
            if step < total and (signal_flag or budget_flag):
                outcome.state = "stopped"
                outcome.reason = (
                    f"signal {stopwatch.received or 'received by another rank'}"
                    if signal_flag
                    else f"time budget of {cfg.time_budget_minutes} min"
                )
                self.save_checkpoint(outcome.reason)
                return
            if checkpoint_due:
                self.save_checkpoint("interval")
