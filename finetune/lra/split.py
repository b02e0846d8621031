"""What reading one Long Range Arena split gives: `LraSplit` (the examples, stored compactly)
and `SplitStats` (what was read and skipped), and the helpers every reader shares: the
`Builder` of a split, the label check and where a task's files are looked for. The formats
themselves: `finetune/lra/data.py` (text and TSV tasks) and `finetune/lra/images.py` (CIFAR-10,
Pathfinder)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from finetune.lra.tasks import PAD_ID, LraTask, to_ids

log = logging.getLogger("finetune.lra.data")
MAX_SKIPPED_ITEMS = 20  # items kept in SplitStats; the count is always complete


@dataclass
class SplitStats:
    """What reading one split saw."""

    task: str
    split: str
    source: str
    """The file or folder read."""
    format: str
    """"tsv", "aclImdb", "hf", "cifar-pickle" or "pathfinder"."""
    rows: int = 0
    """Records read: data rows, review files, images (Pathfinder: metadata lines of the whole
    difficulty, before the split)."""
    examples: int = 0
    truncated: int = 0
    """Documents cut to max_length (a Retrieval pair counts each document)."""
    longest: int = 0
    """The longest document in data tokens, before truncation."""
    skipped: int = 0
    """Records skipped (Pathfinder: empty images, over the whole difficulty)."""
    skipped_items: list[str] = field(default_factory=list)
    """The first MAX_SKIPPED_ITEMS skipped records."""
    label_counts: dict[int, int] = field(default_factory=dict)
    note: str = ""
    """How the split was made where the release has no such split."""

    def skip(self, item: str) -> None:
        self.skipped += 1
        if len(self.skipped_items) < MAX_SKIPPED_ITEMS:
            self.skipped_items.append(item)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(eq=False)
class LraSplit(Sequence):
    """The examples of one split, stored as data values (id = value + OFFSET, see tasks.py):
    document i is codes[offsets[i]:offsets[i + 1]]. Indexing gives the dict `collate` takes."""

    task: str
    codes: np.ndarray
    """(T,) uint8 data values of every (truncated) document, one after the other."""
    offsets: np.ndarray
    """(N + 1,) int64."""
    labels: np.ndarray
    """(N,) int64 class ids."""
    indices: np.ndarray
    """(N,) int64: the example's position in its source (see the module docstring)."""
    cls: bool = True
    """Prepend CLS to every document."""
    codes_b: np.ndarray | None = None
    """Pair tasks: the second documents, as codes / offsets."""
    offsets_b: np.ndarray | None = None

    @property
    def pair(self) -> bool:
        return self.codes_b is not None

    @property
    def pad_id(self) -> int:
        return PAD_ID

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: Any) -> dict[str, Any]:  # type: ignore[override]
        n = len(self)
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"LraSplit indices are ints, got {type(i).__name__}")
        if not -n <= i < n:
            raise IndexError(f"example {i} out of range for {n} examples")
        i = int(i) % n
        ids = to_ids(self.codes[self.offsets[i] : self.offsets[i + 1]], self.cls)
        item: dict[str, Any] = {
            "input_ids": ids,
            "token_type_ids": np.zeros(len(ids), dtype=np.int8),
            "label": int(self.labels[i]),
            "index": int(self.indices[i]),
        }
        if self.codes_b is not None:
            assert self.offsets_b is not None
            ids_b = to_ids(self.codes_b[self.offsets_b[i] : self.offsets_b[i + 1]], self.cls)
            item["input_ids_b"] = ids_b
            item["token_type_ids_b"] = np.zeros(len(ids_b), dtype=np.int8)
        return item

    def lengths(self) -> np.ndarray:
        """(N,) tokens per example (CLS included; pairs: the longer document)."""
        n = np.diff(self.offsets) + int(self.cls)
        if self.offsets_b is not None:
            n = np.maximum(n, np.diff(self.offsets_b) + int(self.cls))
        return n


class Builder:
    """Accumulates documents (truncated to max_length) and labels into an LraSplit."""

    def __init__(self, task: LraTask, stats: SplitStats, max_length: int, cls: bool) -> None:
        self.task, self.stats, self.max_length, self.cls = task, stats, max_length, cls
        self.docs: list[list[np.ndarray]] = [[], []] if task.pair else [[]]
        self.labels: list[int] = []
        self.indices: list[int] = []

    def add(self, docs: Sequence[np.ndarray], label: int, index: int) -> None:
        for store, codes in zip(self.docs, docs, strict=True):
            self.stats.longest = max(self.stats.longest, len(codes))
            if len(codes) > self.max_length:
                self.stats.truncated += 1
                codes = codes[: self.max_length]
            store.append(codes)
        self.labels.append(label)
        self.indices.append(index)

    def finish(self) -> tuple[LraSplit, SplitStats]:
        codes, offsets = zip(*(concat(store) for store in self.docs))
        split = LraSplit(
            self.task.name,
            codes[0],
            offsets[0],
            np.asarray(self.labels, dtype=np.int64),
            np.asarray(self.indices, dtype=np.int64),
            self.cls,
            codes[1] if self.task.pair else None,
            offsets[1] if self.task.pair else None,
        )
        return finish_split(self.stats, split)


def concat(docs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    codes = np.concatenate(docs).astype(np.uint8, copy=False) if docs else np.zeros(0, np.uint8)
    return codes, offsets


def finish_split(stats: SplitStats, split: LraSplit) -> tuple[LraSplit, SplitStats]:
    stats.examples = len(split)
    if not len(split):
        raise ValueError(
            f"{stats.source}: no examples in LRA {stats.task} split {stats.split!r} "
            f"({stats.rows} records, {stats.skipped} skipped)"
        )
    stats.label_counts = {int(k): int(v) for k, v in sorted(Counter(split.labels.tolist()).items())}
    if stats.skipped:
        log.warning(
            "%s: skipped %d of %d records (%s%s)",
            stats.source,
            stats.skipped,
            stats.rows,
            ", ".join(stats.skipped_items),
            ", ..." if stats.skipped > len(stats.skipped_items) else "",
        )
    if stats.truncated:
        log.info("%s: %d documents cut to max_length", stats.source, stats.truncated)
    return split, stats


def check_label(task: LraTask, label: int, where: str) -> int:
    if not 0 <= label < task.num_labels:
        raise ValueError(
            f"{where}: label {label} is outside {task.name}'s labels 0..{task.num_labels - 1}"
        )
    return label


def find_file(task: LraTask, data_dir: Path, name: str) -> Path:
    """data_dir/name or data_dir/<subdir>/name, whichever exists first."""
    if not data_dir.is_dir():
        raise FileNotFoundError(f"LRA {task.name} data directory {data_dir} does not exist")
    candidates = [data_dir / name] + [data_dir / sub / name for sub in task.data_subdirs]
    for path in candidates:
        if path.exists():
            return path
    raise FileNotFoundError(
        f"LRA {task.name}: {name} not found; looked for {', '.join(map(str, candidates))}"
    )
