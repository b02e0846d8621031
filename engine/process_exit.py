"""Ending a command-line process without Python's interpreter teardown.

A process that has imported torch, torch._dynamo and DeepSpeed spends a noticeable time after
its last line in Python's finalization (modules torn down one by one, a final garbage
collection; measured once: docs/benchmarks.md#decisions-whose-measurements-are-in-the-history).
Every rank of a job, every `--status` or `--print-config` call in a batch script and
every launcher process pays it. `exit_process` does what that teardown must do and skips the
rest: it runs the `atexit` handlers (logging's flush, multiprocessing's clean-up of worker
processes, the trackers'), flushes stdout and stderr, and ends the process with `os._exit`.
Objects still alive are not finalised: nothing in this project leaves a file open for its
finaliser to flush (every writer is closed by the code that opened it).

Where a thread that Python would wait for is still running (a non-daemon thread, e.g. a
`concurrent.futures` pool that torch.compile's workers leave behind, which Python stops through
its threading hooks before joining it), the process exits normally instead.
ALBATROSS_FULL_EXIT=1 always exits normally.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int | None) -> NoReturn:
    """Ends the process with exit status `code` (None: 0) without the interpreter's teardown
    (module docstring)."""
    code = 0 if code is None else code
    waits_for = [
        t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
    ]
    if waits_for or os.environ.get("ALBATROSS_FULL_EXIT") == "1":
        sys.exit(code)
    from albatross.compat import run_exit_handlers

    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a reader that went away
            stream.flush()
    os._exit(code)
