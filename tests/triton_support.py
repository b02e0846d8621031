"""Runs code in Triton's interpreter: the project's GPU kernels on CPU tensors (tests)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def total(X, n):
    acc = 0.0
    for i in range(0, n):
        acc += tl.load(X + i)
    tl.store(X, acc)

x = torch.ones(3)
total[(1,)](x, 3)
assert x[0].item() == 3.0
"""
"""A loop over a runtime bound, the least every kernel here needs of the interpreter."""


def _run(code: str, timeout: float, started=None) -> subprocess.CompletedProcess:
    """`code` in a fresh Python with TRITON_INTERPRET=1; `started(process)` is called once it
    runs (`InterpreterRuns` keeps it, to end it at its close)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", code]
    with subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        if started is not None:
            started(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


def _checked(result: subprocess.CompletedProcess) -> str:
    """The standard output of a run that succeeded; otherwise the test fails with its output,
    saying so when the interpreter cannot run even a trivial loop: Triton 3.5's interpreter
    does not run with NumPy 2.4 (Triton 3.9 does, and 3.5 with NumPy 2.3), a pair that a CUDA
    torch's pinned Triton can bring."""
    if result.returncode != 0 and _run(PROBE, 120).returncode != 0:
        import numpy
        import triton

        pytest.fail(
            f"Triton {triton.__version__}'s interpreter cannot run a trivial kernel with NumPy "
            f"{numpy.__version__} (an incompatibility of that pair, not of these kernels): run "
            "these tests where Triton >= 3.9 is installed, or with NumPy < 2.4\n"
            + result.stderr[-2000:]
        )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _needs_triton() -> None:
    assert importlib.util.find_spec("triton"), (
        "triton is in the test extras: pip install -e .[test]"
    )


def run_in_triton_interpreter(code: str, timeout: float = 300) -> str:
    """Runs `code` in a fresh Python with TRITON_INTERPRET=1 (Triton reads it when a kernel is
    defined, so it cannot be switched on inside this process once a kernel module is imported);
    returns its standard output, or fails the test with its output (`_checked`)."""
    _needs_triton()
    return _checked(_run(code, timeout))


class InterpreterRuns:
    """Scripts run in Triton's interpreter side by side, `workers` at a time, started in the
    order given (the longest first), while the tests wait for theirs in their own order: the
    interpreter and Inductor's code generation are mostly one thread each, so two runs use a
    two-core runner's second core. Each script is its own process, as with
    `run_in_triton_interpreter`, and `output` checks it as that does."""

    def __init__(self, scripts: dict[str, float], workers: int = 2):
        """`scripts`: each script's code and its timeout in seconds (from its start)."""
        _needs_triton()
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="interpreter")
        self._runs: dict[str, Future] = {
            code: self._pool.submit(self._start, code, timeout) for code, timeout in scripts.items()
        }

    def _start(self, code: str, timeout: float) -> subprocess.CompletedProcess:
        return _run(code, timeout, self._started)

    def _started(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.append(proc)
            if self._closed:  # started as the runs were closed
                proc.kill()

    @classmethod
    def of_selected(cls, request, scripts: list[tuple[str, str]], workers: int = 2, timeout=900):
        """The runs of the scripts, of (test name, script) in `scripts` (the longest first),
        whose tests in the requesting module this session runs (`-k`, `-m` and node ids
        leave the others unstarted); `timeout`: seconds a script may take from its start."""
        module = request.module
        selected = {
            item.originalname
            for item in request.session.items
            if getattr(item, "module", None) is module
        }
        return cls({code: timeout for test, code in scripts if test in selected}, workers)

    def output(self, code: str) -> str:
        """The standard output of the script `code` once it has run, checked as
        `run_in_triton_interpreter` checks it."""
        assert code in self._runs, "this script was not given to InterpreterRuns"
        return _checked(self._runs[code].result())

    def close(self) -> None:
        """Ends what still runs (a session stopped early) and starts nothing more."""
        with self._lock:
            self._closed = True
            for proc in self._procs:
                if proc.poll() is None:
                    proc.kill()
        self._pool.shutdown(wait=True, cancel_futures=True)
