"""Shards stage: tokenize documents and write ALBERT pretraining examples as numpy shards.

Examples (ALBERT's `create_instances_from_document`, google-research/albert
create_pretraining_data.py, for sentence-order prediction):

    per document, with max_num_tokens = max_seq_length - 3 ([CLS] A [SEP] B [SEP]):
    target = max_num_tokens, or with probability short_seq_prob a uniform length in [2, max_num_tokens]
    accumulate consecutive sentences into a chunk until it holds >= target tokens (or the
    document ends); split the chunk at a random sentence boundary into A and B; truncate the
    longer side one token at a time, from the front or the back at random, until
    len(A) + len(B) <= max_num_tokens.

Decisions where this differs from ALBERT's code (MLM masking and the SOP swap are done at
training time by the loader, so none of that happens here):

* **Target drawn per example.** ALBERT draws `target` once per document; here it is drawn again
  for every chunk, so the share of short examples is `short_seq_prob` whatever the document
  lengths (with ALBERT's rule one long short-target document makes many short examples).
* **A sentence longer than the target is cut** into pieces: the first fills the open chunk up to
  the target exactly, the rest are handled like the next sentences (so they become target-size
  pieces). Long JSONL lines lose nothing to truncation.
* **A one-sentence chunk is split inside the sentence** at a random token, so A and B stay
  consecutive text of one document (ALBERT takes B from a random other document there, which
  would make SOP's "not swapped" label wrong). A one-token chunk has no A/B split and is
  dropped (counted in `dropped_tokens`).
* No `dupe_factor`: masking is dynamic, so one pass over the corpus gives one set of A/B splits.

Determinism: document d (0-based, `iter_documents` order) goes to shard d % S, and all its
randomness comes from `random.Random(f"{seed}:{d}")`; nothing depends on --workers,
--job-index or --num-jobs, so the bytes of every file are the same however the work is split
(for one Python and `tokenizers` version).

Validation split (--validation-fraction F / --validation-documents N; format.py has the rule):
every worker reads every document anyway, so each decides for itself, from (seed, d) alone,
whether d is held out (one blake2b per document, ~1 us); a held-out document goes, with the
same examples, to validation shard d % V instead of training shard d % S. Validation shard v is
built by job v % k, like training shard v; the done-records carry the selection and the
held-out count, which `finalize` checks agree. --validation-documents N first reads the input
once more, without tokenizing, to find the N smallest keys (`choose_validation`). Without a
flag nothing changes: no key in the config, no file, the same bytes as before the option.

Writing: each shard streams its tokens and index rows to hidden `.partial` files (memory stays
bounded whatever the corpus and the number of shards a worker holds), then writes the two .npy
arrays (temp file + rename), then its done-record (`format.done_file`) last. A shard with a
valid done-record is complete; anything else is rebuilt. The manifest is written by `finalize`
(at the end of a single-job run, or explicitly after a multi-job run) from the done-records.

Changed input: every done-record (and the manifest) lists the input files with their size,
mtime and sha256 (`readers.fingerprint_inputs`, the whole file is hashed: ~0.05 s per 100 MB,
against ~35 s to tokenize it). A run whose inputs differ in content from those records (a file
edited under the same path, whatever its size and mtime; a glob or @list that now names other
files) is refused, naming the file: every shard depends on every input (document d goes to
shard d % S), so no old shard can be kept, and mixing old and new shards would be silent.
A file that was only touched or copied (same bytes, new mtime) is the same input.
"""

from __future__ import annotations

import array
import heapq
import json
import logging
import math
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from data_prep import datasets_source
from data_prep import format as fmt
from data_prep import sentences as sentence_rules
from data_prep.readers import (
    DEFAULT_MAX_LINE_CHARS,
    ReadStats,
    Unsplit,
    expand_inputs,
    fingerprint_inputs,
    iter_documents,
    splits_sentences,
)
from data_prep.tokenizer import load_tokenizer, tokenizer_kind

log = logging.getLogger(__name__)

# Documents are tokenized in batches of about this many characters (one encode_batch call,
# parallel over sentences inside `tokenizers`).
BATCH_CHARS = 2_000_000
# Buffered tokens across all shards one worker holds before they go to the .partial files.
BUFFER_TOKENS = 1 << 25


TRUNCATIONS = ("albert", "junction")
"""`ShardConfig.truncation` values."""


@dataclass(frozen=True)
class ShardConfig:
    """Everything besides the tokenizer that decides the bytes of the shards. Recorded in every
    done-record and in the manifest; a shard directory made with another config is refused.
    (--workers, --job-index and --num-jobs only split the work and are not part of it.)"""

    inputs: tuple[str, ...]
    """Input arguments as given: paths, globs, @list files, `embedded[:N]`."""

    num_shards: int
    """S: document d goes to shard d % S."""

    max_seq_length: int = 512
    """Length of [CLS] A [SEP] B [SEP]; A and B hold at most max_seq_length - 3 tokens."""

    short_seq_prob: float = 0.1
    """Probability that an example's target length is drawn uniformly from [2, max]."""

    seed: int = 0
    """Document d's randomness comes from random.Random(f"{seed}:{d}")."""

    text_field: str = "text"
    """JSONL field / Parquet or HF column holding a document's text."""

    max_line_chars: int = DEFAULT_MAX_LINE_CHARS
    """Longer input lines are skipped (and counted)."""

    truncation: str = "albert"
    """How a pair longer than the budget is cut. `albert`: ALBERT's truncate_seq_pair (the longer
    side loses a token at a random end, which cuts the A|B junction of most short pairs).
    `junction`: A loses tokens from its front and B from its back (the same lengths as the
    loader's truncation), so B still starts where A ends: the order signal SOP is about. On the
    embedded corpus's 32-token pairs it lets SOP be learned on more seeds (BENCHMARKS.md)."""

    validation_fraction: float = 0.0
    """Hold out each document with this probability (by its `format.validation_key`), as the
    validation split; 0: no split. At most one of validation_fraction / validation_documents."""

    validation_documents: int = 0
    """Hold out exactly this many documents (the N smallest keys); 0: no split."""

    validation_shards: int = 1
    """V: held-out document d goes to validation shard d % V."""

    sentences: str = "auto"
    """How a document's text becomes sentences (`readers`, data_prep/sentences.py): 'auto'
    (lines of plain text and of the embedded corpus; JSONL, Parquet and `datasets` documents
    split into sentences), 'split' or 'lines'."""

    streaming: bool = False
    """Read `hf:` sources as streams. The same rows in the same order, so not part of
    `to_dict` (like --workers): a directory built streaming resumes without, and back."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if not self.inputs:
            raise ValueError("no input given")
        if self.num_shards < 1:
            raise ValueError(f"--num-shards must be >= 1, got {self.num_shards}")
        if self.max_seq_length < 5:
            raise ValueError(f"--max-seq-length must be >= 5, got {self.max_seq_length}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.max_line_chars < 1:
            raise ValueError(f"--max-line-chars must be >= 1, got {self.max_line_chars}")
        if self.truncation not in TRUNCATIONS:
            raise ValueError(
                f"--truncation must be one of {list(TRUNCATIONS)}, got {self.truncation!r}"
            )
        f = self.validation_fraction
        if not 0.0 <= f < 1.0:  # also refuses NaN
            raise ValueError(
                f"--validation-fraction must be in [0, 1), got {f}"
                + (": it would leave no training documents" if f >= 1.0 else "")
            )
        if not isinstance(self.validation_documents, int) or self.validation_documents < 0:
            raise ValueError(
                f"--validation-documents must be an int >= 0, got {self.validation_documents!r}"
            )
        if f > 0 and self.validation_documents > 0:
            raise ValueError(
                "give --validation-fraction or --validation-documents, not both (got "
                f"{f} and {self.validation_documents})"
            )
        if self.validation_shards < 1:
            raise ValueError(f"--validation-shards must be >= 1, got {self.validation_shards}")
        if self.validation_shards != 1 and not self.has_validation:
            raise ValueError(
                f"--validation-shards {self.validation_shards} needs {fmt.VALIDATION_FLAGS}"
            )
        sentence_rules.check_mode(self.sentences)

    @property
    def has_validation(self) -> bool:
        return self.validation_fraction > 0 or self.validation_documents > 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["inputs"] = list(self.inputs)
        if d["truncation"] == "albert":  # the default: manifests written before the option match
            del d["truncation"]
        # No split: the keys are left out, so such directories are byte-identical to those made
        # before the option existed. With one: only the flag in use, and V.
        if not self.validation_fraction:
            del d["validation_fraction"]
        if not self.validation_documents:
            del d["validation_documents"]
        if not self.has_validation:
            del d["validation_shards"]
        del d["streaming"]  # the same documents either way
        # Sentences: recorded (with the splitter and its version) only when some input's text
        # is split, so a directory of line-per-sentence input has the config it had before the
        # option; a directory split by another splitter version is refused, never mixed.
        del d["sentences"]
        if splits_sentences(self.inputs, self.sentences):
            d["sentences"] = self.sentences
            d["sentence_splitter"] = sentence_rules.splitter_id()
        return d

    def read(self, stats: ReadStats | None = None) -> Iterator[list[str]]:
        """`iter_documents` of this config's input, documents to split coming `Unsplit` (each
        worker splits only the documents it keeps)."""
        return iter_documents(
            list(self.inputs),
            self.text_field,
            stats,
            self.max_line_chars,
            sentences=self.sentences,
            streaming=self.streaming,
            defer_split=True,
        )


# ----------------------------------------------------------------------------- examples


def build_examples(
    sentences: Sequence[Sequence[int]],
    max_num_tokens: int,
    short_seq_prob: float,
    rng: random.Random,
    truncation: str = "albert",
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """ALBERT SOP examples (A, B) of one tokenized document, and the number of tokens dropped
    (truncation, one-token leftovers). See the module docstring for the rules."""

    def draw_target() -> int:
        if rng.random() < short_seq_prob:
            return rng.randint(2, max_num_tokens)
        return max_num_tokens

    queue = deque(list(s) for s in sentences if len(s))
    examples: list[tuple[list[int], list[int]]] = []
    dropped = 0
    chunk: list[list[int]] = []
    length = 0
    target = draw_target()
    while queue:
        segment = queue.popleft()
        if len(segment) > target:
            # Cut a too-long sentence so the open chunk ends exactly at the target.
            cut = target - length
            queue.appendleft(segment[cut:])
            segment = segment[:cut]
        chunk.append(segment)
        length += len(segment)
        if not queue or length >= target:
            pair, lost = _split_chunk(chunk, max_num_tokens, rng, truncation)
            dropped += lost
            if pair is not None:
                examples.append(pair)
            chunk, length = [], 0
            target = draw_target()
    return examples, dropped


def _split_chunk(
    chunk: list[list[int]], max_num_tokens: int, rng: random.Random, truncation: str = "albert"
) -> tuple[tuple[list[int], list[int]] | None, int]:
    if len(chunk) >= 2:
        a_end = rng.randint(1, len(chunk) - 1)
        a = [t for seg in chunk[:a_end] for t in seg]
        b = [t for seg in chunk[a_end:] for t in seg]
    else:
        (tokens,) = chunk
        if len(tokens) < 2:
            return None, len(tokens)
        cut = rng.randint(1, len(tokens) - 1)
        a, b = tokens[:cut], tokens[cut:]
    if truncation == "junction":
        # The lengths of truncate_seq_pair, taken from A's front and B's back: the junction stays.
        la, lb = fmt.truncated_pair_lengths(len(a), len(b), max_num_tokens)
        lost = len(a) + len(b) - la - lb
        return (a[len(a) - la :], b[:lb]), lost
    # ALBERT's truncate_seq_pair: drop from the longer side, front or back at random.
    a0, a1, b0, b1 = 0, len(a), 0, len(b)
    while (a1 - a0) + (b1 - b0) > max_num_tokens:
        if a1 - a0 > b1 - b0:
            if rng.random() < 0.5:
                a0 += 1
            else:
                a1 -= 1
        elif rng.random() < 0.5:
            b0 += 1
        else:
            b1 -= 1
    lost = len(a) + len(b) - (a1 - a0) - (b1 - b0)
    return (a[a0:a1], b[b0:b1]), lost


def document_rng(seed: int, document_index: int) -> random.Random:
    """The RNG of one document: depends on (seed, d) only."""
    return random.Random(f"{seed}:{document_index}")


# ----------------------------------------------------------------------------- validation split


@dataclass(frozen=True)
class ValidationSplit:
    """Which documents are held out for validation (the rule: format.py's docstring).

    rule "fraction": d is held out iff key(d) < threshold (an int, floor(F * 2**64)).
    rule "documents": d is held out iff (key(d), d) <= threshold (the N-th smallest (key, d)
    of the input, found by `choose_validation`'s read of the input)."""

    seed: int
    rule: str
    threshold: int | tuple[int, int]
    requested: float | int
    """The fraction F or the count N asked for."""

    def held_out(self, document_index: int) -> bool:
        key = fmt.validation_key(self.seed, document_index)
        if isinstance(self.threshold, int):  # rule "fraction"
            return key < self.threshold
        return (key, document_index) <= self.threshold

    def selection(self) -> dict[str, Any]:
        """What the manifest and the done-records report under validation.selection."""
        if isinstance(self.threshold, int):
            return {"rule": "fraction", "fraction": self.requested, "threshold": self.threshold}
        return {
            "rule": "documents",
            "documents": self.requested,
            "threshold": list(self.threshold),
        }

    def describe(self, num_shards: int) -> str:
        """The rule in words, with this split's numbers (the manifest's validation.how)."""
        key = (
            f"key(d) = the first 8 bytes, big-endian, of blake2b(f'{self.seed}:{{d}}'.encode(), "
            "digest_size=8, person=b'validation')"
        )
        if isinstance(self.threshold, int):
            which = f"key(d) < {self.threshold} (floor({self.requested} * 2**64))"
        else:
            which = (
                f"(key(d), d) is among the {self.requested} smallest of the input, i.e. "
                f"<= {list(self.threshold)}"
            )
        return (
            f"document d (0-based, input order) is held out iff {which}, where {key}; a held-out "
            f"document's examples are in valid_{{d % {num_shards}}}, never in a training shard"
        )


def choose_validation(config: ShardConfig) -> ValidationSplit | None:
    """The validation split of `config` (None without one). --validation-documents N reads the
    input once (no tokenizing) to find the N documents with the smallest keys; ValueError if
    the input has no more than N documents (nothing would be left to train on)."""
    if config.validation_fraction > 0:
        threshold = math.floor(Fraction(config.validation_fraction) * 2**64)
        return ValidationSplit(config.seed, "fraction", threshold, config.validation_fraction)
    if not config.validation_documents:
        return None
    n = config.validation_documents
    start = time.perf_counter()
    readers_log = logging.getLogger("data_prep.readers")
    level = readers_log.level
    readers_log.setLevel(logging.ERROR)  # the build's own read warns about bad input
    try:
        docs = config.read()
        count = 0

        def keys() -> Iterator[tuple[int, int]]:
            nonlocal count
            for d, _ in enumerate(docs):
                count = d + 1
                yield fmt.validation_key(config.seed, d), d

        smallest = heapq.nsmallest(n, keys())
    finally:
        readers_log.setLevel(level)
    if n >= count:
        raise ValueError(
            f"--validation-documents {n} leaves no training documents: the input has "
            f"{count} document(s); use a smaller N (at most {count - 1}) or --validation-fraction"
        )
    log.info(
        "validation split: %d of %d documents held out (chosen in %.1f s, one read of the input)",
        n,
        count,
        time.perf_counter() - start,
    )
    return ValidationSplit(config.seed, "documents", smallest[-1], n)


# ----------------------------------------------------------------------------- writing


def _atomic_write_json(path: Path, data: Any) -> None:
    fmt.atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def _atomic_copy(src: Path, dst: Path) -> None:
    """Copies via a unique temp file + rename (concurrent jobs may copy the same file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    try:
        with os.fdopen(fd, "wb") as f, open(src, "rb") as s:
            shutil.copyfileobj(s, f)
        fmt.publish_mode(Path(tmp))
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _partial_files(out_dir: Path, name: str) -> tuple[Path, Path]:
    return out_dir / f".{name}.tokens.partial", out_dir / f".{name}.index.partial"


def _raw_to_npy(raw: Path, final: Path, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    """Writes the .npy `final` (np.save's exact bytes) from a raw native-order dump, atomically."""
    assert raw.stat().st_size == int(np.prod(shape)) * dtype.itemsize, (raw, shape)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False}
            np.lib.format.write_array_header_1_0(f, {**header, "shape": shape})
            with open(raw, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 22)
        fmt.publish_mode(Path(tmp))
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ShardWriter:
    """Appends examples of one shard; `finish` writes the arrays, then the done-record
    (`finalize` makes the manifest from the done-records). Also used by other producers of
    shard directories (`finetune.lra.shards`)."""

    def __init__(
        self,
        out_dir: Path,
        index: int,
        dtype: np.dtype,
        flush_tokens: int,
        name: str | None = None,
    ) -> None:
        self.out_dir, self.index, self.dtype = out_dir, index, dtype
        self.name = name if name is not None else fmt.shard_name(index)
        self.tok_raw, self.idx_raw = _partial_files(out_dir, self.name)
        for p in (self.tok_raw, self.idx_raw):
            p.unlink(missing_ok=True)
            p.touch()
        self.tokens = array.array("H" if dtype.itemsize == 2 else "I")
        assert self.tokens.itemsize == dtype.itemsize
        self.rows = array.array("q")
        self.flush_tokens = flush_tokens
        self.offset = self.examples = self.documents = self.dropped = 0
        self.split_sentences = 0
        """Sentences of the documents this shard split itself (`readers.Unsplit`)."""

    def add(self, examples: list[tuple[list[int], list[int]]], dropped: int) -> None:
        self.documents += 1
        self.dropped += dropped
        for a, b in examples:
            self.rows.extend((self.offset, len(a), len(b)))
            self.tokens.extend(a)
            self.tokens.extend(b)
            self.offset += len(a) + len(b)
        self.examples += len(examples)
        if len(self.tokens) >= self.flush_tokens:
            self._flush()

    def _flush(self) -> None:
        with open(self.tok_raw, "ab") as f:
            self.tokens.tofile(f)
        with open(self.idx_raw, "ab") as f:
            self.rows.tofile(f)
        del self.tokens[:]
        del self.rows[:]

    def finish(self, record_extra: dict[str, Any]) -> dict[str, Any]:
        self._flush()
        files = {
            fmt.tokens_file(self.name): (self.tok_raw, self.dtype, (self.offset,)),
            fmt.index_file(self.name): (self.idx_raw, np.dtype(np.int64), (self.examples, 3)),
        }
        for fname, (raw, dtype, shape) in files.items():
            _raw_to_npy(raw, self.out_dir / fname, dtype, shape)
            raw.unlink()
        record = {
            "format_version": fmt.FORMAT_VERSION,
            "name": self.name,
            "examples": self.examples,
            "tokens": self.offset,
            "documents": self.documents,
            "dropped_tokens": self.dropped,
            "sha256": {f: fmt.sha256_file(self.out_dir / f) for f in files},
            **record_extra,
        }
        _atomic_write_json(self.out_dir / fmt.done_file(self.name), record)
        return record


# ----------------------------------------------------------------------------- the worker


@dataclass(frozen=True)
class _Task:
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


def _run_task(task: _Task, progress: Callable[[int, int], None] | None = None) -> list[str]:
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


def _init_worker(counters: Any, threads: int, log_level: int) -> None:
    global _COUNTERS
    _COUNTERS = counters
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _run_task_in_pool(task: _Task) -> list[str]:
    if task.worker > 0:  # every worker reads the same input: warn about it once
        logging.getLogger("data_prep.readers").setLevel(logging.ERROR)

    def progress(docs: int, tokens: int) -> None:
        _COUNTERS[2 * task.worker] = docs
        _COUNTERS[2 * task.worker + 1] = tokens

    return _run_task(task, progress)


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


# ----------------------------------------------------------------------------- the stage


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise fmt.ShardError(f"{path} cannot be read: {e}") from e


def _config_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(set(old) | set(new))
    return ", ".join(
        f"{k}: {old.get(k)!r} there vs {new.get(k)!r} now" for k in keys if old.get(k) != new.get(k)
    )


def _input_change(
    recorded: list[dict[str, Any]] | None, current: list[dict[str, Any]] | None
) -> str:
    """How the `current` input fingerprints (`readers.fingerprint_inputs`) differ from the
    `recorded` ones: '' if the same files, in the same order, have the same size and sha256
    (mtimes are not compared: a copy or `touch` is the same input). '' too if either is None
    (a record made before fingerprints were kept cannot tell)."""
    if recorded is None or current is None:
        return ""
    old = {f["path"]: f for f in recorded}
    new = {f["path"]: f for f in current}

    def shown(paths: list[str]) -> str:
        return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")

    added = [p for p in new if p not in old]
    removed = [p for p in old if p not in new]
    if added or removed:
        lists = (("added", added), ("removed", removed))
        return "input files " + "; ".join(f"{w}: {shown(ps)}" for w, ps in lists if ps)
    changed = [
        p for p in new if (old[p]["size"], old[p]["sha256"]) != (new[p]["size"], new[p]["sha256"])
    ]
    if changed:
        a, b = old[changed[0]], new[changed[0]]
        if a["size"] == b["size"]:
            size = f"the same size, {a['size']} bytes"
        else:
            size = f"size {a['size']} there vs {b['size']} bytes now"
        more = f" (and {shown(changed[1:])})" if changed[1:] else ""
        return (
            f"input file {changed[0]}{more} has changed: sha256 {a['sha256'][:12]}... there vs "
            f"{b['sha256'][:12]}... now, {size}"
        )
    if list(old) != list(new):
        return f"input files in another order: {shown(list(old))} there vs {shown(list(new))} now"
    return ""


def _check_same_origin(
    path: Path,
    record: dict[str, Any],
    config: dict[str, Any],
    tok_sha: str,
    input_files: list[dict[str, Any]] | None,
) -> None:
    """ShardError unless `record` (a done-record or manifest) was made with this config,
    tokenizer and input (`input_files`: fingerprints; None: not checked)."""
    if record.get("config") != config:
        raise fmt.ShardError(
            f"{path.parent} holds shards made with a different config ({path.name}: "
            f"{_config_diff(record.get('config') or {}, config)}); use another --out "
            "directory or delete this one"
        )
    if record.get("tokenizer_sha256") != tok_sha:
        raise fmt.ShardError(
            f"{path.parent} holds shards made with a different tokenizer ({path.name}: sha256 "
            f"{str(record.get('tokenizer_sha256'))[:12]}... vs {tok_sha[:12]}... now); use "
            "another --out directory or delete this one"
        )
    change = _input_change(record.get("input_files"), input_files)
    if change:
        raise fmt.ShardError(
            f"{path.parent} holds shards made from other input ({path.name}: {change}); every "
            "shard depends on every input file, so none of them can be kept: use another --out "
            "directory, or delete this one to rebuild it from the current input"
        )


def _check_unchanged_while_read(input_files: list[dict[str, Any]], out: Path) -> None:
    """ShardError if an input file's size or mtime differs from its fingerprint, taken before
    it was read (a download or an edit still going on): the shards just built may mix old and
    new text, and no manifest is written. (Their done-records hold the old sha256, so a re-run
    refuses the directory too.) A stat per file: nothing is read again."""
    for f in input_files:
        if f["mtime_ns"] is None or not os.path.isfile(f["path"]):
            continue  # the embedded corpus; HF directories are checked by the next run's hash
        st = os.stat(f["path"])
        if (st.st_size, st.st_mtime_ns) != (f["size"], f["mtime_ns"]):
            raise fmt.ShardError(
                f"input file {f['path']} changed while it was being read (size {f['size']} -> "
                f"{st.st_size} bytes, or a new mtime): the shards in {out} may mix old and new "
                "text; delete the directory and rebuild it once the file is final"
            )


def _shard_is_done(out_dir: Path, name: str) -> bool:
    """True if the done-record exists and the arrays match it; False (with a warning for a
    stale record) if the shard must be (re)built."""
    done = out_dir / fmt.done_file(name)
    if not done.is_file():
        return False
    record = _read_json(done)
    for fname, digest in record.get("sha256", {}).items():
        path = out_dir / fname
        if not path.is_file() or fmt.sha256_file(path) != digest:
            log.warning("%s does not match %s: rebuilding %s", path, done.name, name)
            return False
    return True


def _clean_shard(out_dir: Path, name: str) -> None:
    (out_dir / fmt.done_file(name)).unlink(missing_ok=True)  # first: never a record without files
    for p in (out_dir / fmt.tokens_file(name), out_dir / fmt.index_file(name)):
        p.unlink(missing_ok=True)
    for p in out_dir.glob(f".{name}.*"):  # .partial files, temp files of a killed writer
        p.unlink(missing_ok=True)


def build_shards(
    config: ShardConfig,
    tokenizer_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    workers: int = 1,
    job_index: int = 0,
    num_jobs: int = 1,
) -> dict[str, Any]:
    """Builds the shards s with s % num_jobs == job_index that are not already done (resume),
    in `workers` processes; a single-job run then writes manifest.json. Returns a summary."""
    if num_jobs < 1 or not 0 <= job_index < num_jobs:
        raise ValueError(f"need 0 <= --job-index < --num-jobs, got {job_index} and {num_jobs}")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    tok = load_tokenizer(tokenizer_path)
    tok_sha = fmt.sha256_file(tokenizer_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = config.to_dict()

    # An existing directory must come from the same config and tokenizer: never overwrite.
    out_tok = out / fmt.TOKENIZER
    if out_tok.exists() and fmt.sha256_file(out_tok) != tok_sha:
        raise fmt.ShardError(
            f"{out} holds a different tokenizer.json than {tokenizer_path}; use another --out "
            "directory or delete this one"
        )
    hash_start = time.perf_counter()
    input_files = fingerprint_inputs(expand_inputs(config.inputs))
    log.info(
        "input: %d file(s), %.1f MB, hashed in %.1f s",
        len(input_files),
        sum(f["size"] for f in input_files) / 1e6,
        time.perf_counter() - hash_start,
    )
    for path in [*_done_records(out), out / fmt.MANIFEST]:
        if path.is_file():
            _check_same_origin(path, _read_json(path), cfg_dict, tok_sha, input_files)
    if not out_tok.exists():
        _atomic_copy(Path(tokenizer_path), out_tok)

    # Units of work: training shard s and validation shard v both go to job (s or v) % k.
    mine = [_Unit(False, s) for s in range(config.num_shards) if s % num_jobs == job_index]
    if config.has_validation:
        mine += [
            _Unit(True, v) for v in range(config.validation_shards) if v % num_jobs == job_index
        ]
    todo = [u for u in mine if not _shard_is_done(out, u.name)]
    n_valid = sum(u.validation for u in mine)
    log.info(
        "shards: %d of %d for job %d/%d%s, %d already done, %d to build with %d worker(s)",
        len(mine) - n_valid,
        config.num_shards,
        job_index,
        num_jobs,
        f" (+ {n_valid} of {config.validation_shards} validation)" if n_valid else "",
        len(mine) - len(todo),
        len(todo),
        min(workers, max(len(todo), 1)),
    )
    start = time.perf_counter()
    if todo:
        if not config.streaming and min(workers, len(todo)) > 1:
            for item in config.inputs:  # download/convert once, not in every worker at once
                if datasets_source.is_spec(item):
                    datasets_source.prepare(datasets_source.parse(item))
        split = choose_validation(config)  # --validation-documents: one read of the input
        (out / fmt.MANIFEST).unlink(missing_ok=True)  # a manifest only lists complete shards
        for u in todo:
            _clean_shard(out, u.name)
        _run(config, str(tokenizer_path), tok_sha, out, todo, workers, input_files, split)
        _check_unchanged_while_read(input_files, out)
    seconds = time.perf_counter() - start
    records = [_read_json(out / fmt.done_file(u.name)) for u in todo]
    tokens = sum(r["tokens"] for r in records)
    summary = {
        "built": len(todo),
        "skipped": len(mine) - len(todo),
        "examples": sum(r["examples"] for r in records),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if todo and seconds > 0 else None,
        "manifest": None,
    }
    if todo:
        chars = records[0]["input"]["characters"]
        log.info(
            "built %d shard(s): %d examples, %d tokens in %.1f s (%.0f tokens/s; read %.1f M "
            "characters per worker, %.2f M characters/s)",
            len(todo),
            summary["examples"],
            tokens,
            seconds,
            tokens / seconds,
            chars / 1e6,
            chars / 1e6 / seconds,
        )
    del tok
    if num_jobs == 1:
        finalize(out)
        summary["manifest"] = str(out / fmt.MANIFEST)
    else:
        log.info(
            "job %d/%d done; run `python -m data_prep finalize --out %s` after all jobs",
            job_index,
            num_jobs,
            out,
        )
    return summary


@dataclass(frozen=True)
class _Unit:
    """One shard to build: training shard `index`, or validation shard `index`."""

    validation: bool
    index: int

    @property
    def name(self) -> str:
        return fmt.valid_name(self.index) if self.validation else fmt.shard_name(self.index)


def _done_records(out: Path) -> list[Path]:
    """The done-records in `out`: training shards, then validation shards."""
    return [*sorted(out.glob("shard_*.done.json")), *sorted(out.glob("valid_*.done.json"))]


def _run(
    config: ShardConfig,
    tokenizer_path: str,
    tok_sha: str,
    out: Path,
    todo: list[_Unit],
    workers: int,
    input_files: list[dict[str, Any]],
    split: ValidationSplit | None = None,
) -> None:
    workers = min(workers, len(todo))
    tasks = [
        _Task(
            config,
            tokenizer_path,
            tok_sha,
            str(out),
            tuple(u.index for u in todo[w::workers] if not u.validation),
            w,
            tuple(input_files),
            tuple(u.index for u in todo[w::workers] if u.validation),
            split,
        )
        for w in range(workers)
    ]
    bar = Progress("shards", "tok")
    try:
        if workers == 1:
            _run_task(tasks[0], lambda docs, toks: bar.update(toks, docs=docs))
            return
        ctx = mp.get_context("spawn")  # fresh interpreters: no forked tokenizers thread pools
        counters = ctx.Array("q", 2 * workers, lock=False)
        threads = max(1, (os.cpu_count() or 1) // workers)
        with ctx.Pool(
            workers, _init_worker, (counters, threads, logging.getLogger().level)
        ) as pool:
            result = pool.map_async(_run_task_in_pool, tasks, chunksize=1)
            while not result.ready():
                result.wait(0.5)
                bar.update(sum(counters[1::2]), docs=min(counters[0::2]))
            result.get()  # re-raises a worker's exception here
    finally:
        bar.close()


# ----------------------------------------------------------------------------- finalize


def finalize(out_dir: str | os.PathLike) -> dict[str, Any]:
    """Checks that every shard's done-record exists and matches its files (sha256) and that all
    come from one config, tokenizer and input (the same input statistics and, where recorded,
    the same input file contents), and the validation shards' too where the config has a
    validation split (and the same held-out documents); then writes manifest.json.
    Byte-identical to the manifest of a single-job run. ShardError (naming the file) otherwise."""
    out = Path(out_dir)
    done_paths = sorted(out.glob("shard_*.done.json"))
    if not done_paths:
        raise fmt.ShardError(
            f"{out}: no shard done-records (shard_*.done.json); nothing to finalize"
        )
    first = _read_json(done_paths[0])
    config, tok_sha, input_stats, input_files = (
        first.get("config"),
        first.get("tokenizer_sha256"),
        first.get("input"),
        first.get("input_files"),  # None in records made before fingerprints were kept
    )
    if not isinstance(config, dict) or "num_shards" not in config:
        raise fmt.ShardError(f"{done_paths[0]} has no config: not a done-record of this format")
    num_shards = int(config["num_shards"])
    has_validation = bool(config.get("validation_fraction") or config.get("validation_documents"))
    num_valid = int(config.get("validation_shards", 1)) if has_validation else 0
    split_meta = first.get("validation")
    names = [fmt.shard_name(s) for s in range(num_shards)]
    names += [fmt.valid_name(v) for v in range(num_valid)]
    records = []
    missing = []
    for name in names:
        path = out / fmt.done_file(name)
        if not path.is_file():
            missing.append(name)
            continue
        record = _read_json(path)
        _check_same_origin(path, record, config, tok_sha, input_files)
        if record.get("input") != input_stats:
            raise fmt.ShardError(
                f"{path} was made from different input than {done_paths[0].name} (input stats "
                "differ: did the input files change between jobs?); rebuild the directory"
            )
        if record.get("validation") != split_meta:
            raise fmt.ShardError(
                f"{path} holds out other validation documents than {done_paths[0].name} "
                f"({record.get('validation')} vs {split_meta}); rebuild the directory"
            )
        records.append(record)
    if missing:
        shown = ", ".join(missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        valid = f" and {num_valid} validation shards" if num_valid else ""
        raise fmt.ShardError(
            f"{out}: {len(missing)} of {num_shards} shards{valid} are not done ({shown}); run "
            "the job(s) that make them (with --num-jobs k, shard s is made by job s % k, "
            "validation shard v by job v % k), then finalize"
        )
    tok_path = out / fmt.TOKENIZER
    if not tok_path.is_file() or fmt.sha256_file(tok_path) != tok_sha:
        raise fmt.ShardError(
            f"{tok_path} is missing or is not the tokenizer the shards were made with"
        )
    for record in records:
        for fname, digest in record["sha256"].items():
            path = out / fname
            if not path.is_file():
                raise fmt.ShardError(
                    f"{path} is missing (listed in {fmt.done_file(record['name'])})"
                )
            if fmt.sha256_file(path) != digest:
                raise fmt.ShardError(
                    f"{path} is corrupt or truncated: its sha256 does not match "
                    f"{fmt.done_file(record['name'])}; delete that done-record and re-run the "
                    "shards command to rebuild it"
                )
    if any("split_sentences" in r for r in records):
        # Each worker split only its own documents: the sentences of the whole input are those
        # read as they were plus those each shard split.
        input_stats = dict(input_stats)
        input_stats["sentences"] += sum(r.get("split_sentences", 0) for r in records)
    tok = load_tokenizer(tok_path)
    empty = [r["name"] for r in records if r["examples"] == 0]
    if empty:
        log.warning(
            "%d shard(s) hold no example (more shards than documents?): %s",
            len(empty),
            ", ".join(empty[:10]),
        )
    train, valid = records[:num_shards], records[num_shards:]
    manifest = {
        "format_version": fmt.FORMAT_VERSION,
        "tokenizer_sha256": tok_sha,
        "tokenizer_kind": tokenizer_kind(tok_path),
        "special_tokens": fmt.SpecialTokens.from_tokenizer(tok).to_dict(),
        "vocab_size": tok.get_vocab_size(),
        "token_dtype": fmt.token_dtype(tok.get_vocab_size()).name,
        **({"layout": config["layout"]} if "layout" in config else {}),
        "config": config,
        "num_shards": num_shards,
        "shards": _shard_entries(train),
        "totals": _totals(train),
        **({fmt.VALIDATION_KEY: _validation_section(config, split_meta, valid)} if valid else {}),
        "input": input_stats,
        **({"input_files": input_files} if input_files is not None else {}),
    }
    _atomic_write_json(out / fmt.MANIFEST, manifest)
    log.info(
        "wrote %s: %d shards, %d examples, %d tokens%s",
        out / fmt.MANIFEST,
        num_shards,
        manifest["totals"]["examples"],
        manifest["totals"]["tokens"],
        (
            f"; validation: {num_valid} shard(s), {manifest['validation']['totals']['examples']} "
            f"examples, {manifest['validation']['totals']['tokens']} tokens, "
            f"{manifest['validation']['totals']['documents']} documents"
            if valid
            else ""
        ),
    )
    return manifest


def _shard_entries(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "name": r["name"],
            "examples": r["examples"],
            "tokens": r["tokens"],
            "documents": r["documents"],
            "sha256": r["sha256"],
        }
        for r in records
    ]


def _totals(records: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "examples": sum(r["examples"] for r in records),
        "tokens": sum(r["tokens"] for r in records),
        "documents": sum(r["documents"] for r in records),
        "dropped_tokens": sum(r["dropped_tokens"] for r in records),
    }


def _validation_section(
    config: dict[str, Any], meta: dict[str, Any] | None, records: list[dict[str, Any]]
) -> dict[str, Any]:
    """The manifest's "validation" section (format.py) from the validation done-records."""
    if not isinstance(meta, dict) or "selection" not in meta:
        raise fmt.ShardError(
            f"{records[0]['name']}: its done-record does not say how the validation documents "
            "were chosen; rebuild the directory"
        )
    sel = meta["selection"]
    threshold = sel["threshold"] if sel["rule"] == "fraction" else tuple(sel["threshold"])
    requested = sel["fraction"] if sel["rule"] == "fraction" else sel["documents"]
    split = ValidationSplit(int(config["seed"]), sel["rule"], threshold, requested)
    totals = _totals(records)
    if totals["documents"] != meta["documents"]:
        raise fmt.ShardError(
            f"the validation shards hold {totals['documents']} documents, but "
            f"{meta['documents']} were held out; rebuild the directory"
        )
    return {
        "selection": sel,
        "how": split.describe(len(records)),
        "seed": int(config["seed"]),
        "num_shards": len(records),
        "shards": _shard_entries(records),
        "totals": totals,
    }
