"""``python -m finetune lra``: train or fine-tune an encoder on a Long Range Arena task.

    python -m finetune lra --task listops --data lra_release --protocol skyformer \\
        [--family transject] [--init RELEASE] [--seeds 0 1 2] [key=value ...]
    python -m finetune lra --task listops --data DIR --config my.yaml ...
    python -m finetune lra-summary runs/lra/skyformer     # every task and family run below it

The recipe: ``--config``, or the shipped one of ``--protocol`` (``lra``: the official LRA
settings; ``skyformer``: the Skyformer/TransJect PyTorch setting) and ``--family``:
``configs/finetune/lra/<protocol>/<task>[-<family>].yaml``. From scratch (the model section of
the recipe, vocabulary and positions sized by the task) or from a release (``--init``, e.g. a
self-pretrained one: its vocabulary must be the task's, see ``lra-shards``). Retrieval trains a
dual encoder on the two documents. Every seed's run is evaluated on the val split every
``train.eval_every`` steps; the best val step's test accuracy is reported:

    <train.run_dir>/seed_<s>/results.json, best/ (release), tensorboard/; its "summary" row
                                           counts the records read and skipped per split ("rows")
    <train.run_dir>/results.json, results.md   val/test accuracy per seed, median and spread

``lra-summary ROOT`` gathers every ``seed_*/results.json`` below ROOT (array jobs write them
with ``--no-summary``) into ROOT/results.md and results.json: test accuracy per task and
family (median over seeds), the averages over the 5 tasks without Path-X and over all 6 (a
missing Path-X counted as 50, the LRA paper's FAIL), beside the published numbers, and what
the runs can tell apart: each family's mean test accuracy and its difference from softmax (same
task and init) with 95 % bootstrap intervals (``finetune.compare``, from each run's
predictions.npz).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.distributed import detect
from engine.engine import EngineConfig
from engine.optim import OptimizerConfig, ScheduleConfig
from engine.recipe import build_config, config_dict, load_recipe
from finetune.lra.data import collate_pair, load_split
from finetune.lra.tasks import PAD_ID, get_task
from finetune.trainer import (
    EXIT_STOPPED,
    FinetuneConfig,
    FinetuneData,
    Finetuner,
    finished_run,
    run_identity,
    write_finished,
)
from model.config import EncoderConfig, deep_merge
from model.heads import build_model
from model.hub.hf_export import load_release_or_export, release_or_export_encoder
from model.hub.release import directory_digest


@dataclass
class LraDataConfig:
    """How the task's examples are read and cut (the data directory itself is ``--data``)."""

    max_length: int | None = None
    """Data tokens per sequence (None: the task's official length); a [CLS] is prepended."""
    difficulty: str | None = None
    """Pathfinder / Path-X difficulty (easy, intermediate, hard; None: hard)."""
    split_seed: int = 0
    """Seed of Pathfinder's 80/10/10 split."""


@dataclass
class LraTrainConfig(FinetuneConfig):
    """The ``train`` section: the fine-tuning run (``finetune.trainer.FinetuneConfig``) and
    where the runs go (``train.run_dir``, as in pretraining)."""

    run_dir: str = "runs/lra"
    """Root of the runs: ``seed_<s>/`` and the summary (results.md, results.json). Was the
    top-level ``run_dir`` (still accepted, with a warning)."""


@dataclass
class LraConfig:
    task: str = "listops"
    """An LRA task: listops, text, retrieval, image, pathfinder or pathx (``--task``)."""
    data: LraDataConfig = field(default_factory=LraDataConfig)
    model: dict[str, Any] = field(default_factory=lambda: {"preset": "debug"})
    """Encoder config for training from scratch (EncoderConfig fields, ``preset:`` allowed);
    vocab_size, pad_token_id and max_position_embeddings come from the task."""
    pooling: str = "mean"
    """Pooling of the classifier (LRA models pool by mean)."""
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(name="adamw", lr=1e-4, weight_decay=0.0)
    )
    schedule: ScheduleConfig = field(
        default_factory=lambda: ScheduleConfig(warmup_steps=100, total_steps=1000)
    )
    engine: EngineConfig = field(
        default_factory=lambda: EngineConfig(backend="torch", precision="bf16-mixed")
    )
    train: LraTrainConfig = field(
        default_factory=lambda: LraTrainConfig(select="accuracy", select_split="val")
    )
    seeds: list[int] = field(default_factory=lambda: [0])
    """One run per seed; tables report the median and the spread (max - min)."""


RECIPES = Path(__file__).resolve().parents[2] / "configs" / "finetune" / "lra"
PROTOCOLS = ("lra", "skyformer")

PUBLISHED: dict[str, dict[str, float | None]] = {
    # Tay et al. 2021 (the LRA paper), Table 1; Path-X FAIL. ListOps/Text/Retrieval as quoted
    # in Yorsh & Kovalenko 2022, Table 1.
    "Transformer (LRA paper)": {
        "listops": 36.37, "text": 64.27, "retrieval": 57.46, "image": 42.44,
        "pathfinder": 71.40, "pathx": None,
    },
    # Sengupta et al. 2023 (TransJect), LRA table (the Skyformer setting).
    "Transformer (TransJect paper)": {
        "listops": 38.4, "text": 61.9, "retrieval": 80.7, "pathfinder": 65.2, "image": 40.6,
    },
    "TransJect (TransJect paper)": {
        "listops": 42.2, "text": 64.9, "retrieval": 80.3, "pathfinder": 71.5, "image": 38.9,
    },
    # Yorsh & Kovalenko 2022, Table 1 (3x AOGLU, mean of five runs; three tasks only).
    "Kernel 3x AOGLU (kernel paper)": {"listops": 18.45, "text": 66.06, "retrieval": 72.57},
}  # fmt: skip
"""Published test accuracies (%) to print beside ours."""

TASK_ORDER = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")


def recipe_path(task: str, protocol: str, family: str | None) -> Path:
    """The shipped recipe of a task, protocol and attention family (None: softmax)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown --protocol {protocol!r}; valid: {list(PROTOCOLS)}")
    name = task if family in (None, "softmax") else f"{task}-{family}"
    path = RECIPES / protocol / f"{name}.yaml"
    if not path.is_file():
        shipped = sorted(p.stem for p in (RECIPES / protocol).glob(f"{task}*.yaml"))
        raise ValueError(f"no shipped recipe {path}; for {task} there are: {shipped}")
    return path


def build_lra_model(cfg: LraConfig, init: Path | None, seq_len: int) -> torch.nn.Module:
    task = get_task(cfg.task)
    head: dict[str, Any] = {"num_labels": task.num_labels, "pooling": cfg.pooling}
    head["type"] = "dual_classification" if task.pair else "sequence_classification"
    if init is not None:
        encoder = release_or_export_encoder(init)  # an HF export too (e.g. a Hub download)
        if encoder["vocab_size"] != task.vocab_size:
            raise ValueError(
                f"--init {init} has vocab_size {encoder['vocab_size']}, the {task.name} task "
                f"{task.vocab_size}: use a release pretrained on this task's inputs"
            )
        if encoder["max_position_embeddings"] < seq_len:
            raise ValueError(
                f"--init {init} has {encoder['max_position_embeddings']} positions; the task "
                f"needs {seq_len}"
            )
        return load_release_or_export(init, head=head)
    model_cfg = EncoderConfig.from_dict(
        {
            **cfg.model,
            "vocab_size": task.vocab_size,
            "pad_token_id": PAD_ID,
            "max_position_embeddings": max(seq_len, cfg.model.get("max_position_embeddings", 0)),
        }
    )
    return build_model(model_cfg, head)


def _dual_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "input_ids_2": batch["input_ids_b"],
        "attention_mask_2": batch["attention_mask_b"],
    }


def _accuracy(predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    # the share of exact matches (sklearn's accuracy_score, without importing sklearn, whose
    # import is a visible share of every LRA process's start)
    return {"accuracy": float(np.mean(np.asarray(predictions) == labels.astype(np.int64)))}


def run_seed(
    cfg: LraConfig, data_dir: Path, init: Path | None, seed: int, init_digest: str | None = None
) -> dict[str, Any]:
    """One seed. Returns its row; ``row["state"]`` is ``"stopped"`` when a signal or the time
    budget stopped it (a checkpoint was saved: run again to resume). A seed that finished
    before is not run again: its row is read back."""
    run_dir = Path(cfg.train.run_dir) / f"seed_{seed}"
    identity = run_identity(config_dict(cfg), suite="lra", seed=seed, init_sha256=init_digest)
    done = finished_run(run_dir, identity)
    if done is not None:
        print(f"{run_dir}: finished before; skipping it (delete it to run it again)", flush=True)
        return done["summary"]
    task = get_task(cfg.task)
    options: dict[str, Any] = {}
    if task.name in ("pathfinder", "pathx"):
        options = {"difficulty": cfg.data.difficulty, "split_seed": cfg.data.split_seed}
    loaded = {
        s: load_split(task, data_dir, s, cfg.data.max_length, **options)
        for s in ("train", "val", "test")
    }
    splits = {s: examples for s, (examples, _) in loaded.items()}
    seq_len = task.sequence_length(cfg.data.max_length)
    torch.manual_seed(seed)
    model = build_lra_model(cfg, init, seq_len)
    train_cfg = replace(cfg.train, seed=seed)
    data = FinetuneData(
        splits["train"],
        {"val": splits["val"], "test": splits["test"]},
        _accuracy,
        pad_id=PAD_ID,
        collate_fn=collate_pair if task.pair else None,
        inputs_fn=_dual_inputs if task.pair else None,
    )
    trainer = Finetuner(
        model,
        data,
        train_cfg,
        run_dir,
        engine=cfg.engine,
        optimizer=cfg.optimizer,
        schedule=cfg.schedule,
        identity=identity,
    )
    result = trainer.run()
    row = {
        "state": result.state,
        "task": task.name,
        "family": _family(model),
        "seed": seed,
        "init": None if init is None else str(init),
        "best_step": result.best_step,
        "val_accuracy": result.best.get("val", {}).get("accuracy"),
        "test_accuracy": result.best.get("test", {}).get("accuracy"),
        "rows": {  # records read and skipped (e.g. Pathfinder's empty images) per split
            s: {"read": stats.rows, "skipped": stats.skipped} for s, (_, stats) in loaded.items()
        },
        "run_dir": str(run_dir),
    }
    if result.state != "completed":
        return row
    if detect().rank == 0:  # the per-seed record lra-summary reads
        path = run_dir / "results.json"
        write_finished(run_dir, {**json.loads(path.read_text()), "summary": row})
    trainer.discard_checkpoints()
    return row


def _family(model: torch.nn.Module) -> str:
    config = getattr(getattr(model, "encoder", model), "config", None)
    return str(getattr(config, "attention", "unknown"))


def summarise(rows: list[dict[str, Any]], root: Path) -> str:
    """The run dir's results.md: val and test accuracy over the seeds (median, spread) and the
    test accuracy's mean with a 95 % bootstrap interval (``finetune.compare``)."""
    from finetune.compare import bootstrap_difference, format_interval, load_seeds

    lines = ["| task | init | seeds | val acc (median) | test acc (median) | test spread "
             "| test acc (mean, 95% interval) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    tests = [r["test_accuracy"] for r in rows]
    vals = [r["val_accuracy"] for r in rows]
    init = rows[0]["init"] or "scratch"
    try:
        predictions, labels = load_seeds([r["run_dir"] for r in rows], "test")
        mean = format_interval(bootstrap_difference(labels, predictions), signed=False)
    except FileNotFoundError:  # a seed finished before runs saved their predictions
        mean = "–"
    lines.append(
        f"| {rows[0]['task']} | {init} | {len(rows)} | {100 * statistics.median(vals):.2f} | "
        f"{100 * statistics.median(tests):.2f} | {100 * (max(tests) - min(tests)):.2f} | {mean} |"
    )
    table = "\n".join(lines) + "\n"
    root.mkdir(parents=True, exist_ok=True)
    (root / "results.md").write_text(table)
    (root / "results.json").write_text(json.dumps({"runs": rows}, indent=2) + "\n")
    return table


def _average(scores: dict[str, float], tasks: tuple[str, ...], fail: float | None) -> str:
    values = [fail if scores.get(t) is None else scores[t] for t in tasks]
    if any(v is None for v in values):
        return "–"
    return f"{statistics.mean(values):.2f}"  # type: ignore[arg-type]


def summarise_dir(root: Path) -> str:
    """ROOT/results.md and results.json from every seed_*/results.json below ROOT."""
    found = sorted(root.glob("**/seed_*/results.json"))
    if not found:
        raise FileNotFoundError(f"no seed_*/results.json below {root}: nothing to summarise")
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for path in found:
        run = json.loads(path.read_text())
        row = run.get("summary")
        if row is None:
            print(f"{path}: no 'summary' (unfinished, or not written by python -m finetune lra)")
            continue
        init = "scratch" if row["init"] is None else "pretrained"
        # where the run is now (the row's run_dir is where it ran: a moved tree still works)
        row = {**row, "run_dir": str(path.parent)}
        groups.setdefault((row["family"], init, row["task"]), []).append(row)
    ours: dict[str, dict[str, float]] = {}
    for (family, init, task), runs in sorted(groups.items()):
        tests = [r["test_accuracy"] for r in runs]
        ours.setdefault(f"{family} ({init}, ours, {len(runs)} seeds)", {})[task] = 100 * (
            statistics.median(tests)
        )
    names = {"listops": "ListOps", "text": "Text", "retrieval": "Retrieval", "image": "Image"}
    names |= {"pathfinder": "Pathfinder", "pathx": "Path-X"}
    lines = ["| model | " + " | ".join(names[t] for t in TASK_ORDER) + " | Avg (5) | Avg (6) |"]
    lines.append("|---" * (len(TASK_ORDER) + 3) + "|")
    for label, scores in [*ours.items(), *PUBLISHED.items()]:
        cells = [
            "FAIL" if label in PUBLISHED and t == "pathx" and t in scores
            else ("–" if scores.get(t) is None else f"{scores[t]:.2f}")
            for t in TASK_ORDER
        ]  # fmt: skip
        avg5 = _average(scores, TASK_ORDER[:5], None)
        avg6 = _average(scores, TASK_ORDER, 50.0 if avg5 != "–" else None)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {avg5} | {avg6} |")
    table = "\n".join(lines) + "\n"
    note = (
        "\nTest accuracy (%), median over seeds, at each run's best val step. Avg (5): the five "
        "tasks without Path-X; Avg (6): all six with a missing Path-X counted as 50 (FAIL).\n"
    )
    intervals, interval_md = summary_intervals(groups)
    (root / "results.md").write_text(table + note + interval_md)
    (root / "results.json").write_text(
        json.dumps(
            {"ours": ours, "published": PUBLISHED, "intervals": intervals,
             "runs": [str(p) for p in found]},
            indent=2,
        )
        + "\n"
    )  # fmt: skip
    return table


REFERENCE_FAMILY = "softmax"
"""lra-summary compares every family with this one (the same task and init)."""


def summary_intervals(
    groups: dict[tuple[str, str, str], list[dict[str, Any]]],
) -> tuple[list[dict[str, Any]], str]:
    """95 % bootstrap intervals (``finetune.compare``) of each (family, init, task)'s mean test
    accuracy at the best val step and of its difference from `REFERENCE_FAMILY`'s (same task
    and init; paired over the test examples, resampling each side's seeds): a list for
    results.json and a Markdown section. Groups whose runs saved no predictions are named in
    the section and left out."""
    from finetune.compare import bootstrap_difference, format_interval, load_seeds

    preds, missing = {}, []

    def order(key: tuple[str, str, str]) -> tuple:
        family, init, task = key
        rank = TASK_ORDER.index(task) if task in TASK_ORDER else len(TASK_ORDER)
        return rank, task, init, family != REFERENCE_FAMILY, family

    for key in sorted(groups, key=order):
        name = f"{key[0]} ({key[1]}) on {key[2]}"
        try:
            preds[key] = load_seeds([r["run_dir"] for r in groups[key]], "test", "best", name)
        except FileNotFoundError:
            missing.append(name)
    out, lines = [], []
    for (family, init, task), (mine, labels) in preds.items():
        row: dict[str, Any] = {"family": family, "init": init, "task": task, "seeds": len(mine)}
        accuracy = bootstrap_difference(labels, mine)
        row["accuracy"] = accuracy.to_dict()
        ref = preds.get((REFERENCE_FAMILY, init, task))
        cell = ""
        if family != REFERENCE_FAMILY and ref is not None:
            if not np.array_equal(ref[1], labels):
                raise ValueError(f"{task}: {family} and {REFERENCE_FAMILY} saw other test sets")
            difference = bootstrap_difference(labels, mine, ref[0])
            row[f"vs_{REFERENCE_FAMILY}"] = difference.to_dict()
            cell = format_interval(difference)
        out.append(row)
        shown = format_interval(accuracy, signed=False)
        lines.append(f"| {task} | {family} | {init} | {len(mine)} | {shown} | {cell} |")
    if not lines and not missing:
        return out, ""
    md = (
        f"\nWhat these runs can tell apart: mean test accuracy over seeds (%) and its "
        f"difference from {REFERENCE_FAMILY} with 95 % bootstrap intervals (over the test "
        "examples, paired between the two, and over each side's seeds); `*`: the interval "
        "excludes 0.\n\n"
        f"| task | model | init | seeds | test accuracy | − {REFERENCE_FAMILY} |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n"
    )
    if missing:
        md += "\nNo predictions saved (runs from an older version), left out: "
        md += ", ".join(missing) + ".\n"
    return out, md


def main(args, overrides: list[str]) -> int:
    config = args.config
    if config is None and args.protocol is not None:
        config = str(recipe_path(args.task, args.protocol, args.family))
    elif args.family is not None and config is None:
        raise ValueError("--family picks a shipped recipe: give --protocol too (or --config)")
    data = load_recipe(config, [f"task={args.task}", *overrides])
    # LRA selects on val accuracy, whatever part of the train section the recipe sets.
    data = deep_merge({"train": {"select": "accuracy", "select_split": "val"}}, data)
    cfg = build_config(LraConfig, data)
    get_task(cfg.task)  # a clear error for an unknown task, before any work
    if args.seeds:
        cfg.seeds = list(args.seeds)
    init = Path(args.init) if args.init else None
    if init is not None and not init.is_dir():
        raise ValueError(f"--init {init}: no such directory")
    digest = None if init is None else directory_digest(init)
    rows = []
    for seed in cfg.seeds:
        rows.append(run_seed(cfg, Path(args.data), init, seed, digest))
        if rows[-1]["state"] == "stopped":
            return EXIT_STOPPED
    if detect().rank == 0 and not args.no_summary:  # every rank trained; rank 0 writes
        print(summarise(rows, Path(cfg.train.run_dir)))
    return 0
