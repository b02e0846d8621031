"""The real trainer on a GPU under ``torch.cuda.set_sync_debug_mode("error")``: any host
synchronisation inside a training step that is not a logging step raises.

Each point is ``pretrain.train.Trainer`` itself (the shipped recipe ``configs/pretrain/
albert-base[-<family>].yaml``: DeepSpeed, ``bf16-mixed``, LAMB ``foreach``, the given ZeRO stage)
on small shards made here from the embedded corpus (sequences of ``--seq`` tokens, the tokenizer's
vocabulary), ``--steps`` steps logging every ``--log-every``. Sync debug mode is ``error`` from the
start of each step's iteration and off only for the logging (and final checkpoint) that follows
a logging step, so the steps between logging steps, with everything the loop does around them
(stop flags, counters), must not synchronise. Where the recipe compiles the encoder
(``engine.compile``), the steps up to the first logging step are its warm-up and run unchecked:
Inductor synchronises while it compiles (its pattern matcher initialises on the device), which
is not the training step's doing; every later step is checked, so a recompilation would fail.
``--warmup-steps`` sets that number for every point. CUDA's sync debug mode flags the calls
that wait for the device (``item``, ``.cpu()``, blocking copies, ``nonzero``, boolean-mask
indexing, ...).

One JSON row per point: ``ok``, the step time median over the non-logging steps (host clock,
for the record), and on failure the error and the innermost frames of its traceback.

    python bench/bench_host_syncs.py --device cuda --out syncs_gpu.json
    python bench/bench_host_syncs.py --device cuda --points zero0:softmax   # SMOKE

On the CPU the mode is not available; there it only runs the steps (a setup check). The CPU
test of the same property counts the calls instead: tests/test_host_syncs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_POINTS = (
    "zero0:softmax",
    "zero0:tisa",
    "zero0:kernel",
    "zero0:transject",
    "zero2:softmax",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_shards(root: Path, seq: int) -> Path:
    from data_prep.shards import ShardConfig, build_shards
    from data_prep.tokenizer import write_tokenizer

    write_tokenizer(root / "tokenizer", inputs=["embedded:200"], vocab_size=2000)
    cfg = ShardConfig(inputs=("embedded:200",), num_shards=1, max_seq_length=seq, seed=0)
    build_shards(cfg, root / "tokenizer" / "tokenizer.json", root / "shards", workers=1)
    return root / "shards"


def run_point(point: str, shards: Path, root: Path, args) -> dict:
    import torch

    import pretrain.train as train_module
    from engine.recipe import load_recipe
    from pretrain.config import pretrain_config

    stage, family = point.split(":")
    recipe = (
        ROOT
        / "configs/pretrain"
        / ("albert-base.yaml" if family == "softmax" else f"albert-base-{family}.yaml")
    )
    overrides = [
        f"data.shards={shards}",
        f"data.max_seq_length={args.seq}",
        "data.num_workers=0",
        "data.verify_checksums=false",
        f"engine.zero_stage={stage.removeprefix('zero')}",
        f"engine.device={args.device}",
        f"engine.micro_batch_size={args.batch}",
        "schedule.warmup_steps=5",
        "schedule.total_steps=1000",
        f"train.run_dir={root / point.replace(':', '-')}",
        f"train.steps={args.steps}",
        f"train.log_every={args.log_every}",
        "train.checkpoint_every=0",
        "train.diagnostics_every=0",
        "train.export_at_end=false",
        "train.progress=false",
        *args.override,
    ]
    trainer = train_module.Trainer(pretrain_config(load_recipe(recipe, overrides)))
    cuda = args.device == "cuda"
    total = trainer.cfg.total_steps
    step_fn = trainer._train_step
    times: list[float] = []
    warmup = args.warmup_steps
    if warmup is None:
        warmup = args.log_every if trainer.engine.compiled else 0

    def checked_step(*a, **k):
        number = trainer.step + 1
        if cuda and number > warmup:
            torch.cuda.set_sync_debug_mode("error")
        t0 = time.perf_counter()
        out = step_fn(*a, **k)
        logging = number % args.log_every == 0 or number == total
        if logging:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)  # the logging step reads, on purpose
        elif number > warmup:
            times.append(time.perf_counter() - t0)
        return out

    trainer._train_step = checked_step
    row: dict = {"point": point, "recipe": str(recipe.relative_to(ROOT))}
    try:
        result = trainer.run()
        row.update(ok=result.state == "completed", steps=result.step)
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)[-8:]
        row.update(
            ok=False,
            error=f"{type(e).__name__}: {e}"[:800],
            where=[f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames],
        )
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    row["compiled"] = trainer.engine.compiled
    row["unchecked_warmup_steps"] = warmup
    row["deferred_step"] = trainer.engine.deferred
    row["optimizer"] = type(trainer.engine.optimizer).__module__
    row["step_s_median"] = statistics.median(times) if times else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--points", nargs="+", default=list(DEFAULT_POINTS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--log-every", type=int, default=6)
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="steps run unchecked first (default: up to the first logging step where the "
        "encoder is compiled, none otherwise)",
    )
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--override", nargs="*", default=[], help="recipe overrides key=value")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards = make_shards(root / "data", args.seq)
        for point in args.points:
            row = run_point(point, shards, root, args)
            rows.append(row)
            status = "OK: no host sync between logging steps" if row["ok"] else "FAILED"
            print(f"syncs {point}: {status}", flush=True)
            if not row["ok"]:
                print("  " + row.get("error", "")[:400], flush=True)
                for frame in row.get("where", []):
                    print("    " + frame, flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"args": vars(args), "rows": rows}, default=str))
    print(f"syncs: {sum(r['ok'] for r in rows)}/{len(rows)} points passed in "
          f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
