"""What a study's executors have started: ``<out>/ledger.json``, node -> element -> the Slurm
job that runs it or the local process's outcome, so ``status`` can say pending / running /
failed and ``run`` never submits a second job for an element whose job is still queued.

One ``study run`` at a time per study directory: ``study_lock`` holds the directory as its one
writer (``albatross.writer_lock``) while it submits or runs, and a second is refused at once, naming
the holder. A holder that died releases the lock with its process (the kernel drops it)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any

from albatross.writer_lock import DirectoryBusy, one_writer

LEDGER = "ledger.json"
_WRITING = threading.Lock()  # the local executor records from one thread per running stage


StudyBusy = DirectoryBusy  # the refusal of a second ``study run`` on the same directory


def study_lock(out: Path) -> contextlib.AbstractContextManager[None]:
    return one_writer(out, "`study run`", hint="`study status` shows what it started")


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
