"""Trivial baselines of an LRA classification task, from its official-format files: what a
model's test accuracy must beat before it says anything about long-range reasoning.

    python -m finetune.lra.baselines --task listops --data DIR      # DIR/basic_{train,val,test}.tsv
    python -m finetune.lra.baselines --task text --data DIR/aclImdb [--max-length 280]

Every baseline is fit on the train split and scored once on the test split (nothing is tuned
on test; nothing is tuned on val either), from the same data values a model sees
(`finetune.lra.data.load_split`, documents cut to `--max-length` like the model's):

* **majority**: the most frequent training label (ties: the smallest label).
* **first-token rule** (ListOps: the *first-operator rule*): the most frequent training label
  for each value of the first data token, i.e. the token right after [CLS]. In ListOps that is
  the outermost operator, and its most frequent answer (MAX -> 9, MIN -> 0, ...) is right far
  more often than the majority class. A first token never seen in training gets the majority
  label. Reported for ListOps only (for bytes it means nothing).
* **bag-of-tokens**: a multinomial logistic regression on the counts of each data value
  (ListOps: its 15 tokens; Text: its 256 byte values), i.e. everything but the order.
* **bag-of-words** (Text only): the same regression on word counts (lower-cased ASCII letter
  runs, the training vocabulary). It uses a word tokenizer no byte-level model is given, so
  it is a reference for the Text task's difficulty rather than a shortcut of the model's
  inputs; on the mini-LRA's synthetic Text (label = the majority of three cue words) a linear
  model of word counts is enough.

The regression (`logistic_regression`) is deterministic: float64 features, each divided by its
largest training value (so a rare word stays 0/1 rather than being blown up, as standardising
would), a bias, L2 penalty `l2` on the weights, full-batch L-BFGS from zero weights for at most
a fixed number of iterations, in torch on the CPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from finetune.lra.data import LraSplit, load_split
from finetune.lra.tasks import get_task

TASKS = ("listops", "text")
L2 = 1e-4
"""Default L2 penalty of the regression (on the mean cross-entropy)."""
LBFGS_ITERATIONS = 200
_WORD = re.compile(rb"[a-z]+")

BASELINE_NAMES = {
    "majority": "majority class",
    "first_token": "first-operator rule",
    "bag_of_tokens": "bag-of-tokens",
    "bag_of_words": "bag-of-words",
}
"""Display names (the first-token rule is named for ListOps, the only task it is run on)."""


# ----------------------------------------------------------------------------- the baselines


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if predictions.shape != labels.shape or not len(labels):
        raise ValueError(f"need as many predictions as labels (> 0): {predictions.shape}")
    return float(np.mean(predictions == labels))


def majority_label(labels: Sequence[int] | np.ndarray) -> int:
    """The most frequent label; ties go to the smallest."""
    counts = Counter(int(x) for x in labels)
    if not counts:
        raise ValueError("no labels")
    return min(counts, key=lambda k: (-counts[k], k))


def majority(train_labels: np.ndarray, test_labels: np.ndarray) -> float:
    """Test accuracy of always predicting the most frequent training label."""
    return accuracy(np.full(len(test_labels), majority_label(train_labels)), test_labels)


def fit_first_token_rule(
    first_tokens: Sequence[int], labels: Sequence[int]
) -> tuple[dict[int, int], int]:
    """{first token: its most frequent label} and the fallback (the overall majority)."""
    by_token: dict[int, list[int]] = {}
    for token, label in zip(first_tokens, labels, strict=True):
        by_token.setdefault(int(token), []).append(int(label))
    return {t: majority_label(ls) for t, ls in by_token.items()}, majority_label(labels)


def first_token_predictions(
    train_first: Sequence[int], train_labels: np.ndarray, test_first: Sequence[int]
) -> np.ndarray:
    """The most frequent training label of each test example's first token."""
    rule, fallback = fit_first_token_rule(train_first, train_labels)
    return np.array([rule.get(int(t), fallback) for t in test_first], dtype=np.int64)


def first_token_rule(
    train_first: Sequence[int],
    train_labels: np.ndarray,
    test_first: Sequence[int],
    test_labels: np.ndarray,
) -> float:
    """Test accuracy of the most frequent training label per first token."""
    return accuracy(first_token_predictions(train_first, train_labels, test_first), test_labels)


def logistic_regression(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    num_classes: int,
    l2: float = L2,
    iterations: int = LBFGS_ITERATIONS,
) -> np.ndarray:
    """Predicted classes of `test_x` from a multinomial logistic regression fit on the training
    features (see the module docstring); deterministic."""
    x = torch.as_tensor(np.asarray(train_x, dtype=np.float64))
    xt = torch.as_tensor(np.asarray(test_x, dtype=np.float64))
    y = torch.as_tensor(np.asarray(train_y, dtype=np.int64))
    if x.dim() != 2 or xt.dim() != 2 or x.shape[1] != xt.shape[1] or len(x) != len(y):
        raise ValueError(f"features {tuple(x.shape)} / {tuple(xt.shape)}, labels {len(y)}")
    scale = x.abs().amax(0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    x, xt = x / scale, xt / scale
    w = torch.zeros(x.shape[1], num_classes, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [w, b], lr=1.0, max_iter=iterations, tolerance_grad=1e-9, tolerance_change=1e-12,
        history_size=20, line_search_fn="strong_wolfe",
    )  # fmt: skip

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w + b, y) + 0.5 * l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return (xt @ w + b).argmax(-1).numpy()


# ----------------------------------------------------------------------------- features


def documents(split: LraSplit) -> list[np.ndarray]:
    """Each example's data values (no [CLS])."""
    return [split.codes[split.offsets[i] : split.offsets[i + 1]] for i in range(len(split))]


def token_counts(split: LraSplit, num_values: int) -> np.ndarray:
    """(N, num_values) counts of each data value per example."""
    out = np.zeros((len(split), num_values), dtype=np.float64)
    for i, doc in enumerate(documents(split)):
        out[i] = np.bincount(doc, minlength=num_values)[:num_values]
    return out


def words(doc: np.ndarray) -> list[bytes]:
    """Lower-cased ASCII letter runs of a byte document."""
    return _WORD.findall(bytes(doc).lower())


def word_counts(train: list[list[bytes]], test: list[list[bytes]]) -> tuple[np.ndarray, np.ndarray]:
    """(N, V) word counts of train and test over the training vocabulary (sorted)."""
    vocab = {w: i for i, w in enumerate(sorted({w for doc in train for w in doc}))}

    def counts(docs: list[list[bytes]]) -> np.ndarray:
        out = np.zeros((len(docs), len(vocab)), dtype=np.float64)
        for i, doc in enumerate(docs):
            for w in doc:
                if w in vocab:
                    out[i, vocab[w]] += 1
        return out

    return counts(train), counts(test)


# ----------------------------------------------------------------------------- per task


def task_baseline_predictions(
    task: str, data_dir: str | Path, max_length: int | None = None, l2: float = L2
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(test labels, {baseline: its test predictions}) of a task's files (see the module
    docstring for which baselines): what pairs a baseline with a model in
    ``finetune.compare``."""
    lra_task = get_task(task)
    if lra_task.name not in TASKS:
        raise ValueError(f"baselines exist for {list(TASKS)}, not {task!r}")
    train, _ = load_split(lra_task, data_dir, "train", max_length, cls=False)
    test, _ = load_split(lra_task, data_dir, "test", max_length, cls=False)
    out = {"majority": np.full(len(test.labels), majority_label(train.labels), dtype=np.int64)}
    if lra_task.name == "listops":
        first_train, first_test = (
            [int(d[0]) if len(d) else -1 for d in documents(s)] for s in (train, test)
        )
        out["first_token"] = first_token_predictions(first_train, train.labels, first_test)
    n = lra_task.num_values
    out["bag_of_tokens"] = logistic_regression(
        token_counts(train, n), train.labels, token_counts(test, n), lra_task.num_labels, l2
    )
    if lra_task.name == "text":
        train_w, test_w = word_counts(
            [words(d) for d in documents(train)], [words(d) for d in documents(test)]
        )
        out["bag_of_words"] = logistic_regression(
            train_w, train.labels, test_w, lra_task.num_labels, l2
        )
    return np.asarray(test.labels), out


def task_baselines(
    task: str, data_dir: str | Path, max_length: int | None = None, l2: float = L2
) -> dict[str, float]:
    """{baseline: test accuracy} of a task's files (see the module docstring for which)."""
    labels, predictions = task_baseline_predictions(task, data_dir, max_length, l2)
    return {name: accuracy(pred, labels) for name, pred in predictions.items()}


SHORTCUTS = ("majority", "first_token", "bag_of_tokens")
"""The baselines that see only what a model sees (not bag-of-words' word tokenizer)."""


def shortcut(baselines: dict[str, float]) -> tuple[str, float]:
    """The best of a task's SHORTCUTS: (name, test accuracy)."""
    usable = {k: v for k, v in baselines.items() if k in SHORTCUTS}
    name = max(usable, key=lambda k: (usable[k], k))
    return name, usable[name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m finetune.lra.baselines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument("--data", required=True, help="the task's data directory")
    parser.add_argument("--max-length", type=int, default=None, help="data tokens kept")
    parser.add_argument("--l2", type=float, default=L2, help="L2 penalty of the regression")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--out", help="also write the JSON to this file (atomically)")
    args = parser.parse_args(argv)
    try:
        got = task_baselines(args.task, args.data, args.max_length, args.l2)
    except (FileNotFoundError, ValueError) as e:
        print(f"python -m finetune.lra.baselines: {e}", file=sys.stderr)
        return 1
    if args.out:
        from engine.checkpoint import write_json_atomically

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomically(args.out, got)
    if args.json:
        print(json.dumps(got, indent=2))
    else:
        for k, v in got.items():
            print(f"{BASELINE_NAMES[k]:<20} {100 * v:5.1f} %")
    return 0


if __name__ == "__main__":
    from engine.process_exit import exit_process

    exit_process(main())
