"""Long Range Arena examples from the official `lra_release` files (and the other usual
downloads), as token ids in the shared LRA vocabulary of tasks.py.

    examples, stats = load_split("listops", "lra_release/listops-1000", "train")
    batch = collate([examples[i] for i in range(8)], pad_id=PAD_ID)    # single-document tasks
    batch = collate_pair([examples[i] for i in range(8)], pad_id=PAD_ID)  # retrieval

`load_split` returns an `LraSplit`, an indexable sequence of example dicts ready for
`finetune.batching.collate`: `input_ids` ((L,) int32: [CLS] then the data ids, at most
max_length data ids), `token_type_ids` (zeros), `label` (int) and `index` (int); Retrieval
examples also carry `input_ids_b` / `token_type_ids_b`, the second document. The data are kept
compactly (one uint8 value per token) and ids are made on access.

Formats and splits (split names are "train", "val", "test" for every task; `data_dir` may be
the folder holding the files or a folder above it, see `LraTask.data_subdirs`):

* ListOps: `basic_{train,val,test}.tsv` (lra_release `listops-1000/`, or the output of
  `python -m data_prep listops`, which writes the same format): a `Source<TAB>Target` header,
  then rows, read with csv.reader(delimiter TAB, quoting off). Source is tokenised by
  whitespace with the parentheses dropped and the brackets kept (`model_tokens`); Target must
  be 0..9.
* Retrieval: `new_aan_pairs.{train,eval,test}.tsv` (lra_release `tsv_data/`; val = eval),
  as the official `lra_benchmarks/matching/input_pipeline.py` reads them: no header, TAB
  delimiter, quoting off (a `"` is text), five columns `label id1 id2 text1 text2`, the label a
  float ("0", "1", "0.0", "1.0") cast to int. Fields are huge (whole papers), so the csv field
  size limit is raised while reading. Each text becomes its first max_length bytes (the file is
  read with surrogateescape, so even invalid UTF-8 keeps its exact bytes).
* Text (IMDb): the `aclImdb` folder (`{train,test}/{neg,pos}/<id>_<rating>.txt`, neg = 0,
  pos = 1, `unsup` ignored; files in (label, id) order), or a local HF `datasets` DatasetDict
  folder of `imdb` (`datasets.load_from_disk`; columns text, label; splits train, test). The
  text is the file's bytes with surrounding ASCII whitespace stripped, as tfds `imdb_reviews`
  (which LRA uses) reads it; the HF text is UTF-8 encoded and stripped the same way. IMDb has
  no validation set: as in LRA (`text_classification/input_pipeline.py`: "use test set for
  validation"), val IS the test set. Select checkpoints on it only to reproduce LRA.
* Image (CIFAR-10): the `cifar-10-batches-py` pickles (`data_batch_1..5`, `test_batch`: dicts
  with b"data" (N, 3072) uint8, the R, G, B planes of a 32x32 image each, and b"labels"),
  unpickled with a loader that only builds numpy arrays (no other code can run). Grey levels as
  `tf.image.rgb_to_grayscale` (`rgb_to_grayscale` in tasks.py), row-major, 1024 tokens. As in
  LRA (`image/input_pipeline.py`: tfds `train[:90%]` / `train[90%:]`), val is 10 % of the
  training images: train = the first 45000 rows of data_batch_1..5, val = the last 5000
  (n - n // 10 and n // 10 for other sizes; tfds's own order cannot be reproduced, and the
  batches are in random order already).
* Pathfinder (pathfinder32) and Path-X (pathfinder128): `<difficulty>/metadata/<n>.npy`, text
  files despite the name, one line per image `imgs/<batch> sample_<k>.png <?> <label> ...`
  (whitespace-separated; the image is `<difficulty>/<field 0>/<field 1>`, the label field 3),
  and 8-bit grey PNGs. `difficulty` is one of curv_baseline, curv_contour_length_9,
  curv_contour_length_14 (or easy, intermediate, hard; default hard, the LRA setting). The
  release holds one empty image (pathfinder32/curv_baseline/imgs/0/sample_172.png); like the
  official pipeline (which filters images of length 0) every empty file is skipped, and
  counted in SplitStats. A missing, unreadable or wrongly sized image is an error. Splits, as
  the official tfds slices `[:80%]`, `[80%:90%]`, `[90%:]` of one difficulty: the metadata
  files in numeric order, their lines in order, empty images removed, then
  `np.random.default_rng(split_seed).permutation(n)`: the first n * 8 // 10 are train, the next
  n * 9 // 10 - n * 8 // 10 val, the rest test; each split is returned in metadata order.
  The split depends only on the metadata, the empty files and the seed.

`index` is the example's position in its source: the 0-based data row (TSV), the review's
position in (label, id) order, the row in the concatenated CIFAR batches, or the metadata line
(counted over all metadata files of the difficulty, empty images included) for Pathfinder.

Bad input: a missing file or folder -> FileNotFoundError naming what was looked for; a
malformed row, an unknown ListOps token or a label outside the task's labels -> ValueError
with file:line; no examples at all -> ValueError.
"""

from __future__ import annotations

import csv
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune.batching import collate as collate  # re-exported: the shared batching
from finetune.lra.images import (
    DEFAULT_DIFFICULTY,
    PATHFINDER_SPLIT_SEED,
    PATHFINDER_TASKS,
    PathfinderEntry,
    load_image,
    load_pathfinder,
    read_cifar_batch,
    read_pathfinder_metadata,
    split_indices,
)
from finetune.lra.split import Builder, LraSplit, SplitStats, check_label, find_file
from finetune.lra.tasks import (
    PAD_ID,
    LraTask,
    byte_codes,
    get_task,
    listops_codes,
    listops_codes_batch,
)

log = logging.getLogger(__name__)

HF_MARKER = "dataset_dict.json"  # written by DatasetDict.save_to_disk
LISTOPS_HEADER = ("Source", "Target")
RETRIEVAL_COLUMNS = ("label", "id1", "id2", "text1", "text2")
LISTOPS_CHUNK = 1024  # rows tokenised at once
_IMDB_FILE = re.compile(r"^(\d+)_(\d+)\.txt$")
_IMDB_LABELS = {"neg": 0, "pos": 1, "negative": 0, "positive": 1}
_CSV_FIELD_LIMIT = min(sys.maxsize, 2**31 - 1)


# ----------------------------------------------------------------------------- TSV tasks


def _tsv_rows(path: Path, errors: str = "strict") -> Iterator[tuple[int, list[str]]]:
    """(1-based line number, fields) of a TSV file, quoting off, the field size limit raised
    while reading (and restored after)."""
    old_limit = csv.field_size_limit(_CSV_FIELD_LIMIT)
    try:
        with open(path, encoding="utf-8", errors=errors, newline="") as f:
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE, quotechar=None)
            try:
                for row in reader:
                    yield reader.line_num, row
            except (csv.Error, UnicodeDecodeError) as e:
                raise ValueError(f"{path}:{reader.line_num + 1}: unreadable TSV: {e}") from e
    finally:
        csv.field_size_limit(old_limit)


def read_listops(
    path: str | os.PathLike, split: str = "?", max_length: int | None = None, cls: bool = True
) -> tuple[LraSplit, SplitStats]:
    """A ListOps TSV (official or `data_prep.listops`): `Source<TAB>Target` header, then rows."""
    task = get_task("listops")
    path = Path(path)
    stats = SplitStats(task.name, split, str(path), "tsv")
    builder = Builder(task, stats, task.resolve_max_length(max_length), cls)
    rows = _tsv_rows(path)
    first = next(rows, None)
    if first is None:
        raise ValueError(f"{path}: empty file (no header)")
    if tuple(first[1]) != LISTOPS_HEADER:
        raise ValueError(
            f"{path}:{first[0]}: header {first[1]!r}, expected {list(LISTOPS_HEADER)!r}; "
            "is this a ListOps file?"
        )
    chunk: list[tuple[str, str, int]] = []  # (where, source, label)
    for line, row in rows:
        where = f"{path}:{line}"
        if len(row) != 2:
            raise ValueError(f"{where}: expected 2 columns (Source, Target), got {len(row)}")
        source, target = row
        try:
            label = int(target)
        except ValueError:
            raise ValueError(f"{where}: Target {target!r} is not an integer") from None
        chunk.append((where, source, check_label(task, label, where)))
        if len(chunk) == LISTOPS_CHUNK:
            _add_listops(builder, chunk)
            chunk = []
    _add_listops(builder, chunk)
    return builder.finish()


def _add_listops(builder: Builder, chunk: list[tuple[str, str, int]]) -> None:
    """Tokenises a chunk of rows at once (`listops_codes_batch`), else row by row."""
    codes = listops_codes_batch([source for _, source, _ in chunk])
    for i, (where, source, label) in enumerate(chunk):
        if codes is None:
            try:
                row_codes = listops_codes(source)
            except KeyError as e:
                raise ValueError(f"{where}: {e.args[0]}") from None
        else:
            row_codes = codes[i]
        builder.add([row_codes], label, builder.stats.rows)
        builder.stats.rows += 1


def _parse_float_label(value: str, where: str) -> int:
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"{where}: label {value!r} is not a number") from None
    if not (np.isfinite(x) and x == int(x)):
        raise ValueError(f"{where}: label {value!r} is not a whole number")
    return int(x)


def read_retrieval(
    path: str | os.PathLike, split: str = "?", max_length: int | None = None, cls: bool = True
) -> tuple[LraSplit, SplitStats]:
    """An AAN pairs TSV: no header, quoting off, rows `label id1 id2 text1 text2`."""
    task = get_task("retrieval")
    path = Path(path)
    stats = SplitStats(task.name, split, str(path), "tsv")
    limit = task.resolve_max_length(max_length)
    builder = Builder(task, stats, limit, cls)
    for line, row in _tsv_rows(path, errors="surrogateescape"):
        where = f"{path}:{line}"
        if len(row) != len(RETRIEVAL_COLUMNS):
            raise ValueError(
                f"{where}: expected {len(RETRIEVAL_COLUMNS)} columns "
                f"({' '.join(RETRIEVAL_COLUMNS)}), got {len(row)}"
            )
        label = check_label(task, _parse_float_label(row[0], where), where)
        docs = []
        for text in row[3:]:
            data = text.encode("utf-8", errors="surrogateescape")
            stats.longest = max(stats.longest, len(data))
            if len(data) > limit:  # cut before converting: texts are long
                stats.truncated += 1
                data = data[:limit]
            docs.append(byte_codes(data))
        builder.add(docs, label, stats.rows)
        stats.rows += 1
    return builder.finish()


# ----------------------------------------------------------------------------- Text (IMDb)


def _imdb_split_dir(split: str) -> str:
    return "train" if split == "train" else "test"


def read_aclimdb(
    root: str | os.PathLike, split: str, max_length: int | None = None, cls: bool = True
) -> tuple[LraSplit, SplitStats]:
    """IMDb from the `aclImdb` folder: {train,test}/{neg,pos}/<id>_<rating>.txt (val = test)."""
    task = get_task("text")
    task.check_split(split)
    split_dir = Path(root) / _imdb_split_dir(split)
    stats = SplitStats(task.name, split, str(split_dir), "aclImdb", note=_text_note(split))
    builder = Builder(task, stats, task.resolve_max_length(max_length), cls)
    for name, label in (("neg", 0), ("pos", 1)):
        folder = split_dir / name
        if not folder.is_dir():
            raise FileNotFoundError(f"aclImdb folder {folder} does not exist")
        files = []
        for path in folder.iterdir():
            if path.suffix != ".txt":
                continue
            m = _IMDB_FILE.match(path.name)
            if m is None:
                raise ValueError(f"{path}: not an aclImdb review file name (<id>_<rating>.txt)")
            files.append((int(m.group(1)), path))
        for _, path in sorted(files):
            builder.add([byte_codes(path.read_bytes().strip())], label, stats.rows)
            stats.rows += 1
    return builder.finish()


def _text_note(split: str) -> str:
    return "val is the IMDb test set (as LRA)" if split == "val" else ""


def read_hf_imdb(
    hf_dir: str | os.PathLike, split: str, max_length: int | None = None, cls: bool = True
) -> tuple[LraSplit, SplitStats]:
    """IMDb from a local HF DatasetDict folder (`imdb`: text, label; train / test; val = test)."""
    import datasets

    task = get_task("text")
    task.check_split(split)
    hf_dir = Path(hf_dir)
    if not (hf_dir / HF_MARKER).is_file():
        raise FileNotFoundError(
            f"{hf_dir} is not a HF DatasetDict directory (no {HF_MARKER}; make one with "
            "DatasetDict.save_to_disk)"
        )
    dataset_dict = datasets.load_from_disk(str(hf_dir))
    hf_split = _imdb_split_dir(split)
    if hf_split not in dataset_dict:
        raise ValueError(f"{hf_dir}: no split {hf_split!r}; its splits are {sorted(dataset_dict)}")
    ds = dataset_dict[hf_split]
    source = f"{hf_dir}:{hf_split}"
    for column in ("text", "label"):
        if column not in ds.column_names:
            raise ValueError(f"{source}: no column {column!r} (columns: {ds.column_names})")
    mapping = _hf_imdb_label_map(ds.features["label"], source)
    stats = SplitStats(task.name, split, source, "hf", note=_text_note(split))
    builder = Builder(task, stats, task.resolve_max_length(max_length), cls)
    data = ds.select_columns(["text", "label"])[:]
    for i, (text, value) in enumerate(zip(data["text"], data["label"])):
        where = f"{source} row {i}"
        if text is None:
            raise ValueError(f"{where}: no text")
        if value not in mapping:
            raise ValueError(f"{where}: label {value!r} is not one of {sorted(mapping)}")
        builder.add([byte_codes(text.encode("utf-8").strip())], mapping[value], i)
        stats.rows += 1
    return builder.finish()


def _hf_imdb_label_map(feature: Any, where: str) -> dict[int, int]:
    """HF label id -> ours (neg 0, pos 1), by the ClassLabel's names when there is one."""
    import datasets

    if not isinstance(feature, datasets.ClassLabel):
        return {0: 0, 1: 1}
    mapping = {}
    for hf_id, name in enumerate(feature.names):
        if name not in _IMDB_LABELS:
            raise ValueError(f"{where}: label name {name!r} is not one of {list(_IMDB_LABELS)}")
        mapping[hf_id] = _IMDB_LABELS[name]
    return mapping


def _load_text(
    task: LraTask, data_dir: Path, split: str, max_length: int | None, cls: bool
) -> tuple[LraSplit, SplitStats]:
    candidates = [data_dir, data_dir / "aclImdb", data_dir / "imdb"]
    for cand in candidates:
        if (cand / HF_MARKER).is_file():
            return read_hf_imdb(cand, split, max_length, cls)
        if (cand / _imdb_split_dir(split) / "pos").is_dir():
            return read_aclimdb(cand, split, max_length, cls)
    raise FileNotFoundError(
        f"no IMDb {split} data under {data_dir}: looked for an aclImdb folder "
        f"({_imdb_split_dir(split)}/pos, {_imdb_split_dir(split)}/neg) or a HF {HF_MARKER} in "
        f"{', '.join(map(str, candidates))}"
    )


# ----------------------------------------------------------------------------- any task


def load_split(
    task: str | LraTask,
    data_dir: str | os.PathLike,
    split: str,
    max_length: int | None = None,
    *,
    cls: bool = True,
    difficulty: str | None = None,
    split_seed: int = PATHFINDER_SPLIT_SEED,
    workers: int | None = None,
) -> tuple[LraSplit, SplitStats]:
    """One split of an LRA task: (examples, stats). See the module docstring for the formats.

    max_length: data tokens kept per document (None: the task's; image tasks only take their
    image size). cls: prepend CLS. difficulty, split_seed, workers (PNG decoding threads):
    Pathfinder and Path-X only; setting them for another task warns.
    """
    task = get_task(task)
    task.check_split(split)
    task.resolve_max_length(max_length)
    data_dir = Path(data_dir)
    if task.name not in PATHFINDER_TASKS:
        ignored = [
            name
            for name, value, default in (
                ("difficulty", difficulty, None),
                ("split_seed", split_seed, PATHFINDER_SPLIT_SEED),
                ("workers", workers, None),
            )
            if value != default
        ]
        if ignored:
            log.warning("LRA %s: ignoring %s (Pathfinder only)", task.name, ", ".join(ignored))
    if task.name in PATHFINDER_TASKS:
        return load_pathfinder(
            task, data_dir, split, cls, difficulty or DEFAULT_DIFFICULTY, split_seed, workers
        )
    return _LOADERS[task.name](task, data_dir, split, max_length, cls)


def _load_listops(
    task: LraTask, data_dir: Path, split: str, max_length: int | None, cls: bool
) -> tuple[LraSplit, SplitStats]:
    return read_listops(
        find_file(task, data_dir, task.official_source(split)), split, max_length, cls
    )


def _load_retrieval(
    task: LraTask, data_dir: Path, split: str, max_length: int | None, cls: bool
) -> tuple[LraSplit, SplitStats]:
    path = find_file(task, data_dir, task.official_source(split))
    return read_retrieval(path, split, max_length, cls)


def _load_cifar(
    task: LraTask, data_dir: Path, split: str, max_length: int | None, cls: bool
) -> tuple[LraSplit, SplitStats]:
    return load_image(task, data_dir, split, cls)  # max_length was checked: the whole image


_LOADERS = {
    "listops": _load_listops,
    "retrieval": _load_retrieval,
    "text": _load_text,
    "image": _load_cifar,
}


# ----------------------------------------------------------------------------- batching


def collate_pair(
    batch: Sequence[Mapping[str, Any]], pad_id: int = PAD_ID, pad_to_multiple_of: int | None = None
) -> dict[str, torch.Tensor]:
    """Pads the two documents of Retrieval examples separately (each to its own longest).

    Returns input_ids, attention_mask, token_type_ids (document 1), input_ids_b,
    attention_mask_b, token_type_ids_b (document 2), all (B, N) int64, index (B,) and
    labels (B,) int64: what a dual encoder takes."""
    out = collate(batch, pad_id, pad_to_multiple_of)
    second = collate(
        [
            {"input_ids": ex["input_ids_b"], "token_type_ids": ex["token_type_ids_b"]}
            for ex in batch
        ],
        pad_id,
        pad_to_multiple_of,
    )
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        out[f"{key}_b"] = second[key]
    return out


__all__ = [  # the readers of every format (images.py's re-exported), and what they return
    "PATHFINDER_SPLIT_SEED",
    "LraSplit",
    "PathfinderEntry",
    "SplitStats",
    "collate",
    "collate_pair",
    "load_split",
    "read_aclimdb",
    "read_cifar_batch",
    "read_hf_imdb",
    "read_listops",
    "read_pathfinder_metadata",
    "read_retrieval",
    "split_indices",
]
