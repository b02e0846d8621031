"""What a study's executors have started: ``<out>/ledger.json``, node -> element -> the Slurm
job that runs it or the local process's outcome, so ``status`` can say pending / running /
failed and ``run`` never submits a second job for an element whose job is still queued.

One ``study run`` at a time per study directory: ``study_lock`` holds an exclusive ``flock`` on
``<out>/.lock`` while it submits or runs, and a second is refused at once, naming the holder.
A holder that died releases the lock with its process (the kernel drops it)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LEDGER = "ledger.json"
LOCK = ".lock"
_WRITING = threading.Lock()  # the local executor records from one thread per running stage


class StudyBusy(RuntimeError):
    """Another ``study run`` holds the study directory."""


@contextlib.contextmanager
def study_lock(out: Path) -> Iterator[None]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Path(path).read_text().strip() or "another process"
            raise StudyBusy(
                f"{out} is in use by another `study run` ({holder}); wait for it or run "
                "`study status` to see what it started"
            ) from None
        os.ftruncate(fd, 0)
        job = os.environ.get("SLURM_JOB_ID")
        holder = f"host {socket.gethostname()}, pid {os.getpid()}" + (f", job {job}" if job else "")
        os.write(fd, holder.encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def read_ledger(out: Path) -> dict[str, dict[str, Any]]:
    path = out / LEDGER
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {}  # a torn write cannot happen (os.replace), but never fail status on it


def record(out: Path, node_id: str, element: str, entry: dict[str, Any]) -> None:
    """Sets ``ledger[node_id][element]`` (atomically; callers hold ``study_lock``)."""
    from engine.checkpoint import write_json_atomically

    with _WRITING:
        ledger = read_ledger(out)
        ledger.setdefault(node_id, {})[element] = {**entry, "time": time.time()}
        write_json_atomically(out / LEDGER, ledger)
