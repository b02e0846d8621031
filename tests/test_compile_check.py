"""bench/check_compiled_steps.py, the GPU suite's diagnostic for compiled steps that stop being
finite: on the CPU it runs the debug TransJect recipe eager and compiled (aot_eager) and must
report every step finite, with the compiled run's first-step losses equal to eager's (fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]


def run_check(tmp_path, family: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The diagnostic on the debug recipe of `family` (seq 32, batch 4): (process, report)."""
    out = tmp_path / "check.json"
    cmd = [
        sys.executable, str(REPO / "bench/check_compiled_steps.py"), "--device", "cpu",
        "--base", "debug", "--family", family, "--seq", "32", "--batch", "4",
        "--vocab", "2000", "--out", str(out), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_compile_check_reports_each_mode_step_by_step(tmp_path):
    proc, report = run_check(tmp_path, "transject", "--steps", "2", "--modes", "eager", "aot_eager")
    assert [m["mode"] for m in report["modes"]] == ["eager", "aot_eager"]
    for mode in report["modes"]:
        assert "error" not in mode, mode
        assert len(mode["steps"]) == 2
        for step in mode["steps"]:
            assert step["loss_finite"] and not step["skipped"], step
            assert step["nonfinite_grads"] == 0 and step["first_nonfinite_grads"] == []
            assert all(o["finite"] for o in step["outputs"].values())
            assert {"mlm", "sop", "aux/transject_reconstruction"} <= set(step["loss"])
    diff = report["first_step_vs_eager"]["aot_eager"]
    assert max(diff.values()) < 1e-5, diff
    assert "aot_eager step 2:" in proc.stdout


def test_compile_check_names_the_nonfinite_gradients(tmp_path):
    """A learning rate of 1e30 blows the weights up after the first update: the report must say
    which step went non-finite, that the engine skipped it, and name parameters."""
    _, report = run_check(
        tmp_path, "softmax", "--steps", "3", "--modes", "eager",
        "--override", "optimizer.lr=1e30", "schedule.warmup_steps=0", "engine.gradient_clipping=0",
    )  # fmt: skip
    steps = report["modes"][0]["steps"]
    assert steps[0]["loss_finite"] and not steps[0]["skipped"]
    bad = [s for s in steps if not s["loss_finite"] or s["nonfinite_grads"]]
    assert bad, steps
    assert bad[0]["skipped"]
    assert bad[0]["first_nonfinite_grads"] or not bad[0]["loss_finite"]


def test_scoped_inductor_mode_compiles_only_its_part(tmp_path):
    """`inductor-state`: the eager encoder with only its embeddings and family state compiled
    (inductor, CPU); finite, and its first step equal to eager's."""
    _, report = run_check(
        tmp_path, "transject", "--steps", "1", "--modes", "eager", "inductor-state"
    )
    scoped = report["modes"][1]
    assert scoped["mode"] == "inductor-state" and "error" not in scoped, scoped
    assert scoped["compiled"] == ["embeddings", "family_state"]
    assert scoped["steps"][0]["loss_finite"] and not scoped["steps"][0]["skipped"]
    diff = report["first_step_vs_eager"]["inductor-state"]
    assert max(diff.values()) < 1e-5, diff
