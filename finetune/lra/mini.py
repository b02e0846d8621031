"""The CPU mini-LRA: each attention family from scratch and self-pretrained, on short ListOps and
a synthetic byte-level Text task, several seeds; the table goes to BENCHMARKS.md.

    python -m finetune.lra.mini --out runs/mini-lra                       # the whole table
    python -m finetune.lra.mini --out runs/x --tasks listops --families softmax --seeds 0

Every stage is the project's real command line, run as a subprocess:

    1. data: ``python -m data_prep listops`` (short ListOps, official TSV format) and
       `finetune.lra.synthetic` (an aclImdb-layout byte-level sentiment task);
    2. ``python -m finetune lra-shards``: each task's training inputs as pretraining shards;
    3. ``python -m pretrain --config configs/pretrain/debug-lra-<task>.yaml``: masked-LM
       self-pretraining of each family on those inputs (a release at the end);
    4. ``python -m finetune lra --config configs/finetune/lra/debug-<task>.yaml [--init
       release] --seeds ...``: fine-tuning from scratch and from the release, same steps,
       same seeds, evaluated once, after the last step (no selection on val/test).

Independent runs go ``--jobs`` at a time (default 2, one CPU thread each). Finished runs are
reused when the command is run again. Writes <out>/results.json and <out>/results.md.
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("listops", "text")
FAMILIES = ("softmax", "tisa", "kernel", "transject")

FAMILY_OVERRIDES: dict[str, list[str]] = {
    "softmax": [],
    # as configs/pretrain/debug-<family>.yaml
    "tisa": ["model.attention=tisa", "model.position_embedding=none", "model.tisa.num_kernels=5"],
    "kernel": ["model.attention=kernel", "model.kernel.feature_map=aoglu"],
    "transject": ["model.attention=transject", "model.transject.num_experts=2"],
}


@dataclass(frozen=True)
class Scale:
    """Sizes of one mini-LRA (the table's, or a smaller one for the main job and tests)."""

    listops: tuple[int, int, int] = (4000, 500, 500)
    """ListOps train / val / test examples."""
    listops_length: tuple[int, int] = (50, 150)
    """ListOps min / max length (exclusive)."""
    text: tuple[int, int] = (2000, 500)
    """Synthetic Text train / test examples (val is test, as in LRA)."""
    text_words: tuple[int, int] = (6, 12)
    """Synthetic Text neutral words per review (min, max): at most 150 bytes with the cues."""
    pretrain_steps: int = 300
    finetune_steps: int = 400


SCALES = {
    "table": Scale(),
    "main": Scale(listops=(3000, 300, 300), text=(1000, 300)),
    "tiny": Scale(
        listops=(200, 50, 50),
        listops_length=(20, 60),
        text=(200, 50),
        pretrain_steps=8,
        finetune_steps=8,
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


def make_data(out: Path, scale: Scale, threads: int) -> dict[str, Path]:
    """The two tasks' data directories (reused when present)."""
    from finetune.lra.synthetic import write_synthetic_imdb

    listops = out / "data" / "listops"
    if not (listops / "basic_test.tsv").is_file():
        train, val, test = scale.listops
        lo, hi = scale.listops_length
        cmd = [sys.executable, "-m", "data_prep", "listops", "--out", str(listops)]
        cmd += ["--train", str(train), "--val", str(val), "--test", str(test)]
        cmd += ["--min-length", str(lo), "--max-length", str(hi), "--overwrite", "--quiet"]
        _run(cmd, out / "logs" / "data-listops.log", threads)
    text = out / "data" / "text"
    if not (text / "aclImdb").is_dir():
        lo, hi = scale.text_words
        write_synthetic_imdb(text, *scale.text, min_words=lo, max_words=hi)
    return {"listops": listops, "text": text / "aclImdb"}


def max_length(task: str, scale: Scale) -> int:
    """Data tokens per document: ListOps' upper length bound; for Text, room for the longest
    review (15 words of at most 9 letters and a space)."""
    return scale.listops_length[1] if task == "listops" else 10 * (scale.text_words[1] + 3)


def pretrain_cmd(task: str, family: str, shards: Path, run_dir: Path, scale: Scale) -> list[str]:
    cmd = [sys.executable, "-m", "pretrain", "--config"]
    cmd += [str(ROOT / "configs" / "pretrain" / f"debug-lra-{task}.yaml")]
    cmd += [f"data.shards={shards}", f"train.run_dir={run_dir}", "train.progress=false"]
    cmd += [f"data.max_seq_length={max_length(task, scale) + 1}"]
    cmd += [f"schedule.total_steps={scale.pretrain_steps}"]
    cmd += [f"schedule.warmup_steps={scale.pretrain_steps // 10}", *FAMILY_OVERRIDES[family]]
    return cmd


def finetune_cmd(
    task: str,
    family: str,
    data: Path,
    run_dir: Path,
    seeds: Sequence[int],
    scale: Scale,
    init: Path | None,
) -> list[str]:
    steps = scale.finetune_steps
    cmd = [sys.executable, "-m", "finetune", "lra", "--task", task, "--data", str(data)]
    cmd += ["--config", str(ROOT / "configs" / "finetune" / "lra" / f"debug-{task}.yaml")]
    if init is not None:
        cmd += ["--init", str(init)]
    cmd += [f"seeds=[{','.join(map(str, seeds))}]"]
    cmd += [f"run_dir={run_dir}", f"data.max_length={max_length(task, scale)}"]
    cmd += [f"schedule.total_steps={steps}", f"schedule.warmup_steps={steps // 10}"]
    cmd += [f"train.eval_every={steps}"]
    if init is None:  # a release carries its own model config
        cmd += FAMILY_OVERRIDES[family]
    return cmd


def _done(run_dir: Path, seeds: Sequence[int]) -> bool:
    path = run_dir / "results.json"
    if not path.is_file():
        return False
    return sorted(r["seed"] for r in json.loads(path.read_text())["runs"]) == sorted(seeds)


def run(
    out: Path,
    tasks: Sequence[str],
    families: Sequence[str],
    seeds: Sequence[int],
    scale: Scale,
    jobs: int = 2,
) -> list[dict[str, Any]]:
    """Runs (or reuses) everything; returns one row per task x family x init."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    start = time.perf_counter()
    data = make_data(out, scale, threads)

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
        if not _done(run_dir, seeds):
            cmd = finetune_cmd(task, family, data[task], run_dir, seeds, scale, init)
            _run(cmd, out / "logs" / f"finetune-{task}-{family}-{kind}.log", threads)
        runs = json.loads((run_dir / "results.json").read_text())["runs"]
        tests = [r["test_accuracy"] for r in runs]
        return {
            "task": task,
            "family": family,
            "init": kind,
            "seeds": [r["seed"] for r in runs],
            "test_accuracy": tests,
            "median": statistics.median(tests),
            "spread": max(tests) - min(tests),
            "run_dir": str(run_dir),
        }

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
    minutes = (time.perf_counter() - start) / 60
    write_results(out, rows, scale, seeds, minutes)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: test accuracy (median over seeds, spread) per task, family and init."""
    by = {(r["task"], r["family"], r["init"]): r for r in rows}
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    families = list(dict.fromkeys(r["family"] for r in rows))
    head = "| family | " + " | ".join(
        f"{t} scratch | {t} self-pretrained | {t} gain" for t in tasks
    )
    lines = [head + " | average scratch | average self-pretrained |"]
    lines.append("|---" * (1 + 3 * len(tasks) + 2) + "|")
    for f in families:
        cells, avg = [], {"scratch": [], "self-pretrained": []}
        for t in tasks:
            got = {k: by.get((t, f, k)) for k in ("scratch", "self-pretrained")}
            for k, r in got.items():
                cells.append(
                    "–" if r is None else f"{100 * r['median']:.1f} ± {50 * r['spread']:.1f}"
                )
                if r is not None:
                    avg[k].append(r["median"])
            if all(got.values()):
                gain = got["self-pretrained"]["median"] - got["scratch"]["median"]
                cells.append(f"{100 * gain:+.1f}")
            else:
                cells.append("–")
        for k in ("scratch", "self-pretrained"):
            cells.append(f"{100 * statistics.mean(avg[k]):.1f}" if avg[k] else "–")
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(
    out: Path, rows: list[dict[str, Any]], scale: Scale, seeds: Sequence[int], minutes: float
) -> None:
    body = table(rows)
    note = (
        f"\nTest accuracy in %, median over seeds {list(seeds)} ± half the spread (max - min); "
        f"evaluated once after {scale.finetune_steps} fine-tuning steps. Self-pretrained: "
        f"{scale.pretrain_steps} masked-LM steps on the task's training inputs first. "
        f"{minutes:.1f} min in all.\n"
    )
    (out / "results.md").write_text(body + note)
    (out / "results.json").write_text(
        json.dumps(
            {"scale": scale.__dict__, "seeds": list(seeds), "minutes": minutes, "rows": rows},
            indent=2,
            default=list,
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
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--scale", default="table", choices=sorted(SCALES))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        rows = run(out, args.tasks, args.families, args.seeds, SCALES[args.scale], args.jobs)
    except (RuntimeError, ValueError, FileExistsError) as e:
        print(f"python -m finetune.lra.mini: {e}", file=sys.stderr)
        return 1
    print(table(rows))
    print(f"results: {out / 'results.md'}, {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
