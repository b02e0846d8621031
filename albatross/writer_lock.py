"""One writer per directory: a run directory, a shard set, a fine-tuning sweep or a study.

``one_writer(directory, what)`` holds an exclusive ``flock`` on ``<directory>/.writer.lock`` for
as long as the writer runs and records the holder in it (host, pid, Slurm job, start time); the
file is removed when the writer ends. A
second writer is refused at once with ``DirectoryBusy`` naming the holder; the commands turn that
into exit 2. A holder that died (SIGKILL, OOM) releases the lock with its process: the kernel
drops it, so a resume is never blocked by a dead writer.

Slurm's requeue of the same job is not a second writer: its earlier incarnation has ended, or is
ending (a lost node's lock on a network file system lasts until the server's lease on it
expires). A writer whose Slurm job id equals the holder's therefore waits up to
``REQUEUE_WAIT_S`` for the lock before it gives up.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

LOCK_FILE = ".writer.lock"
REQUEUE_WAIT_S = 180.0
"""How long a requeued Slurm job waits for its own earlier incarnation's lock: longer than an
NFSv4 lease (90 s by default), so a lost node's lock has expired by then."""


class DirectoryBusy(RuntimeError):
    """Another live process writes the directory; the message names it and what to do."""


def _holder() -> dict[str, object]:
    record: dict[str, object] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        array = os.environ.get("SLURM_ARRAY_JOB_ID")
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        record["slurm_job"] = f"{array}_{task}" if array and task else job
    return record


def describe(record: dict[str, object]) -> str:
    text = f"host {record.get('host', '?')}, pid {record.get('pid', '?')}"
    if record.get("slurm_job"):
        text += f", Slurm job {record['slurm_job']}"
    if record.get("since"):
        text += f", since {record['since']}"
    return text


def read_holder(directory: Path, lock_name: str = LOCK_FILE) -> dict[str, object]:
    """The recorded holder of ``directory``'s lock ({} when none was recorded)."""
    try:
        record = json.loads((Path(directory) / lock_name).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def one_writer(
    directory: str | os.PathLike[str], what: str, hint: str = "", lock_name: str = LOCK_FILE
) -> Iterator[None]:
    """Hold ``directory`` as its only writer for the block (the directory is created).

    ``what`` names the writer in the refusal ("pretraining run", "study run", ...); ``hint``
    adds what the user can do instead; ``lock_name`` gives writers that share a directory by
    design (the jobs of a shard build, one shard set each) a lock each."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / lock_name
    holder: dict[str, object] = {}
    mine = _holder().get("slurm_job")
    deadline: float | None = None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if _try_lock(fd) and _same_file(fd, path):
            break  # held, and still the file under that name (its holder did not remove it)
        os.close(fd)
        if deadline is None:  # the first refusal: a requeue of the holder's own job waits
            holder = read_holder(directory, lock_name)
            same_job = mine and holder.get("slurm_job") == mine
            deadline = time.monotonic() + (REQUEUE_WAIT_S if same_job else 0)
        if time.monotonic() >= deadline:
            raise DirectoryBusy(
                f"{directory} is written by another {what} "
                f"({describe(holder) if holder else 'holder unknown'}); one writer per "
                "directory: wait for it to end or stop it" + (f"; {hint}" if hint else "")
            )
        time.sleep(1.0)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        yield
    finally:
        # The file goes before the lock does (the directory keeps only its data); a writer
        # that opened it meanwhile finds it unlinked and opens the name anew.
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)  # releases the lock


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


@contextlib.contextmanager
def one_writer_collectively(
    directory: str | os.PathLike[str],
    what: str,
    is_main: bool,
    any_rank: Callable[[bool], bool],
) -> Iterator[None]:
    """``one_writer`` for a job of several processes (collective): rank 0 holds the lock, and
    every rank raises ``DirectoryBusy`` when it is refused (``any_rank``: true on every rank
    when it is true on one), so no rank waits for a peer that left."""
    with contextlib.ExitStack() as stack:
        refusal: DirectoryBusy | None = None
        if is_main:
            try:
                stack.enter_context(one_writer(directory, what))
            except DirectoryBusy as e:
                refusal = e
        if any_rank(refusal is not None):
            raise refusal or DirectoryBusy(
                f"{directory} is written by another {what} (rank 0 says which)"
            )
        yield
