"""The fine-tuning loop shared by GLUE and LRA: sequence classification or regression on
encoded examples, through the same engine as pretraining (``engine.Engine``: DeepSpeed or plain
PyTorch, any precision), with evaluation every N steps and the best-dev weights kept as a
release.

    result = Finetuner(model, train_set, eval_sets, score_fn, cfg, run_dir).run()

* ``train_set`` / ``eval_sets[name]``: indexable sequences of example dicts holding
  ``input_ids``, ``token_type_ids`` (lists or 1-D arrays), optionally ``index`` and ``label``;
  batches are padded to their longest sequence by :func:`collate`.
* ``score_fn(predictions, labels) -> dict[str, float]`` computes the task's metrics;
  ``cfg.select`` names the one that picks the best evaluation (higher is better).
* Every rank evaluates the whole evaluation set (evaluation sets are small; under ZeRO-3 the
  forward is collective anyway); rank 0 writes TensorBoard, ``results.json`` and the releases.

Fine-tuning runs are short, so they do not checkpoint for resumption; a stopped run is re-run.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from data_prep.transport import loader_batches
from engine.distributed import detect
from engine.engine import Engine, EngineConfig
from engine.metrics import MetricsWriter, Progress
from engine.optim import OptimizerConfig, ScheduleConfig
from model.release import save_release

ScoreFn = Callable[[np.ndarray, np.ndarray], dict[str, float]]


@dataclass
class FinetuneConfig:
    """The fine-tuning run (the task and data are the caller's)."""

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

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"train.steps={self.steps} is invalid; valid: >= 1")
        for name in ("eval_every", "log_every", "num_workers"):
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


def collate(
    batch: Sequence[Mapping[str, Any]], pad_id: int, pad_to_multiple_of: int | None = None
) -> dict[str, torch.Tensor]:
    """Pads examples to the batch's longest (rounded up to ``pad_to_multiple_of``).

    Returns torch tensors: input_ids, attention_mask (1 real, 0 padding), token_type_ids (0 on
    padding), all (B, N) int64; index (B,) int64 when the examples carry one; and labels (B,)
    (int64 class ids or float32 scores) when they carry labels. The model takes the first three.
    """
    if not batch:
        raise ValueError("empty batch")
    width = max(len(item["input_ids"]) for item in batch)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    type_ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, item in enumerate(batch):
        n = len(item["input_ids"])
        input_ids[i, :n] = torch.as_tensor(np.asarray(item["input_ids"], dtype=np.int64))
        type_ids[i, :n] = torch.as_tensor(np.asarray(item["token_type_ids"], dtype=np.int64))
        mask[i, :n] = 1
    out = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": type_ids}
    if all("index" in item for item in batch):
        out["index"] = torch.tensor([item["index"] for item in batch], dtype=torch.long)
    labels = [item.get("label") for item in batch]
    if any(label is not None for label in labels):
        if any(label is None for label in labels):
            raise ValueError("a batch mixes labelled and unlabelled examples")
        regression = any(isinstance(label, (float, np.floating)) for label in labels)
        out["labels"] = torch.tensor(labels, dtype=torch.float32 if regression else torch.long)
    return out


MEGABATCH_BATCHES = 50
"""Global batches per megabatch of the length-grouped sampler (HF's mega_batch_mult)."""


def example_lengths(examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """(n,) int64 token counts: the set's ``lengths`` (an array, or a method returning one) if it
    has one, else ``len(input_ids)`` plus ``len(input_ids_b)`` for two-document examples."""
    given = getattr(examples, "lengths", None)
    if callable(given):  # the GLUE and LRA example sets compute it
        given = given()
    if given is not None:
        return np.asarray(given, dtype=np.int64)
    out = np.empty(len(examples), dtype=np.int64)
    for i in range(len(examples)):
        item = examples[i]
        out[i] = len(item["input_ids"]) + (len(item["input_ids_b"]) if "input_ids_b" in item else 0)
    return out


class LengthGroupedBatchSampler:
    """This rank's batches of indices, grouped by length; the same count on every rank.

    Epoch e: a permutation seeded by (seed, e); cut into megabatches of ``MEGABATCH_BATCHES``
    global batches (``batch_size x world_size`` examples); each megabatch sorted by length
    (longest first, stable) and cut into global batches; the ragged tail dropped; the global
    batches shuffled (seeded); rank r takes examples [r*batch_size, (r+1)*batch_size) of
    each. Sorting inside megabatches keeps batches random while their members have similar
    lengths; shuffling the batches avoids a long-to-short sweep within every megabatch.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        megabatch_batches: int = MEGABATCH_BATCHES,
    ):
        if batch_size < 1 or megabatch_batches < 1:
            raise ValueError("batch_size and megabatch_batches must be >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {rank}, {world_size}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.megabatch_batches = seed, megabatch_batches
        self.epoch = 0
        if len(self) == 0:
            raise ValueError(
                f"{len(self.lengths)} training examples give no full global batch of "
                f"{batch_size} x {world_size} ranks"
            )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths) // (self.batch_size * self.world_size)

    def global_batches(self) -> np.ndarray:
        """(num_batches, batch_size x world_size) example indices of this epoch, all ranks."""
        rng = np.random.default_rng([self.seed, self.epoch])
        perm = rng.permutation(len(self.lengths))
        global_batch = self.batch_size * self.world_size
        mega = global_batch * self.megabatch_batches
        chunks = []
        for start in range(0, len(perm), mega):
            chunk = perm[start : start + mega]
            chunks.append(chunk[np.argsort(-self.lengths[chunk], kind="stable")])
        order = np.concatenate(chunks)[: len(self) * global_batch]
        batches = order.reshape(len(self), global_batch)
        return batches[rng.permutation(len(batches))]

    def __iter__(self):
        lo = self.rank * self.batch_size
        for batch in self.global_batches():
            yield batch[lo : lo + self.batch_size].tolist()


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


class Finetuner:
    def __init__(
        self,
        model: torch.nn.Module,
        train_set: Sequence[Mapping[str, Any]],
        eval_sets: Mapping[str, Sequence[Mapping[str, Any]]],
        score_fn: ScoreFn,
        cfg: FinetuneConfig,
        run_dir: str | Path,
        *,
        engine: EngineConfig,
        optimizer: OptimizerConfig,
        schedule: ScheduleConfig,
        pad_id: int,
        tokenizer_file: str | Path | None = None,
        collate_fn: Callable[..., dict[str, torch.Tensor]] | None = None,
        inputs_fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ):
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
        self.train_set, self.eval_sets = train_set, eval_sets
        self.score_fn = score_fn
        self.pad_id = pad_id
        self.tokenizer_file = tokenizer_file
        self.collate = functools.partial(collate_fn or collate, pad_id=pad_id)
        self.inputs_fn = inputs_fn or model_inputs
        self.engine = Engine(model, engine, optimizer, schedule, self.dist)
        self.total_steps = cfg.steps if cfg.steps is not None else schedule.total_steps
        self.micro_batch = engine.micro_batch_size
        self.step = 0

    def _train_batches(self):
        """Endless training batches: epoch after epoch of this rank's share, shuffled by seed
        and epoch (grouped by length with ``group_by_length``)."""
        sampler: LengthGroupedBatchSampler | DistributedSampler
        if self.cfg.group_by_length:
            sampler = LengthGroupedBatchSampler(
                example_lengths(self.train_set),
                self.micro_batch,
                rank=self.dist.rank,
                world_size=self.dist.world_size,
                seed=self.cfg.seed,
            )
            batching: dict[str, Any] = {"batch_sampler": sampler}
        else:
            sampler = DistributedSampler(
                self.train_set,  # type: ignore[arg-type]
                num_replicas=self.dist.world_size,
                rank=self.dist.rank,
                shuffle=True,
                seed=self.cfg.seed,
                drop_last=True,
            )
            batching = {"batch_size": self.micro_batch, "sampler": sampler, "drop_last": True}
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader_batches(
                self.train_set, self.collate, self.cfg.num_workers, **batching
            )
            epoch += 1

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

    def evaluate(self) -> tuple[dict[str, dict[str, float]], dict[str, np.ndarray]]:
        metrics, predictions = {}, {}
        for name, examples in self.eval_sets.items():
            preds = self.predict(examples)
            labels = np.array([e.get("label") for e in examples], dtype=object)
            if all(x is not None for x in labels):
                metrics[name] = self.score_fn(preds, labels.astype(preds.dtype))
            predictions[name] = preds
        return metrics, predictions

    def _save_best(self) -> Path | None:
        weights = self.engine.consolidated_state_dict()  # collective
        if not self.is_main:
            return None
        return save_release(
            self.run_dir / "best",
            self.engine.module,
            tokenizer_file=self.tokenizer_file,
            state_dict=weights,
            overwrite=True,
            extra={"step": self.step},
        )

    def run(self) -> FinetuneResult:
        cfg = self.cfg
        writer = MetricsWriter(self.run_dir / "tensorboard", enabled=self.is_main)
        progress = Progress(
            self.total_steps, enabled=self.is_main, log_every=cfg.log_every, desc="finetune"
        )
        result = FinetuneResult(best_step=None, best={})
        best_value = -math.inf

        def evaluate_now() -> None:
            nonlocal best_value
            metrics, predictions = self.evaluate()
            result.history.append({"step": self.step, **metrics})
            for split, values in metrics.items():
                writer.scalars(self.step, {f"eval/{split}/{k}": v for k, v in values.items()})
            value = metrics.get(cfg.select_split, {}).get(cfg.select, -math.inf)
            if value > best_value or result.best_step is None:
                best_value = value
                result.best_step, result.best = self.step, metrics
                result.predictions = predictions
                if cfg.save_best:
                    result.best_release = self._save_best()
            progress.write(
                f"step {self.step}: "
                + ", ".join(
                    f"{split} {k} {v:.4f}" for split, m in metrics.items() for k, v in m.items()
                )
            )

        if cfg.eval_at_start:
            evaluate_now()
        batches = self._train_batches()
        loss_sum, count, start = 0.0, 0, time.perf_counter()
        self.engine.train(True)
        try:
            while self.step < self.total_steps:
                for _ in range(self.engine.cfg.gradient_accumulation_steps):
                    batch = self.engine.to_device(next(batches))
                    out = self.engine.forward(**self.inputs_fn(batch))
                    loss = task_loss(out.logits, batch["labels"])
                    loss = loss + sum(out.aux_losses.values(), torch.zeros((), device=loss.device))
                    self.engine.backward(loss)
                    loss_sum += float(loss.detach())
                    count += 1
                step = self.engine.step()
                self.step += 1
                if self.step % max(cfg.log_every, 1) == 0 or self.step == self.total_steps:
                    mean = loss_sum / max(count, 1)
                    writer.scalars(
                        self.step,
                        {
                            "train/loss": mean,
                            "optim/lr": step.lr,
                            "optim/grad_norm": step.grad_norm,
                            "throughput/steps_per_s": count
                            / self.engine.cfg.gradient_accumulation_steps
                            / (time.perf_counter() - start),
                        },
                    )
                    progress.update(self.step, {"loss": mean, "lr": step.lr})
                    loss_sum, count, start = 0.0, 0, time.perf_counter()
                if (
                    cfg.eval_every
                    and self.step % cfg.eval_every == 0
                    and self.step < self.total_steps
                ):
                    evaluate_now()
            evaluate_now()
        finally:
            progress.close()
            writer.close()
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            summary = {
                "best_step": result.best_step,
                "best": result.best,
                "history": result.history,
                "best_release": None if result.best_release is None else str(result.best_release),
            }
            (self.run_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
        return result
