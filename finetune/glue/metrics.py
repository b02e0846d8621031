"""GLUE's metrics, computed with scikit-learn and scipy, and the GLUE score.

Per task (the GLUE paper, table 1, and the leaderboard's columns):

    cola          mcc (Matthews correlation)
    sst2 qnli rte wnli mnli (each of matched / mismatched)   accuracy
    mrpc qqp      f1 (of the positive class 1) and accuracy
    stsb          pearson and spearman (of the predicted and gold scores)

Every result also has "score": the mean of the task's metrics, which is the number the GLUE
score averages (the paper: "for tasks with multiple metrics, we first average those metrics to
get a task score"). Values are fractions (accuracy in [0, 1], correlations in [-1, 1]); the
leaderboard shows them x 100.

The GLUE score (`glue_average`) is the unweighted mean of the task scores of CoLA, SST-2, MRPC,
STS-B, QQP, MNLI, QNLI, RTE and WNLI, where MNLI's task score is the mean of its matched and
mismatched accuracies (so MNLI counts once, not twice) and AX is left out. This reproduces the
leaderboard: BERT-large's published test results give 80.5 (a test checks it). BERT's paper
reports an average without WNLI (its WNLI predictions were the majority class);
`exclude_wnli=True` leaves WNLI out the same way (8 tasks) but keeps the leaderboard's
per-task scores, so it is not BERT's column-wise average.

A correlation of a constant input (a model that predicts one score for everything) is undefined;
it counts as 0.0, as scikit-learn's matthews_corrcoef does, so model selection never sees NaN.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from finetune import compare
from finetune.glue.tasks import ACCURACY, F1, MCC, PEARSON, SPEARMAN, TASKS, GlueTask, get_task

log = logging.getLogger(__name__)

SCORE = "score"
GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")


def _mcc(pred: np.ndarray, gold: np.ndarray) -> float:
    from sklearn.metrics import matthews_corrcoef

    return float(matthews_corrcoef(gold, pred))


def _accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    from sklearn.metrics import accuracy_score

    return float(accuracy_score(gold, pred))


def _f1(pred: np.ndarray, gold: np.ndarray) -> float:
    from sklearn.metrics import f1_score

    return float(f1_score(gold, pred, pos_label=1, average="binary", zero_division=0.0))


METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    MCC: _mcc,
    ACCURACY: _accuracy,
    F1: _f1,
    PEARSON: compare.pearson,
    SPEARMAN: compare.spearman,
}


def score_metric(task: str | GlueTask) -> Callable[[np.ndarray, np.ndarray], float]:
    """The task's "score" (the mean of its metrics) as a ``finetune.compare`` metric: computed
    from the confusion matrix for the classification tasks (fast in the bootstrap), from
    Pearson and Spearman for STS-B. Equal to ``compute_metrics(task, ...)["score"]``."""
    task = get_task(task)
    if not task.metrics:
        raise ValueError(f"{task.name} has no public labels: only the GLUE server scores it")
    if task.is_regression:
        return lambda pred, gold: float(np.mean([METRICS[m](pred, gold) for m in task.metrics]))
    forms = {MCC: compare.confusion_mcc, ACCURACY: compare.confusion_accuracy,
             F1: compare.confusion_f1}  # fmt: skip
    chosen = [forms[m] for m in task.metrics]
    return compare.ConfusionMetric(
        len(task.labels), lambda counts: sum(f(counts) for f in chosen) / len(chosen)
    )


def _class_ids(task: GlueTask, values: Any, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(
            f"{task.name} {what} must be class ids of shape (n,), got shape {array.shape}"
            + ("; take the argmax of the logits" if array.ndim == 2 else "")
        )
    if array.dtype.kind == "f" and np.all(np.isfinite(array)) and np.all(array == np.round(array)):
        array = array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{task.name} {what} must be integer class ids, got dtype {array.dtype}")
    bad = (array < 0) | (array >= len(task.labels))
    if bad.any():
        raise ValueError(
            f"{task.name} {what} hold {array[bad][0]}, outside the task's label ids "
            f"0..{len(task.labels) - 1} ({list(task.labels)})"
        )
    return array


def _scores(task: GlueTask, values: Any, what: str, check_range: bool) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 1:
        raise ValueError(f"{task.name} {what} must have shape (n,), got {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{task.name} {what} hold NaN or infinite values")
    if check_range and ((array < 0.0) | (array > 5.0)).any():
        raise ValueError(f"{task.name} {what} hold values outside the STS-B range [0, 5]")
    return array


def compute_metrics(task: str | GlueTask, predictions: Any, labels: Any) -> dict[str, float]:
    """The task's GLUE metrics on one evaluation split, plus "score" (their mean).

    Classification: `predictions` and `labels` are class ids (n,) into `task.labels`; STS-B:
    float scores (n,) (labels in [0, 5]). For MNLI call it once per dev split (matched,
    mismatched). ValueError for a shape mismatch or a value outside the task's label set."""
    task = get_task(task)
    if not task.metrics:
        raise ValueError(f"{task.name} has no public labels: only the GLUE server scores it")
    if task.is_regression:
        pred = _scores(task, predictions, "predictions", check_range=False)
        gold = _scores(task, labels, "labels", check_range=True)
    else:
        pred = _class_ids(task, predictions, "predictions")
        gold = _class_ids(task, labels, "labels")
    if len(pred) != len(gold):
        raise ValueError(f"{task.name}: {len(pred)} predictions for {len(gold)} labels")
    if len(gold) < 2:
        raise ValueError(f"{task.name}: need at least 2 examples to score, got {len(gold)}")
    result = {name: METRICS[name](pred, gold) for name in task.metrics}
    result[SCORE] = float(np.mean([result[name] for name in task.metrics]))
    return result


def _task_score(key: str, metrics: Mapping[str, float]) -> float:
    if SCORE in metrics:
        return float(metrics[SCORE])
    task = get_task(key.partition("_")[0])
    missing = [name for name in task.metrics if name not in metrics]
    if missing:
        raise ValueError(f"results for {key!r} have neither {SCORE!r} nor {missing}")
    return float(np.mean([metrics[name] for name in task.metrics]))


def _required_keys(tasks: Iterable[str]) -> dict[str, list[str]]:
    """GLUE task -> its result keys (MNLI: mnli_matched and mnli_mismatched)."""
    out = {}
    for name in tasks:
        task = get_task(name)
        if not task.metrics:
            raise ValueError(f"{task.name} is not part of the GLUE score")
        out[task.name] = [task.result_key(split) for split in task.dev_splits]
    return out


def glue_average(
    scores: Mapping[str, Mapping[str, float]],
    *,
    exclude_wnli: bool = False,
    tasks: Iterable[str] | None = None,
) -> float:
    """The GLUE score: the mean over tasks of each task's score (see the module docstring).

    `scores` maps result keys (`GlueTask.result_key`: the task name; MNLI "mnli_matched" and
    "mnli_mismatched") to `compute_metrics` results (their "score" is used, or else the mean of
    the task's metrics). `tasks` (default: the nine GLUE tasks, less WNLI with `exclude_wnli`)
    are the tasks averaged; each must be present. An "ax" entry is ignored (with a warning);
    any other unknown key is a ValueError."""
    names = list(tasks) if tasks is not None else list(GLUE_TASKS)
    if exclude_wnli:
        names = [n for n in names if get_task(n).name != "wnli"]
    if not names:
        raise ValueError("no tasks to average")
    required = _required_keys(names)
    known = {get_task(t).result_key(s) for t in TASKS for s in get_task(t).dev_splits}
    for key in scores:
        if key == "ax":
            log.warning("glue_average: AX is not part of the GLUE score; ignored")
        elif key not in known:
            raise ValueError(
                f"unknown result key {key!r}; keys are task names, MNLI's are mnli_matched "
                f"and mnli_mismatched: {sorted(known)}"
            )
    missing = [key for keys in required.values() for key in keys if key not in scores]
    if missing:
        raise ValueError(f"glue_average: no results for {missing}")
    task_scores = [
        float(np.mean([_task_score(key, scores[key]) for key in keys]))
        for keys in required.values()
    ]
    return float(np.mean(task_scores))
