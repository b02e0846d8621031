"""The report's figures (PNG, matplotlib's Agg backend): per task, every variant's score with its
95 % interval and the paper's number marked; the pretraining loss curves; per task, the
fine-tuning curves (the evaluated metric against the step, median over seeds)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from study.results import TaskResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def score_figure(
    task: str, rows: list[tuple[str, TaskResult | None, float | None]], out: Path
) -> Path:
    """rows: (label, our result or None, the paper's number or None)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.0, 0.5 * len(rows) + 1.6))
    for y, (_, ours, paper) in enumerate(rows):
        if ours is not None and ours.interval is not None:
            mean = 100 * ours.interval.estimate
            low, high = mean - 100 * ours.interval.low, 100 * ours.interval.high - mean
            ax.errorbar(mean, y, xerr=[[low], [high]], fmt="o", color="C0", capsize=3,
                        label="ours: mean, 95% interval" if y == 0 else None)  # fmt: skip
        elif ours is not None:
            ax.plot([ours.aggregate], [y], "o", color="C0")
        if paper is not None:
            ax.plot([paper], [y], "x", color="C3", markersize=9, label="paper")
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    metric = next((r[1].metric for r in rows if r[1] is not None), "score")
    ax.set_xlabel(f"{task}: {metric} x 100")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))  # fmt: skip
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = out / f"scores-{task}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pretraining_figure(curves: dict[str, list[tuple[int, float]]], out: Path) -> Path | None:
    if not curves:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, points in curves.items():
        ax.plot([s for s, _ in points], [v for _, v in points], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("MLM loss (training)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "pretraining.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _curve(histories: list[list[dict[str, Any]]], split: str, metric: str):
    by_step: dict[int, list[float]] = {}
    for history in histories:
        for point in history:
            value = (point.get(split) or {}).get(metric)
            if value is not None:
                by_step.setdefault(int(point["step"]), []).append(100 * value)
    return sorted((s, statistics.median(v)) for s, v in by_step.items())


def finetuning_figure(task: str, results: dict[str, TaskResult], out: Path) -> Path | None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    drawn = False
    for label, result in results.items():
        split = "val" if result.split == "test" else result.split  # LRA selects on val
        points = _curve(result.histories, split, result.metric)
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], marker=".", label=label)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel(f"{split} {next(iter(results.values())).metric} (x 100), median over seeds")
    ax.set_title(task)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / f"finetuning-{task}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
