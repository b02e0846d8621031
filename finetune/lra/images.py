"""The pixel tasks of Long Range Arena: Image (the `cifar-10-batches-py` pickles, read by an
unpickler that builds numpy arrays only) and Pathfinder / Path-X (metadata files and grey PNGs,
split 80/10/10 by a seeded permutation). Formats and splits: `finetune/lra/data.py`'s docstring;
`load_split` there is the entry point."""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from finetune.lra.split import LraSplit, SplitStats, find_file, finish_split
from finetune.lra.tasks import PATHFINDER_DIFFICULTIES, SPLITS, LraTask, rgb_to_grayscale

CIFAR_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_BATCH = "test_batch"
CIFAR_VAL_FRACTION = 10  # val = the last 1/10 of the training images (5000 of 50000)
PATHFINDER_SPLIT_SEED = 0
DEFAULT_DIFFICULTY = "hard"
PATHFINDER_TASKS = ("pathfinder", "pathx")
DECODE_CHUNK = 4096  # images decoded per batch of thread-pool work


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: a CIFAR batch cannot run code."""

    _ALLOWED = frozenset(
        {
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"),
            ("numpy.core.numeric", "_frombuffer"),
            ("numpy._core.numeric", "_frombuffer"),
            ("_codecs", "encode"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR batch")
        return super().find_class(module, name)


def read_cifar_batch(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """One `cifar-10-batches-py` pickle: ((N, 1024) uint8 grey images, (N,) int64 labels)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            batch = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a CIFAR-10 python batch: {e}") from e
    if not isinstance(batch, Mapping) or b"data" not in batch or b"labels" not in batch:
        keys = list(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(f"{path}: expected a dict with b'data' and b'labels', got {keys}")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 1024:
        raise ValueError(f"{path}: b'data' is {data.dtype} {data.shape}, expected (N, 3072) uint8")
    if labels.shape != (len(data),):
        raise ValueError(f"{path}: {labels.shape} labels for {len(data)} images")
    bad = np.flatnonzero((labels < 0) | (labels >= 10))
    if len(bad):
        raise ValueError(f"{path}: image {bad[0]} has label {labels[bad[0]]}, outside 0..9")
    # Rows are the R plane, then G, then B, each 32x32 row-major: (N, 3, 1024) -> (N, 1024, 3).
    rgb = data.reshape(len(data), 3, 1024).transpose(0, 2, 1)
    return rgb_to_grayscale(rgb), labels


def load_image(task: LraTask, data_dir: Path, split: str, cls: bool) -> tuple[LraSplit, SplitStats]:
    names = CIFAR_TRAIN_BATCHES if split in ("train", "val") else (CIFAR_TEST_BATCH,)
    paths = [find_file(task, data_dir, name) for name in names]
    images, labels = zip(*(read_cifar_batch(p) for p in paths))
    pixels, targets = np.concatenate(images), np.concatenate(labels)
    targets_all = targets
    index = np.arange(len(pixels), dtype=np.int64)
    note = ""
    if split != "test":
        cut = len(pixels) - len(pixels) // CIFAR_VAL_FRACTION
        keep = slice(0, cut) if split == "train" else slice(cut, None)
        pixels, targets, index = pixels[keep], targets[keep], index[keep]
        note = f"train = rows [0, {cut}), val = rows [{cut}, {len(targets_all)}) of data_batch_1..5"
    stats = SplitStats(task.name, split, str(paths[0].parent), "cifar-pickle", note=note)
    stats.rows = sum(len(x) for x in images)
    stats.longest = pixels.shape[1]
    n = len(pixels)
    split_ = LraSplit(
        task.name,
        np.ascontiguousarray(pixels).reshape(-1),
        np.arange(n + 1, dtype=np.int64) * pixels.shape[1],
        targets,
        index,
        cls,
    )
    return finish_split(stats, split_)


# ----------------------------------------------------------------------------- Pathfinder


@dataclass(frozen=True)
class PathfinderEntry:
    """One metadata line."""

    path: Path
    label: int
    index: int
    """The line's position over all metadata files of the difficulty."""
    where: str
    """metadata file:line."""


def _difficulty_dir_name(difficulty: str) -> str:
    if difficulty in PATHFINDER_DIFFICULTIES:
        return PATHFINDER_DIFFICULTIES[difficulty]
    if difficulty in PATHFINDER_DIFFICULTIES.values():
        return difficulty
    raise ValueError(
        f"unknown Pathfinder difficulty {difficulty!r}; valid: "
        f"{list(PATHFINDER_DIFFICULTIES)} or {list(PATHFINDER_DIFFICULTIES.values())}"
    )


def _metadata_order(path: Path) -> tuple[int, int, str]:
    return (0, int(path.stem), "") if path.stem.isdigit() else (1, 0, path.name)


def read_pathfinder_metadata(root: str | os.PathLike) -> list[PathfinderEntry]:
    """Every metadata line of one difficulty folder (`root`), files in numeric order."""
    root = Path(root)
    meta_dir = root / "metadata"
    files = sorted(meta_dir.glob("*.npy"), key=_metadata_order) if meta_dir.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no Pathfinder metadata: {meta_dir}/*.npy matches nothing")
    entries = []
    for meta in files:
        with open(meta, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                fields = line.split()
                if not fields:
                    continue
                where = f"{meta}:{line_no}"
                if len(fields) < 4:
                    raise ValueError(
                        f"{where}: expected 'imgs/<batch> sample_<n>.png <?> <label> ...', got "
                        f"{line.strip()!r}"
                    )
                try:
                    label = int(fields[3])
                except ValueError:
                    raise ValueError(f"{where}: label {fields[3]!r} is not an integer") from None
                if label not in (0, 1):
                    raise ValueError(f"{where}: label {label} is outside Pathfinder's labels 0..1")
                entries.append(
                    PathfinderEntry(root / fields[0] / fields[1], label, len(entries), where)
                )
    return entries


def split_indices(n: int, split: str, seed: int = PATHFINDER_SPLIT_SEED) -> np.ndarray:
    """Positions (sorted) of `split` among n items: a seeded permutation cut 80/10/10."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")
    perm = np.random.default_rng(seed).permutation(n)
    a, b = n * 8 // 10, n * 9 // 10
    part = {"train": perm[:a], "val": perm[a:b], "test": perm[b:]}[split]
    return np.sort(part)


def _decode_png(entry: PathfinderEntry, side: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(entry.path) as img:
            img.load()
            if img.mode != "L":
                raise ValueError(f"mode {img.mode}, expected 8-bit grey (L)")
            if img.size != (side, side):
                raise ValueError(f"size {img.size}, expected ({side}, {side})")
            return np.asarray(img, dtype=np.uint8).reshape(-1)
    except FileNotFoundError:
        raise FileNotFoundError(f"{entry.where}: image {entry.path} does not exist") from None
    except (OSError, ValueError, UnidentifiedImageError) as e:
        raise ValueError(f"{entry.where}: image {entry.path}: {e}") from e


def load_pathfinder(
    task: LraTask,
    data_dir: Path,
    split: str,
    cls: bool,
    difficulty: str,
    seed: int,
    workers: int | None,
) -> tuple[LraSplit, SplitStats]:
    root = find_file(task, data_dir, _difficulty_dir_name(difficulty))
    entries = read_pathfinder_metadata(root)
    stats = SplitStats(task.name, split, str(root), "pathfinder", rows=len(entries))
    kept = []
    for entry in entries:
        try:
            size = entry.path.stat().st_size
        except FileNotFoundError:
            raise FileNotFoundError(f"{entry.where}: image {entry.path} does not exist") from None
        if size == 0:  # the official pipeline drops images of length 0
            stats.skip(str(entry.path))
        else:
            kept.append(entry)
    chosen = [kept[i] for i in split_indices(len(kept), split, seed)]
    stats.note = (
        f"{split} = {len(chosen)} of {len(kept)} non-empty images "
        f"(seeded 80/10/10 split, seed {seed})"
    )
    side = task.image_side
    assert side is not None
    pixels = np.zeros((len(chosen), side * side), dtype=np.uint8)
    workers = workers or min(8, os.cpu_count() or 1)
    from tqdm import tqdm

    with (
        ThreadPoolExecutor(max_workers=workers) as pool,
        tqdm(total=len(chosen), desc=f"LRA {task.name} {split}", disable=None) as bar,
    ):
        for start in range(0, len(chosen), DECODE_CHUNK):
            chunk = chosen[start : start + DECODE_CHUNK]
            for i, image in enumerate(pool.map(lambda e: _decode_png(e, side), chunk), start):
                pixels[i] = image
            bar.update(len(chunk))
    stats.longest = side * side if len(chosen) else 0
    split_ = LraSplit(
        task.name,
        pixels.reshape(-1),
        np.arange(len(chosen) + 1, dtype=np.int64) * side * side,
        np.asarray([e.label for e in chosen], dtype=np.int64),
        np.asarray([e.index for e in chosen], dtype=np.int64),
        cls,
    )
    return finish_split(stats, split_)
