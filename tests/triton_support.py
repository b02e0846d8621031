"""Runs code in Triton's interpreter: the project's GPU kernels on CPU tensors (tests)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from background_runs import BackgroundRuns, selected_tests

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


def _run(code: str, timeout: float, run=subprocess.run) -> subprocess.CompletedProcess:
    """`code` in a fresh Python with TRITON_INTERPRET=1, through `run` (`subprocess.run` or
    `BackgroundRuns.run`)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    return run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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


class InterpreterRuns(BackgroundRuns):
    """Scripts run in Triton's interpreter side by side (`BackgroundRuns`), each in a process of
    its own as with `run_in_triton_interpreter`, and checked as that checks them."""

    def __init__(self, scripts: dict[str, float], workers: int = 2):
        """`scripts`: each script's code and its timeout in seconds (from its start), the
        longest first."""
        _needs_triton()
        super().__init__(workers)
        for code, timeout in scripts.items():
            self.submit(code, _run, code, timeout, self.run)

    @classmethod
    def of_selected(cls, request, scripts: list[tuple[str, str]], workers: int = 2, timeout=900):
        """The runs of the scripts, of (test name, script) in `scripts`, whose tests in the
        requesting module this session runs (`selected_tests`)."""
        selected = selected_tests(request)
        return cls({code: timeout for test, code in scripts if test in selected}, workers)

    def output(self, code: str) -> str:
        """The standard output of the script `code` once it has run, checked as
        `run_in_triton_interpreter` checks it."""
        return _checked(self.result(code))
