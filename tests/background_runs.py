"""Subprocesses of several tests started together, a few at a time, while the tests wait for
their own results in their own order (`BackgroundRuns`).

What these tests run (Triton's interpreter, Inductor's code generation, torchrun launches of a
tiny DeepSpeed model) is mostly one busy thread per process, or waits on process start-up, so
one at a time leaves a two-core runner's second core idle. Each job runs exactly what its test
ran before, in its own processes and folders; only the waiting overlaps.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


def selected_tests(request) -> set[str]:
    """The names of the requesting module's tests that this session runs (after `-k`, `-m`
    and node ids), so that a module fixture starts only their jobs."""
    module = request.module
    return {
        item.originalname
        for item in request.session.items
        if getattr(item, "module", None) is module
    }


def selected_params(request, test: str, name: str) -> set:
    """The values of parameter `name` of the requesting module's test `test` that this session
    runs."""
    module = request.module
    return {
        item.callspec.params[name]
        for item in request.session.items
        if getattr(item, "module", None) is module
        and item.originalname == test
        and hasattr(item, "callspec")
    }


def uses_fixture(request, name: str) -> bool:
    """Whether a test of the requesting module that this session runs uses fixture `name`."""
    module = request.module
    return any(
        name in getattr(item, "fixturenames", ())
        for item in request.session.items
        if getattr(item, "module", None) is module
    )


class BackgroundRuns:
    """Jobs in `workers` threads, started in the order submitted (the longest first makes the
    whole take about what the longest chain takes); a job starts its subprocesses through
    `run`, which `close` can end."""

    def __init__(self, workers: int = 2):
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="background")
        self._jobs: dict[Any, Future] = {}

    def submit(self, key, job: Callable, *args) -> None:
        """Runs `job(*args)` in a worker thread; `result(key)` waits for what it returns."""
        assert key not in self._jobs, key
        self._jobs[key] = self._pool.submit(job, *args)

    def result(self, key):
        """What the job `key` returned, once it has (its exception, raised here)."""
        assert key in self._jobs, "this job was not submitted (its test not selected?)"
        return self._jobs[key].result()

    def run(
        self, args: Iterable[str], *, timeout: float, capture_output=True, text=True, **popen
    ) -> subprocess.CompletedProcess:
        """`subprocess.run(args, capture_output=True, text=True, timeout=timeout, **popen)`
        (its output always captured, as text), the process ended by `close` if it still runs
        then."""
        assert capture_output and text, "BackgroundRuns.run captures the output, as text"
        args = list(args)
        with subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
        ) as proc:
            with self._lock:
                self._procs.append(proc)
                if self._closed:  # started as the runs were closed
                    proc.kill()
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
        return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)

    def close(self) -> None:
        """Ends what still runs (a session stopped early) and starts nothing more."""
        with self._lock:
            self._closed = True
            for proc in self._procs:
                if proc.poll() is None:
                    proc.kill()
        self._pool.shutdown(wait=True, cancel_futures=True)
