"""The CPU mini-LRA: each attention family from scratch and self-pretrained, on generated ListOps
and a synthetic byte-level Text task, several seeds, beside trivial baselines; its committed
result (bench/results/mini_lra_cpu.json) is the table in docs/benchmarks.md#mini-lra.

    python -m finetune.lra.mini --out runs/mini-lra                       # the whole table
    python -m finetune.lra.mini --out runs/x --tasks listops --families softmax --seeds 0
    python -m finetune.lra.mini --out runs/mini-lra-gpu --scale gpu --jobs 1   # a GPU-sized one

Every stage is the project's real command line, run as a subprocess:

    1. data: ``python -m data_prep listops`` (ListOps in the official TSV format, with the
       scale's tree shape and lengths) and `finetune.lra.synthetic` (an aclImdb-layout
       byte-level sentiment task);
    2. baselines (`finetune.lra.baselines`, from those files): the majority class, the
       first-operator rule (ListOps: the most frequent answer of the outermost operator, the
       token right after [CLS]) and a bag-of-tokens logistic regression (Text: also a
       bag-of-words one, for reference), each fit on train and scored on test;
    3. ``python -m finetune lra-shards``: each task's training inputs as pretraining shards;
    4. ``python -m pretrain --config configs/pretrain/debug-lra-<task>.yaml``: masked-LM
       self-pretraining of each family on those inputs (a release at the end);
    5. ``python -m finetune lra --config configs/finetune/lra/debug-<task>.yaml [--init
       release] --seeds ...``: fine-tuning from scratch and from the release. Every family
       gets the same steps, batch, schedule and seeds (one step budget per task). Val and test
       are evaluated at `Scale.curve_points` evenly spaced steps, the last one the last step:
       the table reports the test accuracy **after the last step** (no selection on val or
       test; the fine-tuning command's own summary picks the best val step, which this
       driver ignores), and the learning curves the median test accuracy at every point;
    6. intervals (`finetune.compare`, from the runs' saved predictions and the baselines'):
       every row's mean test accuracy and its differences from the task's best shortcut, from
       softmax and (self-pretrained rows) from the scratch run, with 95 % bootstrap intervals
       over the test examples (paired) and the seeds: what the table can tell apart.

ListOps at the table scale is shallow on purpose (trees of depth <= 3, operators of 2-5
arguments, 10 < length < 40, 3000 fine-tuning steps): on the LRA generator's own shape (depth
10, up to 10 arguments) at lengths 50-150 (scale ``lra-shape``), predicting the outermost
operator's most frequent answer is as good as any model trained there, so a table on it
measures whether a model reads position 1. The setting was chosen among
candidate shapes as the one where softmax from scratch clears every shortcut baseline by the
widest margin (docs/benchmarks.md#mini-lra).

Independent runs go ``--jobs`` at a time (default 2, one CPU thread each). Finished runs are
reused when the command is run again with the same scale (a different scale in the same
``--out`` is refused). Writes <out>/results.json and <out>/results.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.recipe import recipe_overrides

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("listops", "text")
FAMILIES = ("softmax", "tisa", "kernel", "transject")
"""The table's families (the default of --families)."""

FAMILY_OVERRIDES: dict[str, list[str]] = {
    family: recipe_overrides(ROOT / "configs" / "families" / f"{family}.yaml")
    for family in (*FAMILIES, "tisa-nopos")  # TISA's "TISA only" ablation: only when asked for
}
"""Every family --families accepts, with its model overrides (scratch runs and pretraining):
``configs/families/<family>.yaml``, the single source of the small runs' family settings."""


@dataclass(frozen=True)
class Scale:
    """Sizes of one mini-LRA (the table's, a GPU-sized one, or smaller ones for the main job
    and tests)."""

    listops: tuple[int, int, int] = (8000, 500, 2000)
    """ListOps train / val / test examples (2000 test: a difference between two families is
    resolved to about ±2 points rather than ±3 with 500)."""
    listops_length: tuple[int, int] = (10, 40)
    """ListOps min / max length (exclusive), tokens without parentheses."""
    listops_max_depth: int = 3
    """Generator: nodes at this depth are leaves (LRA: 10)."""
    listops_max_args: int = 5
    """Generator: an operator takes 2..max_args arguments (LRA: 10)."""
    listops_op_prob: float = 0.25
    """Generator: the probability that a node above max_depth is an operator (LRA: 0.25)."""
    text: tuple[int, int] = (2000, 2000)
    """Synthetic Text train / test examples (val is test, as in LRA)."""
    text_words: tuple[int, int] = (6, 12)
    """Synthetic Text neutral words per review (min, max): at most 150 bytes with the cues."""
    pretrain_steps: int = 300
    """Masked-LM self-pretraining steps on Text's inputs (and ListOps' unless set below)."""
    finetune_steps: int = 400
    """Fine-tuning steps on Text (and ListOps unless set below); every family the same."""
    listops_pretrain_steps: int | None = 500
    """ListOps' own self-pretraining steps (None: pretrain_steps)."""
    listops_finetune_steps: int | None = 3000
    """ListOps' own fine-tuning steps (None: finetune_steps)."""
    curve_points: int = 8
    """Evaluations per fine-tuning run, evenly spaced, the last after the last step."""
    overrides: tuple[str, ...] = ()
    """Extra dotted overrides of every pretraining and fine-tuning run (device, precision)."""
    model: tuple[str, ...] = ()
    """Extra model overrides of every family's scratch and pretraining runs (a bigger model)."""

    def steps(self, task: str, kind: str = "finetune") -> int:
        """Fine-tuning (kind "finetune") or pretraining ("pretrain") steps of a task."""
        own = getattr(self, f"{task}_{kind}_steps", None)
        return own if own is not None else getattr(self, f"{kind}_steps")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))


LRA_LISTOPS = dict(listops_max_depth=10, listops_max_args=10)
"""The LRA generator's tree shape."""

SCALES = {
    # The table (docs/benchmarks.md#mini-lra; its result file records the minutes it took).
    "table": Scale(),
    # The same tasks with more of everything, for one GPU (--jobs 1; not run yet): 10x the
    # data, 10x the steps, a 4-layer d=128 encoder, Text reviews of 60-120 words, and ListOps
    # 6x longer and deeper (depth <= 5, 2-5 arguments, more operators: op-prob 0.4,
    # 60 < length < 250), where the shortcuts are weaker still; whether the models get past
    # them there is what it measures.
    "gpu": Scale(
        listops=(80000, 2000, 2000),
        listops_length=(60, 250),
        listops_max_depth=5,
        listops_max_args=5,
        listops_op_prob=0.4,
        text=(20000, 2000),
        text_words=(60, 120),
        pretrain_steps=5000,
        finetune_steps=5000,
        listops_pretrain_steps=None,
        listops_finetune_steps=20000,
        overrides=("engine.device=cuda", "engine.precision=bf16-mixed"),
        model=(
            "model.hidden_size=128",
            "model.embedding_size=128",
            "model.num_hidden_layers=4",
            "model.num_attention_heads=4",
            "model.intermediate_size=512",
        ),
    ),
    # The LRA generator's shape at the main job's sizes (configs/studies/main.yaml, scale
    # demo), evaluated once, after the last step.
    "main": Scale(
        listops=(3000, 300, 300),
        listops_length=(50, 150),
        **LRA_LISTOPS,
        text=(1000, 300),
        listops_pretrain_steps=None,
        listops_finetune_steps=None,
        curve_points=1,
    ),
    # The previous table (lengths 50-150 on the LRA generator's shape, 400 steps): the
    # first-operator rule is as good as any model on it; kept to reproduce that.
    "lra-shape": Scale(
        listops=(4000, 500, 500),
        listops_length=(50, 150),
        **LRA_LISTOPS,
        text=(2000, 500),
        listops_pretrain_steps=None,
        listops_finetune_steps=None,
    ),
    "tiny": Scale(
        listops=(200, 50, 50),
        listops_length=(10, 40),
        text=(200, 50),
        pretrain_steps=8,
        finetune_steps=8,
        listops_pretrain_steps=None,
        listops_finetune_steps=None,
        curve_points=2,
    ),
}


def _run(cmd: list[str], log: Path, threads: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd[1:]) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if rc != 0:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(
            f"{' '.join(cmd[1:4])} ... failed ({rc}); log {log}:\n" + "\n".join(tail)
        )


def check_scale(out: Path, scale: Scale) -> None:
    """Records the scale in <out>/scale.json; refuses an --out made at another scale (its data
    and runs would be reused)."""
    path = out / "scale.json"
    if path.is_file():
        before = json.loads(path.read_text())
        if before != scale.to_dict():
            changed = sorted(k for k in scale.to_dict() if before.get(k) != scale.to_dict()[k])
            raise ValueError(
                f"{out} holds a mini-LRA of another scale (differs in {', '.join(changed)}); "
                "use another --out"
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(scale.to_dict(), indent=2) + "\n")


def listops_data_cmd(out: Path, scale: Scale) -> list[str]:
    train, val, test = scale.listops
    lo, hi = scale.listops_length
    cmd = [sys.executable, "-m", "data_prep", "listops", "--out", str(out)]
    cmd += ["--train", str(train), "--val", str(val), "--test", str(test)]
    cmd += ["--min-length", str(lo), "--max-length", str(hi)]
    cmd += ["--max-depth", str(scale.listops_max_depth)]
    cmd += ["--max-args", str(scale.listops_max_args)]
    if scale.listops_op_prob != 0.25:
        cmd += ["--op-prob", str(scale.listops_op_prob)]
    cmd += ["--overwrite", "--quiet"]
    return cmd


def make_data(out: Path, scale: Scale, threads: int) -> dict[str, Path]:
    """The two tasks' data directories (reused when present)."""
    from finetune.lra.synthetic import write_synthetic_imdb

    listops = out / "data" / "listops"
    if not (listops / "basic_test.tsv").is_file():
        _run(listops_data_cmd(listops, scale), out / "logs" / "data-listops.log", threads)
    text = out / "data" / "text"
    if not (text / "aclImdb").is_dir():
        lo, hi = scale.text_words
        write_synthetic_imdb(text, *scale.text, min_words=lo, max_words=hi)
    return {"listops": listops, "text": text / "aclImdb"}


def max_length(task: str, scale: Scale) -> int:
    """Data tokens per document: ListOps' upper length bound; for Text, room for the longest
    review (the longest words are 9 letters and a space; 3 cue words)."""
    return scale.listops_length[1] if task == "listops" else 10 * (scale.text_words[1] + 3)


def baselines(out: Path, task: str, data: Path, scale: Scale) -> dict[str, float]:
    """The task's trivial baselines (`finetune.lra.baselines`): test accuracies, cached in
    <out>/baselines/<task>.json beside their test predictions (<task>.npz, for the intervals)."""
    from finetune.lra.baselines import accuracy, task_baseline_predictions

    path = out / "baselines" / f"{task}.json"
    if path.is_file() and path.with_suffix(".npz").is_file():
        return json.loads(path.read_text())
    labels, predictions = task_baseline_predictions(task, data, max_length(task, scale))
    got = {name: accuracy(pred, labels) for name, pred in predictions.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path.with_suffix(".npz"), labels=labels, **predictions)
    path.write_text(json.dumps(got, indent=2) + "\n")
    return got


def baseline_predictions(out: Path, task: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(test labels, {baseline: test predictions}) cached by `baselines`."""
    with np.load(out / "baselines" / f"{task}.npz", allow_pickle=False) as data:
        return data["labels"], {k: data[k] for k in data.files if k != "labels"}


def eval_steps(task: str, scale: Scale) -> list[int]:
    """The fine-tuning steps evaluated: every `steps // curve_points` steps, and the last."""
    steps = scale.steps(task)
    every = max(1, steps // max(1, scale.curve_points))
    return sorted({*range(every, steps, every), steps})


def pretrain_cmd(task: str, family: str, shards: Path, run_dir: Path, scale: Scale) -> list[str]:
    steps = scale.steps(task, "pretrain")
    seq = max_length(task, scale) + 1
    cmd = [sys.executable, "-m", "pretrain", "--config"]
    cmd += [str(ROOT / "configs" / "pretrain" / f"debug-lra-{task}.yaml")]
    cmd += [f"data.shards={shards}", f"train.run_dir={run_dir}", "train.progress=false"]
    cmd += [f"data.max_seq_length={seq}"]
    if seq > 512:  # the model config's positions
        cmd += [f"model.max_position_embeddings={seq}"]
    cmd += [f"schedule.total_steps={steps}", f"schedule.warmup_steps={steps // 10}"]
    return [*cmd, *scale.overrides, *scale.model, *FAMILY_OVERRIDES[family]]


def finetune_cmd(
    task: str,
    family: str,
    data: Path,
    run_dir: Path,
    seeds: Sequence[int],
    scale: Scale,
    init: Path | None,
) -> list[str]:
    steps = scale.steps(task)
    every = eval_steps(task, scale)[0]
    cmd = [sys.executable, "-m", "finetune", "lra", "--task", task, "--data", str(data)]
    cmd += ["--config", str(ROOT / "configs" / "finetune" / "lra" / f"debug-{task}.yaml")]
    if init is not None:
        cmd += ["--init", str(init)]
    cmd += [f"seeds=[{','.join(map(str, seeds))}]"]
    cmd += [f"train.run_dir={run_dir}", f"data.max_length={max_length(task, scale)}"]
    cmd += [f"schedule.total_steps={steps}", f"schedule.warmup_steps={steps // 10}"]
    # The curve's points; no best-weights release (nothing is selected here).
    cmd += [f"train.eval_every={every}", "train.save_best=false", *scale.overrides]
    if init is None:  # a release carries its own model config
        cmd += [*scale.model, *FAMILY_OVERRIDES[family]]
    return cmd


def seed_history(run_dir: Path, seed: int) -> list[dict[str, Any]] | None:
    """The evaluations of one seed's run ([{step, val: {accuracy}, test: {accuracy}}]), or
    None when it has not finished."""
    path = run_dir / f"seed_{seed}" / "results.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("history")


def _done(run_dir: Path, seeds: Sequence[int], steps: list[int]) -> bool:
    """Every seed finished, evaluated at exactly `steps`."""
    for seed in seeds:
        history = seed_history(run_dir, seed)
        if history is None or [h["step"] for h in history] != steps:
            return False
    return True


def summarise_runs(run_dir: Path, seeds: Sequence[int], steps: list[int]) -> dict[str, Any]:
    """Final test accuracy per seed (after the last step), its median and spread, and the
    learning curves (val and test accuracy at every evaluated step, per seed and median)."""
    histories = {s: seed_history(run_dir, s) for s in seeds}
    curves: dict[str, list[list[float]]] = {"val": [], "test": []}
    for seed, history in histories.items():
        if history is None or [h["step"] for h in history] != steps:
            raise RuntimeError(f"{run_dir}/seed_{seed}: not evaluated at steps {steps}")
        for split in curves:
            curves[split].append([h[split]["accuracy"] for h in history])
    tests = [c[-1] for c in curves["test"]]
    return {
        "seeds": list(seeds),
        "test_accuracy": tests,
        "median": statistics.median(tests),
        "spread": max(tests) - min(tests),
        "curve": {
            "steps": steps,
            "test_median": [statistics.median(x) for x in zip(*curves["test"])],
            "val_median": [statistics.median(x) for x in zip(*curves["val"])],
            "test": curves["test"],
            "val": curves["val"],
        },
    }


def run(
    out: Path,
    tasks: Sequence[str],
    families: Sequence[str],
    seeds: Sequence[int],
    scale: Scale,
    jobs: int = 2,
) -> list[dict[str, Any]]:
    """Runs (or reuses) everything; returns one row per task x family x init (the baselines go
    to results.json / results.md)."""
    unknown = [f for f in families if f not in FAMILY_OVERRIDES]
    if unknown:
        raise ValueError(f"unknown families {unknown}; valid: {list(FAMILY_OVERRIDES)}")
    threads = max(1, (os.cpu_count() or 1) // jobs)
    start = time.perf_counter()
    check_scale(out, scale)
    data = make_data(out, scale, threads)
    found = {t: baselines(out, t, data[t], scale) for t in tasks}

    def shards(task: str) -> Path:
        path = out / "shards" / task
        cmd = [sys.executable, "-m", "finetune", "lra-shards", "--task", task]
        cmd += ["--data", str(data[task]), "--out", str(path)]
        cmd += ["--max-length", str(max_length(task, scale))]
        _run(cmd, out / "logs" / f"shards-{task}.log", threads)
        return path

    def pretrain(task: str, family: str, shard_dir: Path) -> Path:
        run_dir = out / "pretrain" / f"{task}-{family}"
        if not (run_dir / "release" / "config.json").is_file():
            cmd = pretrain_cmd(task, family, shard_dir, run_dir, scale)
            _run(cmd, out / "logs" / f"pretrain-{task}-{family}.log", threads)
        return run_dir / "release"

    def finetune(task: str, family: str, init: Path | None) -> dict[str, Any]:
        kind = "scratch" if init is None else "self-pretrained"
        run_dir = out / "finetune" / f"{task}-{family}-{kind}"
        steps = eval_steps(task, scale)
        if not _done(run_dir, seeds, steps):
            cmd = finetune_cmd(task, family, data[task], run_dir, seeds, scale, init)
            _run(cmd, out / "logs" / f"finetune-{task}-{family}-{kind}.log", threads)
        row = {"task": task, "family": family, "init": kind}
        return {**row, **summarise_runs(run_dir, seeds, steps), "run_dir": str(run_dir)}

    with ThreadPoolExecutor(jobs) as pool:
        shard_dirs = dict(zip(tasks, pool.map(shards, tasks)))
        pairs = [(t, f) for t in tasks for f in families]
        # Scratch runs and pretraining runs are independent: interleave them.
        scratch = [pool.submit(finetune, t, f, None) for t, f in pairs]
        releases = {(t, f): pool.submit(pretrain, t, f, shard_dirs[t]) for t, f in pairs}
        pretrained = [
            pool.submit(lambda t=t, f=f: finetune(t, f, releases[(t, f)].result()))
            for t, f in pairs
        ]
        rows = [x.result() for x in scratch] + [x.result() for x in pretrained]
    add_intervals(out, rows, found)
    minutes = (time.perf_counter() - start) / 60
    write_results(out, rows, found, scale, seeds, minutes)
    return rows


# ----------------------------------------------------------------------------- intervals

REFERENCE = "softmax"
"""The family every other is compared with in the intervals."""


def add_intervals(out: Path, rows: list[dict[str, Any]], found: dict[str, Any]) -> None:
    """Adds ``row["intervals"]`` to every row: 95 % bootstrap intervals (`finetune.compare`:
    paired over the test examples, resampling seeds) of its test accuracy, of its difference
    from the task's best shortcut baseline, from the same init of `REFERENCE`, and, for a
    self-pretrained row, from the same family's scratch row (the gain)."""
    from finetune.compare import bootstrap_difference, load_seeds
    from finetune.lra.baselines import shortcut

    preds = {}
    for r in rows:
        seeds = [Path(r["run_dir"]) / f"seed_{s}" for s in r["seeds"]]
        try:  # the test predictions after the last step: what the table reports
            preds[(r["task"], r["family"], r["init"])] = load_seeds(seeds, "test", "last")
        except FileNotFoundError:  # runs reused from an older version: no intervals for them
            r["intervals"] = {}
    for r in rows:
        task, family, init = r["task"], r["family"], r["init"]
        if (task, family, init) not in preds:
            continue
        mine, labels = preds[(task, family, init)]
        others = {"accuracy": None}
        if task in found:
            base_labels, base = baseline_predictions(out, task)
            if not np.array_equal(base_labels, labels):
                raise ValueError(f"{task}: the baselines were scored on another test set")
            others["vs_shortcut"] = base[shortcut(found[task])[0]]
        if family != REFERENCE and (task, REFERENCE, init) in preds:
            others[f"vs_{REFERENCE}"] = preds[(task, REFERENCE, init)][0]
        if init == "self-pretrained" and (task, family, "scratch") in preds:
            others["gain"] = preds[(task, family, "scratch")][0]
        r["intervals"] = {
            name: bootstrap_difference(labels, mine, other).to_dict()
            for name, other in others.items()
        }


def interval_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: each row's test accuracy and differences with their 95 % intervals."""
    from finetune.compare import Interval, format_interval

    columns = [("accuracy", "test accuracy (mean)"), ("vs_shortcut", "− shortcut"),
               (f"vs_{REFERENCE}", f"− {REFERENCE}"), ("gain", "self-pretraining gain")]  # fmt: skip
    lines = ["| task | model | init | " + " | ".join(title for _, title in columns) + " |"]
    lines.append("|---" * (3 + len(columns)) + "|")
    for r in rows:
        cells = []
        for key, _ in columns:
            found = r.get("intervals", {}).get(key)
            iv = None if found is None else Interval(**found)
            cells.append("" if iv is None else format_interval(iv, signed=key != "accuracy"))
        lines.append(f"| {r['task']} | {r['family']} | {r['init']} | " + " | ".join(cells) + " |")
    old = [f"{r['task']} {r['family']} {r['init']}" for r in rows if r.get("intervals") == {}]
    note = (
        f"\nNo predictions saved (runs from an older version): {', '.join(old)}.\n" if old else ""
    )
    return "\n".join(lines) + "\n" + note


# ----------------------------------------------------------------------------- tables

BASELINE_LABELS = {
    "majority": "majority class",
    "first_token": "first-operator rule",
    "bag_of_tokens": "bag-of-tokens",
    "bag_of_words": "bag-of-words (reference)",
}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def table(rows: list[dict[str, Any]], found: dict[str, dict[str, float]] | None = None) -> str:
    """Markdown: the baselines, then each family and init: test accuracy after the last step
    (median over seeds ± half the spread), its distance to the task's best shortcut baseline,
    and the self-pretraining gain (self-pretrained - scratch medians)."""
    from finetune.lra.baselines import shortcut

    found = found or {}
    by = {(r["task"], r["family"], r["init"]): r for r in rows}
    tasks = list(dict.fromkeys([*found, *(r["task"] for r in rows)]))
    families = list(dict.fromkeys(r["family"] for r in rows))
    head = "| model | init | " + " | ".join(f"{t} | {t} − shortcut | {t} gain" for t in tasks)
    lines = [head + " | average |", "|---" * (2 + 3 * len(tasks) + 1) + "|"]
    names = [n for n in BASELINE_LABELS if any(n in found.get(t, {}) for t in tasks)]
    for name in names:
        cells = []
        for t in tasks:
            value = found.get(t, {}).get(name)
            cells += ["–" if value is None else _pct(value), "", ""]
        lines.append(f"| {BASELINE_LABELS[name]} | baseline | " + " | ".join(cells) + " | |")
    for f in families:
        for kind in ("scratch", "self-pretrained"):
            cells, medians = [], []
            for t in tasks:
                r = by.get((t, f, kind))
                if r is None:
                    cells += ["–", "–", "–"]
                    continue
                medians.append(r["median"])
                cells.append(f"{_pct(r['median'])} ± {50 * r['spread']:.1f}")
                cells.append(
                    f"{100 * (r['median'] - shortcut(found[t])[1]):+.1f}" if t in found else "–"
                )
                base = by.get((t, f, "scratch"))
                gain = kind == "self-pretrained" and base is not None
                cells.append(f"{100 * (r['median'] - base['median']):+.1f}" if gain else "")
            average = _pct(statistics.mean(medians)) if len(medians) == len(tasks) else "–"
            lines.append(f"| {f} | {kind} | " + " | ".join(cells) + f" | {average} |")
    return "\n".join(lines) + "\n"


def curve_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: median test accuracy over seeds at every evaluated step, per task, family and
    init (one block per task: the tasks' steps differ)."""
    blocks = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        steps = mine[0]["curve"]["steps"]
        lines = [f"| {task}: step | " + " | ".join(map(str, steps)) + " |"]
        lines.append("|---" * (1 + len(steps)) + "|")
        for r in mine:
            values = " | ".join(_pct(x) for x in r["curve"]["test_median"])
            lines.append(f"| {r['family']}, {r['init']} | {values} |")
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def write_results(
    out: Path,
    rows: list[dict[str, Any]],
    found: dict[str, dict[str, float]],
    scale: Scale,
    seeds: Sequence[int],
    minutes: float,
) -> None:
    from finetune.lra.baselines import shortcut

    tasks = list(dict.fromkeys([*found, *(r["task"] for r in rows)]))
    budget = ", ".join(
        f"{t}: {scale.steps(t)} fine-tuning steps of 32 (self-pretraining "
        f"{scale.steps(t, 'pretrain')} masked-LM steps first)"
        for t in tasks
    )
    note = (
        f"\nTest accuracy in %, median over seeds {list(seeds)} ± half the spread (max − min), "
        f"after the last fine-tuning step (no selection on val or test). The same step budget "
        f"for every family: {budget}. Baselines: fit on train, scored on test "
        f"(`finetune.lra.baselines`). `− shortcut`: the median minus the best of the "
        f"majority class, the first-operator rule and bag-of-tokens (bag-of-words uses a word "
        f"tokenizer no model has: a reference, not a shortcut). Gain: self-pretrained minus "
        f"scratch. {minutes:.1f} min in all.\n"
    )
    curves = (
        "\nLearning curves: test accuracy (%, median over seeds) after each number of "
        "fine-tuning steps.\n\n" + curve_table(rows)
    )
    intervals = (
        "\nWhat the table can tell apart: the mean over seeds with a 95 % bootstrap interval "
        "(over the test examples, paired between the two sides, and over each side's seeds; "
        "`finetune.compare`), in points; `*`: the interval excludes 0.\n\n" + interval_table(rows)
    )
    (out / "results.md").write_text(table(rows, found) + note + intervals + curves)
    shortcuts = {t: dict(zip(("name", "accuracy"), shortcut(b))) for t, b in found.items()}
    (out / "results.json").write_text(
        json.dumps(
            {
                "scale": scale.to_dict(),
                "seeds": list(seeds),
                "minutes": minutes,
                "baselines": found,
                "shortcut": shortcuts,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m finetune.lra.mini",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="runs/mini-lra")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument(
        "--families",
        nargs="+",
        default=list(FAMILIES),
        choices=list(FAMILY_OVERRIDES),
        help="tisa-nopos: TISA without absolute positions (ablation; not in the default set)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--scale", default="table", choices=list(SCALES))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        run(out, args.tasks, args.families, args.seeds, SCALES[args.scale], args.jobs)
    except (RuntimeError, ValueError, FileExistsError) as e:
        print(f"python -m finetune.lra.mini: {e}", file=sys.stderr)
        return 1
    print((out / "results.md").read_text())
    print(f"results: {out / 'results.md'}, {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    from engine.process_exit import exit_process

    exit_process(main())
