"""Length-grouped pretraining batches: how many batches carry no padding, and what it costs.

1. Embedded corpus: a tokenizer and ALBERT shards made by the real CLI (``python -m data_prep
   tokenizer`` / ``shards``, as bench/bench_loader.py does), one shard directory per sequence
   length. For each (max_seq_length, batch size): the share of full-length examples, then the
   real ``PretrainingLoader`` (one rank, num_workers=0) over ``--epochs`` epochs with and
   without ``group_by_length``: the share of batches whose attention mask is all ones
   (unpadded), the padding share (padding positions / batch positions) and the mean width.
2. Cost per batch: the loader's batch (build + mask + collate) with and without grouping
   (median of ``--repeats`` interleaved passes over the same batches), and the order alone
   (``EpochPlan.batch_indices``: index arithmetic, window arrangements included, amortised).
3. At scale (``--synthetic``): example lengths made by ALBERT's example construction
   (``data_prep.shards.build_examples``, short_seq_prob 0.1) from synthetic documents of a
   log-normal length (median ``--doc-tokens``); the order computed by ``EpochPlan`` with the
   default window and chunk, for several micro-steps (batch x ranks), counting each rank's
   batches. Also the time to arrange one window.

    python -m bench.bench_length_grouping --out bench/results/length_grouping_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.bench_loader import make_data  # the real CLI, as bench_loader runs it
from bench.common import subprocess_env, write_result
from data_prep.loader import (
    DEFAULT_GROUP_CHUNK,
    DEFAULT_GROUP_WINDOW,
    EpochPlan,
    LengthGrouping,
    PretrainingData,
    PretrainingLoader,
)


def loader_stats(data, batch: int, grouping, epochs: int) -> dict:
    """Real loader batches over `epochs` epochs: unpadded share, padding share, mean width."""
    loader = PretrainingLoader(data, batch, num_epochs=epochs, group_by_length=grouping)
    unpadded = widths = positions = real = count = 0
    for b in loader:
        mask = b["attention_mask"]
        unpadded += int(bool(mask.all()))
        widths += mask.shape[1]
        positions += mask.numel()
        real += int(mask.sum())
        count += 1
    return {
        "batches": count,
        "unpadded_share": unpadded / count,
        "padding_share": 1 - real / positions,
        "mean_width": widths / count,
    }


def batch_cost(data, batch: int, grouping, batches: int, repeats: int) -> dict:
    """Median seconds per loader batch (build + collate) and per batch_indices call."""
    per_batch, per_order = [], []
    for _ in range(repeats):
        loader = PretrainingLoader(data, batch, group_by_length=grouping)
        it = iter(loader)
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        per_batch.append((time.perf_counter() - start) / batches)
        it.close()
        plan = EpochPlan(
            data.num_examples,
            batch,
            0,
            1,
            data.seed,
            True,
            group_by_length=grouping,
            lengths=data.built_lengths if grouping else None,
        )
        start = time.perf_counter()
        done = 0
        for epoch in range(10**6):
            for b in range(plan.batches_per_epoch):
                plan.batch_indices(epoch, b)
                done += 1
                if done == batches:
                    break
            if done == batches:
                break
        per_order.append((time.perf_counter() - start) / batches)
    return {"batch_s": statistics.median(per_batch), "order_s": statistics.median(per_order)}


def synthetic_lengths(doc_tokens: int, documents: int, seq: int) -> np.ndarray:
    """Built lengths of ALBERT examples (`data_prep.shards.build_examples`, short_seq_prob 0.1)
    made from `documents` synthetic documents of lognormal length (median `doc_tokens`) and
    sentences (median 25 tokens)."""
    from data_prep.shards import build_examples

    rng = np.random.default_rng(0)
    out = []
    for d in range(documents):
        n_doc = int(rng.lognormal(np.log(doc_tokens), 0.8))
        sentences, total = [], 0
        while total < n_doc:
            s = max(3, int(rng.lognormal(np.log(25), 0.5)))
            sentences.append([7] * s)
            total += s
        examples, _ = build_examples(sentences, seq - 3, 0.1, random.Random(d))
        out += [3 + len(a) + len(b) for a, b in examples]
    return np.array(out, dtype=np.int64)


def synthetic_stats(lengths: np.ndarray, batch: int, world: int, grouping, epochs: int) -> dict:
    """Each rank's batches over `epochs` epochs, from lengths alone."""
    unpadded = count = 0
    real = positions = 0
    for rank in range(world):
        plan = EpochPlan(
            len(lengths),
            batch,
            rank,
            world,
            0,
            True,
            group_by_length=grouping,
            lengths=lengths.take if grouping else None,
        )
        for epoch in range(epochs):
            for b in range(plan.batches_per_epoch):
                ls = lengths[plan.batch_indices(epoch, b)]
                unpadded += int((ls == ls.max()).all())
                real += int(ls.sum())
                positions += int(ls.max()) * len(ls)
                count += 1
    return {
        "batches": count,
        "unpadded_share": unpadded / count,
        "padding_share": 1 - real / positions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqs", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument(
        "--window", type=int, default=512,
        help="embedded corpus: the window (a multiple of every batch size); chunk = the batch "
        "size (one rank)",
    )  # fmt: skip
    parser.add_argument("--cost-batches", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--synthetic", action="store_true", help="also section 3")
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--documents", type=int, default=4000)
    parser.add_argument("--synthetic-epochs", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="kept if given")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_grouping_"))
    work.mkdir(parents=True, exist_ok=True)
    env = subprocess_env(HF_HUB_OFFLINE="1")
    rows, cost, synthetic = [], [], []
    try:
        _, shards = make_data(work, set(args.seqs), env)
        for seq in args.seqs:
            data = PretrainingData(shards[seq], max_seq_length=seq, seed=0)
            lengths = data.built_lengths(np.arange(data.num_examples))
            full = float((lengths == seq).mean())
            for batch in args.batches:
                grouping = LengthGrouping(args.window, batch)
                for name, g in (("off", None), ("on", grouping)):
                    row = {
                        "seq": seq,
                        "batch": batch,
                        "examples": data.num_examples,
                        "full_length_share": full,
                        "grouping": name,
                        "window": g and g.window,
                        "chunk": g and g.chunk,
                        **loader_stats(data, batch, g, args.epochs),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            # the lengths of one default window read from the shard index (random indices)
            idx = np.random.default_rng(0).integers(0, data.num_examples, DEFAULT_GROUP_WINDOW)
            times = []
            for _ in range(args.repeats * 5):
                start = time.perf_counter()
                data.built_lengths(idx)
                times.append(time.perf_counter() - start)
            lengths_s = statistics.median(times)
            for batch in args.batches:
                grouping = LengthGrouping(args.window, batch)
                off = batch_cost(data, batch, None, args.cost_batches, args.repeats)
                on = batch_cost(data, batch, grouping, args.cost_batches, args.repeats)
                row = {"seq": seq, "batch": batch, "off": off, "on": on, "lengths_s": lengths_s}
                cost.append(row)
                print(json.dumps(row), flush=True)
        if args.synthetic:
            default = LengthGrouping(DEFAULT_GROUP_WINDOW, DEFAULT_GROUP_CHUNK)
            for seq in args.seqs:
                lengths = synthetic_lengths(args.doc_tokens, args.documents, seq)
                plan = EpochPlan(
                    len(lengths), 64, 0, 1, 0, True, group_by_length=default,
                    lengths=lengths.take,
                )  # fmt: skip
                times = []
                for w in range(min(5, -(-len(lengths) // DEFAULT_GROUP_WINDOW))):
                    start = time.perf_counter()
                    plan.window_order(0, w)  # includes the epoch's Feistel evaluation
                    times.append(time.perf_counter() - start)
                arrange = statistics.median(times)
                for batch, world in ((32, 1), (64, 1), (64, 8), (64, 16)):
                    for name, g in (("off", None), ("on", default)):
                        row = {
                            "seq": seq,
                            "doc_tokens": args.doc_tokens,
                            "examples": len(lengths),
                            "full_length_share": float((lengths == seq).mean()),
                            "batch": batch,
                            "world": world,
                            "grouping": name,
                            "window_arrange_s": arrange,
                            **synthetic_stats(lengths, batch, world, g, args.synthetic_epochs),
                        }
                        synthetic.append(row)
                        print(json.dumps(row), flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    print("\n| seq | full-length examples | batch | grouping | unpadded batches | padding share "
          "| mean width |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for r in rows:
        g = "off" if r["grouping"] == "off" else f"window {r['window']}, chunk {r['chunk']}"
        print(
            f"| {r['seq']} | {100 * r['full_length_share']:.1f}% | {r['batch']} | {g} | "
            f"{100 * r['unpadded_share']:.1f}% | {100 * r['padding_share']:.1f}% | "
            f"{r['mean_width']:.1f} |"
        )
    print("\n| seq | batch | loader batch off (ms) | on (ms) | order off (us) | on (us) |")
    print("|---|---|---|---|---|---|")
    for r in cost:
        print(
            f"| {r['seq']} | {r['batch']} | {r['off']['batch_s'] * 1e3:.2f} | "
            f"{r['on']['batch_s'] * 1e3:.2f} | {r['off']['order_s'] * 1e6:.1f} | "
            f"{r['on']['order_s'] * 1e6:.1f} |"
        )
    for seq in args.seqs:
        arr = next(r["lengths_s"] for r in cost if r["seq"] == seq)
        print(f"seq {seq}: built_lengths of {DEFAULT_GROUP_WINDOW} examples: {arr * 1e3:.2f} ms")
    if synthetic:
        print("\n| seq | examples | full-length | batch x ranks | grouping | unpadded batches | "
              "padding share |\n|---|---|---|---|---|---|---|")  # fmt: skip
        for r in synthetic:
            print(
                f"| {r['seq']} | {r['examples']} | {100 * r['full_length_share']:.1f}% | "
                f"{r['batch']} x {r['world']} | {r['grouping']} | "
                f"{100 * r['unpadded_share']:.1f}% | {100 * r['padding_share']:.1f}% |"
            )
        for seq in args.seqs:
            arr = next(r["window_arrange_s"] for r in synthetic if r["seq"] == seq)
            print(f"seq {seq}: arranging one window of {DEFAULT_GROUP_WINDOW}: {arr * 1e3:.2f} ms")
    out = {"args": vars(args), "loader": rows, "cost": cost, "synthetic": synthetic}
    write_result(args.out, out)


if __name__ == "__main__":
    main()
