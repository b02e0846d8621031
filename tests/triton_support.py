"""Runs code in Triton's interpreter: the project's GPU kernels on CPU tensors (tests)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
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


def _run(code: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_in_triton_interpreter(code: str, timeout: float = 300) -> str:
    """Runs `code` in a fresh Python with TRITON_INTERPRET=1 (Triton reads it when a kernel is
    defined, so it cannot be switched on inside this process once a kernel module is imported);
    returns its standard output, or fails the test with its output. When the interpreter cannot
    run even a trivial loop, the failure says so: Triton 3.5's interpreter does not run with
    NumPy 2.4 (Triton 3.9 does, and 3.5 with NumPy 2.3), a pair that a CUDA torch's pinned
    Triton can bring."""
    assert importlib.util.find_spec("triton"), (
        "triton is in the test extras: pip install -e .[test]"
    )
    result = _run(code, timeout)
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
