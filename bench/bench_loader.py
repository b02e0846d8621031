"""Loader vs training step: is the data loader ever the bottleneck?

1. Data: a tokenizer and ALBERT shards made from the embedded corpus by the real CLI
   (``python -m data_prep tokenizer`` / ``python -m data_prep shards``, as scripts/main.sh and
   main_job/pipeline.py do), one shard directory per sequence length.
2. Loader throughput, alone: ``data_prep.loader.PretrainingLoader`` (dynamic MLM + SOP masking,
   collation, dynamic padding) at the config's batch size with ``num_workers`` in ``--workers``;
   the first ``--skip`` batches (worker start-up) are not timed, then batches/s over
   ``--batches`` batches.
3. Data-wait share in the real trainer: ``python -m pretrain`` (one process, DeepSpeed ZeRO-0,
   ``bf16-mixed`` on a GPU, ``train.time_split=true`` for the split) on those shards with the
   same ``num_workers``, ``--steps`` steps, logging every
   ``--log-every``; the trainer writes its time split (``time/data``, ``time/forward``,
   ``time/backward``, ``time/step``, ``time/step_total``) to ``metrics.jsonl``, read back with
   ``engine.metrics.read_jsonl``. The first logging window (start-up, first batches) is dropped;
   the share is sum(time/data) / sum(time/step_total) over the rest. ``time/data`` is the wait
   for the next batch plus its host -> device copy (synchronised on CUDA).

Headroom = loader batches/s (alone) x training step time: how many times faster the loader is
than the step consumes batches (> 1 means the loader keeps up even without overlap).

Configs: ``debug`` (configs/pretrain/debug.yaml: d=64, 4 layers, seq 64, batch 16), ``small``
(d=256, 4 layers, seq 128, batch 16), and for a GPU ``albert-base-128`` / ``albert-base-512``
(configs/pretrain/albert-base.yaml, batch 64, bf16-mixed, ZeRO-0).

    python -m bench.bench_loader --configs debug small --workers 0 2 --threads 1 --out bench/results/loader_cpu.json
    python -m bench.bench_loader --device cuda --configs albert-base-128 albert-base-512 --workers 2 4 --out loader_gpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, free_port, subprocess_env, write_result

SMALL_MODEL = [
    "model.hidden_size=256",
    "model.embedding_size=128",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=4",
    "model.intermediate_size=1024",
    "model.max_position_embeddings=128",
]
# name -> (recipe, seq, batch, extra overrides)
CONFIGS: dict[str, tuple[str, int, int, list[str]]] = {
    "debug": ("debug.yaml", 64, 16, []),
    "small": ("debug.yaml", 128, 16, SMALL_MODEL),
    "albert-base-128": ("albert-base.yaml", 128, 64, []),
    "albert-base-512": ("albert-base.yaml", 512, 64, []),
}


def make_data(
    work: Path, seqs: set[int], env: dict, vocab_size: int = 8000, shard_args: tuple = ()
) -> tuple[Path, dict[int, Path]]:
    """A tokenizer and shards per sequence length from the embedded corpus, with the real CLI
    (`shard_args`: more `data_prep shards` options, e.g. a validation split)."""
    py = sys.executable
    tok_dir = work / "tokenizer"
    subprocess.run(
        [py, "-m", "data_prep", "tokenizer", "--input", "embedded", "--out", str(tok_dir),
         "--vocab-size", str(vocab_size)],
        check=True, env=env, cwd=ROOT, capture_output=True,
    )  # fmt: skip
    shards = {}
    for seq in sorted(seqs):
        out = work / f"shards_{seq}"
        subprocess.run(
            [py, "-m", "data_prep", "shards", "--input", "embedded", "--tokenizer",
             str(tok_dir / "tokenizer.json"), "--out", str(out), "--num-shards", "2",
             "--max-seq-length", str(seq), *shard_args],
            check=True, env=env, cwd=ROOT, capture_output=True,
        )  # fmt: skip
        shards[seq] = out
    return tok_dir / "tokenizer.json", shards


def loader_throughput(shards: Path, seq: int, batch: int, workers: int, args) -> dict:
    from data_prep.loader import PretrainingData, PretrainingLoader

    data = PretrainingData(shards, max_seq_length=seq, seed=0)
    loader = PretrainingLoader(data, batch, num_workers=workers)
    it = iter(loader)
    for _ in range(args.skip):
        next(it)
    tokens = 0
    start = time.perf_counter()
    for _ in range(args.batches):
        b = next(it)
        tokens += int(b["attention_mask"].sum())
    seconds = time.perf_counter() - start
    del it  # stops the workers
    return {
        "batches_per_s": args.batches / seconds,
        "samples_per_s": args.batches * batch / seconds,
        "tokens_per_s": tokens / seconds,
        "examples_in_corpus": data.num_examples,
    }


def trainer_split(name: str, shards: Path, workers: int, work: Path, args, env: dict) -> dict:
    from engine.metrics import read_jsonl

    recipe, seq, batch, extra = CONFIGS[name]
    run_dir = work / f"run_{name}_w{workers}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        f"data.shards={shards}",
        f"data.max_seq_length={seq}",
        f"data.num_workers={workers}",
        f"engine.micro_batch_size={batch}",
        "engine.gradient_accumulation_steps=1",
        "engine.zero_stage=0",  # the recipes' engine: ZeRO-0, bf16-mixed on a GPU
        f"engine.device={args.device}",
        f"engine.precision={'bf16-mixed' if args.device == 'cuda' else 'fp32'}",
        "train.time_split=true",  # the forward / backward / step split (synchronised on a GPU)
        f"train.run_dir={run_dir}",
        f"train.steps={args.steps}",
        f"train.log_every={args.log_every}",
        "train.checkpoint_every=0",
        "train.diagnostics_every=0",
        "train.export_at_end=false",
        "train.progress=false",
        f"schedule.total_steps={max(args.steps, 1000)}",
        "schedule.warmup_steps=10",
        *extra,
        *args.override,
    ]
    cmd = [sys.executable, "-m", "pretrain", "--config", str(ROOT / "configs/pretrain" / recipe)]
    env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    start = time.perf_counter()
    res = subprocess.run(cmd + overrides, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if res.returncode != 0:
        raise RuntimeError(f"python -m pretrain failed ({res.returncode}): {res.stderr[-2000:]}")
    rows = read_jsonl(run_dir / "tensorboard")
    logged = [rows[s] for s in sorted(rows) if "time/step_total" in rows[s]]
    kept = logged[1:] if len(logged) > 1 else logged  # drop the start-up window
    total = sum(r["time/step_total"] for r in kept)
    parts = {
        k: sum(r[f"time/{k}"] for r in kept) / total
        for k in ("data", "forward", "backward", "step")
    }
    mfu = statistics.mean(r.get("throughput/mfu", math.nan) for r in kept)  # logged on GPUs
    return {
        "step_total_s": statistics.mean(r["time/step_total"] for r in kept),
        "data_s": statistics.mean(r["time/data"] for r in kept),
        "share": parts,
        "data_wait_share": parts["data"],
        "tokens_per_s": statistics.mean(r["throughput/tokens_per_s"] for r in kept),
        "mfu": mfu if math.isfinite(mfu) else None,
        "windows": len(kept),
        "wall_s": wall,
        "first_window_data_s": logged[0]["time/data"] if logged else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", default=["debug", "small"], choices=list(CONFIGS))
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument(
        "--runs", nargs="+", default=None, metavar="CONFIG:WORKERS",
        help="explicit (config, num_workers) pairs instead of --configs x --workers",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batches", type=int, default=40, help="timed loader batches")
    parser.add_argument("--skip", type=int, default=3, help="untimed loader batches first")
    parser.add_argument("--steps", type=int, default=40, help="trainer steps")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--no-trainer", action="store_true", help="loader throughput only")
    parser.add_argument(
        "--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")),
        help="intra-op threads of the trainer (OMP_NUM_THREADS) and of this process; on a "
        "shared CPU 1 avoids OpenMP oversubscription",
    )  # fmt: skip
    parser.add_argument("--override", nargs="*", default=[], help="extra trainer overrides")
    parser.add_argument("--workdir", type=Path, default=None, help="kept if given")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.runs:
        runs = [(r.split(":")[0], int(r.split(":")[1])) for r in args.runs]
        bad = [name for name, _ in runs if name not in CONFIGS]
        if bad:
            parser.error(f"unknown configs {bad}; valid: {list(CONFIGS)}")
    else:
        runs = [(c, w) for c in args.configs for w in args.workers]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_loader_"))
    work.mkdir(parents=True, exist_ok=True)
    env = subprocess_env(HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    try:
        t0 = time.perf_counter()
        _, shards = make_data(work, {CONFIGS[c][1] for c, _ in runs}, env)
        print(f"data_prep: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        for name, workers in runs:
            _, seq, batch, _ = CONFIGS[name]
            row: dict = {"config": name, "seq": seq, "batch": batch, "workers": workers}
            row["loader"] = loader_throughput(shards[seq], seq, batch, workers, args)
            if not args.no_trainer:
                try:
                    row["trainer"] = trainer_split(name, shards[seq], workers, work, args, env)
                    row["headroom"] = (
                        row["loader"]["batches_per_s"] * row["trainer"]["step_total_s"]
                    )
                except RuntimeError as e:
                    row["trainer"] = {"error": str(e)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            # what is done survives a kill of this process
            write_result(args.out, {"args": vars(args), "complete": False, "rows": rows})
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\n{where}, torch {torch.__version__}, {os.cpu_count()} CPUs, {args.threads} threads\n")
    print(
        "| config | workers | loader batches/s (alone) | trainer step (ms) | data wait (ms) | "
        "data-wait share | headroom |\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        t = r.get("trainer", {})
        if "step_total_s" in t:
            cells = (
                f"{t['step_total_s'] * 1e3:.1f} | {t['data_s'] * 1e3:.2f} | "
                f"{100 * t['data_wait_share']:.2f}% | {r['headroom']:.1f}x"
            )
        else:
            cells = "- | - | - | -"
        print(f"| {r['config']} | {r['workers']} | {r['loader']['batches_per_s']:.1f} | {cells} |")
    meta = {"threads": args.threads, "device": where}
    write_result(args.out, {"args": vars(args), "meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
