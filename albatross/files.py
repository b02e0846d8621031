"""Durable file operations: atomic writes (a temporary file, fsync, ``os.replace``, the
directory fsynced: readers see the old file or the whole new one), checksums of files (hashed in
threads), and removing a tree without leaving half of it under its name. The checkpoint store
(`engine/checkpoint.py`) is built on them; every other writer of a file or a directory that
others read goes through `atomic_file`, `write_atomically` / `write_json_atomically` or
`staged_directory`, which also turn a full disk into `DiskFullError` naming the path and what was
being written."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
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


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
NEARLY_FULL_BYTES = 64 << 20
"""A writer's ``RuntimeError`` (torch's zip writer: "unexpected pos ...", "file write failed")
is taken for a full disk when less than this is left on the file system of the path."""


class DiskFullError(OSError):
    """No space (or quota) left while writing; names the path, what was written and what is
    kept. An ``OSError`` with ``errno.ENOSPC``, so callers that handle OS errors see one."""

    def __init__(
        self, path: str | os.PathLike[str], what: str, free: int | None, cause: str = ""
    ) -> None:
        left = "" if free is None else f"; {free / 2**20:.1f} MiB free there"
        super().__init__(
            errno.ENOSPC,
            f"no space left on the device while writing {what} to {path}{left}. What was "
            "complete before is kept and the partial files were removed: free space (or write "
            "elsewhere) and run the same command again" + (f" ({cause})" if cause else ""),
        )
        self.path = Path(path)
        self.what = what
        self._args = (str(path), what, free, cause)

    def __reduce__(self):  # crosses process pools (shard workers) whole
        return (type(self), self._args)

    def __str__(self) -> str:
        return self.strerror


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (its nearest
    existing parent), or None where that cannot be asked."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def is_disk_full(exc: BaseException, path: str | os.PathLike[str]) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a full disk or quota while
    writing under ``path``."""
    seen: BaseException | None = exc
    for _ in range(8):  # the cause chain, bounded
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    if isinstance(exc, RuntimeError):
        free = free_bytes(path)
        return free is not None and free < NEARLY_FULL_BYTES
    return False


def disk_full_error(
    exc: BaseException, path: str | os.PathLike[str], what: str
) -> DiskFullError | None:
    """The ``DiskFullError`` to raise for ``exc`` (naming ``path``, ``what`` and ``exc``),
    or None when ``exc`` is not a full disk. Raise it outside the ``except`` block: the
    writer's exception then is not its context, and its frames (which hold the writer's open
    files, so the space they took) can be collected."""
    if isinstance(exc, DiskFullError) or not is_disk_full(exc, path):
        return None
    return DiskFullError(path, what, free_bytes(path), f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def disk_full_named(path: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Turn a full disk inside the block into ``DiskFullError`` naming ``path`` and ``what``;
    every other error passes unchanged."""
    full: DiskFullError | None = None
    try:
        yield
    except (OSError, RuntimeError) as e:
        full = disk_full_error(e, path, what)
        if full is None:
            raise
    if full is not None:
        raise full


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike[str], what: str = "a file", *, unique: bool = False
) -> Iterator[Path]:
    """A temporary sibling path to write ``path`` through (for writers that take a path:
    ``torch.save``, ``np.save``, a tokenizer's ``save``); on success it is fsynced and replaces
    ``path`` (readers see the old file or the whole new one), on any error it is removed and a
    full disk is reported as ``DiskFullError``. ``unique``: a hidden temporary name of its own
    (``.<name>.<random>.tmp``) where several processes may write the same file at once."""
    path = Path(path)
    tmp = path.with_name(
        f".{path.name}.{uuid.uuid4().hex[:12]}.tmp" if unique else path.name + ".tmp"
    )
    try:
        with disk_full_named(path, what):
            yield tmp
            fsync_file(tmp)
            os.replace(tmp, path)
            fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_atomically(path: Path, write: Callable[[BinaryIO], object], what: str = "a file") -> None:
    """Write ``path`` through a temporary sibling + fsync + ``os.replace``: readers see the old
    file or the whole new one, never a prefix (a full disk: ``DiskFullError``)."""
    with atomic_file(path, what) as tmp, open(tmp, "wb") as f:
        write(f)
        f.flush()


def write_json_atomically(
    path: str | os.PathLike[str], value: Any, what: str = "a status file"
) -> None:
    """``value`` as indented JSON at ``path``, atomically and durably (see
    ``write_atomically``): a status or results file is never seen half-written."""
    data = (json.dumps(value, indent=2) + "\n").encode()
    write_atomically(Path(path), lambda f: f.write(data), what)


@contextlib.contextmanager
def staged_directory(
    final: str | os.PathLike[str], what: str, *, replace: bool = False
) -> Iterator[Path]:
    """A staging directory next to ``final`` to fill; on success it is made durable and renamed
    to ``final`` (which must not exist, or be an empty directory; with ``replace`` an existing
    ``final`` is swapped out only once the new one is complete), so ``final`` is whole or
    absent. On any error the staging directory is removed, and a full disk is reported as
    ``DiskFullError`` naming ``final`` and ``what``."""
    final = Path(final)
    staging = final.with_name(f"{final.name}.partial-{os.getpid()}")
    remove_tree(staging)
    try:
        with disk_full_named(final, what):
            staging.mkdir(parents=True)
            yield staging
            for dirpath, _, names in os.walk(staging):
                for name in names:
                    fsync_file(Path(dirpath) / name)
                fsync_dir(Path(dirpath))
            aside = final.with_name(f"{final.name}.replaced-{os.getpid()}")
            if replace and final.exists():
                os.replace(final, aside)
            os.replace(staging, final)
            fsync_dir(final.parent)
            remove_tree(aside)
    finally:
        remove_tree(staging)


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a directory tree (or a file); missing is fine."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
