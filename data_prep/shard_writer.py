"""Writing shard files: `ShardWriter` appends one shard's examples and finishes it (the arrays,
then its done-record), atomically; also used by other producers of shard directories
(`finetune.lra.shards`)."""

from __future__ import annotations

import array
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from albatross.files import atomic_file
from data_prep import format as fmt

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- writing


def atomic_write_json(path: Path, data: Any) -> None:
    fmt.atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def atomic_copy(src: Path, dst: Path) -> None:
    """Copies via a unique temp file + rename (concurrent jobs may copy the same file)."""
    with atomic_file(dst, dst.name, unique=True) as tmp:
        shutil.copyfile(src, tmp)


def _partial_files(out_dir: Path, name: str) -> tuple[Path, Path]:
    return out_dir / f".{name}.tokens.partial", out_dir / f".{name}.index.partial"


def _raw_to_npy(raw: Path, final: Path, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    """Writes the .npy `final` (np.save's exact bytes) from a raw native-order dump, atomically."""
    assert raw.stat().st_size == int(np.prod(shape)) * dtype.itemsize, (raw, shape)
    with atomic_file(final, f"shard file {final.name}", unique=True) as tmp, open(tmp, "wb") as f:
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False}
        np.lib.format.write_array_header_1_0(f, {**header, "shape": shape})
        with open(raw, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 22)


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
        atomic_write_json(self.out_dir / fmt.done_file(self.name), record)
        return record
