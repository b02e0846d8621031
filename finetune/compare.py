"""Can a benchmark tell two models apart? Confidence intervals for the difference of their
scores, over the two sources of chance in a fine-tuning table: which test examples the set
happens to hold, and which seeds the runs happened to use.

A model here is one configuration (family, init) fine-tuned with several seeds, each seed's
predictions on the same test set; a trivial baseline is a model with one "seed". For two
models A and B scored by a metric (accuracy unless given), the estimate is

    mean over A's seeds of metric(A_s)  -  mean over B's seeds of metric(B_s)

and its interval comes from a two-level (hierarchical) bootstrap: each of ``resamples`` rounds
draws n test examples with replacement, the **same** examples for A and B (the comparison is
paired: both models answered the same questions, so the examples both get right or both get
wrong cancel), and, independently for A and for B, as many seeds as each has, with replacement;
the round's difference is the estimate's formula on those. The interval is the percentile
interval of the rounds (95 % by default). Two models are *told apart* when it excludes 0.

With one seed per model this is the paired bootstrap over test examples (tests compare it with
``scipy.stats.bootstrap(..., paired=True)``); with several, seed-to-seed variation widens the
interval as it should. Three seeds are few for the seed level: its resampling can only
reflect the spread those seeds happened to show (a reason to read an interval as approximate,
and to add seeds where two models sit near the edge).

From the command line, on any fine-tuning runs (GLUE or LRA; each directory is one model, every
``predictions.npz`` below it one of its seeds; the first is the reference):

    python -m finetune compare runs/glue-softmax/rte/lr_3e-05 runs/glue-tisa/rte/lr_3e-05 \\
        --split dev [--metric accuracy|mcc|f1|pearson|spearman] [--at best|last] [--out x.json]

A run of the fine-tuning loop writes its predictions for this (``finetune.trainer``:
``run_dir/predictions.npz``, read by :func:`load_predictions`): for every evaluation set the
predictions at the best evaluation (``best``, the step the run reports) and at the last one
(``last``), and the labels where the set has them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.checkpoint import write_atomically

PREDICTIONS_FILE = "predictions.npz"
"""A fine-tuning run's predictions (see the module docstring), in run_dir."""
WHICH = ("best", "last")
DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95
METRIC_NAMES = ("accuracy", "mcc", "f1", "pearson", "spearman")
"""The metrics of ``python -m finetune compare --metric``."""

Metric = Callable[[np.ndarray, np.ndarray], float]
"""metric(predictions, labels) -> score, higher is better (None where accuracy is meant)."""


@dataclass(frozen=True)
class ConfusionMetric:
    """A classification metric that is a function of the confusion matrix alone (accuracy,
    F1, Matthews correlation, their means): the bootstrap then counts each round's confusion
    matrix instead of calling a metric per round and seed (1000 rounds of 3 seeds: CoLA's MCC
    4.1 -> 0.2 s, QQP's F1 + accuracy 16 -> 1.8 s; equal to scikit-learn's to 1e-12).
    ``fn`` maps (..., C, C) counts, [true class, predicted class], to (...) scores."""

    num_classes: int
    fn: Callable[[np.ndarray], np.ndarray]

    def __call__(self, predictions: np.ndarray, labels: np.ndarray) -> float:
        return float(self.fn(confusion(predictions[None], labels, self.num_classes)[0]))


def confusion(predictions_SN: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """(S, C, C) counts [true, predicted] of each row of predictions; ``labels`` (N,) for every
    row, or (S, N) one row each."""
    predictions_SN, labels = np.asarray(predictions_SN), np.asarray(labels)
    rows = np.arange(len(predictions_SN))[:, None] * num_classes**2
    codes_SN = labels * num_classes + predictions_SN + rows
    counts = np.bincount(codes_SN.ravel(), minlength=len(predictions_SN) * num_classes**2)
    return counts.reshape(len(predictions_SN), num_classes, num_classes)


def confusion_accuracy(counts: np.ndarray) -> np.ndarray:
    return np.trace(counts, axis1=-2, axis2=-1) / counts.sum(axis=(-2, -1))


def confusion_f1(counts: np.ndarray) -> np.ndarray:
    """F1 of class 1 (binary); 0 where it has no true or predicted member (sklearn's
    ``zero_division=0``)."""
    tp, fp, fn = counts[..., 1, 1], counts[..., 0, 1], counts[..., 1, 0]
    denominator = 2 * tp + fp + fn
    return np.where(denominator > 0, 2 * tp / np.maximum(denominator, 1), 0.0)


def confusion_mcc(counts: np.ndarray) -> np.ndarray:
    """Matthews correlation (multiclass, sklearn's formula); 0 where it is undefined."""
    t, p = counts.sum(axis=-1), counts.sum(axis=-2)  # true / predicted class totals
    c, n = np.trace(counts, axis1=-2, axis2=-1), counts.sum(axis=(-2, -1))
    numerator = c * n - (t * p).sum(-1)
    denominator = np.sqrt((n**2 - (p * p).sum(-1)) * (n**2 - (t * t).sum(-1)).astype(np.float64))
    return np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1), 0.0)


def _correlation(fn: Callable, pred: np.ndarray, gold: np.ndarray) -> float:
    if np.ptp(pred) == 0 or np.ptp(gold) == 0:
        return 0.0  # undefined for a constant input (a model predicting one value): 0
    return float(fn(pred, gold).statistic)


def pearson(pred: np.ndarray, gold: np.ndarray) -> float:
    """Pearson's correlation of predicted and gold scores (GLUE's STS-B); 0 where undefined."""
    from scipy.stats import pearsonr

    return _correlation(pearsonr, pred, gold)


def spearman(pred: np.ndarray, gold: np.ndarray) -> float:
    """Spearman's rank correlation (GLUE's STS-B); 0 where undefined."""
    from scipy.stats import spearmanr

    return _correlation(spearmanr, pred, gold)


# ----------------------------------------------------------------------------- the file


def save_predictions(
    run_dir: str | os.PathLike[str],
    best: Mapping[str, np.ndarray],
    last: Mapping[str, np.ndarray],
    labels: Mapping[str, np.ndarray],
) -> Path:
    """Writes ``run_dir/predictions.npz`` atomically: ``best/<set>``, ``last/<set>`` and
    ``labels/<set>`` arrays (plain numbers; read back without pickle)."""
    arrays = {f"{kind}/{name}": np.asarray(v) for kind, m in (("best", best), ("last", last),
              ("labels", labels)) for name, v in m.items()}  # fmt: skip
    for key, value in arrays.items():
        if value.dtype == object:
            raise ValueError(f"predictions {key}: not an array of numbers")
    path = Path(run_dir) / PREDICTIONS_FILE
    write_atomically(path, lambda f: np.savez(f, **arrays))
    return path


def load_predictions(
    run_dir: str | os.PathLike[str], split: str, which: str = "best"
) -> tuple[np.ndarray, np.ndarray]:
    """(predictions, labels) of one evaluation set of a finished run; ``which``: ``best`` (the
    reported evaluation) or ``last``. A clear error names what is missing."""
    if which not in WHICH:
        raise ValueError(f"which={which!r} is invalid; valid: {list(WHICH)}")
    path = Path(run_dir) / PREDICTIONS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no predictions (a run that has not finished, or one made before runs "
            "saved their predictions: run it again in a new directory)"
        )
    with np.load(path, allow_pickle=False) as data:
        keys = set(data.files)
        if f"{which}/{split}" not in keys or f"labels/{split}" not in keys:
            have = sorted({k.split("/", 1)[1] for k in keys if k.startswith("labels/")})
            raise ValueError(f"{path}: no labelled predictions of {split!r}; labelled sets: {have}")
        return data[f"{which}/{split}"], data[f"labels/{split}"]


def stack_seeds(
    runs: Sequence[tuple[np.ndarray, np.ndarray]], what: str = "runs"
) -> tuple[np.ndarray, np.ndarray]:
    """Several seeds' (predictions, labels) of one model as ((S, n) predictions, (n,) labels);
    refuses seeds scored on different test sets."""
    if not runs:
        raise ValueError(f"{what}: no runs")
    labels = np.asarray(runs[0][1])
    for i, (pred, lab) in enumerate(runs):
        if np.shape(pred) != labels.shape or not np.array_equal(np.asarray(lab), labels):
            raise ValueError(f"{what}: run {i} was scored on another test set than run 0")
    return np.stack([np.asarray(p) for p, _ in runs]), labels


def load_seeds(
    run_dirs: Sequence[str | os.PathLike[str]], split: str, which: str = "best", what: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """One model's seeds (one run directory each) on an evaluation set: ((S, n) predictions,
    (n,) labels), by `load_predictions` and `stack_seeds` (FileNotFoundError for a run without
    predictions)."""
    runs = [load_predictions(r, split, which) for r in run_dirs]
    return stack_seeds(runs, what or str(run_dirs[0]))


# ----------------------------------------------------------------------------- the bootstrap


@dataclass(frozen=True)
class Interval:
    """An estimate and its bootstrap interval (same units as the metric)."""

    estimate: float
    low: float
    high: float
    level: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def to_dict(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high,
                "level": self.level}  # fmt: skip


def _check(predictions: np.ndarray, labels: np.ndarray, what: str) -> np.ndarray:
    predictions = np.asarray(predictions)
    if predictions.ndim == 1:
        predictions = predictions[None]
    if predictions.ndim != 2 or predictions.shape[1] != len(labels) or not len(labels):
        raise ValueError(
            f"{what}: predictions of shape {predictions.shape} for {len(labels)} labels; "
            "expected (seeds, examples) or (examples,), the same test set for every model"
        )
    return predictions


def _round_scores(
    predictions_SN: np.ndarray,
    labels_N: np.ndarray,
    metric: Metric | None,
    examples_RN: np.ndarray,
) -> np.ndarray:
    """(R, S) metric of every seed on every round's resampled examples."""
    if metric is None:  # accuracy: the mean of the drawn examples' hits
        hits_SN = predictions_SN == labels_N
        return hits_SN[:, examples_RN].mean(axis=-1).T
    if isinstance(metric, ConfusionMetric):  # each (round, seed) as one row of predictions
        (rounds, n), seeds = examples_RN.shape, len(predictions_SN)
        drawn = predictions_SN[:, examples_RN].reshape(seeds * rounds, n)  # seed-major rows
        truth = np.broadcast_to(labels_N[examples_RN], (seeds, rounds, n)).reshape(-1, n)
        counts = confusion(drawn, truth, metric.num_classes)
        return metric.fn(counts).reshape(seeds, rounds).T
    return np.array([[metric(p[ix], labels_N[ix]) for p in predictions_SN] for ix in examples_RN])


def _score(predictions_SN: np.ndarray, labels_N: np.ndarray, metric: Metric | None) -> float:
    if metric is None:
        return float(np.mean(predictions_SN == labels_N))
    return float(np.mean([metric(p, labels_N) for p in predictions_SN]))


def bootstrap_difference(
    labels: np.ndarray,
    a: np.ndarray,
    b: np.ndarray | None = None,
    metric: Metric | None = None,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = 0,
) -> Interval:
    """The score of A minus B's (``b`` None: A's score alone) with its two-level bootstrap
    interval (see the module docstring). ``a``, ``b``: (seeds, examples) predictions on the
    test set ``labels`` (a 1-D array is one seed); ``metric`` None: accuracy. Deterministic
    for a given ``seed``."""
    labels = np.asarray(labels)
    if not 0 < level < 1:
        raise ValueError(f"level={level} is invalid; valid: 0 < level < 1")
    if resamples < 10:
        raise ValueError(f"resamples={resamples} is invalid; valid: >= 10")
    a = _check(a, labels, "A")
    models = [a] if b is None else [a, _check(b, labels, "B")]
    rng = np.random.default_rng(seed)
    n = len(labels)
    rounds_R = np.zeros(resamples)
    chunk = max(1, min(resamples, 2_000_000 // n))  # rounds at a time: bounded memory
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        examples_RN = rng.integers(0, n, size=(size, n))  # shared: the comparison is paired
        for sign, model in zip((1.0, -1.0), models):
            scores_RS = _round_scores(model, labels, metric, examples_RN)
            seeds_RS = rng.integers(0, len(model), size=(size, len(model)))
            picked_R = np.take_along_axis(scores_RS, seeds_RS, axis=1).mean(axis=1)
            rounds_R[start : start + size] += sign * picked_R
    estimate = sum(sign * _score(m, labels, metric) for sign, m in zip((1.0, -1.0), models))
    low, high = np.quantile(rounds_R, [(1 - level) / 2, (1 + level) / 2])
    return Interval(estimate, float(low), float(high), level)


def format_interval(interval: Interval, scale: float = 100.0, signed: bool = True) -> str:
    """``+2.4 [-0.3, +5.1]`` (in points of ``scale``); a trailing ``*`` when the interval
    excludes 0 (the two are told apart)."""
    spec = "+.1f" if signed else ".1f"
    text = (
        f"{format(scale * interval.estimate, spec)} "
        f"[{format(scale * interval.low, spec)}, {format(scale * interval.high, spec)}]"
    )
    return text + (" *" if signed and interval.excludes_zero else "")


# ----------------------------------------------------------------------------- the command


def metric_named(name: str, num_classes: int) -> Metric | None:
    """The ``--metric`` of that name: None (the fast accuracy) for ``accuracy``, confusion
    matrix forms for ``mcc`` and ``f1`` (binary, class 1), GLUE's ``pearson`` / ``spearman``."""
    if name == "accuracy":
        return None
    if name == "mcc":
        return ConfusionMetric(num_classes, confusion_mcc)
    if name == "f1":
        if num_classes > 2:
            raise ValueError(f"--metric f1 is binary (class 1), but {num_classes} classes occur")
        return ConfusionMetric(2, confusion_f1)
    return {"pearson": pearson, "spearman": spearman}[name]


def model_runs(directory: str | os.PathLike[str]) -> list[Path]:
    """The runs (directories holding ``predictions.npz``) at or below ``directory``."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory")
    runs = sorted(p.parent for p in root.glob(f"**/{PREDICTIONS_FILE}"))
    if not runs:
        raise FileNotFoundError(
            f"{root}: no {PREDICTIONS_FILE} at or below it (no finished fine-tuning run, or runs "
            "made before runs saved their predictions)"
        )
    return runs


def check_one_model(runs: Sequence[Path], directory: str | os.PathLike[str]) -> None:
    """Refuses runs that differ in more than their seed (a GLUE task directory holding several
    learning rates, two families under one root): their identities (``run.json``, where
    present) may differ only in keys named ``seed``/``seeds``."""
    import json

    from engine.recipe import diff_keys

    identities = [json.loads((r / "run.json").read_text())
                  for r in runs if (r / "run.json").is_file()]  # fmt: skip
    keys = {k for i in identities[1:] for k in diff_keys(identities[0], i)}
    differ = sorted(k for k in keys if k.rsplit(".", 1)[-1] not in ("seed", "seeds"))
    if differ:
        raise ValueError(
            f"{directory}: its runs differ in more than the seed ({', '.join(differ[:6])}); "
            "name one directory per model (e.g. one learning rate's, lr_<lr>/)"
        )


def compare_dirs(
    directories: Sequence[str | os.PathLike[str]],
    split: str,
    metric: str = "accuracy",
    which: str = "best",
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
) -> tuple[list[dict], str]:
    """Every model's score and every model's difference from the first one, with intervals:
    rows for JSON and a Markdown table. Refuses models scored on different examples."""
    if len(directories) < 1:
        raise ValueError("name at least one directory")
    if metric not in METRIC_NAMES:
        raise ValueError(f"--metric {metric!r} is invalid; valid: {', '.join(METRIC_NAMES)}")
    models = []
    for directory in directories:
        runs = model_runs(directory)
        check_one_model(runs, directory)
        models.append((str(directory), len(runs), *load_seeds(runs, split, which, str(directory))))
    _, _, reference, labels = models[0]
    regression = metric in ("pearson", "spearman")
    classes = 0 if regression else int(max(labels.max(), *(m[2].max() for m in models))) + 1
    fn = metric_named(metric, classes)
    rows, lines = [], []
    for name, seeds, predictions, these in models:
        if not np.array_equal(these, labels):
            raise ValueError(f"{name} was scored on other {split} examples than {models[0][0]}")
        own = bootstrap_difference(labels, predictions, None, fn, resamples, level)
        row = {"model": name, "seeds": seeds, metric: own.to_dict()}
        cell = ""
        if name != models[0][0]:
            difference = bootstrap_difference(labels, predictions, reference, fn, resamples, level)
            row["difference"] = difference.to_dict()
            cell = format_interval(difference)
        rows.append(row)
        lines.append(f"| {name} | {seeds} | {format_interval(own, signed=False)} | {cell} |")
    md = (
        f"{split} {metric} at the {which} evaluation (x 100), mean over seeds, and the difference "
        f"from {models[0][0]}, with {100 * level:g} % bootstrap intervals (over the examples, "
        "paired, and over each side's seeds); `*`: the interval excludes 0.\n\n"
        f"| model | seeds | {metric} | difference |\n|---|---|---|---|\n" + "\n".join(lines) + "\n"
    )
    return rows, md


def main(args) -> int:
    """``python -m finetune compare`` (arguments: see ``finetune.__main__``)."""
    import json

    rows, md = compare_dirs(
        args.models, args.split, args.metric, args.at, args.resamples, args.level
    )
    print(md)
    if args.out:
        out = Path(args.out)
        if out.exists() and not args.overwrite:
            raise ValueError(f"{out} exists; pass --overwrite to replace it")
        out.write_text(json.dumps({"split": args.split, "metric": args.metric, "at": args.at,
                                   "models": rows}, indent=2) + "\n")  # fmt: skip
    return 0


__all__ = [
    "DEFAULT_LEVEL",
    "DEFAULT_RESAMPLES",
    "METRIC_NAMES",
    "PREDICTIONS_FILE",
    "ConfusionMetric",
    "Interval",
    "bootstrap_difference",
    "compare_dirs",
    "format_interval",
    "load_predictions",
    "load_seeds",
    "save_predictions",
    "stack_seeds",
]
