"""Data pipeline throughput: `python -m data_prep shards` vs the plain HF approach, same run.

The corpus (>= 200 MB by default) is made by repeating the embedded corpus (CPython's pydoc
topics) with variation: repetition r rotates every document's lines by r and tags it, so no two
documents are identical. It is written as plain text in the BERT convention.

Both sides use the same fast tokenizer (`tokenizer.json`, trained once on the embedded corpus)
and the same number of processes:
  * ours:   python -m data_prep shards --input corpus.txt --workers P ...
  * theirs: datasets.load_dataset("text", data_files=corpus.txt) + .map(batched tokenization,
            num_proc=P), the usual recipe (it tokenizes only; it builds no ALBERT examples).
Each runs in a fresh subprocess. Ours is timed as the whole process (imports included); theirs
from the start of its script to the tokenized dataset on disk (the token count afterwards is not
timed). Reported: wall time, tokens/s, MB/s per process, the peak RSS of the largest process.
Ratio = our tokens/s / theirs (>= 1.0 means we are faster).

    python -m bench.bench_data_prep --size-mb 200 --procs 2 --out bench/results/data_prep_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_result

HF_SCRIPT = r"""
import sys, time
start = time.perf_counter()
import datasets
from transformers import PreTrainedTokenizerFast
corpus, tok_path, procs, cache = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tok = PreTrainedTokenizerFast(tokenizer_file=tok_path)
ds = datasets.load_dataset("text", data_files=corpus, split="train", cache_dir=cache)
def encode(batch):
    return {"input_ids": tok(batch["text"], add_special_tokens=False)["input_ids"]}
out = ds.map(encode, batched=True, batch_size=1000, num_proc=procs, remove_columns=["text"])
seconds = time.perf_counter() - start  # process start -> tokenized dataset on disk
n = len(out.data.column("input_ids").combine_chunks().flatten())  # untimed count
print(n, seconds)
"""


def make_corpus(path: Path, size_mb: int) -> int:
    from data_prep.corpus import embedded_documents

    docs = [d.splitlines() for d in embedded_documents()]
    written, r = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size_mb * 2**20:
            for i, lines in enumerate(docs):
                lines = [ln for ln in lines if ln.strip()]
                if not lines:
                    continue
                k = r % len(lines)
                text = f"copy {r} of topic {i}\n" + "\n".join(lines[k:] + lines[:k]) + "\n\n"
                f.write(text)
                written += len(text.encode("utf-8"))
            r += 1
    return written


RSS_WRAPPER = r"""
import resource, subprocess, sys
res = subprocess.run(sys.argv[1:])
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
sys.exit(res.returncode)
"""


def run(cmd: list[str], env=None) -> tuple[float, float, str]:
    """(seconds, peak RSS MB of the largest process in its tree, stdout) of a fresh subprocess.

    A wrapper process runs the command so RUSAGE_CHILDREN covers that tree only."""
    start = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-c", RSS_WRAPPER, *cmd], capture_output=True, text=True, env=env
    )
    seconds = time.perf_counter() - start
    if res.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed:\n{res.stderr[-3000:]}")
    peak_kb = int(res.stderr.strip().splitlines()[-1].split()[-1])
    return seconds, peak_kb / 1024.0, res.stdout


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--num-shards", type=int, default=8)
    parser.add_argument("--max-seq-length", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=30000)
    parser.add_argument("--workdir", type=Path, default=None, help="kept if given, else a temp dir")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_data_prep_"))
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    try:
        corpus = work / "corpus.txt"
        nbytes = make_corpus(corpus, args.size_mb)
        print(f"corpus: {nbytes / 2**20:.0f} MB at {corpus}", flush=True)
        tok_dir = work / "tok"
        if not (tok_dir / "tokenizer.json").exists():
            subprocess.run(
                [
                    py,
                    "-m",
                    "data_prep",
                    "tokenizer",
                    "--input",
                    "embedded",
                    "--out",
                    str(tok_dir),
                    "--vocab-size",
                    str(args.vocab_size),
                ],
                check=True,
                env=env,
            )
        tok = tok_dir / "tokenizer.json"

        _, theirs_rss, out = run(
            [py, "-c", HF_SCRIPT, str(corpus), str(tok), str(args.procs), str(work / "hf_cache")],
            env,
        )
        count, seconds = out.strip().splitlines()[-1].split()
        theirs_tokens, theirs_s = int(count), float(seconds)
        print(
            f"HF datasets: {theirs_s:.1f} s, {theirs_tokens} tokens, peak RSS {theirs_rss:.0f} MB",
            flush=True,
        )

        shards = work / "shards"
        shutil.rmtree(shards, ignore_errors=True)
        ours_s, ours_rss, _ = run(
            [
                py,
                "-m",
                "data_prep",
                "shards",
                "--input",
                str(corpus),
                "--tokenizer",
                str(tok),
                "--out",
                str(shards),
                "--num-shards",
                str(args.num_shards),
                "--workers",
                str(args.procs),
                "--max-seq-length",
                str(args.max_seq_length),
            ],
            env,
        )
        manifest = json.loads((shards / "manifest.json").read_text())
        ours_tokens = manifest["totals"]["tokens"]
        print(
            f"ours: {ours_s:.1f} s, {ours_tokens} tokens in examples, peak RSS {ours_rss:.0f} MB",
            flush=True,
        )

        # Tokens/s on the same input: HF's count is every token of the corpus; ours counts the
        # tokens kept in examples (a little less: truncation). Use the corpus token count for both.
        corpus_tokens = theirs_tokens
        mb = nbytes / 2**20
        row = {
            "size_mb": round(mb, 1),
            "procs": args.procs,
            "ours_s": ours_s,
            "theirs_s": theirs_s,
            "ours_tokens_per_s": corpus_tokens / ours_s,
            "theirs_tokens_per_s": corpus_tokens / theirs_s,
            "ours_mb_per_s_per_proc": mb / ours_s / args.procs,
            "theirs_mb_per_s_per_proc": mb / theirs_s / args.procs,
            "ours_peak_rss_mb": ours_rss,
            "theirs_peak_rss_mb": theirs_rss,
            "ratio": theirs_s / ours_s,
            "tokens_in_examples": ours_tokens,
            "corpus_tokens": corpus_tokens,
        }
        print(json.dumps(row, indent=2))
        print(
            f"\n| corpus | procs | ours tok/s | HF tok/s | ours MB/s/proc | HF MB/s/proc | ours / HF | peak RSS ours / HF (MB) |\n"
            f"|---|---|---|---|---|---|---|---|\n"
            f"| {mb:.0f} MB | {args.procs} | {row['ours_tokens_per_s']:.3g} | {row['theirs_tokens_per_s']:.3g} | "
            f"{row['ours_mb_per_s_per_proc']:.2f} | {row['theirs_mb_per_s_per_proc']:.2f} | {row['ratio']:.2f} | "
            f"{ours_rss:.0f} / {theirs_rss:.0f} |"
        )
        write_result(args.out, {"args": vars(args), "row": row})
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
