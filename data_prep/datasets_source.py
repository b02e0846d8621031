"""`hf:` inputs: a corpus named the way the field names it, read through HF `datasets`.

    hf:SOURCE[@REVISION][:CONFIG[:SPLIT[:COLUMN]]]

SOURCE is a Hub dataset (`wikimedia/wikipedia`, `allenai/c4`, any `datasets` repository) or a
local directory: one made by `save_to_disk` (a Dataset or a DatasetDict), or a folder of data
files that `datasets` recognises (Parquet, Arrow, JSON Lines, CSV, text; its split layout, e.g.
`train-00000-of-00004.parquet` or `train/*.parquet`, decides the splits). Empty fields take
their defaults, so `hf:DIR`, `hf:NAME:CONFIG` and `hf:NAME::train:content` all work:

    REVISION  a Hub commit, branch or tag (default: the newest commit, recorded in the shards)
    CONFIG    the dataset's configuration (`20231101.en`, `en`); default: its default config
    SPLIT     the split, default `train`; slices such as `train[:1%]` work without --streaming
    COLUMN    the text column; default: --text-field (`text`)

Every source is read with the calls a user would write, `datasets.load_dataset(SOURCE, CONFIG,
split=SPLIT, revision=REVISION, streaming=S)` (a Hub name and a local folder alike), or
`datasets.load_from_disk(DIR)[SPLIT]` (+ `.to_iterable_dataset()` with --streaming) for a
`save_to_disk` directory. With --streaming nothing is downloaded or converted ahead: the rows
are read as they are needed (for a Hub dataset, from the Hub's files; each worker reads the
whole stream, as it reads every file input, and keeps its own documents), so a corpus larger
than the disk can be sharded; without it `datasets` first downloads and converts the split into
its cache (about the size of the text, on top of the download). Rows come in the dataset's own
order either way, so the documents, their indices and so the shards are the same with and
without --streaming (tested), whatever --workers and --num-jobs.

What the shards record for a source (its "fingerprint", like size/mtime/sha256 for a file):
* a `save_to_disk` directory: the sha256 of every file of the split read (relative path +
  content), as for a bare directory input;
* a data-file folder or a Hub dataset: the split's resolved data files, as `datasets` lists
  them (`load_dataset_builder(...).config.data_files`): a local file by its relative path and
  the sha256 of its content, a Hub file by its URL, which holds the commit it was resolved at
  (`hf://datasets/NAME@<sha>/...`). A new commit on the Hub, or an edited local file, is
  another input, and a shard directory made from the old one is refused (exit 2), as an
  edited file is. Where `datasets` cannot list the files (a Hub dataset only in the local
  cache, under HF_HUB_OFFLINE=1), the builder's own hash of its config stands in.

Bad input is a ValueError or FileNotFoundError naming the source (exit 2): a local path that
does not exist, an unknown split (naming the splits there), a missing column (naming the
columns), an empty split, a Hub dataset that cannot be reached (offline, or no such dataset).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep import format as fmt

PREFIX = "hf:"
DEFAULT_SPLIT = "train"
BATCH_ROWS = 1024
_SPLIT_AND_COLUMN = re.compile(r"^(?P<split>[^:\[\]]*(?:\[[^\]]*\])?)(?::(?P<column>.*))?$")


@dataclass(frozen=True)
class DatasetSource:
    """A parsed `hf:` input."""

    spec: str
    """The input argument as given (the name it has in stats and fingerprints)."""
    path: str
    """Hub dataset name or local directory."""
    revision: str | None = None
    config: str | None = None
    split: str | None = None
    """None: DEFAULT_SPLIT (or the one Dataset of a save_to_disk directory)."""
    column: str | None = None
    """None: --text-field."""

    @property
    def split_name(self) -> str:
        return self.split or DEFAULT_SPLIT

    @property
    def base_split(self) -> str:
        """The split without a slice: `train` for `train[:1%]`."""
        return self.split_name.split("[", 1)[0]

    @property
    def is_local(self) -> bool:
        return os.path.isdir(self.path)

    @property
    def is_saved(self) -> bool:
        """A `save_to_disk` directory (read with load_from_disk)."""
        return is_saved_dir(self.path)

    def text_column(self, text_field: str) -> str:
        return self.column or text_field


def is_spec(item: str) -> bool:
    return item.startswith(PREFIX)


def is_saved_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (
        (p / "dataset_dict.json").is_file()
        or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file())
    )


def parse(spec: str) -> DatasetSource:
    """The parts of `hf:SOURCE[@REVISION][:CONFIG[:SPLIT[:COLUMN]]]`; ValueError if malformed."""
    if not is_spec(spec):
        raise ValueError(f"{spec!r} is not an hf: input")
    rest = spec[len(PREFIX) :]
    path, _, rest = rest.partition(":")
    config, _, rest = rest.partition(":")
    m = _SPLIT_AND_COLUMN.match(rest)
    if not path or m is None:
        raise ValueError(
            f"bad input {spec!r}: use hf:SOURCE[@REVISION][:CONFIG[:SPLIT[:COLUMN]]], e.g. "
            "hf:wikimedia/wikipedia:20231101.en:train:text or hf:path/to/dir"
        )
    revision = None
    if "@" in path and not os.path.isdir(path):
        path, revision = path.split("@", 1)
        if not path or not revision:
            raise ValueError(f"bad input {spec!r}: an empty name or revision around '@'")
    split = m.group("split") or None
    column = m.group("column") or None
    if column is not None and ":" in column:
        raise ValueError(f"bad input {spec!r}: too many ':' fields (SOURCE:CONFIG:SPLIT:COLUMN)")
    return DatasetSource(spec, path, revision, config or None, split, column)


def check(spec: str) -> DatasetSource:
    """Parses `spec` and refuses a local path that does not exist before anything is read (a
    name that is not a directory is taken as a Hub name, `org/name` or a legacy `name`)."""
    src = parse(spec)
    looks_local = src.path.startswith(("/", "./", "../", "~")) or src.path.count("/") > 1
    if looks_local and not src.is_local:
        raise FileNotFoundError(
            f"input {spec!r}: directory {src.path!r} does not exist (a Hub dataset is named "
            "org/name)"
        )
    if src.is_saved:
        if src.config:
            raise ValueError(
                f"input {spec!r}: {src.path} is a save_to_disk directory, which has no configs"
            )
        if src.revision:
            raise ValueError(f"input {spec!r}: a local directory has no revision")
    return src


# ----------------------------------------------------------------------------- opening


def _hub_error(src: DatasetSource, e: Exception) -> Exception:
    """Our error for what `datasets` raised while resolving or loading `src`."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if isinstance(e, ConnectionError):
        hint = (
            "HF_HUB_OFFLINE is set, and it is not in the local cache: unset HF_HUB_OFFLINE, or "
            "download it first (see docs/data.md, 'Real corpora')"
            if offline
            else "no connection to the Hub"
        )
        return ValueError(f"input {src.spec}: cannot reach dataset {src.path!r} ({hint}): {e}")
    if isinstance(e, FileNotFoundError):
        return FileNotFoundError(f"input {src.spec}: {e}")
    return ValueError(f"input {src.spec}: {type(e).__name__}: {e}")


def _saved_split(src: DatasetSource) -> tuple[Any, str]:
    """(the Dataset of a save_to_disk directory, the directory of its files)."""
    import datasets

    try:
        ds = datasets.load_from_disk(src.path)
    except Exception as e:
        # datasets cannot load a saved split without rows (save_to_disk writes no data file)
        raise _empty(src) if _saved_without_rows(src.path) else _hub_error(src, e) from e
    if isinstance(ds, datasets.DatasetDict):
        if "[" in src.split_name:
            raise ValueError(
                f"input {src.spec}: a split slice needs load_dataset; a save_to_disk "
                "directory takes a split name"
            )
        if src.split_name not in ds:
            raise _unknown_split(src, list(ds))
        return ds[src.split_name], os.path.join(src.path, src.split_name)
    if src.split is not None and src.split != str(ds.split):
        raise ValueError(
            f"input {src.spec}: {src.path} holds a single Dataset (split {ds.split}); leave the "
            "split empty, e.g. hf:DIR"
        )
    return ds, src.path


def data_files(src: DatasetSource) -> list[str] | None:
    """The resolved data files of `src`'s split (local paths or `hf://...@<commit>/...` URLs);
    None where `datasets` does not list them (a cached dataset offline). ValueError naming the
    splits if the split is unknown."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(src.path, src.config, revision=src.revision)
    except Exception as e:  # datasets raises many kinds; each is the user's input
        raise _hub_error(src, e) from e
    files = builder.config.data_files
    if files is None:
        return None
    if src.base_split not in files:
        raise _unknown_split(src, list(files))
    return [str(f) for f in files[src.base_split]]


def _unknown_split(src: DatasetSource, splits: list[Any]) -> ValueError:
    return ValueError(
        f"input {src.spec}: unknown split {src.base_split!r} (splits: "
        f"{sorted(str(s) for s in splits)}); give it as hf:SOURCE:CONFIG:SPLIT"
    )


def _saved_without_rows(path: str) -> bool:
    """True if the save_to_disk directory (or every split of a DatasetDict) has no data file."""
    p = Path(path)
    states = [p / "state.json"] if (p / "state.json").is_file() else sorted(p.glob("*/state.json"))
    try:
        return bool(states) and all(
            not json.loads(s.read_text()).get("_data_files") for s in states
        )
    except (OSError, json.JSONDecodeError):
        return False


def _local_rows(files: list[str] | None) -> int | None:
    """Rows of local Parquet data files (from their footers); None if not all are such."""
    if not files or not all(f.endswith(".parquet") and os.path.isfile(f) for f in files):
        return None
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def _builder_hash(src: DatasetSource) -> str:
    import datasets

    builder = datasets.load_dataset_builder(src.path, src.config, revision=src.revision)
    return str(builder.hash)


def open_dataset(src: DatasetSource, streaming: bool) -> Any:
    """The split of `src` as a Dataset, or an IterableDataset with `streaming`."""
    import datasets

    if src.is_saved:
        ds, _ = _saved_split(src)
        return ds.to_iterable_dataset() if streaming else ds
    if streaming and "[" in src.split_name:
        raise ValueError(
            f"input {src.spec}: a split slice ({src.split_name}) cannot be streamed; drop "
            "--streaming or the slice"
        )
    files = data_files(src)  # an unknown split is named here, with the splits there are
    if _local_rows(files) == 0:
        raise _empty(src)  # (datasets fails on a Parquet file without rows)
    try:
        return datasets.load_dataset(
            src.path, src.config, split=src.split_name, revision=src.revision, streaming=streaming
        )
    except Exception as e:
        raise _hub_error(src, e) from e


def iter_texts(src: DatasetSource, text_field: str, streaming: bool) -> Iterator[Any]:
    """The text column of `src`'s rows, in the dataset's order. ValueError naming the columns if
    the column is missing, and if the split has no rows."""
    column = src.text_column(text_field)
    ds = open_dataset(src, streaming)
    names = ds.column_names
    if names is not None:
        if column not in names:
            raise _missing_column(src, column, names)
        ds = ds.select_columns([column])
        if not streaming and len(ds) == 0:
            raise _empty(src)
    rows = 0
    for batch in ds.iter(batch_size=BATCH_ROWS):
        if column not in batch:  # a stream whose columns are known only from its rows
            raise _missing_column(src, column, sorted(batch))
        texts = batch[column]
        rows += len(texts)
        yield from texts
    if rows == 0:
        raise _empty(src)


def _missing_column(src: DatasetSource, column: str, names: list[str]) -> ValueError:
    return ValueError(
        f"input {src.spec}: no column {column!r} (columns: {list(names)}); name the text "
        "column with --text-field or as the spec's last field (hf:SOURCE:CONFIG:SPLIT:COLUMN)"
    )


def _empty(src: DatasetSource) -> ValueError:
    return ValueError(f"input {src.spec}: split {src.split_name!r} is empty (no rows)")


def prepare(src: DatasetSource) -> None:
    """Download and convert a non-streamed `load_dataset` source into the cache once, before
    several workers open it (each would otherwise wait on the others' lock)."""
    if not src.is_saved:
        open_dataset(src, streaming=False)


# ----------------------------------------------------------------------------- fingerprint


def fingerprint(src: DatasetSource) -> dict[str, Any]:
    """{"path": spec, "size", "mtime_ns": None, "sha256"} of what `src` reads (module doc)."""
    if src.is_saved:
        _, directory = _saved_split(src)
        members = sorted(p for p in Path(directory).rglob("*") if p.is_file())
        h = hashlib.sha256()
        for p in members:
            h.update(f"{p.relative_to(directory).as_posix()}\0{fmt.sha256_file(p)}\n".encode())
        size = sum(p.stat().st_size for p in members)
        return {"path": src.spec, "size": size, "mtime_ns": None, "sha256": h.hexdigest()}
    files = data_files(src)
    entries: list[Any]
    size = 0
    if files is None:
        entries = [f"datasets builder hash {_builder_hash(src)}"]
    else:
        entries = []
        for f in files:
            if os.path.isfile(f):
                rel = os.path.relpath(f, src.path) if src.is_local else f
                entries.append([rel, fmt.sha256_file(f)])
                size += os.path.getsize(f)
            else:
                entries.append(f)  # a URL with the commit it was resolved at
    key = {
        "source": src.path if not src.is_local else "local",
        "config": src.config,
        "split": src.split_name,
        "files": entries,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return {"path": src.spec, "size": size, "mtime_ns": None, "sha256": digest}
