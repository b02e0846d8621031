"""SIGKILL a run again and again at random moments; after each kill, check that the run
directory holds a loadable checkpoint; then let the run finish and compare it with an
uninterrupted run of the same command.

    python -m bench.bench_kill_resume --stage finetune --kills 20      # LRA ListOps, tiny
    python -m bench.bench_kill_resume --stage pretrain --kills 20      # debug recipe, tiny

A quarter of the kills land during start-up (imports, the resume, the first steps), the rest
1 to 15 steps into training at a random moment inside a step: a training step, an evaluation,
the writing of the best release or of a checkpoint (one every 5 steps). "loadable" means ``CheckpointStore.resolve()`` returns a checkpoint
whose files pass their size and checksum checks and whose rank state loads; a kill before the
first checkpoint leaves none (counted apart: the re-run starts fresh, which is correct).
Writes bench/results/kill_resume_<stage>_cpu.json. A benchmark, not a test: it takes minutes.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from bench.bench_loader import make_data
from bench.common import ROOT as REPO
from bench.common import subprocess_env, write_result
from engine.checkpoint import CheckpointStore, load_rank_state

CHECKPOINT_EVERY = 5

TINY = [
    "model.hidden_size=32",
    "model.embedding_size=32",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "model.hidden_dropout_prob=0.1",
    "engine.precision=fp32",
    "engine.backend=torch",
]


def _env() -> dict[str, str]:
    env = subprocess_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def finetune_setup(root: Path, steps: int) -> tuple[list[str], Path, Path]:
    from data_prep.listops import write_splits

    data = root / "listops"
    write_splits(data, {"train": 256, "val": 48, "test": 48}, min_length=5, max_length=30, seed=0)

    def command(run_dir: Path) -> list[str]:
        return [
            sys.executable, "-m", "finetune", "lra", "--task", "listops", "--data", str(data),
            *TINY, "engine.micro_batch_size=8", f"schedule.total_steps={steps}",
            "schedule.warmup_steps=5", "train.eval_every=10", f"train.checkpoint_every={CHECKPOINT_EVERY}",
            "train.log_every=1", "data.max_length=40", f"train.run_dir={run_dir}",
        ]  # fmt: skip

    return (
        command,
        Path("seed_0/checkpoints"),
        Path("seed_0/best/model.safetensors"),
        Path("seed_0/results.json"),
        Path("seed_0/tensorboard/metrics.jsonl"),
    )


def pretrain_setup(root: Path, steps: int):
    _, shards = make_data(root / "data", {32}, _env(), vocab_size=300)

    def command(run_dir: Path) -> list[str]:
        return [
            sys.executable, "-m", "pretrain", "--config", str(REPO / "configs/pretrain/debug.yaml"),
            *TINY, "model.num_hidden_layers=2", "model.max_position_embeddings=32",
            f"data.shards={shards[32]}", "data.max_seq_length=32", "data.num_workers=0",
            "engine.micro_batch_size=4", "engine.zero_stage=0", "optimizer.name=adamw",
            "optimizer.lr=0.003", "schedule.warmup_steps=2", "schedule.total_steps=1000",
            f"train.steps={steps}", f"train.checkpoint_every={CHECKPOINT_EVERY}", "train.log_every=1",
            "train.progress=false", f"train.run_dir={run_dir}",
        ]  # fmt: skip

    # A finished pretraining run keeps its checkpoints: "finished" never applies.
    return (
        command,
        Path("checkpoints"),
        Path("release/model.safetensors"),
        Path("no-such-file"),
        Path("tensorboard/metrics.jsonl"),
    )


def _logged_step(metrics: Path) -> int:
    """The last step in a metrics.jsonl (0 before it exists); a line being written is skipped."""
    if not metrics.is_file():
        return 0
    last = 0
    for line in metrics.read_text().splitlines():
        try:
            last = max(last, int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            continue
    return last


def loadable(store_root: Path, finished_file: Path) -> str:
    """'yes' (with the step), 'finished' (the run completed and discarded its checkpoints
    before the kill landed), 'none yet' or 'NO: reason'."""
    if not store_root.exists() and finished_file.is_file():
        return "finished"
    store = CheckpointStore(store_root)
    try:
        found = store.resolve(loader=lambda path: load_rank_state(path, 0))
    except Exception as e:  # reported: it is the measurement
        return f"NO: {type(e).__name__}: {e}"
    if found is None:
        return "none yet"
    return f"yes: {found[0].name}"


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="albatross-kill-") as tmp:
        root = Path(tmp)
        setup = finetune_setup if args.stage == "finetune" else pretrain_setup
        command, store_rel, weights_rel, finished_rel, metrics_rel = setup(root, args.steps)
        reference = root / "reference"
        t0 = time.monotonic()
        proc = subprocess.run(command(reference), env=_env(), cwd=REPO, capture_output=True)
        uninterrupted_s = time.monotonic() - t0
        if proc.returncode != 0:
            raise SystemExit(proc.stderr.decode()[-3000:])
        killed = root / "killed"
        metrics = killed / metrics_rel
        outcomes = []
        while len(outcomes) < args.kills:
            start_step = _logged_step(metrics)
            p = subprocess.Popen(
                command(killed), env=_env(), cwd=REPO,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            started = time.monotonic()
            if rng.random() < args.startup_share:  # during start-up, resume or the first steps
                when = f"start-up +{rng.uniform(0.2, args.startup_s):.2f} s"
                target = started + float(when.split("+")[1].split()[0])
                while time.monotonic() < target and p.poll() is None:
                    time.sleep(0.02)
            else:  # while training: a random number of steps past where it started
                steps = rng.randint(1, 3 * args.checkpoint_every)
                when = f"{steps} steps in"
                while _logged_step(metrics) < start_step + steps and p.poll() is None:
                    time.sleep(0.01)
                time.sleep(rng.uniform(0.0, 0.3))  # anywhere inside the next step(s)
            if p.poll() is not None:
                break  # finished before the kill: enough kills happened
            p.kill()
            p.wait()
            found = loadable(killed / store_rel, killed / finished_rel)
            outcomes.append({"when": when, "checkpoint": found})
            print(f"kill {len(outcomes):2d} ({when}): {found}", flush=True)
        final = subprocess.run(command(killed), env=_env(), cwd=REPO, capture_output=True)
        if final.returncode != 0:
            raise SystemExit(final.stderr.decode()[-3000:])
        wa, wb = load_file(str(reference / weights_rel)), load_file(str(killed / weights_rel))
        max_diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
        same = sorted(wa) == sorted(wb) and max_diff <= 1e-6
        if args.stage == "finetune":
            ra = json.loads((reference / "seed_0/results.json").read_text())
            rb = json.loads((killed / "seed_0/results.json").read_text())
            same = same and ra["history"] == rb["history"] and ra["best_step"] == rb["best_step"]
    loaded = sum(o["checkpoint"].startswith("yes") for o in outcomes)
    none_yet = sum(o["checkpoint"] == "none yet" for o in outcomes)
    finished = sum(o["checkpoint"] == "finished" for o in outcomes)
    return {
        "stage": args.stage,
        "steps": args.steps,
        "kills": len(outcomes),
        "loadable_after_kill": loaded,
        "no_checkpoint_yet": none_yet,
        "after_the_run_finished": finished,
        "unusable": len(outcomes) - loaded - none_yet - finished,
        "final_equals_uninterrupted": same,
        "max_weight_difference": max_diff,
        "uninterrupted_seconds": round(uninterrupted_s, 1),
        "outcomes": outcomes,
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=("finetune", "pretrain"), default="finetune")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument(
        "--steps",
        type=int,
        help="total steps (default 1000: 20 kills of at most 15 steps each fit)",
    )
    parser.add_argument(
        "--startup-share", type=float, default=0.25, help="share of kills during start-up"
    )
    parser.add_argument(
        "--startup-s", type=float, default=6.0, help="start-up kills land in (0.2, this) s"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.checkpoint_every = CHECKPOINT_EVERY
    args.steps = args.steps or 1000
    report = run(args)
    out = args.out or REPO / "bench" / "results" / f"kill_resume_{args.stage}_cpu.json"
    write_result(out, report)
    print(
        f"{args.stage}: {report['kills']} SIGKILLs, {report['loadable_after_kill']} left a "
        f"loadable checkpoint, {report['no_checkpoint_yet']} came before the first one, "
        f"{report['after_the_run_finished']} after the run had finished, "
        f"{report['unusable']} left none usable; final run equals the uninterrupted one: "
        f"{report['final_equals_uninterrupted']} (max weight difference "
        f"{report['max_weight_difference']:.2e}); {out}"
    )


if __name__ == "__main__":
    main()
