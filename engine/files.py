"""Durable file operations: atomic writes (a temporary file, fsync, ``os.replace``, the
directory fsynced: readers see the old file or the whole new one), checksums of files (hashed in
threads), and removing a tree without leaving half of it under its name. The checkpoint store
(`engine/checkpoint.py`) is built on them; every other writer of a status, results or record
file uses `write_json_atomically` or `write_atomically`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

DEFAULT_CHECKSUM = "sha256"
"""The hashlib algorithm a store seals checkpoints with unless told otherwise (see the module
docstring for why)."""
HASH_CHUNK_BYTES = 8 << 20
"""Files are read in chunks of this size when hashed (large enough that the per-call overhead
vanishes)."""
HASH_THREADS = max(2, min(8, os.cpu_count() or 1))
"""Threads that hash (and, when sealing, fsync) the files of one checkpoint in parallel."""


class CheckpointError(RuntimeError):
    """A checkpoint (or a checkpoint file) that cannot be used; names the path and why."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        super().__init__(str(path), reason)  # both in args, so the error pickles across processes
        self.path = Path(path)
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable. No-op where unsupported."""
    if os.name == "nt":  # Windows cannot open a directory to fsync it
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def check_algorithm(algorithm: str) -> str:
    """``algorithm`` when hashlib has it (on every platform), else ``ValueError``."""
    if algorithm not in hashlib.algorithms_guaranteed or algorithm.startswith("shake_"):
        valid = sorted(a for a in hashlib.algorithms_guaranteed if not a.startswith("shake_"))
        raise ValueError(f"checksum={algorithm!r} is invalid; valid: None or one of {valid}")
    return algorithm


def hash_file(path: Path, algorithm: str) -> tuple[int, str]:
    """``(bytes read, hex digest)`` of a file, read in ``HASH_CHUNK_BYTES`` chunks."""
    digest = hashlib.new(algorithm)
    buffer = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def file_checksum(path: str | os.PathLike[str], algorithm: str = DEFAULT_CHECKSUM) -> str:
    """The hex digest of a file's content (what ``COMPLETE.json`` records; for sha256 the same
    as ``sha256sum`` prints)."""
    return hash_file(Path(path), check_algorithm(algorithm))[1]


def hash_files(paths: list[Path], algorithm: str, *, fsync: bool) -> list[tuple[int, str]]:
    """``(bytes read, hex digest)`` of every file, in order, hashed by up to ``HASH_THREADS``
    threads (file reads and hashlib's updates release the GIL). With ``fsync`` every file is
    also fsynced, in the same pool, interleaved with the hashing: a seal then costs about
    max(hashing, fsync) instead of their sum, since reading from the page cache does not wait
    for the write-back."""
    if not paths:
        return []
    workers = min(HASH_THREADS, 2 * len(paths) if fsync else len(paths))
    with ThreadPoolExecutor(workers, thread_name_prefix="checkpoint-hash") as pool:
        hashed, synced = [], []
        for path in paths:
            hashed.append(pool.submit(hash_file, path, algorithm))
            if fsync:
                synced.append(pool.submit(fsync_file, path))
        for future in synced:
            future.result()  # re-raises an fsync's error
        return [future.result() for future in hashed]


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` through ``<path>.tmp`` + fsync + ``os.replace``: readers see the old file or
    the whole new one, never a prefix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomically(path: str | os.PathLike[str], value: Any) -> None:
    """``value`` as indented JSON at ``path``, atomically and durably (see
    ``write_atomically``): a status or results file is never seen half-written."""
    data = (json.dumps(value, indent=2) + "\n").encode()
    write_atomically(Path(path), lambda f: f.write(data))


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a directory tree (or a file); missing is fine."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
