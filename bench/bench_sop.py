"""Is sentence-order prediction (SOP) learned on the embedded corpus? Held-out accuracy vs steps.

1. Data, as the main job makes it (main_job/pipeline.py): a SentencePiece-unigram tokenizer
   (vocab 2000) trained on the whole embedded corpus (``data_prep.tokenizer.write_tokenizer``;
   unsupervised, it carries no order information), and ALBERT sentence-pair shards
   (``data_prep.shards.build_shards``: 2 shards, seed 0, the run's sequence length). The
   documents are split first, by document and deterministically: document d (``embedded``
   order) is held out when d % 4 == 3 (19 of 79 documents, 15 % of the text). Each part is
   written as JSONL (the JSONL reader splits a document into its lines exactly as the
   embedded reader does) and gets its own shard directory.
2. Shard variants (``--variants``): ``builder`` is the shard builder's default (ALBERT's
   random-end truncation, which cuts the A|B junction of 72 % of the 64-token pairs, median 4
   tokens); ``junction`` is ``data_prep shards --truncation junction`` (A loses its front, B
   its back, ``data_prep.format.truncated_pair_lengths``), which keeps it.
3. Training: ``python -m pretrain --config <recipe> ...`` (the project's CLI, one process,
   OMP_NUM_THREADS=1) on the training shards, a checkpoint (with its release) every
   ``eval_every`` steps; ``train.seed`` is the seed (weights, data order, masking).
4. Evaluation: every checkpoint's release (``model.hub.release.load_release``) in eval mode on
   ``[CLS] A [SEP] B [SEP]`` (label 0) and ``[CLS] B [SEP] A [SEP]`` (label 1) of every
   held-out pair, unmasked: both orders of every pair, so a constant prediction scores exactly
   0.5. A 95 % Wilson interval is given. The same on (up to) 1000 training pairs tells
   learning from memorising. "novel" pairs: those whose junction (8 tokens either side of the
   A|B boundary) occurs nowhere in the training tokens (some pydoc topics repeat others' text).

Settings (``--settings``):

* ``main-job``: configs/pretrain/debug.yaml as the main job runs it: d=64, 4 layers, 64-token
  pairs, lr 2e-3, 300 steps of 32 (the main job: 2 processes x 16, DeepSpeed ZeRO-2; here 1 x
  32, plain PyTorch, engine.backend=torch).
* ``sop-budget``: configs/pretrain/debug-sop.yaml: the same model on 32-token pairs, lr 1e-3,
  6000 steps of 32 (about 3 minutes).
* ``sop-long``: the same, 12000 steps (the linear decay stretched to match).
* ``sop-budget-64``: debug-sop.yaml on the main job's 64-token pairs, 6000 steps.

The figures in BENCHMARKS.md ("Sentence-order prediction"), in bench/results/sop_cpu.json:

    OMP_NUM_THREADS=1 python bench/bench_sop.py --settings main-job sop-budget \\
        --variants builder junction --seeds 1 2 3 --json bench/results/sop_cpu.json
    OMP_NUM_THREADS=1 python bench/bench_sop.py --settings sop-budget --variants builder \\
        junction --seeds 4 5 6 --json bench/results/sop_cpu.json --append
    OMP_NUM_THREADS=1 python bench/bench_sop.py --settings sop-long --variants builder \\
        --seeds 1 2 3 4 --json bench/results/sop_cpu.json --append
    OMP_NUM_THREADS=1 python bench/bench_sop.py --settings sop-budget-64 --variants builder \\
        --seeds 1 2 --json bench/results/sop_cpu.json --append
    OMP_NUM_THREADS=1 python bench/bench_sop.py --settings main-job sop-budget --variants \\
        builder junction --data-only --json bench/results/sop_cpu.json --append
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ROOT / "configs" / "pretrain"
HELD_OUT_MOD, HELD_OUT_REM = 4, 3
VOCAB = 2000
TRAIN_EVAL_PAIRS = 1000
JUNCTION = 8

# name -> (recipe, sequence length, steps, eval every, overrides on top of the recipe)
SETTINGS: dict[str, tuple[str, int, int, int, list[str]]] = {
    "main-job": (
        "debug.yaml",
        64,
        300,
        50,
        ["engine.backend=torch", "engine.zero_stage=0", "engine.micro_batch_size=32"],
    ),
    "sop-budget": ("debug-sop.yaml", 32, 6000, 500, []),
    # Twice the steps (the linear decay stretched to match).
    "sop-long": ("debug-sop.yaml", 32, 12000, 1000, []),
    # The same budget on the main job's 64-token pairs.
    "sop-budget-64": ("debug-sop.yaml", 64, 6000, 500, []),
}
VARIANTS = ("builder", "junction")


def log(msg: str) -> None:
    print(msg, flush=True)


def rel(path: Path) -> str:
    """`path` relative to the repository when it is inside it (commands run there)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ----------------------------------------------------------------------------------- data


def junction_kept(shards_dir: Path, documents_jsonl: Path, tokenizer: Path) -> float:
    """Share of a shard directory's pairs whose B starts right after A's end in the document."""
    from tokenizers import Tokenizer

    from data_prep.loader import PretrainingData
    from data_prep.readers import ReadStats, iter_documents

    tok = Tokenizer.from_file(str(tokenizer))
    stream: list[int] = []
    for doc in iter_documents([str(documents_jsonl)], "text", ReadStats(), sentences="lines"):
        for enc in tok.encode_batch(doc, add_special_tokens=False):
            stream += enc.ids
        stream.append(-1)
    import numpy as np

    text = np.asarray(stream, dtype=np.int32).tobytes()
    data = PretrainingData(shards_dir)
    kept = 0
    for i in range(data.num_examples):
        a, b = data.segments(i)
        w = min(len(a), JUNCTION), min(len(b), JUNCTION)
        needle = np.concatenate([a[len(a) - w[0] :], b[: w[1]]]).astype(np.int32).tobytes()
        at = text.find(needle)
        while at != -1 and at % 4:
            at = text.find(needle, at + 1)
        kept += at != -1
    return kept / data.num_examples


def prepare(out: Path, seq: int, variant: str) -> dict[str, Path]:
    """tokenizer, the two JSONL parts and their shard directories for (seq, variant)."""
    from data_prep.corpus import embedded_documents
    from data_prep.format import TOKENIZER
    from data_prep.shards import ShardConfig, build_shards
    from data_prep.tokenizer import write_tokenizer

    data = out / "data"
    paths = {"tokenizer": data / "tokenizer" / TOKENIZER}
    if not paths["tokenizer"].is_file():
        write_tokenizer(paths["tokenizer"].parent, inputs=["embedded"], vocab_size=VOCAB)
    for part in ("train", "heldout"):
        paths[f"{part}_jsonl"] = data / f"{part}.jsonl"
    if not all(paths[f"{p}_jsonl"].is_file() for p in ("train", "heldout")):
        rows: dict[str, list[str]] = {"train": [], "heldout": []}
        for d, text in enumerate(embedded_documents()):
            part = "heldout" if d % HELD_OUT_MOD == HELD_OUT_REM else "train"
            rows[part].append(json.dumps({"text": text}))
        for part, lines in rows.items():
            paths[f"{part}_jsonl"].write_text("\n".join(lines) + "\n")
    for part in ("train", "heldout"):
        shards = data / variant / f"{part}-{seq}"
        cfg = ShardConfig(
            inputs=(str(paths[f"{part}_jsonl"]),),
            num_shards=2,
            max_seq_length=seq,
            seed=0,
            truncation="junction" if variant == "junction" else "albert",
            sentences="lines",  # the documents' lines, as when the figures were measured
        )
        build_shards(cfg, paths["tokenizer"], shards, workers=1)  # reused when done
        paths[part] = shards
    return paths


def pairs_of(shards: Path, seq: int, limit: int | None = None):
    """The (A, B) pairs of a shard directory (int64), truncated as the loader does, and the
    special tokens; `limit` takes that many spread over the directory."""
    from data_prep.format import truncated_pair_lengths
    from data_prep.loader import PretrainingData

    data = PretrainingData(shards, max_seq_length=seq)
    n = data.num_examples if limit is None else min(limit, data.num_examples)
    out = []
    for k in range(n):
        a, b = data.segments(int(k * data.num_examples / n))
        la, lb = truncated_pair_lengths(len(a), len(b), seq - 3)
        if la and lb:
            out.append((a[len(a) - la :], b[:lb]))
    return out, data.special


def novelty(heldout, train_shards: Path) -> list[bool]:
    """True for held-out pairs whose junction (up to JUNCTION tokens either side of the A|B
    boundary) occurs nowhere in the training examples' token stream."""
    import numpy as np

    from data_prep.loader import PretrainingData

    data = PretrainingData(train_shards)
    parts = []
    for i in range(data.num_examples):
        a, b = data.segments(i)
        parts += [a, b, np.array([-1])]  # -1: nothing matches across examples
    stream = np.concatenate(parts).astype(np.int32).tobytes()
    flags = []
    for a, b in heldout:
        needle = np.concatenate([a[-JUNCTION:], b[:JUNCTION]]).astype(np.int32).tobytes()
        at = stream.find(needle)
        while at != -1 and at % 4:  # token-aligned matches only
            at = stream.find(needle, at + 1)
        flags.append(at == -1)
    return flags


def bigram_junction_oracle(heldout, train_shards: Path) -> float:
    """SOP accuracy (both orders) of a rule that needs no training beyond counting: bigram
    counts of the training tokens (add-0.1 smoothing) say whether A's last token -> B's first
    reads more like running text than B's last -> A's first. How much order signal the
    junction itself carries."""
    from collections import Counter

    import numpy as np

    from data_prep.loader import PretrainingData

    data = PretrainingData(train_shards)
    unigrams: Counter = Counter()
    bigrams: Counter = Counter()
    for i in range(data.num_examples):
        t = np.concatenate(data.segments(i)).tolist()
        unigrams.update(t)
        bigrams.update(itertools.pairwise(t))
    v = data.vocab_size

    def logp(x: int, y: int) -> float:
        return math.log((bigrams[(x, y)] + 0.1) / (unigrams[x] + 0.1 * v))

    score = 0.0
    for a, b in heldout:
        forward, backward = logp(int(a[-1]), int(b[0])), logp(int(b[-1]), int(a[0]))
        score += 1.0 if forward > backward else 0.5 if forward == backward else 0.0
    return score / len(heldout)


def sop_batches(pairs, special, batch_size: int = 256):
    """Both orders of every pair: yields (input_ids, attention_mask, token_type_ids, labels)."""
    import torch

    rows = []
    for a, b in pairs:
        rows.append((a, b, 0))
        rows.append((b, a, 1))
    for s in range(0, len(rows), batch_size):
        chunk = rows[s : s + batch_size]
        width = max(len(x) + len(y) + 3 for x, y, _ in chunk)
        ids = torch.full((len(chunk), width), special.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        types = torch.zeros_like(ids)
        labels = torch.tensor([lab for _, _, lab in chunk])
        for i, (x, y, _) in enumerate(chunk):
            n = len(x) + len(y) + 3
            seq = [special.cls, *x.tolist(), special.sep, *y.tolist(), special.sep]
            ids[i, :n] = torch.tensor(seq)
            mask[i, :n] = 1
            types[i, len(x) + 2 : n] = 1
        yield ids, mask, types, labels


def sop_predictions(model, pairs, special):
    """(predictions, labels) over both orders of every pair (eval mode, no masking)."""
    import torch

    model.eval()
    preds, labels = [], []
    with torch.no_grad():
        for ids, mask, types, lab in sop_batches(pairs, special):
            none = torch.zeros_like(ids, dtype=torch.bool)  # decode no MLM position
            out = model(ids, mask, types, masked_positions=none)
            preds.append(out.sop_logits.argmax(-1))
            labels.append(lab)
    return torch.cat(preds), torch.cat(labels)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (c - h, c + h)


# ----------------------------------------------------------------------------------- runs


def train(recipe: Path, run_dir: Path, items: list[str], threads: int) -> tuple[int, float]:
    """`python -m pretrain` in a child process; (exit code, seconds)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "pretrain", "--config", rel(recipe), *items]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    log("  $ " + " ".join(["python", *cmd[1:]]))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        log(proc.stdout[-2000:] + proc.stderr[-4000:])
    return proc.returncode, wall


def evaluate_run(run_dir: Path, heldout, novel, train_pairs, special) -> list[dict]:
    from engine.metrics import read_jsonl
    from model.hub.release import load_release

    logged = read_jsonl(run_dir / "tensorboard")
    curve = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*[0-9]")):
        step = int(ckpt.name.split("_")[1])
        model = load_release(ckpt / "release")
        pred, lab = sop_predictions(model, heldout, special)
        correct = (pred == lab).tolist()
        k, n = sum(correct), len(correct)
        nov = [c for i, c in enumerate(correct) if novel[i // 2]]
        tp, tl = sop_predictions(model, train_pairs, special)
        row = {
            "step": step,
            "heldout_sop_acc": k / n,
            "heldout_ci95": list(wilson(k, n)),
            "heldout_novel_sop_acc": sum(nov) / max(len(nov), 1),
            "heldout_pred_swapped_share": float(pred.float().mean()),
            "train_pairs_sop_acc": float((tp == tl).float().mean()),
        }
        window = [s for s in logged if step - 100 < s <= step and "loss/sop" in logged[s]]
        if window:
            last = logged[max(window)]
            row["train_loss_mlm"] = last["loss/mlm"]
            row["train_loss_sop"] = last["loss/sop"]
            row["train_logged_sop_acc"] = last["accuracy/sop"]
        curve.append(row)
        log(
            f"    step {step:>5}: held-out SOP {row['heldout_sop_acc']:.3f} "
            f"[{row['heldout_ci95'][0]:.3f}, {row['heldout_ci95'][1]:.3f}] "
            f"(novel {row['heldout_novel_sop_acc']:.3f}; training pairs "
            f"{row['train_pairs_sop_acc']:.3f}; predicts swapped "
            f"{row['heldout_pred_swapped_share']:.2f}"
            + (
                f"; mlm {row['train_loss_mlm']:.2f}, sop loss {row['train_loss_sop']:.3f})"
                if window
                else ")"
            )
        )
    return curve


def summarize(runs: list[dict]) -> list[dict]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["setting"], r["variant"]), []).append(r)
    rows = []
    for (setting, variant), rs in groups.items():
        finals = [r["curve"][-1]["heldout_sop_acc"] for r in rs]
        first = []
        for r in rs:
            above = [c["step"] for c in r["curve"] if c["heldout_sop_acc"] > 0.6]
            first.append(above[0] if above else None)
        rows.append(
            {
                "setting": setting,
                "variant": variant,
                "steps": rs[0]["steps"],
                "seeds": [r["seed"] for r in rs],
                "final_heldout_sop_acc": finals,
                "mean_final_heldout_sop_acc": sum(finals) / len(finals),
                "first_step_above_0.6": first,
                "final_train_pairs_sop_acc": [r["curve"][-1]["train_pairs_sop_acc"] for r in rs],
                "final_mlm_loss": [r["curve"][-1].get("train_loss_mlm") for r in rs],
                "train_wall_s": [round(r["train_wall_s"], 1) for r in rs],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--settings", nargs="+", default=["main-job"], choices=sorted(SETTINGS))
    parser.add_argument("--variants", nargs="+", default=["builder"], choices=VARIANTS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1], help="train.seed values")
    parser.add_argument("--out", default="runs/bench_sop", help="data, runs and checkpoints")
    parser.add_argument("--json", help="write the results here (after every run)")
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the runs already in --json (other than those run again) and add these",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, help="override the settings' step count")
    parser.add_argument("--eval-every", type=int, help="override the settings' eval interval")
    parser.add_argument("--tag", default="", help="suffix of the run directories")
    parser.add_argument(
        "--data-only", action="store_true", help="prepare the shards and their figures, no training"
    )
    parser.add_argument("override", nargs="*", help="extra dotted overrides for every run")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out).resolve()
    results: dict = {
        "invocations": [vars(args)],
        "meta": {"torch": torch.__version__, "cpus": os.cpu_count(), "threads": args.threads},
        "split": f"held out: embedded document d with d % {HELD_OUT_MOD} == {HELD_OUT_REM}",
        "data": {},
        "runs": [],
    }
    if args.append and args.json and Path(args.json).is_file():
        old = json.loads(Path(args.json).read_text())
        again = {(s, v, seed) for s in args.settings for v in args.variants for seed in args.seeds}
        if args.data_only:  # runs nothing: every run stays
            again = set()
        results["invocations"] = [*old.get("invocations", [old.get("args")]), vars(args)]
        results["data"] = old.get("data", {})
        results["runs"] = [
            r for r in old["runs"] if (r["setting"], r["variant"], r["seed"]) not in again
        ]
        results["meta"]["wall_s"] = old.get("meta", {}).get("wall_s", 0.0)
        if results["runs"]:
            results["summary"] = summarize(results["runs"])
    start = time.perf_counter() - results["meta"].get("wall_s", 0.0)
    for name in args.settings:
        recipe, seq, steps, every, overrides = SETTINGS[name]
        steps, every = args.steps or steps, args.eval_every or every
        for variant in args.variants:
            paths = prepare(out, seq, variant)
            heldout, special = pairs_of(paths["heldout"], seq)
            train_pairs, _ = pairs_of(paths["train"], seq, TRAIN_EVAL_PAIRS)
            novel = novelty(heldout, paths["train"])
            manifest = json.loads((paths["train"] / "manifest.json").read_text())
            key = f"{variant}-{seq}"
            if key not in results["data"] or args.data_only:
                results["data"][key] = {
                    "train_pairs": manifest["totals"]["examples"],
                    "train_documents": manifest["totals"]["documents"],
                    "heldout_pairs": len(heldout),
                    "heldout_novel_pairs": sum(novel),
                    "train_junction_kept": junction_kept(
                        paths["train"], paths["train_jsonl"], paths["tokenizer"]
                    ),
                    "heldout_bigram_junction_oracle_acc": bigram_junction_oracle(
                        heldout, paths["train"]
                    ),
                }
            log(f"{name} / {variant} shards (seq {seq}): {json.dumps(results['data'][key])}")
            if args.data_only:
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
                continue
            for seed in args.seeds:
                run_dir = out / "runs" / f"{name}-{variant}-seed{seed}{args.tag}"
                items = [
                    f"data.shards={rel(paths['train'])}",
                    f"data.max_seq_length={seq}",
                    "data.num_workers=0",
                    f"train.run_dir={rel(run_dir)}",
                    f"train.steps={steps}",
                    f"schedule.total_steps={steps}",
                    f"train.seed={seed}",
                    f"train.checkpoint_every={every}",
                    "train.keep_last=1000",
                    "train.diagnostics_every=0",
                    f"train.log_every={min(every, 50)}",
                    "train.progress=false",
                    *overrides,
                    *args.override,
                ]
                rc, wall = train(CONFIGS / recipe, run_dir, items, args.threads)
                if rc != 0:
                    log(f"  training failed (exit code {rc})")
                    return 1
                log(f"  {name} / {variant} / seed {seed}: {steps} steps in {wall:.0f} s")
                curve = evaluate_run(run_dir, heldout, novel, train_pairs, special)
                results["runs"].append(
                    {
                        "setting": name,
                        "variant": variant,
                        "seed": seed,
                        "seq": seq,
                        "steps": steps,
                        "recipe": f"configs/pretrain/{recipe}",
                        "overrides": items,
                        "train_wall_s": wall,
                        "curve": curve,
                    }
                )
                results["summary"] = summarize(results["runs"])
                results["meta"]["wall_s"] = time.perf_counter() - start
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    for row in results.get("summary", []):
        log(
            f"{row['setting']:<11} {row['variant']:<9} {row['steps']:>5} steps: held-out SOP "
            + ", ".join(f"{a:.3f}" for a in row["final_heldout_sop_acc"])
            + f" (seeds {row['seeds']}); first step > 0.6: {row['first_step_above_0.6']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
