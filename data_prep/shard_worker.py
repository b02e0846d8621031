"""One unit of the shard stage's work (`Task`: a slice of the input documents into its
shards), run in the process or in a pool of workers, and the progress counters they share."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep import format as fmt
from data_prep.examples import ValidationSplit, build_examples, document_rng
from data_prep.readers import (
    ReadStats,
    Unsplit,
)
from data_prep.shard_config import ShardConfig
from data_prep.shard_writer import ShardWriter

log = logging.getLogger(__name__)


# Documents are tokenized in batches of about this many characters (one encode_batch call,
# parallel over sentences inside `tokenizers`).
BATCH_CHARS = 2_000_000
# Buffered tokens across all shards one worker holds before they go to the .partial files.
BUFFER_TOKENS = 1 << 25


# ----------------------------------------------------------------------------- the worker


@dataclass(frozen=True)
class Task:
    config: ShardConfig
    tokenizer_path: str
    tokenizer_sha256: str
    out_dir: str
    shards: tuple[int, ...]
    worker: int
    input_files: tuple[dict[str, Any], ...]
    """`readers.fingerprint_inputs` of the input, recorded in the done-records."""
    valid_shards: tuple[int, ...] = ()
    """Validation shards v (held-out documents d with d % V == v) this task writes."""
    validation: ValidationSplit | None = None


def run_task(task: Task, progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Reads the whole input, keeps the documents of `task.shards`, writes those shards."""
    from tokenizers import Tokenizer

    cfg = task.config
    out_dir = Path(task.out_dir)
    tok = Tokenizer.from_file(task.tokenizer_path)
    dtype = fmt.token_dtype(tok.get_vocab_size())
    flush_tokens = max(1 << 14, BUFFER_TOKENS // (len(task.shards) + len(task.valid_shards)))
    writers = {s: ShardWriter(out_dir, s, dtype, flush_tokens) for s in task.shards}
    valid_writers = {
        v: ShardWriter(out_dir, v, dtype, flush_tokens, fmt.valid_name(v))
        for v in task.valid_shards
    }
    split = task.validation
    held_out = 0
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # same ids, no offsets
    max_num_tokens = cfg.max_seq_length - 3
    stats = ReadStats()
    pending: list[tuple[int, list[str], ShardWriter]] = []
    pending_chars = 0
    written = 0

    def flush_pending() -> None:
        nonlocal written
        flat = [s for _, doc, _ in pending for s in doc]
        encodings = encode(flat, add_special_tokens=False) if flat else []
        k = 0
        for d, doc, writer in pending:
            ids = [encodings[k + j].ids for j in range(len(doc))]
            k += len(doc)
            examples, dropped = build_examples(
                ids, max_num_tokens, cfg.short_seq_prob, document_rng(cfg.seed, d), cfg.truncation
            )
            writer.add(examples, dropped)
            written += sum(len(a) + len(b) for a, b in examples)
        pending.clear()

    docs = cfg.read(stats)
    d = -1
    for d, doc in enumerate(docs):
        if split is not None and split.held_out(d):
            held_out += 1
            writer = valid_writers.get(d % cfg.validation_shards)
        else:
            writer = writers.get(d % cfg.num_shards)
        if writer is not None:
            if isinstance(doc, Unsplit):
                doc = doc.split()
                writer.split_sentences += len(doc)
            pending.append((d, doc, writer))
            pending_chars += sum(len(s) for s in doc)
            if pending_chars >= BATCH_CHARS:
                flush_pending()
                pending_chars = 0
                if progress:
                    progress(d + 1, written)
    flush_pending()
    if progress:
        progress(d + 1, written)
    extra = {
        "config": cfg.to_dict(),
        "tokenizer_sha256": task.tokenizer_sha256,
        "input": stats.to_dict(),
        "input_files": list(task.input_files),
    }
    if split is not None:
        _check_split_sizes(split, held_out, d + 1)
        extra["validation"] = {"selection": split.selection(), "documents": held_out}
    split_here = "sentences" in extra["config"]  # some input's text is split: count per shard

    def finish(writer: ShardWriter) -> str:
        own = {"split_sentences": writer.split_sentences} if split_here else {}
        return writer.finish({**extra, **own})["name"]

    return [finish(writers[s]) for s in task.shards] + [
        finish(valid_writers[v]) for v in task.valid_shards
    ]


def _check_split_sizes(split: ValidationSplit, held_out: int, documents: int) -> None:
    """ValueError (before any done-record is written) if the split left either side empty."""
    flag = f"--validation-{'fraction' if split.rule == 'fraction' else 'documents'}"
    asked = f"{flag} {split.requested} (seed {split.seed})"
    if held_out == 0:
        raise ValueError(
            f"{asked} held out none of the {documents} document(s) of the input: use a larger "
            "fraction, or --validation-documents N for an exact count"
        )
    if held_out >= documents:
        raise ValueError(
            f"{asked} held out all {documents} document(s) of the input, leaving no training "
            "documents: use a smaller fraction, or --validation-documents N for an exact count"
        )


_COUNTERS: Any = None  # per-process: shared (documents, tokens) slots of all workers


def init_worker(counters: Any, threads: int, log_level: int) -> None:
    global _COUNTERS
    _COUNTERS = counters
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_task_in_pool(task: Task) -> list[str]:
    if task.worker > 0:  # every worker reads the same input: warn about it once
        logging.getLogger("data_prep.readers").setLevel(logging.ERROR)

    def progress(docs: int, tokens: int) -> None:
        _COUNTERS[2 * task.worker] = docs
        _COUNTERS[2 * task.worker + 1] = tokens

    return run_task(task, progress)


# ----------------------------------------------------------------------------- progress


class Progress:
    """A tqdm bar on a terminal; otherwise a plain log line every `interval` seconds."""

    def __init__(self, desc: str, unit: str, interval: float = 30.0) -> None:
        self.desc, self.unit, self.interval = desc, unit, interval
        self.start = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True)

    def update(self, n: int, **postfix: Any) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n - self.bar.n)
            return
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            rate = n / max(now - self.start, 1e-9)
            extra = " ".join(f"{k}={v}" for k, v in postfix.items())
            log.info("%s: %d %s (%.0f %s/s) %s", self.desc, n, self.unit, rate, self.unit, extra)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
