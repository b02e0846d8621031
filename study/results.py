"""A study's results read back from its run directories: per variant and task, the seeds' scores
at the paper's metric, their aggregate and spread, the bootstrap interval of the mean
(``finetune.compare``) and the predictions for differences between variants; per pretraining
run, its losses. Nothing here trains or writes; ``study.report`` turns it into the report."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from study.graph import Graph, Node


@dataclass
class TaskResult:
    """One variant on one task: the runs of the chosen setting."""

    variant: str
    task: str
    metric: str
    split: str
    values: list[float]
    """Each seed's score (x 100)."""
    aggregate: float
    spread: float
    """max - min over seeds (x 100)."""
    interval: Any | None = None
    """``finetune.compare.Interval`` of the mean over seeds (fractions), or None."""
    lr: float | None = None
    run_dirs: list[str] = field(default_factory=list)
    predictions: tuple[np.ndarray, np.ndarray] | None = None
    """((seeds, n) predictions, (n,) labels): what differences are computed from."""
    histories: list[list[dict[str, Any]]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("variant", "task", "metric", "split", "values",
                                               "aggregate", "spread", "lr", "run_dirs")}  # fmt: skip
        out["interval"] = None if self.interval is None else self.interval.to_dict()
        return out


def _aggregate(values: list[float], how: str) -> float:
    return statistics.median(values) if how == "median" else statistics.fmean(values)


def metric_of(graph: Graph, task: str) -> str:
    paper = graph.spec.paper
    if paper is not None and task in paper.metrics:
        return paper.metrics[task]
    from finetune.glue.tasks import TASKS as GLUE_TASKS

    if task in GLUE_TASKS and len(GLUE_TASKS[task].metrics) == 1:
        return GLUE_TASKS[task].metrics[0]  # accuracy or mcc: what the task is scored by
    return "accuracy" if task not in GLUE_TASKS else "score"


def _metric_fn(metric: str, task: str, labels: np.ndarray):
    from finetune.compare import metric_named

    if metric == "score":
        from finetune.glue.metrics import score_metric

        return score_metric(task)
    return metric_named(metric, int(labels.max()) + 1 if labels.dtype.kind in "iu" else 2)


def _with_interval(result: TaskResult, which: str = "best") -> TaskResult:
    from finetune.compare import bootstrap_difference, load_seeds

    try:
        preds, labels = load_seeds(result.run_dirs, result.split, which)
    except (FileNotFoundError, ValueError):
        return result
    result.predictions = (preds, labels)
    metric = _metric_fn(result.metric, result.task, labels)
    result.interval = bootstrap_difference(labels, preds, None, metric)
    return result


def glue_result(graph: Graph, node: Node, how: str) -> TaskResult | None:
    from finetune.glue.run import best_lrs, collect_rows
    from finetune.glue.tasks import TASKS

    if not node.run_dir.is_dir():
        return None
    rows = [r for r in collect_rows(node.run_dir) if r.get("state") == "completed"]
    if not rows:
        return None
    task = TASKS[node.task]
    lr = best_lrs(rows)[task.name]["lr"]  # by the median task score over seeds, as GLUE's summary
    chosen = sorted((r for r in rows if r["lr"] == lr), key=lambda r: r["seed"])
    metric, split = metric_of(graph, task.name), task.dev_splits[0]
    values = [100 * r["dev"][split][metric] for r in chosen]
    result = TaskResult(node.variant, task.name, metric, split, values, _aggregate(values, how),
                        max(values) - min(values), lr=lr,
                        run_dirs=[r["run_dir"] for r in chosen])  # fmt: skip
    result.histories = [_history(Path(r["run_dir"])) for r in chosen]
    return _with_interval(result)


def lra_result(graph: Graph, node: Node, how: str) -> TaskResult | None:
    rows = []
    for path in sorted(node.run_dir.glob("seed_*/results.json")):
        row = json.loads(path.read_text()).get("summary")
        if row and row.get("state") == "completed":
            rows.append({**row, "run_dir": str(path.parent)})
    if not rows:
        return None
    values = [100 * r["test_accuracy"] for r in rows]
    result = TaskResult(node.variant, node.task, "accuracy", "test", values,
                        _aggregate(values, how), max(values) - min(values),
                        run_dirs=[r["run_dir"] for r in rows])  # fmt: skip
    result.histories = [_history(Path(r["run_dir"])) for r in rows]
    return _with_interval(result)


def _history(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return json.loads((run_dir / "results.json").read_text()).get("history") or []
    except (OSError, ValueError):
        return []


def task_results(graph: Graph) -> dict[tuple[str, str], TaskResult]:
    """(variant, task) -> its result, for every fine-tuning stage with finished runs."""
    how = graph.spec.paper.aggregate if graph.spec.paper else "mean"
    out = {}
    for node in graph.order():
        reader = {"glue": glue_result, "lra": lra_result}.get(node.kind)
        if reader is None:
            continue
        result = reader(graph, node, how)
        if result is not None:
            out[(node.variant, node.task)] = result
    return out


def pretrain_summary(node: Node) -> dict[str, Any] | None:
    """A finished pretraining run's MLM loss first -> last (the first and last logged values),
    held-out validation, SOP accuracy and throughput; None before it finished."""
    from engine.metrics import read_jsonl

    status_file = node.run_dir / "status.json"
    if not node.is_done() or not status_file.is_file():
        return None
    status = json.loads(status_file.read_text())
    rows = read_jsonl(node.run_dir / "tensorboard")
    logged = [rows[s] for s in sorted(rows) if "loss/mlm" in rows[s]]
    validation = status.get("validation") or {}
    return {
        "variant": node.variant,
        "node": node.id,
        "steps": status.get("step"),
        "mlm_loss_first": logged[0]["loss/mlm"] if logged else None,
        "mlm_loss_last": logged[-1]["loss/mlm"] if logged else None,
        "sop_accuracy_last": logged[-1].get("accuracy/sop") if logged else None,
        "validation_mlm_loss": validation.get("eval/loss/mlm"),
        "tokens_per_s": logged[-1].get("throughput/tokens_per_s") if logged else None,
        "skipped_steps": status.get("skipped_steps"),
        "curve": [(s, rows[s]["loss/mlm"]) for s in sorted(rows) if "loss/mlm" in rows[s]],
        "run_dir": str(node.run_dir),
        "check_loss": bool(node.info.get("check_loss")),
    }


def export_matches(graph: Graph, node: Node) -> bool | None:
    """Whether an export node's release holds the run's own release's weights (None: not run)."""
    import torch

    from model.hub.release import load_release

    if not node.is_done():
        return None
    exported = load_release(node.run_dir / "release")
    own = load_release(graph.nodes[node.deps[0]].run_dir / "release")
    theirs = own.state_dict()
    return all(torch.equal(v, theirs[k]) for k, v in exported.state_dict().items())


def baselines(graph: Graph) -> dict[str, dict[str, float]]:
    """LRA task -> {baseline: test accuracy x 100} from the baselines stages."""
    out = {}
    for node in graph.order():
        path = node.run_dir / "baselines.json"
        if node.kind == "baselines" and node.is_done() and path.is_file():
            out[node.task] = {k: 100 * v for k, v in json.loads(path.read_text()).items()}
    return out
