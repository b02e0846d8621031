"""The main job, on the embedded corpus, CPU only, nothing downloaded:

    1. data_prep: a SentencePiece-unigram tokenizer and ALBERT sentence-pair shards made from
       the embedded corpus (CPython's own documentation text);
    2. pretraining of every attention family with the real DeepSpeed engine (ZeRO-2) on 2
       processes (``torchrun --standalone --nproc_per_node 2 -m pretrain --config
       configs/pretrain/debug[-<family>].yaml ...``): checkpoints, TensorBoard, a release;
    3. export: ``python -m pretrain.export`` of each run's final checkpoint, reloaded and
       checked against the run's own release;
    4. a summary: MLM loss first -> last, the held-out validation MLM loss (5% of the
       documents, evaluated every 50 steps), SOP accuracy, where the logs and releases are;
    5. LRA (``--lra-scale main``, the default; ``none`` skips it): generated short ListOps,
       self-pretraining of a softmax encoder on its training inputs (``python -m finetune
       lra-shards`` + ``python -m pretrain``), then fine-tuning from that release and from
       scratch, side by side (`finetune.lra.mini`, the CPU mini-LRA at a smaller scale).

    python -m main_job --out runs/main [--families softmax tisa] [--nproc 2]
        [--lra-scale main|tiny|none] [-- key=value ...]

Re-running reuses the tokenizer, the shards and finished runs (a finished run resumes at its
last step and stops at once). Exits 1 if a run failed or its MLM loss did not decrease.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from data_prep.format import TOKENIZER
from data_prep.shards import ShardConfig, build_shards
from data_prep.tokenizer import write_tokenizer
from engine.metrics import read_jsonl
from model import ATTENTION_REGISTRY
from model.release import load_release
from pretrain import export as export_cli

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "pretrain"
SEQ = 64


VALIDATION_FRACTION = 0.05
"""Share of the embedded corpus's documents held out as the validation split."""
VALIDATION = ["train.eval_every=50", "data.validation_batches=8"]
"""Every run's held-out evaluation: 8 fixed micro-batches per process every 50 steps."""


def recipe(family: str) -> Path:
    return CONFIGS / ("debug.yaml" if family == "softmax" else f"debug-{family}.yaml")


def prepare_data(out: Path, vocab_size: int) -> Path:
    tok = out / "data" / "tokenizer" / TOKENIZER
    if not tok.is_file():
        write_tokenizer(tok.parent, inputs=["embedded"], vocab_size=vocab_size)
    shards = out / "data" / "shards-val5"  # 5% of the documents held out for validation
    config = ShardConfig(
        inputs=("embedded",),
        num_shards=2,
        max_seq_length=SEQ,
        seed=0,
        validation_fraction=VALIDATION_FRACTION,
    )
    build_shards(config, tok, shards, workers=1)
    return shards


def pretrain(family: str, shards: Path, run_dir: Path, nproc: int, overrides: list[str]) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "pretrain",
        "--config",
        str(recipe(family)),
        f"data.shards={shards}",
        f"train.run_dir={run_dir}",
        "train.progress=false",
        *VALIDATION,
        *overrides,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    return subprocess.run(cmd, env=env).returncode


def summarize(family: str, run_dir: Path, out: Path) -> dict:
    rows = read_jsonl(run_dir / "tensorboard")
    logged = [rows[s] for s in sorted(rows) if "loss/mlm" in rows[s]]
    status = json.loads((run_dir / "status.json").read_text())
    release = out / "releases" / family
    export_cli.export(run_dir, release, overwrite=True)
    exported, own = load_release(release), load_release(run_dir / "release")
    same = all(torch.equal(v, own.state_dict()[k]) for k, v in exported.state_dict().items())
    return {
        "family": family,
        "state": status["state"],
        "steps": status["step"],
        "mlm_loss_first": logged[0]["loss/mlm"],
        "mlm_loss_last": logged[-1]["loss/mlm"],
        "sop_accuracy_last": logged[-1]["accuracy/sop"],
        "validation_mlm_loss": (status.get("validation") or {}).get("eval/loss/mlm"),
        "validation_mlm_accuracy": (status.get("validation") or {}).get("eval/accuracy/mlm"),
        "validation_sop_accuracy": (status.get("validation") or {}).get("eval/accuracy/sop"),
        "tokens_per_s": logged[-1]["throughput/tokens_per_s"],
        "skipped_steps": status["skipped_steps"],
        "tensorboard": str(run_dir / "tensorboard"),
        "release": str(release),
        "export_matches_run": same,
    }


def lra_stage(out: Path, scale: str) -> list[str]:
    """Self-pretrained vs from-scratch softmax encoder on generated ListOps; [] or a failure."""
    from finetune.lra import mini

    start = time.perf_counter()
    print("\nLRA: generated ListOps, self-pretraining -> fine-tuning vs from scratch", flush=True)
    try:
        rows = mini.run(out, ["listops"], ["softmax"], [0], mini.SCALES[scale], jobs=2)
    except (RuntimeError, ValueError) as e:
        print(f"LRA stage failed: {e}", file=sys.stderr)
        return ["lra"]
    from finetune.compare import Interval, format_interval

    for r in rows:
        line = f"  ListOps test accuracy, {r['init']:<15} {100 * r['median']:5.1f} %"
        if "accuracy" in r["intervals"]:  # not for runs reused from before predictions were saved
            own = Interval(**r["intervals"]["accuracy"])
            line += f" (95% interval {100 * own.low:.1f}-{100 * own.high:.1f})"
        print(line)
        if "gain" in r["intervals"]:
            gain = Interval(**r["intervals"]["gain"])
            verdict = "told apart" if gain.excludes_zero else "within chance: not told apart"
            print(
                f"  self-pretraining gain {format_interval(gain).rstrip(' *')} points ({verdict})"
            )
    print(
        f"  (chance: the most frequent class, about 17-20 %; {out / 'results.md'}; "
        f"{time.perf_counter() - start:.0f} s)"
    )
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m main_job",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="runs/main", help="directory for everything it writes")
    parser.add_argument("--families", nargs="+", default=ATTENTION_REGISTRY.names())
    parser.add_argument("--nproc", type=int, default=2, help="processes (ranks) per run")
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument(
        "--lra-scale",
        default="main",
        choices=("main", "tiny", "none"),
        help="size of the LRA stage (none: skip it)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="extra dotted overrides for every pretraining run, e.g. train.steps=20",
    )
    args = parser.parse_args(argv)
    unknown = [f for f in args.families if f not in ATTENTION_REGISTRY]
    if unknown:
        parser.error(f"unknown families {unknown}; valid: {ATTENTION_REGISTRY.names()}")
    out = Path(args.out)
    start = time.perf_counter()
    shards = prepare_data(out, args.vocab_size)
    manifest = json.loads((shards / "manifest.json").read_text())
    print(
        f"data_prep: {manifest['totals']['examples']} examples, {manifest['totals']['tokens']} "
        f"tokens, vocab {manifest['vocab_size']}, in {shards} ({time.perf_counter() - start:.1f} s)"
    )
    rows, failed = [], []
    for family in args.families:
        run_dir = out / "pretrain" / family
        rc = pretrain(family, shards, run_dir, args.nproc, args.overrides)
        if rc != 0:
            failed.append(f"{family} (exit code {rc})")
            continue
        row = summarize(family, run_dir, out)
        rows.append(row)
        if not row["mlm_loss_last"] < row["mlm_loss_first"]:
            failed.append(f"{family} (MLM loss did not decrease)")
        if not row["export_matches_run"]:
            failed.append(f"{family} (exported release differs from the run's)")
    print(
        f"\n{'family':<10} {'steps':>5} {'mlm first':>9} {'mlm last':>9} {'val mlm':>8} "
        f"{'sop acc':>7} {'tok/s':>8}"
    )
    for r in rows:
        val = r["validation_mlm_loss"]
        print(
            f"{r['family']:<10} {r['steps']:>5} {r['mlm_loss_first']:>9.3f} "
            f"{r['mlm_loss_last']:>9.3f} {'-' if val is None else f'{val:.3f}':>8} "
            f"{r['sop_accuracy_last']:>7.2f} {r['tokens_per_s']:>8.0f}"
        )
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    if args.lra_scale != "none":
        failed += lra_stage(out / "lra", args.lra_scale)
    print(
        f"\nTensorBoard: tensorboard --logdir {out / 'pretrain'}\n"
        f"releases:    {out / 'releases'}/<family> (config.json, model.safetensors, tokenizer.json)\n"
        f"summary:     {out / 'summary.json'}"
        + (f", {out / 'lra' / 'results.md'}" if args.lra_scale != "none" else "")
        + f"  ({time.perf_counter() - start:.0f} s in all)"
    )
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from engine.process_exit import exit_process

    exit_process(main())
