"""Experiment tracking on rank 0: TensorBoard (the default), Weights & Biases and MLflow behind
one interface, chosen per run with ``train.trackers`` (pretraining and fine-tuning alike):

    train:
      trackers: [tensorboard, wandb, mlflow]

* `TrackerConfig`: the ``train`` keys that choose and name the trackers (pretraining's and
  fine-tuning's ``train`` sections inherit them). A tracker whose package is not installed is a
  ``ValueError`` when the config is built (the CLIs exit 2 before any work), naming the pip
  extra: ``pip install -e '.[wandb]'`` / ``'.[mlflow]'`` in the clone.
* `open_trackers` -> `Trackers`: what the training loops write to, with the API of
  `engine.metrics.MetricsWriter`. Every ``scalars`` call goes to ``metrics.jsonl`` (always, in
  ``<run_dir>/tensorboard/``: the project's own record, read by ``engine.metrics.read_jsonl``),
  to TensorBoard when ``tensorboard`` is listed, and to each other tracker, with the same tags,
  values and steps. Histograms, figures and text (the resolved config, the TISA curves) are
  TensorBoard's only; W&B gets the config as the run's config, MLflow as parameters.
* `Tracker`: the protocol a tracker implements (``scalars``, ``close``); `WandbTracker` and
  `MlflowTracker` are the two optional ones. Their packages are imported only when they are
  asked for, and only on rank 0.

Resuming. The W&B run id and the MLflow run id are kept in ``<run_dir>/trackers.json``; a
resumed run (the same ``train.run_dir``) continues the same W&B run (``resume="allow"``) and
the same MLflow run. TensorBoard drops the events an interrupted attempt wrote after the
checkpoint it resumes from (``purge_step``) and keeps the newer ones; W&B and MLflow cannot
delete what they received (W&B refuses steps below its last one), so for them the steps an
earlier attempt already logged are not logged again: they keep the earlier values of the steps
between the checkpoint and the interruption (the training values agree with the resumed ones,
resumption being exact; ``time/*`` and ``throughput/*`` may differ). Each tracker records the
last step it logged in ``trackers.json``. A run stopped by a signal or its time budget saves a
checkpoint at the step it stops at, so its resume rewrites nothing.

A tracker that fails while the run goes on (an MLflow server that is down) is reported with a
warning and the run continues: tracking never stops training. Opening one (the W&B run, the
MLflow experiment and run) fails loudly instead, at the start.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import secrets
import string
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine.metrics import MetricsWriter, Scalar, _to_float

__all__ = [
    "EXTRAS",
    "STATE_FILE",
    "TRACKERS",
    "MlflowTracker",
    "Tracker",
    "TrackerConfig",
    "Trackers",
    "WandbTracker",
    "default_run_name",
    "flatten",
    "open_trackers",
]

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb", "mlflow")
"""The trackers ``train.trackers`` may list."""

EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}
"""Tracker -> the pip extra of this project that installs its package."""

_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}

STATE_FILE = "trackers.json"
"""In the run directory: each tracker's run id and the last step it logged (resumption)."""

TENSORBOARD_DIR = "tensorboard"
"""In the run directory: TensorBoard's event files and ``metrics.jsonl``."""

_WARN_EVERY = 100
"""A failing tracker is reported at its first failure and then every this many."""


@dataclass
class TrackerConfig:
    """Where a run's scalars go besides ``metrics.jsonl``: the ``train`` section's tracker keys
    (inherited by pretraining's ``TrainConfig`` and fine-tuning's ``FinetuneConfig``). None of
    them changes what is trained: a resumed run may change them."""

    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers, any of ``tensorboard``, ``wandb``, ``mlflow`` (rank 0 writes).
    ``metrics.jsonl`` is written whatever this lists. ``wandb`` and ``mlflow`` need their
    packages: ``pip install -e '.[wandb]'`` / ``'.[mlflow]'`` in the clone."""
    run_name: str | None = None
    """The run's name in W&B and MLflow. None: from the run directory (pretraining: its name;
    fine-tuning: ``<train.run_dir's name>/<task>/lr_<lr>/seed_<seed>`` and the like)."""
    wandb_project: str | None = None
    """W&B project. None: ``$WANDB_PROJECT``, else ``albatross``. ``WANDB_MODE=offline``
    writes the run to ``<run_dir>/wandb/`` for a later ``wandb sync`` (nodes without internet)."""
    wandb_entity: str | None = None
    """W&B entity (user or team). None: ``$WANDB_ENTITY``, else your default entity."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI: a server (``http://host:5000``), ``databricks``, or a local store
    (``file:/path/mlruns``; MLflow 3 needs ``MLFLOW_ALLOW_FILE_STORE=true`` for it). None:
    ``$MLFLOW_TRACKING_URI``, else MLflow's default (``sqlite:///mlflow.db`` in MLflow 3, which
    needs the full ``mlflow`` package rather than ``mlflow-skinny``)."""
    mlflow_experiment: str | None = None
    """MLflow experiment (created when missing). None: ``$MLFLOW_EXPERIMENT_NAME``, else
    ``albatross``."""

    def __post_init__(self) -> None:
        check_trackers(self.trackers)
        for name in (
            "run_name",
            "wandb_project",
            "wandb_entity",
            "mlflow_tracking_uri",
            "mlflow_experiment",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(
                    f"train.{name}={value!r} is invalid; valid: a non-empty string or null"
                )


TRACKER_KEYS = tuple(f"train.{f}" for f in TrackerConfig.__dataclass_fields__)
"""The dotted config keys of `TrackerConfig` (a resumed run may change them)."""


def check_trackers(trackers: Any) -> None:
    """ValueError unless ``trackers`` is a list of distinct known trackers whose packages are
    installed; the message names the pip extra that installs a missing one."""
    if not isinstance(trackers, (list, tuple)) or not all(isinstance(t, str) for t in trackers):
        raise ValueError(
            f"train.trackers={trackers!r} is invalid; valid: a list of {list(TRACKERS)}"
        )
    for name in trackers:
        if name not in TRACKERS:
            raise ValueError(f"train.trackers: {name!r} is not a tracker; valid: {list(TRACKERS)}")
    if len(set(trackers)) != len(trackers):
        raise ValueError(f"train.trackers={list(trackers)!r} lists a tracker twice")
    for name in trackers:
        if importlib.util.find_spec(_MODULES[name]) is None:
            extra = EXTRAS.get(name)
            how = (
                f"pip install -e '.[{extra}]' in the clone (or pip install {name})"
                if extra
                else f"pip install {name}"
            )
            raise ValueError(
                f"train.trackers lists {name!r}, but the {_MODULES[name]} package is not "
                f"installed: {how}, or drop it from train.trackers"
            )


def default_run_name(run_dir: str | os.PathLike, root: str | os.PathLike | None = None) -> str:
    """A tracker run's name from its run directory: its name, or with ``root`` (a sweep's
    ``train.run_dir``, which holds the run directory) ``<root's name>/<path below root>``."""
    run_dir = Path(run_dir)
    if root is not None:
        try:
            below = run_dir.resolve().relative_to(Path(root).resolve())
        except ValueError:
            below = None
        if below is not None and below.parts:
            return "/".join((Path(root).resolve().name, *below.parts))
    return run_dir.resolve().name


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"dotted.key": value}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, where))
        else:
            out[where] = value
    return out


# ----------------------------------------------------------------------------- state


class _State:
    """``<run_dir>/trackers.json``: per tracker its run id and the last step it logged."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / STATE_FILE
        self.data: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            try:
                loaded = json.loads(self.path.read_text())
            except ValueError:
                warnings.warn(
                    f"{self.path} is unreadable: the trackers start new runs", stacklevel=3
                )
                loaded = {}
            if isinstance(loaded, dict):
                self.data = {k: v for k, v in loaded.items() if isinstance(v, dict)}

    def get(self, tracker: str) -> dict[str, Any]:
        return dict(self.data.get(tracker, {}))

    def update(self, tracker: str, **values: Any) -> None:
        self.data[tracker] = {**self.data.get(tracker, {}), **values}
        from engine.checkpoint import write_json_atomically

        write_json_atomically(self.path, self.data)


# ----------------------------------------------------------------------------- trackers


class Tracker(Protocol):
    """A destination for a run's scalars (created on rank 0 only)."""

    name: str

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Every value (a float; nan and inf included) under its tag at ``step``."""

    def close(self, status: str = "completed") -> None:
        """Ends the run (``status``: ``completed``, ``stopped`` or ``failed``). Idempotent."""


class _ResumableTracker:
    """The bookkeeping W&B and MLflow share: steps an earlier attempt already logged are skipped,
    the last step logged is recorded, failures while logging are warnings."""

    name = ""

    def __init__(self, state: _State):
        self._state = state
        self.logged_before = int(state.get(self.name).get("last_step", 0) or 0)
        """The last step an earlier attempt of this run logged (0: none)."""
        self._last = self.logged_before
        self._failures = 0
        self._closed = False

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if self._closed:
            raise ValueError(f"the {self.name} tracker is closed")
        if step <= self.logged_before or not values:
            return
        try:
            self._log(int(step), values)
        except Exception as e:  # tracking never stops training
            self._failures += 1
            if self._failures == 1 or self._failures % _WARN_EVERY == 0:
                warnings.warn(
                    f"{self.name}: logging step {step} failed ({type(e).__name__}: {e}); "
                    f"training goes on ({self._failures} failure(s) so far)",
                    stacklevel=2,
                )
            return
        if step > self._last:
            self._last = int(step)
            self._state.update(self.name, last_step=self._last)

    def _log(self, step: int, values: Mapping[str, float]) -> None:
        raise NotImplementedError

    def close(self, status: str = "completed") -> None:
        if self._closed:
            return
        self._closed = True
        self._finish(status)

    def _finish(self, status: str) -> None:
        raise NotImplementedError


class WandbTracker(_ResumableTracker):
    """A W&B run in ``<run_dir>/wandb/``; its id in ``trackers.json``, resumed with the run."""

    name = "wandb"

    def __init__(
        self,
        run_dir: Path,
        *,
        run_name: str,
        project: str | None = None,
        entity: str | None = None,
        config: Mapping[str, Any] | None = None,
        state: _State | None = None,
    ):
        import wandb

        state = state if state is not None else _State(run_dir)
        super().__init__(state)
        saved = state.get(self.name)
        project = project or os.environ.get("WANDB_PROJECT") or "albatross"
        resumed = "run_id" in saved and saved.get("project") == project
        run_id = saved["run_id"] if resumed else _new_id()
        if not resumed:
            self.logged_before = self._last = 0
        self.run = wandb.init(
            project=project,
            entity=entity,
            name=run_name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            # On a resume the config is the run's already (W&B keeps it).
            config=dict(config) if config is not None and not resumed else None,
        )
        self.run_id = run_id
        state.update(self.name, run_id=run_id, project=project, last_step=self._last)

    def _log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def _finish(self, status: str) -> None:
        self.run.finish(exit_code=1 if status == "failed" else 0)


def _new_id() -> str:
    """A new W&B run id (8 characters of [a-z0-9], as W&B makes them)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


_MLFLOW_STATUS = {"completed": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


class MlflowTracker(_ResumableTracker):
    """An MLflow run (``mlflow.tracking.MlflowClient``; no global active run, so a process may
    track several runs one after the other, as a fine-tuning sweep does). The run's config goes
    in as parameters (dotted keys); the run id is kept in ``trackers.json``."""

    name = "mlflow"
    MAX_METRICS = 1000
    """Metrics per ``log_batch`` call (MLflow's limit)."""
    MAX_PARAMS = 100
    """Parameters per ``log_batch`` call (MLflow's limit)."""
    MAX_PARAM_LENGTH = 6000
    """Characters of a parameter's value (MLflow's limit; longer values are cut)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        run_name: str,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        config: Mapping[str, Any] | None = None,
        state: _State | None = None,
    ):
        from mlflow.tracking import MlflowClient

        state = state if state is not None else _State(run_dir)
        super().__init__(state)
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self.client = MlflowClient(tracking_uri=uri)
        self.tracking_uri = self.client.tracking_uri
        experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "albatross"
        experiment_id = self._experiment_id(experiment)
        saved = state.get(self.name)
        run_id = None
        if (
            saved.get("run_id")
            and saved.get("tracking_uri") == self.tracking_uri
            and saved.get("experiment_id") == experiment_id
        ):
            try:
                self.client.get_run(saved["run_id"])
                run_id = saved["run_id"]
            except Exception as e:  # deleted meanwhile: a new run
                warnings.warn(
                    f"mlflow: the run {saved['run_id']} of {run_dir} is gone ({e}); starting a "
                    "new one",
                    stacklevel=2,
                )
        if run_id is None:
            self.logged_before = self._last = 0
            run = self.client.create_run(
                experiment_id,
                run_name=run_name,
                tags={"albatross.run_dir": str(Path(run_dir).resolve())},
            )
            run_id = run.info.run_id
            if config is not None:
                self._log_params(run_id, config)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self.experiment_id = experiment_id
        state.update(
            self.name,
            run_id=run_id,
            tracking_uri=self.tracking_uri,
            experiment_id=experiment_id,
            last_step=self._last,
        )

    def _experiment_id(self, name: str) -> str:
        """The id of experiment ``name``, created when missing (another process of a sweep may
        create it at the same moment: then its id)."""
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _log_params(self, run_id: str, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [
            Param(key, json.dumps(value) if not isinstance(value, str) else value)
            for key, value in flatten(config).items()
        ]
        params = [Param(p.key, p.value[: self.MAX_PARAM_LENGTH]) for p in params]
        for i in range(0, len(params), self.MAX_PARAMS):
            self.client.log_batch(run_id, params=params[i : i + self.MAX_PARAMS])

    def _log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, step) for tag, value in values.items()]
        for i in range(0, len(metrics), self.MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + self.MAX_METRICS])

    def _finish(self, status: str) -> None:
        try:
            self.client.set_terminated(self.run_id, status=_MLFLOW_STATUS.get(status, "FINISHED"))
        except Exception as e:
            warnings.warn(f"mlflow: ending run {self.run_id} failed ({e})", stacklevel=2)


# ----------------------------------------------------------------------------- fan-out


class Trackers:
    """What a training loop writes to: ``metrics.jsonl`` and TensorBoard (`MetricsWriter`) plus
    the other trackers, one call each. The API of `MetricsWriter` (``scalars``, ``histogram``,
    ``figure``, ``text``, ``flush``, ``close``; a context manager); on ranks other than 0 every
    call returns at once."""

    def __init__(self, writer: MetricsWriter, others: list[Tracker] | None = None):
        self.writer = writer
        self.others: list[Tracker] = list(others or [])

    @property
    def active(self) -> bool:
        return self.writer.active

    def tracker(self, name: str) -> Tracker | None:
        """The open tracker called ``name`` (``wandb``, ``mlflow``), or None."""
        return next((t for t in self.others if t.name == name), None)

    def scalars(self, step: int, values: Mapping[str, Scalar]) -> None:
        """Each value under its tag at ``step`` in every tracker (``None`` values skipped)."""
        self.writer.scalars(step, values)
        if not self.others or not self.writer.active:
            return
        row = {tag: _to_float(tag, v) for tag, v in values.items() if v is not None}
        for tracker in self.others:
            tracker.scalars(int(step), row)

    def histogram(self, tag: str, values: Any, step: int) -> None:
        self.writer.histogram(tag, values, step)

    def figure(self, tag: str, figure: Any, step: int) -> None:
        self.writer.figure(tag, figure, step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.text(tag, text, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, status: str = "completed") -> None:
        """Closes every tracker (``status``: ``completed``, ``stopped``, ``failed``: how the
        W&B and MLflow runs end). A tracker that fails to close is a warning, so the error that
        ended a run is not hidden by it. Idempotent."""
        try:
            self.writer.close()
        finally:
            for tracker in self.others:
                try:
                    tracker.close(status)
                except Exception as e:
                    warnings.warn(
                        f"{tracker.name}: closing failed ({type(e).__name__}: {e})",
                        stacklevel=2,
                    )

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.close("failed" if exc_type is not None else "completed")


def open_trackers(
    cfg: TrackerConfig,
    run_dir: str | os.PathLike,
    *,
    enabled: bool,
    purge_step: int | None = None,
    config: Mapping[str, Any] | None = None,
    run_name: str | None = None,
) -> Trackers:
    """The trackers of the run in ``run_dir`` (rank 0: ``enabled=True``; elsewhere nothing is
    imported or created). ``purge_step``: TensorBoard's (the first step of a resumed run).
    ``config``: the run's resolved config (W&B run config, MLflow parameters; given to a new
    run only). ``run_name``: the default name when ``cfg.run_name`` is None (else the run
    directory's name)."""
    run_dir = Path(run_dir)
    writer = MetricsWriter(
        run_dir / TENSORBOARD_DIR if enabled else None,
        enabled=enabled,
        purge_step=purge_step,
        tensorboard="tensorboard" in cfg.trackers,
    )
    if not enabled:
        return Trackers(writer)
    name = cfg.run_name or run_name or default_run_name(run_dir)
    plain = None if config is None else _plain(config)
    state = _State(run_dir)
    others: list[Tracker] = []
    try:
        if "wandb" in cfg.trackers:
            others.append(
                WandbTracker(
                    run_dir,
                    run_name=name,
                    project=cfg.wandb_project,
                    entity=cfg.wandb_entity,
                    config=plain,
                    state=state,
                )
            )
        if "mlflow" in cfg.trackers:
            others.append(
                MlflowTracker(
                    run_dir,
                    run_name=name,
                    tracking_uri=cfg.mlflow_tracking_uri,
                    experiment=cfg.mlflow_experiment,
                    config=plain,
                    state=state,
                )
            )
    except BaseException:
        Trackers(writer, others).close("failed")
        raise
    return Trackers(writer, others)


def _plain(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as plain JSON data (paths and other objects as strings; nan kept)."""

    def plain(x: Any) -> Any:
        if isinstance(x, Mapping):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else str(x)
        return str(x)

    return plain(config)
