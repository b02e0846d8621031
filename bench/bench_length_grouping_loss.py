"""Does `data.group_by_length` change what pretraining learns? Same recipe, same data, same
seeds, grouping off and on: the held-out MLM loss along the run (`eval/loss/mlm`, the
validation split of the shards, the same examples and masks at every evaluation).

Shards and tokenizer are made here from the embedded corpus with the real CLI (documents held
out with `--validation-fraction`); each run is `python -m pretrain` (one process, the debug
recipe's DeepSpeed engine) at `--seq` tokens, micro-batch `--batch`, `--steps` steps,
evaluated every `--eval-every`; with grouping the chunk is the micro-batch (one process) and
the window `--window`. Prints one row per (grouping, seed) and the mean final loss of each.

    python bench/bench_length_grouping_loss.py --out bench/results/length_grouping_loss_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_loader  # noqa: E402  (the real CLI, as bench_loader runs it)


def make_data(root: Path, seq: int) -> Path:
    """Shards of the embedded corpus, 10% of its documents held out (bench_loader's maker)."""
    _, shards = bench_loader.make_data(
        root, {seq}, dict(os.environ), vocab_size=2000, shard_args=("--validation-fraction", "0.1")
    )
    return shards[seq]


def run(shards: Path, run_dir: Path, args, seed: int, grouped: bool) -> dict:
    overrides = [
        f"data.shards={shards}",
        f"data.max_seq_length={args.seq}",
        f"model.max_position_embeddings={args.seq}",
        f"engine.micro_batch_size={args.batch}",
        "engine.zero_stage=0",
        f"train.steps={args.steps}",
        f"schedule.total_steps={args.steps}",
        f"train.eval_every={args.eval_every}",
        "data.validation_batches=1000",  # the whole held-out split
        f"train.seed={seed}",
        f"train.run_dir={run_dir}",
        "train.checkpoint_every=0",
        "train.diagnostics_every=0",
        "train.export_at_end=false",
        "train.progress=false",
    ]
    if grouped:
        overrides += [
            "data.group_by_length=true",
            f"data.group_by_length_window={args.window}",
            f"data.group_by_length_chunk={args.batch}",
        ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, "-m", "pretrain", "--config", "configs/pretrain/debug.yaml", *overrides],
        check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    from engine.metrics import read_jsonl

    rows = read_jsonl(run_dir / "tensorboard")
    curve = {s: r["eval/loss/mlm"] for s, r in sorted(rows.items()) if "eval/loss/mlm" in r}
    return {"seed": seed, "grouped": grouped, "eval_mlm": curve}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=150)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shards = make_data(Path(tmp), args.seq)
        for seed in args.seeds:
            for grouped in (False, True):
                row = run(shards, Path(tmp) / f"run-{seed}-{int(grouped)}", args, seed, grouped)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\nheld-out MLM loss, seq {args.seq}, batch {args.batch}, {args.steps} steps:")
    print("| grouping | " + " | ".join(f"step {s}" for s in rows[0]["eval_mlm"]) + " |")
    print("|---|" + "---|" * len(rows[0]["eval_mlm"]))
    for grouped in (False, True):
        mine = [r["eval_mlm"] for r in rows if r["grouped"] == grouped]
        means = [statistics.mean(c[s] for c in mine) for s in mine[0]]
        spread = [max(c[s] for c in mine) - min(c[s] for c in mine) for s in mine[0]]
        cells = " | ".join(f"{m:.3f} (±{d / 2:.3f})" for m, d in zip(means, spread))
        print(f"| {'on' if grouped else 'off'} | {cells} |")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "runs": rows}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
