"""GLUE examples from the original TSV distribution, a local HF `datasets` DatasetDict or a Hub
snapshot of `nyu-mll/glue` (Parquet), and their tokenisation and batching.

Three layouts, detected by `load_split` (split names as in tasks.py: train, dev, test;
MNLI dev_matched, dev_mismatched, test_matched, test_mismatched; AX test):

* TSV: the original GLUE distribution (`download_glue_data.py`): one folder per task (CoLA,
  SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE, WNLI, diagnostic). Read as GLUE's own tools read it:
  tab-separated with quoting OFF (csv.QUOTE_NONE: a `"` is ordinary text and never starts a
  quoted field), UTF-8, a leading BOM dropped (MRPC's train/dev headers carry one). CoLA's train
  and dev files have no header; every other file does, and columns are found by header name.
* HF: a `DatasetDict.save_to_disk` directory of HF's `glue` config for the task (columns
  sentence / sentence1, sentence2 / question1, question2 / premise, hypothesis / question,
  sentence; `label` a ClassLabel; `idx`). A single split's `Dataset.save_to_disk` (state.json,
  no dataset_dict.json) is refused: save the DatasetDict, so every split is there.
* Parquet: a snapshot of the Hub's `nyu-mll/glue` (`huggingface_hub.snapshot_download(...,
  repo_type="dataset")`): `<config>/<split>-00000-of-00001.parquet` (any number of
  `-NNNNN-of-NNNNN` shards), e.g. mnli/validation_matched-00000-of-00001.parquet,
  ax/test-00000-of-00001.parquet. Read with `datasets.load_dataset("parquet", ...)`, which
  restores the features (the ClassLabel and its names) from the files' "huggingface" schema
  metadata.

In the two HF layouts HF's split names (validation, validation_matched, ...) are mapped from
ours, and HF's label ids are mapped to ours BY NAME (HF's MNLI is entailment, neutral,
contradiction; ours is run_glue's contradiction, entailment, neutral). The label column must be
the task's: float scores for STS-B, class ids for the rest, and a ClassLabel's names exactly
HF glue's for the task, in HF's order (or exactly our labels, in our order), so another task's
data with matching columns is refused (RTE's names are entailment, not_entailment; WNLI's the
reverse; MRPC's 0/1 classes are no STS-B scores).

Either way a split becomes a list of `Example`s whose `label` is an id into `task.labels`
(a float for STS-B, None for test splits) and whose `index` is the GLUE test index for test
splits (the server matches predictions by it) and the 0-based data-row number otherwise (HF's
`idx`, which counts rows the same way).

Bad input (all tested):
* a missing file or directory -> FileNotFoundError naming what was looked for;
* a header without a needed column -> ValueError naming the file, the column and the columns
  present (usually the wrong file or task); the same for a HF split without a needed column;
* another task's labels (a ClassLabel with other names or order, an int column for STS-B, a
  float column for a classification task) -> ValueError naming the task, the data and the
  names or type found (and the tasks whose labels they are);
* a row with too few columns -> skipped, counted in `SplitStats` (with its line number) and
  warned about once per file. QQP's train file has such rows (a question broken over lines),
  which run_glue skips the same way;
* a label outside the task's label set, an STS-B score that is not a number in [0, 5], or a
  test index that is not an integer -> ValueError with file:line (HF: directory, split, row);
* no examples at all -> ValueError.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data_prep import format as fmt
from finetune.batching import collate as collate  # re-exported: the shared batching
from finetune.glue.tasks import TASKS, GlueTask, TsvLayout, get_task

log = logging.getLogger(__name__)

HF_MARKER = "dataset_dict.json"  # written by DatasetDict.save_to_disk
HF_DATASET_FILES = ("dataset_info.json", "state.json")  # a single Dataset.save_to_disk
MAX_SKIPPED_LINES = 20  # line numbers kept in SplitStats; the count is always complete
STSB_RANGE = (0.0, 5.0)


@dataclass(frozen=True, slots=True)
class Example:
    """One GLUE example."""

    index: int
    """Test splits: the GLUE index (the submission's `index` column); else the data-row number."""
    text_a: str
    text_b: str | None
    """Segment B of a pair task; None for CoLA and SST-2."""
    label: int | float | None
    """An id into `task.labels`; a float score for STS-B; None for test splits."""


@dataclass
class SplitStats:
    """What reading one split saw."""

    source: str
    """The TSV file, or "<HF folder>:<HF split>" (a DatasetDict or a Hub config folder)."""
    split: str
    format: str
    """"tsv", "hf" or "parquet" (`SplitSource.format`)."""
    rows: int = 0
    """Data rows read (a header excluded)."""
    examples: int = 0
    skipped: int = 0
    """Malformed rows skipped (too few columns; HF: a null text)."""
    skipped_lines: list[int] = field(default_factory=list)
    """The first MAX_SKIPPED_LINES skipped rows: 1-based file lines (TSV) or 0-based rows (HF)."""

    def skip(self, where: int) -> None:
        self.skipped += 1
        if len(self.skipped_lines) < MAX_SKIPPED_LINES:
            self.skipped_lines.append(where)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def counts(self) -> dict[str, int]:
        """{"read": rows, "skipped": malformed rows}: what a run's results.json keeps."""
        return {"read": self.rows, "skipped": self.skipped}


# ----------------------------------------------------------------------------- labels


def _parse_score(value: Any, where: str) -> float:
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: STS-B score {value!r} is not a number") from None
    lo, hi = STSB_RANGE
    if not (math.isfinite(score) and lo <= score <= hi):
        raise ValueError(f"{where}: STS-B score {value!r} is outside [{lo:g}, {hi:g}]")
    return score


def _label_ids(task: GlueTask) -> dict[str, int]:
    return {label: i for i, label in enumerate(task.labels)}


def _parse_label(task: GlueTask, ids: dict[str, int], value: str, where: str) -> int | float:
    if task.is_regression:
        return _parse_score(value, where)
    if value not in ids:
        raise ValueError(
            f"{where}: label {value!r} is not one of {task.name}'s labels {list(task.labels)}"
        )
    return ids[value]


def _finish(stats: SplitStats, examples: list[Example]) -> tuple[list[Example], SplitStats]:
    stats.examples = len(examples)
    if stats.skipped:
        log.warning(
            "%s: skipped %d malformed rows of %d (at %s%s)",
            stats.source,
            stats.skipped,
            stats.rows,
            stats.skipped_lines,
            ", ..." if stats.skipped > len(stats.skipped_lines) else "",
        )
    if not examples:
        raise ValueError(
            f"{stats.source}: no examples in split {stats.split!r} "
            f"({stats.rows} rows, {stats.skipped} skipped as malformed)"
        )
    return examples, stats


# ----------------------------------------------------------------------------- TSV


def tsv_path(task: str | GlueTask, data_dir: str | os.PathLike, split: str) -> Path:
    """The split's TSV file in `data_dir` (the task folder) or `data_dir/<task folder>` (the
    GLUE root); FileNotFoundError naming both places otherwise."""
    task = get_task(task)
    name = task.tsv_file(split)
    candidates = [Path(data_dir) / name, Path(data_dir) / task.dir_name / name]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"GLUE {task.name} {split} file not found: neither {candidates[0]} nor {candidates[1]} "
        "exists"
    )


def _tsv_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(1-based line number, fields) of a GLUE TSV file, quoting off."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE, quotechar=None)
        try:
            for row in reader:
                yield reader.line_num, row
        except (csv.Error, UnicodeDecodeError) as e:
            raise ValueError(f"{path}:{reader.line_num + 1}: unreadable TSV: {e}") from e


def _wanted(layout: TsvLayout, labelled: bool) -> dict[str, str | int]:
    """Field -> column (name or position) a split needs."""
    wanted = {"text_a": layout.text_a, "text_b": layout.text_b}
    wanted["label" if labelled else "index"] = layout.label if labelled else layout.index
    return {key: col for key, col in wanted.items() if col is not None}


def _header_positions(
    path: Path, wanted: dict[str, str | int], header: list[str]
) -> dict[str, int]:
    positions = {}
    for key, column in wanted.items():
        if column not in header:
            raise ValueError(
                f"{path}: the header has no column {column!r} (columns: {header}); "
                "is this the right file for the task?"
            )
        positions[key] = header.index(column)
    return positions


def _tsv_example(
    task: GlueTask,
    ids: dict[str, int],
    pos: dict[str, int],
    row: list[str],
    row_number: int,
    where: str,
) -> Example:
    label = _parse_label(task, ids, row[pos["label"]], where) if "label" in pos else None
    index = row_number
    if "index" in pos:
        value = row[pos["index"]]
        try:
            index = int(value)
        except ValueError:
            raise ValueError(f"{where}: index {value!r} is not an integer") from None
    text_b = row[pos["text_b"]] if "text_b" in pos else None
    return Example(index, row[pos["text_a"]], text_b, label)


def read_tsv_split(
    task: str | GlueTask, data_dir: str | os.PathLike, split: str
) -> tuple[list[Example], SplitStats]:
    """A split of the original GLUE TSV distribution: (examples, stats).

    `data_dir` is the task's folder (e.g. glue_data/MNLI) or the GLUE root (glue_data)."""
    task = get_task(task)
    labelled = task.is_labelled(split)
    layout = task.layout(split)
    path = tsv_path(task, data_dir, split)
    stats = SplitStats(str(path), split, "tsv")
    ids = _label_ids(task)
    rows = _tsv_rows(path)
    wanted = _wanted(layout, labelled)
    if layout.header:
        first = next(rows, None)
        if first is None:
            raise ValueError(f"{path}: empty file (no header)")
        pos = _header_positions(path, wanted, first[1])
    else:
        pos = dict(wanted)
    need = max(pos.values()) + 1
    examples = []
    for line, row in rows:
        stats.rows += 1
        if len(row) < need:
            stats.skip(line)
            continue
        examples.append(_tsv_example(task, ids, pos, row, stats.rows - 1, f"{path}:{line}"))
    return _finish(stats, examples)


# ----------------------------------------------------------------------------- HF datasets


@dataclass(frozen=True)
class _HfLabels:
    """How a labelled HF split's label column is read (see `_hf_labels`)."""

    to_ours: dict[int, int]
    """HF label id -> our label id; empty for STS-B, whose labels are scores."""
    ids: str
    """The valid ids, as errors name them."""


def _is_float(feature: Any) -> bool:
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype.startswith("float")


def _is_int(feature: Any) -> bool:
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype.startswith(("int", "uint"))


def _feature_kind(feature: Any) -> str:
    """A label feature as errors name it: "a ClassLabel with names [...]", "a plain int64
    column"."""
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        return f"a ClassLabel with names {list(feature.names)}"
    if isinstance(feature, datasets.Value):
        return f"a plain {feature.dtype} column"
    return f"a {type(feature).__name__} feature"


def _labelled_like(feature: Any) -> str:
    """Which HF glue configs have a label column like `feature` (ClassLabel names in the same
    order, or float scores), as a hint for errors; "" when none has."""
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        names = list(feature.names)
        like = [t.name for t in TASKS.values() if [hf for hf, _ in t.hf_labels] == names]
    elif _is_float(feature):
        like = [t.name for t in TASKS.values() if t.is_regression]
    else:
        like = []
    if not like:
        return ""
    return f"; that is the label of HF glue/{', glue/'.join(like)}: is --data another task's?"


def _hf_labels(task: GlueTask, feature: Any, where: str) -> _HfLabels:
    """How to read a labelled split's label column, once it is checked to be `task`'s: float
    scores for STS-B; for the other tasks a ClassLabel whose names are HF glue's for the task in
    HF's order (mapped to ours by name) or exactly our labels in our order, or a plain int
    column (read in HF glue's order, with a warning). ValueError naming the task, `where` and
    what was found otherwise: another task's data whose columns happen to match (RTE's names
    are entailment, not_entailment; WNLI's the reverse; MRPC's classes are no STS-B scores)."""
    import datasets

    if task.is_regression:
        if _is_float(feature):
            return _HfLabels({}, "")
        raise ValueError(
            f"{where}: glue/{task.name}'s label is a similarity score (a float in [0, 5]), but "
            f"this label column is {_feature_kind(feature)}{_labelled_like(feature)}"
        )
    ours = _label_ids(task)
    hf_names = [hf for hf, _ in task.hf_labels]
    if isinstance(feature, datasets.ClassLabel):
        names = list(feature.names)
        if names == hf_names:
            labels = [label for _, label in task.hf_labels]
        elif names == list(task.labels):
            labels = names
        else:
            raise ValueError(
                f"{where}: the label's ClassLabel names {names} are not glue/{task.name}'s: "
                f"HF's {hf_names} (in that order) or GLUE's {list(task.labels)}"
                f"{_labelled_like(feature)}"
            )
        to_ours = {hf_id: ours[label] for hf_id, label in enumerate(labels)}
        return _HfLabels(to_ours, f"the ClassLabel's ids 0..{len(names) - 1} ({names})")
    if _is_int(feature):
        log.warning(
            "%s: label is a plain int column, not a ClassLabel; assuming HF glue/%s's order %s",
            where,
            task.name,
            hf_names,
        )
        to_ours = {hf_id: ours[label] for hf_id, (_, label) in enumerate(task.hf_labels)}
        return _HfLabels(
            to_ours,
            f"glue/{task.name}'s label ids 0..{len(hf_names) - 1} (the label column is a plain "
            f"int, not a ClassLabel; read in HF glue's order {hf_names})",
        )
    raise ValueError(
        f"{where}: glue/{task.name}'s label is a class id (a ClassLabel, or ints in HF glue's "
        f"order {hf_names}), but this label column is {_feature_kind(feature)}"
        f"{_labelled_like(feature)}"
    )


def _hf_label(task: GlueTask, labels: _HfLabels, value: Any, where: str) -> int | float:
    if value is None or value == -1:
        raise ValueError(f"{where}: no label (HF's -1) in a labelled split")
    if task.is_regression:
        return _parse_score(value, where)
    if value not in labels.to_ours:
        raise ValueError(f"{where}: label id {value!r} is outside {labels.ids}")
    return labels.to_ours[value]


def _dataset_dict_splits(hf_dir: Path) -> list[str]:
    """The splits a DatasetDict.save_to_disk directory lists in its dataset_dict.json."""
    path = hf_dir / HF_MARKER
    try:
        return [str(split) for split in json.loads(path.read_text())["splits"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a DatasetDict.save_to_disk record ({e!r})") from None


def _load_hf_split(task: GlueTask, hf_dir: Path, split: str) -> Any:
    import datasets

    if not (hf_dir / HF_MARKER).is_file():
        raise FileNotFoundError(
            f"{hf_dir} is not a HF DatasetDict directory (no {HF_MARKER}; make one with "
            "DatasetDict.save_to_disk)"
        )
    hf_split = task.hf_split(split)
    splits = _dataset_dict_splits(hf_dir)
    if hf_split not in splits:
        raise ValueError(
            f"{hf_dir}: no split {hf_split!r} (our {split!r}); its splits are {sorted(splits)}"
        )
    return datasets.load_from_disk(str(hf_dir))[hf_split]


def parquet_shards(folder: str | os.PathLike, hf_split: str) -> list[Path]:
    """A split's files in a Hub config folder: `<hf_split>-NNNNN-of-NNNNN.parquet`, in order
    (so "test-*" never takes MNLI's "test_matched-*")."""
    return sorted(Path(folder).glob(f"{hf_split}-*-of-*.parquet"))


def _load_parquet_split(task: GlueTask, folder: Path, split: str) -> Any:
    import datasets

    hf_split = task.hf_split(split)
    shards = parquet_shards(folder, hf_split)
    if not shards:
        raise FileNotFoundError(
            f"{folder}: no {hf_split}-*-of-*.parquet (the Hub's layout of nyu-mll/glue: "
            "<config>/<split>-00000-of-00001.parquet)"
        )
    # datasets' own Parquet builder: it restores the features (ClassLabel names included) from
    # the files' "huggingface" schema metadata, as load_dataset("nyu-mll/glue", ...) does.
    return datasets.load_dataset(
        "parquet", data_files={hf_split: [str(p) for p in shards]}, split=hf_split
    )


def _read_dataset(
    task: GlueTask, ds: Any, source: str, split: str, layout: str
) -> tuple[list[Example], SplitStats]:
    """The examples of one split of a HF `datasets.Dataset` in HF glue's schema."""
    labelled = task.is_labelled(split)
    col_a, col_b = task.hf_columns
    needed = [c for c in (col_a, col_b, "label" if labelled else None) if c is not None]
    for column in needed:
        if column not in ds.column_names:
            raise ValueError(
                f"{source}: no column {column!r} (columns: {ds.column_names}); "
                f"is this HF's glue/{task.name}?"
            )
    labels = _hf_labels(task, ds.features["label"], source) if labelled else None
    data = ds.select_columns([c for c in [*needed, "idx"] if c in ds.column_names])[:]
    stats = SplitStats(source, split, layout, rows=len(ds))
    indices = data.get("idx", range(len(ds)))
    examples = []
    for i in range(len(ds)):
        text_a = data[col_a][i]
        text_b = data[col_b][i] if col_b is not None else None
        if text_a is None or (col_b is not None and text_b is None):
            stats.skip(i)
            continue
        label = None
        if labels is not None:
            label = _hf_label(task, labels, data["label"][i], f"{source} row {i}")
        examples.append(Example(int(indices[i]), text_a, text_b, label))
    return _finish(stats, examples)


def read_hf_split(
    task: str | GlueTask, hf_dir: str | os.PathLike, split: str
) -> tuple[list[Example], SplitStats]:
    """A split of a local HF `datasets` GLUE directory (save_to_disk of HF's `glue` config for
    the task): (examples, stats). `split` is ours (dev, dev_matched, ...), mapped to HF's."""
    task = get_task(task)
    hf_dir = Path(hf_dir)
    ds = _load_hf_split(task, hf_dir, split)
    return _read_dataset(task, ds, f"{hf_dir}:{task.hf_split(split)}", split, "hf")


def read_parquet_split(
    task: str | GlueTask, folder: str | os.PathLike, split: str
) -> tuple[list[Example], SplitStats]:
    """A split of a Hub snapshot of `nyu-mll/glue`: `folder` is the task's config folder
    (e.g. snapshot/mnli) holding `<HF split>-NNNNN-of-NNNNN.parquet`: (examples, stats)."""
    task = get_task(task)
    folder = Path(folder)
    ds = _load_parquet_split(task, folder, split)
    return _read_dataset(task, ds, f"{folder}:{task.hf_split(split)}", split, "parquet")


# ----------------------------------------------------------------------------- any layout


@dataclass(frozen=True)
class SplitSource:
    """Where `find_split` found a split."""

    format: str
    """"tsv" (original GLUE TSVs), "hf" (DatasetDict.save_to_disk) or "parquet" (a Hub
    snapshot)."""
    folder: Path
    """The folder read: the TSV task folder, the DatasetDict or the Hub config folder."""


_READERS = {"tsv": read_tsv_split, "hf": read_hf_split, "parquet": read_parquet_split}


def _candidates(task: GlueTask, base: Path) -> list[Path]:
    """The folders a split is looked for in: `base`, its GLUE folder, its HF config folder."""
    return [base, base / task.dir_name, base / task.name]


def _source_in(task: GlueTask, folder: Path, split: str) -> SplitSource | None:
    hf_split = task.hf_split(split)
    if (folder / HF_MARKER).is_file():
        return SplitSource("hf", folder) if hf_split in _dataset_dict_splits(folder) else None
    if parquet_shards(folder, hf_split):
        return SplitSource("parquet", folder)
    if (folder / task.tsv_file(split)).is_file():
        return SplitSource("tsv", folder)
    if all((folder / name).is_file() for name in HF_DATASET_FILES):
        hf_splits = ", ".join(task.hf_split(s) for s in task.splits)
        raise ValueError(
            f"{folder} holds a single split (a Dataset.save_to_disk: "
            f"{' and '.join(HF_DATASET_FILES)}, no {HF_MARKER}), but GLUE {task.name} needs its "
            f"splits ({hf_splits}) by name: save the DatasetDict instead, e.g. "
            f"datasets.load_dataset('nyu-mll/glue', '{task.name}').save_to_disk(...)"
        )
    return None


def layouts_looked_for(task: str | GlueTask, data_dir: str | os.PathLike, split: str) -> str:
    """Where and what `find_split` looks for, for messages about a split it did not find."""
    task = get_task(task)
    hf_split = task.hf_split(split)
    folders = _candidates(task, Path(data_dir))
    text = (
        f"looked in {', '.join(str(f) for f in folders)} for {task.tsv_file(split)} (original "
        f"GLUE TSVs), a HF {HF_MARKER} listing {hf_split!r} (DatasetDict.save_to_disk) or "
        f"{hf_split}-*-of-*.parquet (a Hub snapshot of nyu-mll/glue)"
    )
    for folder in folders:
        if (folder / HF_MARKER).is_file():
            text += f"; {folder} is a DatasetDict of {sorted(_dataset_dict_splits(folder))}"
    return text


def find_split(task: str | GlueTask, data_dir: str | os.PathLike, split: str) -> SplitSource | None:
    """Where `data_dir` holds a split, or None.

    Looked for, in order, in `data_dir`, `data_dir/<GLUE folder>` (e.g. SST-2, diagnostic) and
    `data_dir/<HF config>` (e.g. sst2, ax): the first folder that is a HF DatasetDict listing
    the split (dataset_dict.json), holds the Hub's `<HF split>-*-of-*.parquet` or the split's
    TSV file. FileNotFoundError if `data_dir` is no directory; ValueError for a folder holding
    a single split's Dataset.save_to_disk."""
    task = get_task(task)
    task.check_split(split)
    base = Path(data_dir)
    if not base.is_dir():
        raise FileNotFoundError(f"GLUE data directory {base} does not exist")
    for folder in _candidates(task, base):
        source = _source_in(task, folder, split)
        if source is not None:
            return source
    return None


def load_split(
    task: str | GlueTask, data_dir: str | os.PathLike, split: str
) -> tuple[list[Example], SplitStats]:
    """A split from whichever layout `data_dir` holds it in (see `find_split`): (examples,
    stats). FileNotFoundError naming the folders and files looked for if none."""
    task = get_task(task)
    source = find_split(task, data_dir, split)
    if source is None:
        raise FileNotFoundError(
            f"no GLUE {task.name} {split} data under {data_dir}: "
            f"{layouts_looked_for(task, data_dir, split)}"
        )
    return _READERS[source.format](task, source.folder, split)


# ----------------------------------------------------------------------------- tokenisation


@dataclass
class EncodedSplit:
    """Token ids of a split, unpadded and concatenated: example i is ids[offsets[i]:offsets[i+1]].

    Indexing gives the dict `collate` batches: input_ids, token_type_ids (numpy), index and,
    for labelled splits, label."""

    ids: np.ndarray
    """(T,) int32: [CLS] A [SEP] (B [SEP]) of every example, one after the other."""
    type_ids: np.ndarray
    """(T,) int8: 0 for [CLS], A and the first [SEP]; 1 for B and its [SEP]."""
    offsets: np.ndarray
    """(N + 1,) int64."""
    indices: np.ndarray
    """(N,) int64: `Example.index`."""
    labels: np.ndarray | None
    """(N,) int64 class ids or float32 STS-B scores; None for test splits."""
    pad_id: int
    """The tokenizer's padding id (for `collate`)."""
    truncated: int
    """Examples cut to max_length."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        start, end = self.offsets[i], self.offsets[i + 1]
        item = {
            "input_ids": self.ids[start:end],
            "token_type_ids": self.type_ids[start:end],
            "index": int(self.indices[i]),
        }
        if self.labels is not None:
            item["label"] = self.labels[i].item()
        return item

    def lengths(self) -> np.ndarray:
        """(N,) tokens per example (for length-grouped batching)."""
        return np.diff(self.offsets)


def load_glue_tokenizer(path: str | os.PathLike) -> Any:
    """A `tokenizers.Tokenizer` from a tokenizer.json or a release directory."""
    from data_prep.tokenizer import load_tokenizer

    path = Path(path)
    if path.is_dir():
        from model.hub.release import tokenizer_path

        found = tokenizer_path(path)
        if found is None:
            raise FileNotFoundError(f"{path} holds no {fmt.TOKENIZER} (not a release directory?)")
        path = found
    return load_tokenizer(path)


def pad_token_id(tokenizer: Any) -> int:
    """The id of <pad> (or [PAD]); ValueError if the tokenizer has neither."""
    for spelling in fmt.SPECIAL_TOKEN_NAMES["pad"]:
        token_id = tokenizer.token_to_id(spelling)
        if token_id is not None:
            return int(token_id)
    raise ValueError(f"the tokenizer has no padding token {fmt.SPECIAL_TOKEN_NAMES['pad']}")


def _truncating_copy(tokenizer: Any, max_length: int, pair: bool) -> Any:
    """A copy of `tokenizer` (the caller's is left alone) that truncates to max_length tokens,
    special tokens included, longest segment first, and does not pad."""
    from tokenizers import Tokenizer

    if tokenizer.post_processor is None:
        raise ValueError(
            "the tokenizer has no post-processor, so encoding would not add [CLS] / [SEP]; use "
            "the release's tokenizer.json"
        )
    specials = tokenizer.post_processor.num_special_tokens_to_add(pair)
    if max_length < specials + (2 if pair else 1):
        raise ValueError(
            f"max_length {max_length} leaves no room for the text: the tokenizer adds "
            f"{specials} special tokens to a {'pair' if pair else 'sentence'}"
        )
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.no_padding()
    tok.enable_truncation(max_length, strategy="longest_first")
    return tok


def _check_uniform(examples: Sequence[Example]) -> tuple[bool, bool]:
    """(is pair, is labelled), the same for every example; ValueError otherwise."""
    if not examples:
        raise ValueError("no examples to encode")
    pair = examples[0].text_b is not None
    labelled = examples[0].label is not None
    for ex in examples:
        if (ex.text_b is not None) != pair or (ex.label is not None) != labelled:
            raise ValueError(
                f"example {ex.index} differs from the first in having a segment B or a label: "
                "encode one split at a time"
            )
    return pair, labelled


def encode(
    examples: Sequence[Example],
    tokenizer: Any,
    max_length: int,
    batch_size: int = 8192,
) -> EncodedSplit:
    """Tokenises `examples` as [CLS] A [SEP] (B [SEP]) with segment ids 0 / 1, cut to at most
    `max_length` tokens (special tokens included) by shortening the longer segment first.

    `tokenizer` is a `tokenizers.Tokenizer` (the release's tokenizer.json, whose
    post-processor adds the special tokens), or a path to a tokenizer.json or release dir."""
    if not hasattr(tokenizer, "encode_batch"):
        tokenizer = load_glue_tokenizer(tokenizer)
    pair, labelled = _check_uniform(examples)
    tok = _truncating_copy(tokenizer, max_length, pair)
    ids, type_ids, lengths, truncated = [], [], [], 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        inputs = [(ex.text_a, ex.text_b) for ex in chunk] if pair else [ex.text_a for ex in chunk]
        for enc in tok.encode_batch(inputs):
            ids.append(np.asarray(enc.ids, dtype=np.int32))
            type_ids.append(np.asarray(enc.type_ids, dtype=np.int8))
            lengths.append(len(enc.ids))
            truncated += bool(enc.overflowing)
    labels = None
    if labelled:
        dtype = np.float32 if isinstance(examples[0].label, float) else np.int64
        labels = np.asarray([ex.label for ex in examples], dtype=dtype)
    return EncodedSplit(
        ids=np.concatenate(ids),
        type_ids=np.concatenate(type_ids),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        indices=np.asarray([ex.index for ex in examples], dtype=np.int64),
        labels=labels,
        pad_id=pad_token_id(tokenizer),
        truncated=truncated,
    )
