"""Corpus readers: every input kind becomes a stream of documents, each a list of sentences.

Input kinds (chosen by the path, after stripping a `.gz` / `.zst` suffix):

    embedded, embedded:N   the embedded corpus (data_prep/corpus.py), or its first N documents
    *.jsonl *.json *.ndjson one JSON object per line; the document is `record[text_field]`
    *.parquet              one row per document, column `text_field`
    a directory            a local HF `datasets` directory made by `save_to_disk` (one split;
                           a DatasetDict directory is refused with its split names)
    hf:SOURCE[...]         a `datasets` source: a Hub dataset, a save_to_disk directory or a
                           folder of Parquet/Arrow/JSON files, read through `datasets`, optionally
                           streamed (data_prep/datasets_source.py has the syntax)
    anything else          plain text in the BERT/ALBERT convention: one sentence per line, a
                           blank line between documents (and a file boundary ends a document)

`.gz` and `.zst` compressed text and JSONL are decompressed on the fly. An input argument may
be a path, a glob pattern (expanded and sorted; `**` recurses) or `@list.txt` (one path or glob
per line, relative to the current directory, kept in the file's order; `#` starts a comment).

A document's sentences (`sentences`, `--sentences`; data_prep/sentences.py): by default
(`auto`) a plain-text document's lines, as the BERT convention has it, and the embedded corpus's
lines; a JSONL, Parquet or `datasets` document's text is split into sentences, each line on its
own (`split`). `lines` keeps every line as one sentence for any input, `split` splits any input's
lines. Every sentence is stripped of surrounding whitespace; empty ones are dropped and documents
without sentences are skipped.

Bad input (the policy, all tested):
* a missing file, a glob matching nothing, an empty list file -> FileNotFoundError naming it;
* no documents at all -> ValueError;
* undecodable UTF-8 bytes -> replaced by U+FFFD and counted (`replaced_characters`);
* a file where more than `PROBLEM_WARN_FRACTION` (1%) of the lines (rows for Parquet / HF) are
  undecodable or skipped (any of the reasons below) -> one warning naming the file, the share
  and the reasons, when the file has been read: almost always the wrong encoding or format,
  which the counts in the manifest alone would hide;
* a line longer than `max_line_chars` characters -> skipped, counted (`skipped.long_lines`) and
  warned about; it is never held in memory whole (read in bounded pieces). For JSONL this
  applies to the lines of each record's text; the record itself (a physical line, which may
  hold a whole book) may be 64x longer before it is skipped (`skipped.long_records`);
* a JSONL line that is not valid JSON -> skipped, counted (`skipped.bad_json_lines`) and warned
  about with its file and line (crawls often end in a truncated line; one bad line should not
  cost a day-long job). A record without the text field, or whose text is not a string, is
  an error naming the file, line and the fields present (almost always a wrong `--text-field`);
  a null text is skipped and counted (`skipped.null_text`);
* corrupt gzip / zstd data -> ValueError naming the file and the line reached.

`fingerprint_inputs` records what each input was (size, mtime, sha256 of its bytes; for an
`hf:` source the sha256 of its resolved data files, see datasets_source.py), so that a shard
directory can tell that an input changed under the same path.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from data_prep import datasets_source
from data_prep import format as fmt
from data_prep import sentences as sentence_rules

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
DEFAULT_MAX_LINE_CHARS = 1_000_000
# A JSONL record may hold a whole book: its lines are limited to max_line_chars, the record
# itself (the physical JSONL line) to this many times that.
JSONL_RECORD_FACTOR = 64
_GLOB_CHARS = set("*?[")
_WARN_LIMIT = 5  # warnings per kind and file; the counts in ReadStats are always complete
PROBLEM_WARN_FRACTION = 0.01
"""A file with a larger share of undecodable or skipped lines (rows) is warned about."""
_UNITS = {
    "text": "lines",
    "jsonl": "lines",
    "parquet": "rows",
    "hf": "rows",
    "datasets": "rows",
    "embedded": "documents",
}
"""What `ReadStats.records` counts, per input kind."""


@dataclass
class ReadStats:
    """What the readers saw; reported in the shard manifest under "input"."""

    files: list[str] = field(default_factory=list)
    documents: int = 0
    sentences: int = 0
    characters: int = 0
    replaced_characters: int = 0
    skipped: dict[str, int] = field(
        default_factory=lambda: {
            "long_lines": 0,
            "long_records": 0,
            "bad_json_lines": 0,
            "null_text": 0,
        }
    )

    records: int = 0
    """Physical lines of text and JSONL files, rows of Parquet / HF inputs, documents of the
    embedded corpus (the units a problem is counted in). Like `undecodable_lines`, for the console warnings only: not in
    `to_dict`, so the manifests of older directories stay comparable."""
    undecodable_lines: int = 0
    """Lines of text / JSONL files with invalid UTF-8 (the bytes behind `replaced_characters`)."""

    def problems(self) -> dict[str, int]:
        """Undecodable lines and skipped units by reason (a snapshot: deltas give one file's)."""
        return {"undecodable_lines": self.undecodable_lines, **self.skipped}

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": list(self.files),
            "documents": self.documents,
            "sentences": self.sentences,
            "characters": self.characters,
            "replaced_characters": self.replaced_characters,
            "skipped": dict(self.skipped),
        }


# ----------------------------------------------------------------------------- input expansion


def _has_glob(pattern: str) -> bool:
    return any(c in _GLOB_CHARS for c in pattern)


def _expand_one(item: str, origin: str) -> list[str]:
    if item == EMBEDDED or item.startswith(EMBEDDED + ":"):
        _embedded_limit(item)  # validates the suffix
        return [item]
    if datasets_source.is_spec(item):
        try:
            datasets_source.check(item)
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"{e}{origin}") from e
        return [item]
    if _has_glob(item):
        matches = sorted(glob.glob(item, recursive=True))
        matches = [m for m in matches if os.path.isfile(m) or _is_hf_dir(m)]
        if not matches:
            raise FileNotFoundError(f"input pattern {item!r}{origin} matches no file")
        return matches
    if not os.path.exists(item):
        raise FileNotFoundError(f"input file {item!r}{origin} does not exist")
    if os.path.isdir(item) and not _is_hf_dir(item):
        raise ValueError(
            f"input {item!r}{origin} is a directory but not a HF datasets directory "
            "(no dataset_info.json / state.json); pass files or a glob such as 'dir/*.txt'"
        )
    return [item]


def expand_inputs(inputs: Iterable[str]) -> list[str]:
    """The input files in reading order: globs sorted, @list files in their own order."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("no input given")
    files: list[str] = []
    for item in inputs:
        if item.startswith("@"):
            list_path = item[1:]
            if not os.path.isfile(list_path):
                raise FileNotFoundError(f"input list file {list_path!r} does not exist")
            entries = []
            with open(list_path, encoding="utf-8") as f:
                for line in f:
                    line = line.strip()
                    if line and not line.startswith("#"):
                        entries.append(line)
            if not entries:
                raise FileNotFoundError(f"input list file {list_path!r} lists no file")
            for entry in entries:
                files.extend(_expand_one(entry, f" (listed in {list_path})"))
        else:
            files.extend(_expand_one(item, ""))
    return files


def _embedded_limit(item: str) -> int | None:
    if item == EMBEDDED:
        return None
    suffix = item[len(EMBEDDED) + 1 :]
    if not suffix.isdigit() or int(suffix) < 1:
        raise ValueError(f"bad input {item!r}: use 'embedded' or 'embedded:N' with N >= 1")
    return int(suffix)


def _is_hf_dir(path: str) -> bool:
    p = Path(path)
    return p.is_dir() and any(
        (p / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def input_kind(path: str) -> str:
    """'embedded' | 'datasets' (an `hf:` source) | 'hf' (a bare save_to_disk directory) |
    'parquet' | 'jsonl' | 'text' for an expanded input."""
    if path == EMBEDDED or path.startswith(EMBEDDED + ":"):
        return "embedded"
    if datasets_source.is_spec(path):
        return "datasets"
    if _is_hf_dir(path):
        return "hf"
    name = path.lower()
    for suffix in (".gz", ".zst", ".zstd"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    return "text"


# ----------------------------------------------------------------------------- low-level reading


def _open_binary(path: str) -> BinaryIO:
    name = path.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if name.endswith((".zst", ".zstd")):
        import zstandard

        raw = open(path, "rb")  # noqa: SIM115 (closed through the reader)
        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)  # type: ignore[arg-type]
    return open(path, "rb", buffering=1 << 20)


def _decode(raw: bytes, stats: ReadStats) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.undecodable_lines += 1
        text = raw.decode("utf-8", errors="replace")
        # Count only the replacements we made, not U+FFFD characters already in the input.
        stats.replaced_characters += text.count("\ufffd") - raw.count("\ufffd".encode())
        return text


class _Warner:
    """At most _WARN_LIMIT warnings per (kind, file); ReadStats keeps the full counts."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def __call__(self, kind: str, path: str, msg: str) -> None:
        n = self.counts.get((kind, path), 0) + 1
        self.counts[(kind, path)] = n
        if n <= _WARN_LIMIT:
            log.warning(
                "%s%s", msg, " (further such warnings suppressed)" if n == _WARN_LIMIT else ""
            )


@dataclass
class _Reading:
    """What every per-kind reader needs besides its path: the options of one
    `iter_documents` call and its running counts."""

    text_field: str
    stats: ReadStats
    max_line_chars: int
    warn: _Warner
    mode: str
    """'lines' or 'split' (resolved for the input's kind; 'lines' when splitting is deferred)."""
    streaming: bool

    def line_sentences(self, line: str) -> list[str]:
        """A stripped, non-empty line as sentences: itself ('lines') or split ('split')."""
        return sentence_rules.split_line(line) if self.mode == "split" else [line]


def _iter_lines(
    path: str, stats: ReadStats, max_line_chars: int, warn: _Warner, what: str = "line"
) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line without its newline) of a possibly compressed file.

    A line is read in pieces of at most 4 * max_line_chars + 1 bytes (a UTF-8 character is at
    most 4 bytes), so an absurdly long line is skipped without ever being held whole. Skipped
    lines are counted in `stats.skipped[f"long_{what}s"]`."""
    limit = 4 * max_line_chars + 1
    counter = f"long_{what}s"
    lineno = 0
    try:
        with _open_binary(path) as f:
            while True:
                raw = f.readline(limit)
                if not raw:
                    break
                lineno += 1
                stats.records += 1
                if len(raw) == limit and not raw.endswith(b"\n"):
                    while True:  # drain the rest of the long line
                        more = f.readline(1 << 20)
                        if not more or more.endswith(b"\n"):
                            break
                    stats.skipped[counter] += 1
                    warn(
                        "long",
                        path,
                        f"{path}:{lineno}: {what} longer than {max_line_chars} "
                        "characters skipped (--max-line-chars)",
                    )
                    continue
                line = _decode(raw, stats).rstrip("\r\n")
                if len(line) > max_line_chars:
                    stats.skipped[counter] += 1
                    warn(
                        "long",
                        path,
                        f"{path}:{lineno}: {what} of {len(line)} characters "
                        f"skipped (> {max_line_chars})",
                    )
                    continue
                yield lineno, line
    except Exception as e:
        # OSError / EOFError / zlib.error from gzip, zstandard.ZstdError: nothing else runs in
        # this block (a consumer's exceptions are not thrown into the generator).
        hint = " (corrupt or truncated compressed data)" if _is_compressed(path) else ""
        raise ValueError(
            f"{path}: read error after line {lineno}{hint}: {type(e).__name__}: {e}"
        ) from e


def _is_compressed(path: str) -> bool:
    return path.lower().endswith((".gz", ".zst", ".zstd"))


def _split_sentences(text: str, read: _Reading, where: str) -> list[str]:
    """The sentences of a document's text: its lines (`mode` 'lines'), or each line split into
    sentences ('split'). A line longer than `max_line_chars` is skipped and counted."""
    sentences = []
    for line in text.split("\n"):
        line = line.strip()
        if not line:
            continue
        if len(line) > read.max_line_chars:
            read.stats.skipped["long_lines"] += 1
            read.warn(
                "long",
                where,
                f"{where}: line of {len(line)} characters skipped "
                f"(> --max-line-chars {read.max_line_chars})",
            )
            continue
        sentences.extend(read.line_sentences(line))
    return sentences


# ----------------------------------------------------------------------------- per-kind readers


def _read_text(path: str, read: _Reading) -> Iterator[list[str]]:
    doc: list[str] = []
    for _, line in _iter_lines(path, read.stats, read.max_line_chars, read.warn):
        line = line.strip()
        if line:
            doc.extend(read.line_sentences(line))
        elif doc:
            yield doc
            doc = []
    if doc:
        yield doc


def _read_jsonl(path: str, read: _Reading) -> Iterator[list[str]]:
    max_record = JSONL_RECORD_FACTOR * read.max_line_chars
    text_field, stats = read.text_field, read.stats
    for lineno, line in _iter_lines(path, stats, max_record, read.warn, what="record"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            stats.skipped["bad_json_lines"] += 1
            read.warn("json", path, f"{path}:{lineno}: not valid JSON, line skipped ({e})")
            continue
        if not isinstance(record, dict) or text_field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"{path}:{lineno}: record has no field {text_field!r} (fields: {keys}); "
                "pick the text field with --text-field"
            )
        text = record[text_field]
        if text is None:
            stats.skipped["null_text"] += 1
            continue
        if not isinstance(text, str):
            raise ValueError(
                f"{path}:{lineno}: field {text_field!r} is a {type(text).__name__}, not a string"
            )
        yield _split_sentences(text, read, f"{path}:{lineno}")


def _texts_from_column(
    path: str, column: Iterable[Any], read: _Reading, row0: int, name: str | None = None
) -> Iterator[list[str]]:
    """The documents of a column of texts whose first row is row `row0`; `name`: the column's
    name in errors (default: the text field)."""
    name = read.text_field if name is None else name
    for i, text in enumerate(column):
        read.stats.records += 1
        if text is None:
            read.stats.skipped["null_text"] += 1
            continue
        if not isinstance(text, str):
            raise ValueError(
                f"{path}: row {row0 + i}: column {name!r} holds {type(text).__name__}, not strings"
            )
        yield _split_sentences(text, read, f"{path} row {row0 + i}")


def _read_parquet(path: str, read: _Reading) -> Iterator[list[str]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise ValueError(f"{path}: not a readable Parquet file: {e}") from e
    names = pf.schema_arrow.names
    if read.text_field not in names:
        raise ValueError(
            f"{path}: no column {read.text_field!r} (columns: {names}); pick it with --text-field"
        )
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[read.text_field]):
        column = batch.column(0).to_pylist()
        yield from _texts_from_column(path, column, read, row)
        row += len(column)


class Unsplit(list):
    """A document's lines whose sentences are still to be split (`iter_documents(...,
    defer_split=True)`)."""

    def split(self) -> list[str]:
        return [s for line in self for s in sentence_rules.split_line(line)]


def _read_hf(path: str, read: _Reading) -> Iterator[list[str]]:
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(
            f"{path} holds a DatasetDict with splits {sorted(ds)}; pass one split's directory, "
            f"e.g. {os.path.join(path, sorted(ds)[0])}"
        )
    if read.text_field not in ds.column_names:
        raise ValueError(
            f"{path}: no column {read.text_field!r} (columns: {ds.column_names}); "
            "pick it with --text-field"
        )
    ds = ds.select_columns([read.text_field])
    row = 0
    for batch in ds.iter(batch_size=1024):
        column = batch[read.text_field]
        yield from _texts_from_column(path, column, read, row)
        row += len(column)


def _read_embedded(item: str, read: _Reading) -> Iterator[list[str]]:
    for i, text in enumerate(_embedded_texts(item)):
        read.stats.records += 1
        yield _split_sentences(text, read, f"{item} document {i}")


def _embedded_texts(item: str) -> Iterator[str]:
    """The documents of `embedded` / `embedded:N`."""
    from data_prep.corpus import embedded_documents

    limit = _embedded_limit(item)
    for i, text in enumerate(embedded_documents()):
        if limit is not None and i >= limit:
            break
        yield text


def _read_datasets(spec: str, read: _Reading) -> Iterator[list[str]]:
    src = datasets_source.parse(spec)
    column = src.text_column(read.text_field)
    rows: list[Any] = []
    row = 0
    for text in datasets_source.iter_texts(src, read.text_field, read.streaming):
        rows.append(text)
        if len(rows) == datasets_source.BATCH_ROWS:
            yield from _texts_from_column(spec, rows, read, row, column)
            row += len(rows)
            rows = []
    yield from _texts_from_column(spec, rows, read, row, column)


_READERS = {
    "embedded": _read_embedded,
    "datasets": _read_datasets,
    "hf": _read_hf,
    "parquet": _read_parquet,
    "jsonl": _read_jsonl,
    "text": _read_text,
}

# ----------------------------------------------------------------------------- the entry point


def iter_documents(
    inputs: list[str],
    text_field: str = "text",
    stats: ReadStats | None = None,
    max_line_chars: int = DEFAULT_MAX_LINE_CHARS,
    sentences: str = "auto",
    streaming: bool = False,
    defer_split: bool = False,
) -> Iterator[list[str]]:
    """Yields every document (a list of non-empty sentence strings) of `inputs`, in order.

    `sentences` ('auto' | 'split' | 'lines', module doc) decides how a document's text becomes
    sentences; `streaming` reads `hf:` sources as streams (the same rows in the same order).
    With `defer_split` a document whose lines are to be split comes as `Unsplit` (its lines;
    `.split()` gives the sentences), so that a reader who keeps only some documents (a shards
    worker) splits only those; such documents count in `stats.characters` by their lines and
    not in `stats.sentences`. (A non-empty line has at least one sentence, so the documents and
    their indices are the same either way.)

    The order is deterministic: inputs in the order given, each glob sorted, @list files in
    their order, documents in file order. `stats` (if given) is filled as reading goes; it is
    complete once the iterator is exhausted. Raises FileNotFoundError for a missing input
    (before yielding anything) and ValueError if there is no document at all."""
    if max_line_chars < 1:
        raise ValueError(f"max_line_chars must be >= 1, got {max_line_chars}")
    sentence_rules.check_mode(sentences)
    stats = stats if stats is not None else ReadStats()
    files = expand_inputs(inputs)
    stats.files = files
    warn = _Warner()
    for path in files:
        kind = input_kind(path)
        records, problems = stats.records, stats.problems()
        mode = sentence_rules.resolve(sentences, kind)
        defer = defer_split and mode == "split"
        read = _Reading(
            text_field, stats, max_line_chars, warn, "lines" if defer else mode, streaming
        )
        for doc in _READERS[kind](path, read):
            if not doc:
                continue
            stats.documents += 1
            stats.characters += sum(len(s) for s in doc)
            if defer:
                yield Unsplit(doc)  # its sentences are counted by whoever splits it
                continue
            stats.sentences += len(doc)
            yield doc
        _warn_if_mostly_bad(path, kind, stats, records, problems)
    if stats.documents == 0:
        raise ValueError(f"no documents found in the input ({', '.join(files)}): it is empty")


def splits_sentences(inputs: Iterable[str], sentences: str) -> bool:
    """True if `sentences` splits the text of any of `inputs` (after expansion), i.e. if the
    documents read depend on the sentence splitter."""
    sentence_rules.check_mode(sentences)
    if sentences != "auto":
        return sentences == "split"
    inputs = list(inputs)
    try:
        paths = expand_inputs(inputs)
    except (FileNotFoundError, ValueError):  # a config made before its input exists
        paths = inputs
    return any(sentence_rules.resolve(sentences, input_kind(p)) == "split" for p in paths)


def _warn_if_mostly_bad(
    path: str, kind: str, stats: ReadStats, records_before: int, problems_before: dict[str, int]
) -> None:
    """One warning if more than PROBLEM_WARN_FRACTION of the file's lines (rows) were
    undecodable or skipped; `*_before` are the counts before the file was read."""
    records = stats.records - records_before
    found = {k: v - problems_before[k] for k, v in stats.problems().items()}
    found = {k: v for k, v in found.items() if v}
    # A line can have several problems (and a JSONL record several long lines): capped.
    bad = min(sum(found.values()), records)
    if records == 0 or bad <= PROBLEM_WARN_FRACTION * records:
        return
    reasons = {
        "undecodable_lines": "with invalid UTF-8 (bytes replaced by U+FFFD)",
        "long_lines": "longer than --max-line-chars (skipped)",
        "long_records": f"records longer than {JSONL_RECORD_FACTOR} x --max-line-chars (skipped)",
        "bad_json_lines": "not valid JSON (skipped)",
        "null_text": "with a null text (skipped)",
    }
    log.warning(
        "%s: %d of %d %s (%.1f%%) are undecodable or skipped: %s; check the file's encoding "
        "(UTF-8 expected) and format",
        path,
        bad,
        records,
        _UNITS[kind],
        100 * bad / records,
        ", ".join(f"{v} {reasons.get(k, k)}" for k, v in found.items()),
    )


# ----------------------------------------------------------------------------- fingerprints


def fingerprint_inputs(files: Iterable[str]) -> list[dict[str, Any]]:
    """What each expanded input (`expand_inputs`) is now: {"path", "size", "mtime_ns",
    "sha256"}. The sha256 is of the whole file (with SHA instructions far cheaper than
    tokenizing it), so a change is seen whatever its size and mtime; `mtime_ns` is
    informational (a copy or `touch` changes it, not the content). An HF directory is hashed
    over its files (relative path and sha256 of each), with their total size and latest mtime;
    the embedded corpus over its text (its `mtime_ns` is None)."""
    out = []
    for path in files:
        if input_kind(path) == "datasets":
            out.append(datasets_source.fingerprint(datasets_source.parse(path)))
        elif input_kind(path) == "embedded":
            h = hashlib.sha256()
            size = 0
            for text in _embedded_texts(path):
                data = text.encode("utf-8") + b"\0"
                h.update(data)
                size += len(data)
            out.append({"path": path, "size": size, "mtime_ns": None, "sha256": h.hexdigest()})
        elif os.path.isdir(path):
            members = sorted(p for p in Path(path).rglob("*") if p.is_file())
            h = hashlib.sha256()
            for p in members:
                h.update(f"{p.relative_to(path).as_posix()}\0{fmt.sha256_file(p)}\n".encode())
            stats = [p.stat() for p in members]
            out.append(
                {
                    "path": path,
                    "size": sum(st.st_size for st in stats),
                    "mtime_ns": max((st.st_mtime_ns for st in stats), default=0),
                    "sha256": h.hexdigest(),
                }
            )
        else:
            st = os.stat(path)
            out.append(
                {
                    "path": path,
                    "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns,
                    "sha256": fmt.sha256_file(path),
                }
            )
    return out
