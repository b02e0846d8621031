"""``python -m finetune glue``: fine-tune a release (or a local HF ALBERT) on GLUE tasks.

    python -m finetune glue --task rte --data glue_data --init releases/albert-base \\
        [--config configs/finetune/glue/rte.yaml] [--seeds 0 1 2] [--lrs 1e-5 2e-5] [key=value ...]
    python -m finetune glue --task all --data glue_data --init albert-base-v2/ --attention tisa

``--data`` is the GLUE data in any of three layouts, as the root of all tasks or one task's
folder (see finetune/glue/data.py):

    original TSVs        glue_data/<CoLA|SST-2|...|MNLI|diagnostic>/train.tsv, dev.tsv, test.tsv
                         (MNLI dev_matched.tsv ..., AX diagnostic/diagnostic.tsv)
    HF save_to_disk      <dir>/<cola|sst2|...|mnli|ax>/dataset_dict.json: a DatasetDict of HF's
                         glue config (a single split's Dataset.save_to_disk is refused)
    Hub snapshot         a snapshot of the Hub's nyu-mll/glue (Parquet), e.g.
                         <dir>/mnli/validation_matched-00000-of-00001.parquet, ax/test-...parquet

For each task x learning rate x seed: load the training and dev splits, tokenise with the
release's tokenizer, fine-tune through the engine with evaluation every ``train.eval_every``
steps, keep the best dev weights, predict the test split(s) with them and write the GLUE server
files. AX, the diagnostic set (no training or dev data), is predicted by the MNLI runs when its
test data is under ``--data`` (the same root: diagnostic/ or ax/); ``--task ax`` is refused,
``--task all`` trains the nine scored tasks. Outputs under ``train.run_dir``:

    <task>/lr_<lr>/seed_<seed>/results.json, best/ (release), tensorboard/, predictions/<Server>.tsv
    results.json, results.md       every run's best dev metrics; median and spread over seeds;
                                   whether submission/ is complete
    submission/                    server files of the best run per task (by median over seeds),
                                   AX.tsv from the best MNLI run

A run's results.json counts the rows of every split read and skipped as malformed (``rows``).
The summary states whether the submission is complete (all 11 server files, CoLA.tsv ...
AX.tsv, with the official row counts) or names what is missing or wrong, with a warning.
``--no-summary`` skips the summary (an array job running one combination each);
``python -m finetune glue-summary RUN_DIR`` writes it from the runs on disk afterwards.
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.distributed import detect
from engine.engine import EngineConfig
from engine.optim import OptimizerConfig, ScheduleConfig
from engine.recipe import build_config, config_dict, load_recipe
from finetune.glue.data import (
    Example,
    SplitStats,
    encode,
    find_split,
    layouts_looked_for,
    load_glue_tokenizer,
    load_split,
    pad_token_id,
)
from finetune.glue.metrics import compute_metrics, glue_average
from finetune.glue.submission import (
    SubmissionReport,
    check_submission_dir,
    write_predictions,
)
from finetune.glue.tasks import (
    SCORED_TASKS,
    SERVER_FILES,
    TASKS,
    GlueTask,
    get_task,
    parse_result_key,
    tasks_predicted_with,
)
from finetune.trainer import (
    EXIT_STOPPED,
    FinetuneConfig,
    FinetuneData,
    Finetuner,
    finished_run,
    run_identity,
    write_finished,
)
from model.hub.release import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    directory_digest,
    is_release,
    load_release,
    save_release,
)

log = logging.getLogger("finetune.glue")
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "finetune" / "glue"


@dataclass
class GlueModelConfig:
    """How the model is built from ``--init``."""

    classifier_dropout: float = 0.1
    """Dropout before the classifier (ALBERT: 0.1)."""
    hidden_dropout_prob: float | None = None
    """Encoder dropout during fine-tuning (ALBERT's "ALBERT DR": 0 or 0.1); None keeps the
    release's."""
    pooling: str = "cls"
    """``cls`` (ALBERT's pooler), ``mean`` or ``max``."""
    attention: str | None = None
    """Only for an HF ALBERT ``--init``: ``"tisa"`` adds TISA at zero amplitude (the TISA
    paper's protocol); None keeps softmax."""
    tisa: dict[str, Any] = field(default_factory=dict)
    """TISA settings for ``attention: tisa`` (e.g. ``{scope: per_layer, num_kernels: 5}``)."""


@dataclass
class GlueDataConfig:
    """How examples are encoded (the data directory itself is ``--data``)."""

    max_length: int = 512
    """Tokens per example ([CLS] A [SEP] B [SEP]); pairs are truncated longest-first."""


@dataclass
class GlueTrainConfig(FinetuneConfig):
    """The ``train`` section: the fine-tuning run (``finetune.trainer.FinetuneConfig``) and
    where the runs go (``train.run_dir``, as in pretraining)."""

    run_dir: str = "runs/glue"
    """Root of the runs: ``<task>/lr_<lr>/seed_<seed>/`` and the summary (results.md,
    results.json, submission/). Was the top-level ``run_dir`` (still accepted, with a warning)."""


@dataclass
class GlueConfig:
    task: str = "rte"
    """A GLUE task (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli) or ``all``; not ``ax``,
    which the MNLI runs predict."""
    data: GlueDataConfig = field(default_factory=GlueDataConfig)
    model: GlueModelConfig = field(default_factory=GlueModelConfig)
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(name="adamw", lr=2e-5, weight_decay=0.01)
    )
    schedule: ScheduleConfig = field(
        default_factory=lambda: ScheduleConfig(warmup_steps=200, total_steps=800)
    )
    engine: EngineConfig = field(
        default_factory=lambda: EngineConfig(backend="torch", precision="bf16-mixed")
    )
    train: GlueTrainConfig = field(default_factory=GlueTrainConfig)
    seeds: list[int] = field(default_factory=lambda: [0])
    """One run per seed; tables report the median and the spread (max - min)."""
    lrs: list[float] | None = None
    """A learning-rate sweep (each with every seed); None: optimizer.lr alone."""


def prepare_init(init: Path, cfg: GlueConfig, work: Path) -> Path:
    """A release dir to fine-tune from: ``init`` itself, or an HF ALBERT checkpoint imported
    (with the attention switch of ``model.attention``) into ``work``."""
    if not init.exists():
        raise ValueError(f"--init {init}: no such directory")
    if is_release(init):
        if cfg.model.attention is not None:
            raise ValueError(
                "model.attention switches the attention of an HF ALBERT import; --init is a "
                "release (its attention is fixed): drop model.attention"
            )
        return init
    from model.hub.hf_import import import_hf_albert

    model = import_hf_albert(
        init, attention=cfg.model.attention or "softmax", tisa_overrides=cfg.model.tisa or None
    )
    tok = init / TOKENIZER_FILE
    if not tok.is_file():
        raise ValueError(f"--init {init} has no {TOKENIZER_FILE}; fine-tuning needs one")
    return save_release(work / "imported", model, tokenizer_file=tok, overwrite=True)


def build_classifier(release: Path, task: GlueTask, cfg: GlueConfig) -> torch.nn.Module:
    head = {
        "type": "sequence_classification",
        "num_labels": task.num_labels,
        "pooling": cfg.model.pooling,
        "classifier_dropout": cfg.model.classifier_dropout,
    }
    saved = json.loads((release / CONFIG_FILE).read_text())["head"]
    if saved.get("type") == head["type"] and saved.get("num_labels") == task.num_labels:
        head = {**head, **{k: v for k, v in saved.items() if k in ("pooling",)}}
        head["classifier_dropout"] = cfg.model.classifier_dropout
    model = load_release(release, head=head)
    if cfg.model.hidden_dropout_prob is not None:
        for module in model.encoder.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = cfg.model.hidden_dropout_prob
    return model


def run_one(
    task: GlueTask,
    release: Path,
    data_dir: Path,
    cfg: GlueConfig,
    lr: float,
    seed: int,
    init_digest: str | None = None,
) -> dict[str, Any]:
    """One task x learning rate x seed. Returns its row; ``row["state"]`` is ``"stopped"``
    when a signal or the time budget stopped it (a checkpoint was saved: run again to
    resume). A run that finished before is not run again: its row is read back."""
    run_dir = Path(cfg.train.run_dir) / task.name / f"lr_{lr:g}" / f"seed_{seed}"
    identity = run_identity(
        config_dict(cfg), suite="glue", lr=lr, seed=seed, init_sha256=init_digest
    )
    done = finished_run(run_dir, identity)
    if done is not None:
        log.warning("%s: finished before; skipping it (delete it to run it again)", run_dir)
        done.pop("history", None)
        return done
    tokenizer = load_glue_tokenizer(release / TOKENIZER_FILE)
    train, train_stats = load_split(task, data_dir, "train")
    splits = {s: load_split(task, data_dir, s) for s in (*task.dev_splits, *task.test_splits)}
    others = load_predicted_with(task, data_dir)  # MNLI: {"ax": AX's test set}
    splits.update(others)
    encoded = {s: encode(ex, tokenizer, cfg.data.max_length) for s, (ex, _) in splits.items()}
    predicted = {s: (task, s) for s in task.test_splits}  # eval set -> (task, its test split)
    predicted.update({key: parse_result_key(key) for key in others})
    dev_name = task.dev_splits[0]
    train_cfg = replace(cfg.train, seed=seed)
    train_cfg.select_split = dev_name if cfg.train.select_split == "dev" else train_cfg.select_split
    torch.manual_seed(seed)
    model = build_classifier(release, task, cfg)
    opt = OptimizerConfig(**{**config_dict(cfg.optimizer), "lr": lr, "betas": cfg.optimizer.betas})
    data = FinetuneData(
        encode(train, tokenizer, cfg.data.max_length),
        encoded,
        lambda p, y: compute_metrics(task, p, y),
        pad_id=pad_token_id(tokenizer),
        tokenizer_file=release / TOKENIZER_FILE,
    )
    trainer = Finetuner(
        model,
        data,
        train_cfg,
        run_dir,
        engine=cfg.engine,
        optimizer=opt,
        schedule=cfg.schedule,
        identity=identity,
    )
    result = trainer.run()
    row = {
        "state": result.state,
        "task": task.name,
        "lr": lr,
        "seed": seed,
        "best_step": result.best_step,
        "dev": {s: result.best.get(s, {}) for s in task.dev_splits},
        "train_examples": train_stats.examples,
        "rows": {  # read and skipped as malformed, per split (MNLI: AX's test set as "ax")
            "train": train_stats.counts(),
            **{s: st.counts() for s, (_, st) in splits.items()},
        },
        "run_dir": str(run_dir),
    }
    if result.state != "completed":
        return row
    if detect().rank == 0:  # every rank trained and evaluated; rank 0 writes
        for key, (target, split) in predicted.items():
            if key not in result.predictions:  # resumed from a checkpoint made without it
                log.warning(
                    "%s: the best weights' predictions hold no %s; %s is not written",
                    run_dir,
                    key,
                    target.server_file(split).file,
                )
                continue
            write_predictions(
                target,
                encoded[key].indices,
                result.predictions[key],
                run_dir / "predictions",
                split,
                overwrite=True,
            )
        write_finished(run_dir, {**row, "history": result.history})  # last: the run is done
    trainer.discard_checkpoints()
    return row


def load_predicted_with(
    task: GlueTask, data_dir: Path
) -> dict[str, tuple[list[Example], SplitStats]]:
    """The test sets ``task``'s model predicts besides its own (MNLI: AX), keyed by their
    result key ("ax"): those whose data is under ``data_dir``. One that is not is warned about:
    its server file will be missing from the submission."""
    found = {}
    for other in tasks_predicted_with(task):
        for split in other.test_splits:
            if find_split(other, data_dir, split) is None:
                log.warning(
                    "no %s %s data under %s, so the %s runs do not predict it and %s will be "
                    "missing from the GLUE submission (%s)",
                    other.name,
                    split,
                    data_dir,
                    task.name,
                    other.server_file(split).file,
                    layouts_looked_for(other, data_dir, split),
                )
                continue
            found[other.result_key(split)] = load_split(other, data_dir, split)
    return found


def _score(row: dict[str, Any]) -> float:
    return float(np.mean([m["score"] for m in row["dev"].values() if "score" in m]))


def best_lrs(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Task -> {"median": its best median score over seeds, "lr": that learning rate}."""
    best: dict[str, dict[str, float]] = {}
    for (task, lr), group in sorted(_groups(rows).items()):
        median = statistics.median(_score(r) for r in group)
        if task not in best or median > best[task]["median"]:
            best[task] = {"median": median, "lr": lr}
    return best


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, float], list[dict[str, Any]]]:
    """The runs per (task, lr): the seeds of one setting."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["lr"]), []).append(row)
    return groups


def summarise(
    rows: list[dict[str, Any]], out: Path, submission: SubmissionReport | None = None
) -> str:
    """results.md: per task and lr, the median and spread over seeds of each dev metric, the
    GLUE average when every scored task ran and, given ``submission``, whether the server
    files are complete. results.json: the runs, the best lr per task and ``submission``."""
    lines = [
        "| task | lr | seeds | metric | median | spread (max - min) |",
        "|---|---|---|---|---|---|",
    ]
    groups = _groups(rows)
    for (task, lr), group in sorted(groups.items()):
        for split in group[0]["dev"]:
            for metric in group[0]["dev"][split]:
                values = [r["dev"][split][metric] for r in group]
                name = metric if len(group[0]["dev"]) == 1 else f"{split} {metric}"
                lines.append(
                    f"| {task} | {lr:g} | {len(group)} | {name} | "
                    f"{100 * statistics.median(values):.2f} | {100 * (max(values) - min(values)):.2f} |"
                )
    best_per_task = best_lrs(rows)
    table = "\n".join(lines) + "\n"
    scored = {
        TASKS[t].result_key(s): {
            "score": statistics.median(r["dev"][s]["score"] for r in groups[(t, v["lr"])])
        }
        for t, v in best_per_task.items()
        for s in TASKS[t].dev_splits
    }
    if set(best_per_task) >= set(SCORED_TASKS):
        table += f"\nGLUE average (dev, best lr per task, median over seeds): {100 * glue_average(scored):.2f}\n"
    intervals, interval_md = score_intervals(groups)
    table += interval_md
    results: dict[str, Any] = {"runs": rows, "best": best_per_task, "intervals": intervals}
    if submission is not None:
        table += f"\n{submission.summary()}\n"
        results["submission"] = submission.to_dict()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(table)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return table


def score_intervals(
    groups: dict[tuple[str, float], list[dict[str, Any]]],
) -> tuple[list[dict[str, Any]], str]:
    """Each (task, lr, dev split)'s mean dev score over its seeds with a 95 % bootstrap interval
    (``finetune.compare``: over the dev examples and the seeds; GLUE's dev sets are small): rows
    for results.json and a Markdown section. Settings whose runs saved no predictions (an
    older version) are named and left out."""
    from finetune.compare import bootstrap_difference, format_interval, load_seeds
    from finetune.glue.metrics import score_metric

    out, lines, missing = [], [], []
    for (name, lr), group in sorted(groups.items()):
        task = TASKS[name]
        for split in task.dev_splits:
            try:
                runs = [r["run_dir"] for r in group]
                predictions, labels = load_seeds(runs, split, "best", f"{name} lr {lr:g}")
            except FileNotFoundError:
                missing.append(f"{name} lr {lr:g}")
                break
            interval = bootstrap_difference(labels, predictions, None, score_metric(task))
            out.append({"task": name, "lr": lr, "split": split, "seeds": len(group),
                        "score": interval.to_dict()})  # fmt: skip
            shown = format_interval(interval, signed=False)
            lines.append(f"| {name} | {lr:g} | {split} | {len(group)} | {shown} |")
    md = ""
    if lines:
        md = (
            "\nDev score (x 100): the mean over seeds with a 95 % bootstrap interval (over the dev "
            "examples and the seeds; `python -m finetune compare` for differences):\n\n"
            "| task | lr | split | seeds | score |\n|---|---|---|---|---|\n"
            + "\n".join(lines) + "\n"
        )  # fmt: skip
    if missing:
        md += f"\nNo predictions saved (runs from an older version): {', '.join(missing)}.\n"
    return out, md


def collect_submission(rows: list[dict[str, Any]], submission: Path) -> SubmissionReport:
    """``submission``: the server files of the best seed of the best lr per task (AX.tsv from
    the best MNLI run), rebuilt from the runs; then checked, with a warning unless it is a
    complete GLUE submission."""
    for _, server_file in SERVER_FILES:  # none left from an earlier summary's choice
        (submission / server_file.file).unlink(missing_ok=True)
    for name, choice in best_lrs(rows).items():
        candidates = [r for r in rows if r["task"] == name and r["lr"] == choice["lr"]]
        chosen = max(candidates, key=_score)  # the best seed of the best lr
        for f in sorted((Path(chosen["run_dir"]) / "predictions").glob("*.tsv")):
            submission.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, submission / f.name)
    report = check_submission_dir(submission)
    if not report.complete:
        log.warning("%s", report.summary())
    return report


def collect_rows(root: Path) -> list[dict[str, Any]]:
    """Every finished run under ``root`` (``<task>/lr_<lr>/seed_<seed>/results.json``)."""
    rows = []
    for path in sorted(root.glob("*/lr_*/seed_*/results.json")):
        row = json.loads(path.read_text())
        if row.get("finished") is False or "task" not in row:
            continue  # interrupted between its last evaluation and its predictions
        row.pop("history", None)
        row["run_dir"] = str(path.parent)  # where it is now (a moved tree still summarises)
        rows.append(row)
    return rows


def summarise_dir(root: Path) -> str:
    """results.md / results.json and the server files of ``root``, from the runs on disk (so an
    array of jobs, each running one task x lr x seed, is summarised by one later job)."""
    rows = collect_rows(root)
    if not rows:
        raise ValueError(f"no finished GLUE runs under {root} (<task>/lr_<lr>/seed_<seed>/)")
    submission = root / "submission"
    table = summarise(rows, root, collect_submission(rows, submission))
    return table + f"\nresults: {root / 'results.md'}; GLUE server files: {submission}\n"


def trained_task(name: str) -> GlueTask:
    """The task ``--task name`` fine-tunes; ValueError for AX, which the MNLI runs predict."""
    task = get_task(name)
    if task.predicted_with is not None:
        files = ", ".join(sf.file for sf in task.submission)
        raise ValueError(
            f"--task {task.name}: the GLUE diagnostic ({task.name}) has no training or dev data "
            f"and is not fine-tuned; the {task.predicted_with} runs predict it and write {files} "
            f"when its test data is under --data ({task.dir_name}/{task.tsv_file('test')} of "
            f"the original TSVs, or the '{task.name}' config of the HF layouts): run "
            f"--task {task.predicted_with} (or --task all)"
        )
    return task


def main(args, overrides: list[str]) -> int:
    recipe = args.config
    tasks = SCORED_TASKS if args.task == "all" else (trained_task(args.task).name,)
    roots = set()
    with tempfile.TemporaryDirectory(prefix="albatross-glue-") as work:
        for name in tasks:
            path = recipe or CONFIGS / f"{name}.yaml"
            data = load_recipe(path, [f"task={name}", *overrides])
            cfg = build_config(GlueConfig, data)
            if args.seeds:
                cfg.seeds = list(args.seeds)
            if args.lrs:
                cfg.lrs = list(args.lrs)
            if args.attention:
                cfg.model.attention = args.attention
            release = prepare_init(Path(args.init), cfg, Path(work))
            digest = directory_digest(Path(args.init))
            task = get_task(name)
            for lr in cfg.lrs or [cfg.optimizer.lr]:
                for seed in cfg.seeds:
                    row = run_one(task, release, Path(args.data), cfg, lr, seed, digest)
                    if row["state"] == "stopped":
                        return EXIT_STOPPED
            roots.add(Path(cfg.train.run_dir))
    if not args.no_summary and detect().rank == 0:
        for root in sorted(roots):
            print(summarise_dir(root))
    return 0
