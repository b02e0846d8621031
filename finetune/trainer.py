"""The fine-tuning loop shared by GLUE and LRA: sequence classification or regression on
encoded examples, through the same engine as pretraining (``engine.Engine``: DeepSpeed or plain
PyTorch, any precision), with evaluation every N steps and the best-dev weights kept as a
release.

    data = FinetuneData(train_set, eval_sets, score_fn, pad_id)
    result = Finetuner(model, data, cfg, run_dir, engine=..., optimizer=..., schedule=...).run()

* ``train_set`` / ``eval_sets[name]``: indexable sequences of example dicts holding
  ``input_ids``, ``token_type_ids`` (lists or 1-D arrays), optionally ``index`` and ``label``;
  batches are padded to their longest sequence by :func:`collate`.
* ``score_fn(predictions, labels) -> dict[str, float]`` computes the task's metrics;
  ``cfg.select`` names the one that picks the best evaluation (higher is better).
* The loop (resume, checkpoints, stop requests, trackers, the cadences) is
  ``engine.loop.RunLoop``, the one pretraining runs too; the ``Finetuner`` is its stage.
* Every rank evaluates the whole evaluation set (evaluation sets are small; under ZeRO-3 the
  forward is collective anyway); rank 0 writes TensorBoard, ``results.json`` and the releases.

Preemption and resumption follow pretraining's protocol (``engine/checkpoint.py``): a checkpoint
every ``checkpoint_every`` steps, and one when a stop signal arrives (SIGTERM, SIGUSR1, SIGUSR2)
or ``time_budget_minutes`` runs out; the run then returns ``state == "stopped"``. Running the
same run again (same ``run_dir``, same identity) resumes from the newest usable checkpoint with
the same batches, dropout and evaluation history, so the result equals an uninterrupted run's
(to 1e-6 in fp32 on CPU). A checkpoint holds:

    run_dir/checkpoints/step_00000400/
      engine state (DeepSpeed's files or engine.pt), rank_0000r.pt (step, data position, RNG,
      evaluation history, best metrics and predictions), best/ (the best release so far, hard
      links), COMPLETE.json (sizes and checksums, written last)

A finished run leaves ``results.json`` (its evaluation history and best metrics; written last),
``predictions.npz`` (every evaluation set's predictions at the best and at the last evaluation,
and the labels: what ``finetune.compare`` needs to tell two runs apart) and ``best/``.

A run directory belongs to one run: ``identity`` (the caller's description: task, learning
rate, seed, config, the init's content) is written to ``run.json`` on the first start and a
different one is refused. :func:`finished_run` tells a sweep which runs are done.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from albatross.files import staged_directory
from albatross.writer_lock import one_writer_collectively
from data_prep.format import sha256_file
from data_prep.transport import loader_batches
from engine import checkpoint as ckpt
from engine.distributed import detect
from engine.engine import Engine, EngineConfig
from engine.loop import LoopConfig, RunLoop, Stage
from engine.optim import OptimizerConfig, ScheduleConfig
from engine.recipe import diff_keys, move_saved_keys
from engine.trackers import TRACKER_KEYS, TrackerConfig, default_run_name
from finetune.batching import LengthGroupedBatchSampler, collate, example_lengths
from finetune.compare import save_predictions
from model.hub.release import save_release

ScoreFn = Callable[[np.ndarray, np.ndarray], dict[str, float]]


@dataclass
class FinetuneConfig(TrackerConfig):
    """The fine-tuning run (the task and data are the caller's); the trackers: `TrackerConfig`
    (``engine/trackers.py``)."""

    steps: int | None = None
    """Optimizer steps (ALBERT's GLUE recipes give steps, not epochs). None: the schedule's
    total_steps."""
    eval_every: int = 0
    """Steps between evaluations on the evaluation sets; 0: only at the end."""
    eval_at_start: bool = False
    """Also evaluate before the first step (a release's zero-shot head, or an import check)."""
    log_every: int = 10
    """Steps between training-loss log lines / TensorBoard points."""
    select: str = "score"
    """Metric (from the score function) that picks the best evaluation; higher is better."""
    select_split: str = "dev"
    """Evaluation set whose ``select`` metric picks the best step."""
    save_best: bool = True
    """Keep the best evaluation's weights as a release in run_dir/best."""
    seed: int = 0
    """Seeds the head's initialisation, dropout and the data order."""
    num_workers: int = 0
    """DataLoader workers per rank."""
    group_by_length: bool = False
    """Batch training examples of similar length (HF ``group_by_length``), so less padding is
    computed: each epoch's seeded permutation is cut into megabatches of 50 global batches,
    each sorted by length and cut into global batches (every rank takes its slice, so ranks
    pad to similar lengths), and the batches are shuffled. Deterministic by ``seed`` and
    epoch. Lengths are ``len(input_ids)`` (+ ``len(input_ids_b)`` for pairs), or the training
    set's ``lengths`` attribute when it has one. Evaluation order is unchanged."""
    checkpoint_every: int = 1000
    """Steps between checkpoints for resumption (0: only when stopped by a signal or the time
    budget). A checkpoint holds the optimizer state too: about 3x the weights."""
    keep_last: int = 1
    """Complete checkpoints kept on disk while the run goes on."""
    keep_checkpoints: bool = False
    """Keep ``run_dir/checkpoints`` once the run has finished (False: deleted; the best
    release, results and predictions stay)."""
    time_budget_minutes: float | None = None
    """Stop with a checkpoint after this much wall-clock time (None: no budget); re-run the
    same command to go on."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"train.steps={self.steps} is invalid; valid: >= 1")
        if self.keep_last < 1:
            raise ValueError(f"train.keep_last={self.keep_last} is invalid; valid: >= 1")
        if self.time_budget_minutes is not None and self.time_budget_minutes <= 0:
            raise ValueError(
                f"train.time_budget_minutes={self.time_budget_minutes} is invalid; valid: > 0"
            )
        for name in ("eval_every", "log_every", "num_workers", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}={getattr(self, name)} is invalid; valid: >= 0")


@dataclass
class FinetuneResult:
    best_step: int | None
    best: dict[str, dict[str, float]]
    """Evaluation metrics of every set at the best step."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """One entry per evaluation: step, and metrics per evaluation set."""
    best_release: Path | None = None
    predictions: dict[str, np.ndarray] = field(default_factory=dict)
    """Predictions of every evaluation set at the best step (class ids or floats)."""
    state: str = "completed"
    """``"completed"``, or ``"stopped"`` (a signal or the time budget; a checkpoint was saved:
    run it again to resume)."""
    reason: str = ""
    step: int = 0
    """Optimizer steps done."""
    resumed_from: Path | None = None


EXIT_STOPPED = 75
"""Exit code of ``python -m finetune`` when a signal or the time budget stopped a run and a
checkpoint was saved (EX_TEMPFAIL): run the same command again to resume; the batch scripts
requeue on it."""
RUN_FILE = "run.json"
"""The run's identity, written on its first start (see :func:`check_run_identity`)."""
RESULTS_FILE = "results.json"
CHECKPOINTS = "checkpoints"
BEST = "best"


RESUMABLE_KEYS = (
    "train.run_dir",
    "seeds",
    "lrs",
    "train.log_every",
    "train.num_workers",
    "train.checkpoint_every",
    "train.keep_last",
    "train.keep_checkpoints",
    "train.time_budget_minutes",
    "engine.dist_timeout_minutes",
    "engine.compile_cache_dir",
    *TRACKER_KEYS,
)
"""Config keys that are not part of a run's identity: where it is, the sweep around it, and
settings that do not change what it computes (a resumed run may change them)."""


DS_CONFIG_DIGEST = "deepspeed_config_sha256"
"""The identity's record of the content of ``engine.deepspeed_config``'s file."""


def run_identity(config: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """A run's identity for :func:`check_run_identity`: its config without ``RESUMABLE_KEYS``,
    plus ``extra`` (the task, learning rate, seed, the init's content digest)."""
    out = json.loads(json.dumps(dict(config)))
    engine = out.get("engine")
    if isinstance(engine, dict) and engine.get("deepspeed_config", 0) is None:
        del engine["deepspeed_config"]  # unset: the identity of runs from before the key existed
    elif isinstance(engine, dict) and engine.get("deepspeed_config") is not None:
        file = Path(str(engine["deepspeed_config"]))
        if file.is_file():  # its content: a file edited between two attempts is another run
            engine[DS_CONFIG_DIGEST] = sha256_file(file)
    if isinstance(engine, dict) and engine.get("compile_options", 0) == {}:
        del engine["compile_options"]  # unset: the identity of runs from before the key existed
    for key in RESUMABLE_KEYS:
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.get(part, {})
        if isinstance(node, dict):
            node.pop(last, None)
    return {**out, **extra}


def check_run_identity(run_dir: str | Path, identity: Mapping[str, Any]) -> bool:
    """True when ``run_dir`` was started with this identity (a resume or a finished run), False
    when it holds no run. ValueError naming the differing keys when it holds another run, so
    a changed config never resumes or reuses another run's checkpoints and results."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return False
    try:
        saved = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is unreadable ({e}); move the run directory aside") from None
    saved = move_saved_keys(saved)  # keys that moved since (engine.recipe.MOVED_KEYS)
    current = json.loads(json.dumps(dict(identity)))  # the form it is saved in
    if DS_CONFIG_DIGEST not in (saved.get("engine") or {}):  # saved before it was recorded
        (current.get("engine") or {}).pop(DS_CONFIG_DIGEST, None)
    changed = diff_keys(saved, current)
    if changed:
        edited = (
            " (the file engine.deepspeed_config names was edited since the run started)"
            if f"engine.{DS_CONFIG_DIGEST}" in changed
            else ""
        )
        raise ValueError(
            f"{run_dir} holds a fine-tuning run with another config ({path}); differing keys: "
            f"{changed}{edited}. Use another train.run_dir, or restore those values to resume "
            "or reuse it."
        )
    return True


def finished_run(run_dir: str | Path, identity: Mapping[str, Any]) -> dict[str, Any] | None:
    """The results a finished run left (``results.json`` with ``"finished": true``, written by
    :func:`write_finished`), or None when the run has not finished. ValueError when the run
    directory holds a run with another identity."""
    run_dir = Path(run_dir)
    if not check_run_identity(run_dir, identity):
        return None
    path = run_dir / RESULTS_FILE
    if not path.is_file():
        return None
    try:
        results = json.loads(path.read_text())
    except ValueError:
        return None  # a results file cut short by a kill: the run is not finished
    return results if results.get("finished") is True else None


def write_finished(run_dir: str | Path, results: Mapping[str, Any]) -> Path:
    """Writes ``results.json`` with ``"finished": true``, atomically: the last file a run
    writes (after its predictions), so a sweep that finds it may skip the run."""
    path = Path(run_dir) / RESULTS_FILE
    ckpt.write_json_atomically(path, {**results, "finished": True})
    return path


def _link_tree(source: Path, target: Path) -> None:
    """A copy of ``source`` at ``target`` made of hard links where the file system allows
    (releases are written to a new directory and renamed, never modified in place)."""
    target.mkdir(parents=True, exist_ok=True)
    for item in sorted(source.iterdir()):
        if item.is_dir():
            _link_tree(item, target / item.name)
        else:
            try:
                os.link(item, target / item.name)
            except OSError:
                shutil.copy2(item, target / item.name)


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keyword arguments of a sequence classifier from a :func:`collate` batch."""
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "token_type_ids": batch["token_type_ids"],
    }


def task_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for classification (B, C); mean squared error for regression (B,)."""
    if logits.dim() == 1:
        return F.mse_loss(logits.float(), labels.float())
    return F.cross_entropy(logits.float(), labels)


@dataclass
class FinetuneData:
    """What a task gives a fine-tuning run: its examples, its metrics, how they are batched."""

    train_set: Sequence[Mapping[str, Any]]
    eval_sets: Mapping[str, Sequence[Mapping[str, Any]]]
    """Evaluation sets by name (``train.select_split`` names one)."""
    score_fn: ScoreFn
    """``score_fn(predictions, labels) -> {metric: value}``."""
    pad_id: int
    tokenizer_file: str | Path | None = None
    """Copied into the best release."""
    collate_fn: Callable[..., dict[str, torch.Tensor]] | None = None
    """``collate_fn(examples, pad_id=...)`` -> a batch; None: :func:`collate`."""
    inputs_fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    """The model's keyword arguments from a batch; None: :func:`model_inputs`."""


class Finetuner(Stage):
    """One fine-tuning run on this rank, the stage ``engine.loop.RunLoop`` drives (as it
    drives pretraining): ``Finetuner(model, data, cfg, run_dir, ...).run()``. ``identity``:
    the run's (:func:`run_identity`), refused when ``run_dir`` holds another."""

    def __init__(
        self,
        model: torch.nn.Module,
        data: FinetuneData,
        cfg: FinetuneConfig,
        run_dir: str | Path,
        *,
        engine: EngineConfig,
        optimizer: OptimizerConfig,
        schedule: ScheduleConfig,
        identity: Mapping[str, Any] | None = None,
    ):
        train_set, eval_sets = data.train_set, data.eval_sets
        if cfg.select_split not in eval_sets:
            raise ValueError(
                f"train.select_split={cfg.select_split!r} is not an evaluation set; "
                f"have {sorted(eval_sets)}"
            )
        if len(train_set) == 0:
            raise ValueError("the training set is empty")
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.dist = detect()
        global_batch = engine.micro_batch_size * self.dist.world_size
        if len(train_set) < global_batch:
            # Every epoch drops its last partial batch: with fewer examples than one global
            # batch no step could ever run (the endless epoch loop would spin forever).
            raise ValueError(
                f"the training set has {len(train_set)} examples, fewer than one global batch "
                f"of {global_batch} (engine.micro_batch_size={engine.micro_batch_size} x "
                f"{self.dist.world_size} processes): no training step could run; lower "
                "engine.micro_batch_size or use more training data"
            )
        self.is_main = self.dist.rank == 0
        self.identity = dict(identity) if identity is not None else {}
        check_run_identity(self.run_dir, self.identity)  # before any work
        self.train_set, self.eval_sets = train_set, eval_sets
        self.score_fn = data.score_fn
        self.pad_id = data.pad_id
        self.tokenizer_file = data.tokenizer_file
        self.collate = functools.partial(data.collate_fn or collate, pad_id=data.pad_id)
        self.inputs_fn = data.inputs_fn or model_inputs
        self.engine = Engine(model, engine, optimizer, schedule, self.dist)
        self.total_steps = cfg.steps if cfg.steps is not None else schedule.total_steps
        self.micro_batch = engine.micro_batch_size
        self.store = ckpt.CheckpointStore(
            self.run_dir / CHECKPOINTS,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            keep_last=cfg.keep_last,
            barrier=self.engine.barrier,
        )
        self.step = 0
        self.epoch = 0
        """The training epoch the next batch comes from."""
        self.position = 0
        """Batches of ``epoch`` this rank has consumed (the resume point)."""
        # The run, as the loop's stage (``run`` and ``begin`` set them for each run).
        self.result = FinetuneResult(best_step=None, best={})
        self._loss_sum, self._count = 0.0, 0  # the logging window's training loss
        self._window_start: float | None = None
        self._best_value = -math.inf
        self._last_predictions: dict[str, np.ndarray] = {}
        self._last_step: Any = None  # the engine's StepResult of the last step
        self._batches: Iterator[dict[str, torch.Tensor]] = iter(())
        self.sampler: LengthGroupedBatchSampler | DistributedSampler
        if cfg.group_by_length:
            self.sampler = LengthGroupedBatchSampler(
                example_lengths(train_set),
                self.micro_batch,
                rank=self.dist.rank,
                world_size=self.dist.world_size,
                seed=cfg.seed,
            )
        else:
            self.sampler = DistributedSampler(
                train_set,  # type: ignore[arg-type]
                num_replicas=self.dist.world_size,
                rank=self.dist.rank,
                shuffle=True,
                seed=cfg.seed,
                drop_last=True,
            )

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches (example indices) of ``epoch``, in training order: a
        seeded shuffle per epoch (grouped by length with ``group_by_length``); the last
        partial batch is dropped."""
        self.sampler.set_epoch(epoch)
        if isinstance(self.sampler, LengthGroupedBatchSampler):
            return list(self.sampler)
        order = list(self.sampler)
        size = self.micro_batch
        return [order[i : i + size] for i in range(0, len(order) - size + 1, size)]

    def _train_batches(self):
        """Endless training batches from ``(epoch, position)`` on: the rest of that epoch, then
        epoch after epoch. ``position`` counts the batches handed out, so a checkpoint taken
        between steps records exactly where a resumed run must go on."""
        while True:
            rest = self.epoch_batches(self.epoch)[self.position :]
            # The loader's own generator, so creating it never draws from the global RNG (the
            # dropout stream must not depend on where an epoch was entered).
            generator = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.epoch)
            for batch in loader_batches(
                self.train_set,
                self.collate,
                self.cfg.num_workers,
                batch_sampler=rest,
                generator=generator,
            ):
                self.position += 1
                yield batch
            self.epoch += 1
            self.position = 0

    @torch.no_grad()
    def predict(self, examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """Class ids (classification) or values (regression) for ``examples``, in order."""
        self.engine.train(False)
        out = []
        for start in range(0, len(examples), self.micro_batch):
            end = min(start + self.micro_batch, len(examples))
            batch = self.engine.to_device(self.collate([examples[i] for i in range(start, end)]))
            logits = self.engine.forward(**self.inputs_fn(batch)).logits.float()
            out.append((logits if logits.dim() == 1 else logits.argmax(-1)).cpu().numpy())
        self.engine.train(True)
        return np.concatenate(out) if out else np.zeros((0,))

    @functools.cached_property
    def eval_labels(self) -> dict[str, np.ndarray]:
        """The labels of every evaluation set that has them (all its examples labelled); read
        once, not at every evaluation."""
        out = {}
        for name, examples in self.eval_sets.items():
            labels = [e.get("label") for e in examples]
            if labels and all(x is not None for x in labels):
                out[name] = np.asarray(labels)
        return out

    def evaluate(self) -> tuple[dict[str, dict[str, float]], dict[str, np.ndarray]]:
        metrics, predictions = {}, {}
        labelled = self.eval_labels
        for name, examples in self.eval_sets.items():
            preds = self.predict(examples)
            if name in labelled:
                metrics[name] = self.score_fn(preds, labelled[name].astype(preds.dtype))
            predictions[name] = preds
        return metrics, predictions

    def _save_best(self) -> Path | None:
        weights = self.engine.consolidated_state_dict()  # collective
        if not self.is_main:
            return None
        return save_release(
            self.run_dir / BEST,
            self.engine.module,
            tokenizer_file=self.tokenizer_file,
            state_dict=weights,
            overwrite=True,
            extra={"step": self.step},
        )

    # -- checkpoints (the loop's save_state / restore_state) -------------------------------------

    def save_state(self, staging: Path, reason: str) -> dict[str, Any]:
        """Collective (``RunLoop.save_checkpoint``): the engine, every rank's position and RNG,
        the loss window, the evaluation history and the best release so far."""
        result = self.result
        self.engine.save(staging)
        state: dict[str, Any] = {
            "step": self.step,
            "epoch": self.epoch,
            "position": self.position,
            "rng": ckpt.rng_state(),
            "window": json.dumps({"loss_sum": self._loss_sum, "count": self._count}),
            "best_step": result.best_step,
            "best": json.dumps(result.best),
            "history": json.dumps(result.history),
            "predictions": {
                k: torch.from_numpy(np.asarray(v)) for k, v in result.predictions.items()
            },
        }
        ckpt.save_rank_state(staging, self.dist.rank, state)
        if self.is_main and result.best_release is not None:
            _link_tree(result.best_release, staging / BEST)
        return {"reason": reason, "world_size": self.dist.world_size}

    def restore_state(self, path: Path, record: dict[str, Any]) -> None:
        """A checkpoint of this run on the same number of processes (the loop's resume)."""
        ckpt.same_world_size(record, self.dist.world_size)
        result = self.result
        self.engine.load(path)
        state = ckpt.load_rank_state(path, self.dist.rank)
        ckpt.set_rng_state(state["rng"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.position = int(state["position"])
        result.best_step = state["best_step"]
        result.best = json.loads(state["best"])
        result.history = json.loads(state["history"])
        result.predictions = {k: v.numpy() for k, v in state["predictions"].items()}
        result.best_release = None
        if self.is_main:
            # The best release as it was at the checkpoint (a later best written before the
            # interruption is not this run's any more: the resumed run writes it again).
            ckpt.remove_tree(self.run_dir / BEST)
            if (path / BEST).is_dir():
                with staged_directory(self.run_dir / BEST, "the best release") as staging:
                    _link_tree(path / BEST, staging)
        if result.best_step is not None and self.cfg.save_best:
            result.best_release = self.run_dir / BEST
        window = json.loads(state["window"])
        self._loss_sum, self._count = float(window["loss_sum"]), int(window["count"])

    # -- the stage the loop drives (engine/loop.py) ----------------------------------------------

    def run(self) -> FinetuneResult:
        """The run, as the run directory's one writer (``albatross.writer_lock``; a second
        job on the same task, learning rate and seed is refused): its identity into the run
        directory, then ``engine.loop.RunLoop`` (resume, steps, evaluations, checkpoints, stop
        requests); a completed run leaves its predictions and ``results.json`` (rank 0)."""
        with one_writer_collectively(
            self.run_dir, "fine-tuning run", self.is_main, self.engine.any_rank
        ):
            return self._run()

    def _run(self) -> FinetuneResult:
        cfg = self.cfg
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if not (self.run_dir / RUN_FILE).is_file():
                ckpt.write_json_atomically(self.run_dir / RUN_FILE, self.identity)
        self.engine.barrier()
        result = self.result = FinetuneResult(best_step=None, best={})
        self._loss_sum, self._count = 0.0, 0
        self._last_predictions = {}
        loop = RunLoop(
            self,
            LoopConfig(
                name="finetune",
                run_dir=self.run_dir,
                total_steps=self.total_steps,
                trackers=cfg,
                tracker_config=self.identity,
                run_name=default_run_name(self.run_dir, getattr(cfg, "run_dir", None)),
                log_every=cfg.log_every,
                eval_every=cfg.eval_every,
                eval_at_start=cfg.eval_at_start,
                eval_at_end=True,
                checkpoint_every=cfg.checkpoint_every,
                time_budget_minutes=cfg.time_budget_minutes,
            ),
        )
        outcome = loop.run()
        result.state, result.reason = outcome.state, outcome.reason
        result.step, result.resumed_from = self.step, outcome.resumed_from
        if result.state == "stopped":
            if self.is_main:
                loop.say(
                    f"finetune: stopped at step {self.step} ({result.reason}); a checkpoint is "
                    f"in {self.store.root}: run the same command again to resume"
                )
            return result
        if self.is_main:
            # For comparisons between runs (finetune.compare): before results.json, which a
            # finished run writes last.
            save_predictions(
                self.run_dir, result.predictions, self._last_predictions, self.eval_labels
            )
            summary = {
                "best_step": result.best_step,
                "best": result.best,
                "history": result.history,
                "best_release": None if result.best_release is None else str(result.best_release),
            }
            ckpt.write_json_atomically(self.run_dir / RESULTS_FILE, summary)
        return result

    def begin(self, loop: RunLoop) -> None:
        """Start-up lines, the best value so far, the training batches from the resume point."""
        if loop.resumed_from is not None:
            loop.say(f"finetune: resumed from {loop.resumed_from} (step {self.step})")
        if self.is_main and self.engine.hooks_summary is not None:
            loop.say(f"finetune: {self.engine.hooks_summary}")
        result = self.result
        self._best_value = -math.inf
        if result.best_step is not None:
            self._best_value = result.best.get(self.cfg.select_split, {}).get(
                self.cfg.select, -math.inf
            )
        self._batches = self._train_batches()
        self._window_start = None  # set at the first step (after eval_at_start)
        self.engine.train(True)

    def train_step(self, loop: RunLoop) -> None:
        if self._window_start is None:
            self._window_start = time.perf_counter()
        for _ in range(self.engine.cfg.gradient_accumulation_steps):
            batch = self.engine.to_device(next(self._batches))
            out = self.engine.forward(**self.inputs_fn(batch))
            loss = task_loss(out.logits, batch["labels"])
            loss = loss + sum(out.aux_losses.values(), torch.zeros((), device=loss.device))
            self.engine.backward(loss)
            self._loss_sum += float(loss.detach())
            self._count += 1
        self._last_step = self.engine.step()
        self.step += 1

    def log_step(self, loop: RunLoop) -> dict[str, float]:
        assert loop.trackers is not None and self._window_start is not None
        assert self._last_step is not None
        mean = self._loss_sum / max(self._count, 1)
        step = self._last_step
        loop.trackers.scalars(
            self.step,
            {
                "train/loss": mean,
                "optim/lr": step.lr,
                "optim/grad_norm": step.grad_norm,
                "throughput/steps_per_s": self._count
                / self.engine.cfg.gradient_accumulation_steps
                / (time.perf_counter() - self._window_start),
            },
        )
        self._loss_sum, self._count, self._window_start = 0.0, 0, time.perf_counter()
        return {"loss": mean, "lr": step.lr}

    def evaluate_now(self, loop: RunLoop) -> None:
        """Every evaluation set at this step -> the history and the trackers; a better
        ``select`` metric makes this step the best (its predictions, its release)."""
        assert loop.trackers is not None
        cfg, result = self.cfg, self.result
        metrics, predictions = self.evaluate()
        self._last_predictions.update(predictions)
        result.history.append({"step": self.step, **metrics})
        for split, values in metrics.items():
            loop.trackers.scalars(self.step, {f"eval/{split}/{k}": v for k, v in values.items()})
        value = metrics.get(cfg.select_split, {}).get(cfg.select, -math.inf)
        if value > self._best_value or result.best_step is None:
            self._best_value = value
            result.best_step, result.best = self.step, metrics
            result.predictions = predictions
            if cfg.save_best:
                result.best_release = self._save_best()
        loop.say(
            f"step {self.step}: "
            + ", ".join(
                f"{split} {k} {v:.4f}" for split, m in metrics.items() for k, v in m.items()
            )
        )

    def discard_checkpoints(self) -> None:
        """Deletes ``run_dir/checkpoints`` unless ``keep_checkpoints`` (call once the caller has
        written everything the run produces: the checkpoints are its only way back)."""
        self.engine.barrier()
        if self.is_main and not self.cfg.keep_checkpoints:
            ckpt.remove_tree(self.store.root)
