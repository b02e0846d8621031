"""Sentence boundaries: how a document's text becomes the sentences ALBERT's examples are made of.

`--sentences` (`ShardConfig.sentences`, `iter_documents(sentences=...)`):

    auto   (the default) `lines` for plain text and the embedded corpus, `split` for JSONL,
           Parquet and `datasets` documents (a bare `save_to_disk` directory or an `hf:` source)
    split  every line of the text is split into sentences by the sentence splitter
    lines  every line is one sentence (BERT's one-sentence-per-line convention)

A newline is always a boundary: `split` splits each line on its own, so a document stored as
one paragraph per line (Wikipedia in `datasets`, most JSONL crawls) gets the sentences of each
paragraph, and a heading or a list item on its own line stays a sentence of its own. A document
that is one paragraph without newlines is split wherever the splitter finds a boundary.

Why `auto` keeps `lines` for plain text: the BERT/ALBERT text convention is already one sentence
per line (a blank line between documents), so splitting again could only cut sentences the
corpus's own splitter kept whole. The embedded corpus keeps `lines` so that the main job's data
and every figure measured on it stay as they were (its text is hard-wrapped documentation, where
lines are neither sentences nor paragraphs); `--sentences split` applies to it as to any input.

The splitter is nupunkt (Punkt with a trained English model; pure Python, no dependencies,
maintained), chosen over blingfire, pysbd, syntok and sentencex by boundary quality on a
hand-checked sample and speed on the embedded corpus (`python -m bench.bench_sentence_split`;
docs/benchmarks.md#sentence-splitting): the best boundaries, and fast enough that splitting adds
little to the shards stage. Its output depends only on the
line (no state carries from one document to the next: tested), so shards stay byte-identical
whatever --workers and --num-jobs. Another splitter version may place some boundaries
differently: the splitter and its version are part of the shard config (`sentence_splitter`),
so a directory made with another version is refused rather than mixed.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from typing import Any

MODES = ("auto", "split", "lines")
"""`--sentences` values."""

SPLITTER = "nupunkt"
"""The package that splits sentences in `split` mode."""

SPLIT_KINDS = frozenset({"jsonl", "parquet", "hf", "datasets"})
"""Input kinds (`readers.input_kind`) that `auto` splits; the others keep their lines."""


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"--sentences must be one of {list(MODES)}, got {mode!r}")
    return mode


def resolve(mode: str, kind: str) -> str:
    """'split' or 'lines' for an input of `kind` under `--sentences mode`."""
    check_mode(mode)
    if mode != "auto":
        return mode
    return "split" if kind in SPLIT_KINDS else "lines"


@lru_cache(maxsize=1)
def _tokenizer() -> Any:
    try:
        import nupunkt
    except ImportError as e:
        raise ValueError(
            f"--sentences split needs the sentence splitter {SPLITTER} (pip install {SPLITTER}; "
            "it needs Python >= 3.11), or keep each line as a sentence with --sentences lines"
        ) from e
    return nupunkt.load("default")


def splitter_id() -> str:
    """'nupunkt <version>': recorded in the shard config when a document is split."""
    from importlib.metadata import PackageNotFoundError, version

    _tokenizer()  # a missing splitter is reported the same way everywhere
    try:
        return f"{SPLITTER} {version(SPLITTER)}"
    except PackageNotFoundError:  # pragma: no cover (imported, but installed without metadata)
        return SPLITTER


def split_line(line: str) -> list[str]:
    """The sentences of one line (stripped, non-empty); the line itself if none is found."""
    sentences = [s.strip() for s in _tokenizer().tokenize(line)]
    sentences = [s for s in sentences if s]
    return sentences or [line]


def split_document(text: str, mode: str) -> list[str]:
    """The sentences of `text` in `mode` ('split' or 'lines'): every line stripped, empty ones
    dropped, and in `split` mode each line split. (The readers do the same, with the long-line
    checks; this is the rule on its own, for tests and benchmarks.)"""
    out: list[str] = []
    for line in text.split("\n"):
        line = line.strip()
        if not line:
            continue
        out.extend(split_line(line) if mode == "split" else [line])
    return out


def splitter_versions() -> dict[str, str]:
    """Installed versions of the splitters the benchmark compares."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("nupunkt", "blingfire", "pysbd", "syntok", "sentencex"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found
