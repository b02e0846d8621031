"""Runs code in Triton's interpreter: the project's GPU kernels on CPU tensors (tests)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_in_triton_interpreter(code: str, timeout: float = 300) -> str:
    """Runs `code` in a fresh Python with TRITON_INTERPRET=1 (Triton reads it when a kernel is
    defined, so it cannot be switched on inside this process once a kernel module is imported);
    returns its standard output, or fails the test with its output."""
    assert importlib.util.find_spec("triton"), (
        "triton is in the test extras: pip install -e .[test]"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout
