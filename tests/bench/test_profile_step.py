"""``python -m bench.profile_step``, the GPU suite's per-operator profile of a pretraining step:
on the CPU it profiles the debug recipes (host time) and must report each family's operators,
largest first, with shares that add up and the kinds of work named; an unknown family is
reported as an error beside the others, not a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.profile_step import kind_of

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "op, kind",
    [
        ("aten::mm", "matrix products"),
        ("aten::addmm", "matrix products"),
        ("aten::bmm", "matrix products"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
        ("aten::_efficient_attention_backward", "attention"),
        ("aten::linalg_lu_solve", "linear algebra"),
        ("aten::linalg_inv_ex", "linear algebra"),
        ("aten::_foreach_mul_", "optimizer"),
        ("aten::copy_", "copies and casts"),
        ("aten::_to_copy", "copies and casts"),
        ("aten::add", "other"),
        ("aten::native_layer_norm", "other"),
        ("aten::topk", "other"),  # "to" inside a name is no copy
        ("## Call CompiledFxGraph f4jab35akdpoevbk6ofj4w ##", "fused by the compiler"),
        ("triton_poi_fused_add_mul_0", "fused by the compiler"),
        ("row_lse", "attention"),  # TISA's split backend, its own Triton kernels
        ("diagonal_grad", "attention"),
        ("key_summary", "attention"),  # kernel attention's inference kernels
        ("query_output", "attention"),
        ("albatross::kernel_attention_inference", "attention"),
        ("query_grad", "attention"),  # kernel attention's training mixing, backward
        ("summary_grad", "attention"),
        ("key_grad", "attention"),
        ("albatross::kernel_attention_mixing_backward", "attention"),
        ("gauss_jordan_inverse", "linear algebra"),  # the Cayley maps' leaves
    ],
)
def test_operators_are_sorted_into_kinds_of_work(op, kind):
    assert kind_of(op) == kind


def test_profile_reports_each_family_largest_first(tmp_path):
    out = tmp_path / "profile.json"
    cmd = [
        sys.executable, "-m", "bench.profile_step", "--device", "cpu", "--base", "debug",
        "--families", "softmax", "transject", "no_such_family", "--seq", "32", "--batch", "2",
        "--vocab", "2000", "--warmup", "1", "--steps", "2", "--top", "8", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["family"]: r for r in json.loads(out.read_text())["families"]}
    assert "no_such_family" in rows["no_such_family"]["error"]
    for family in ("softmax", "transject"):
        row = rows[family]
        assert row["time"] == "host" and row["self_ms_per_step"] > 0
        top = row["top"]
        assert len(top) == 8
        assert [o["self_ms"] for o in top] == sorted((o["self_ms"] for o in top), reverse=True)
        assert abs(sum(k["share"] for k in row["kinds"].values()) - 1) < 1e-6
        assert row["kinds"]["matrix products"]["ms"] > 0
        assert f"\n{family} (debug, seq 32, batch 2)" in proc.stdout
    # TransJect evaluates its orthogonal maps (below 128 x 128 by an LU-based inverse).
    assert rows["transject"]["kinds"]["linear algebra"]["ms"] > 0


def test_a_compiled_step_reports_its_fused_kernels_apart(tmp_path):
    """As the recipes run on a GPU (engine.compile): the compiled graph's own time is its kind
    of work, beside the products it leaves to aten."""
    out = tmp_path / "profile.json"
    cmd = [
        sys.executable, "-m", "bench.profile_step", "--device", "cpu", "--base", "debug",
        "--families", "softmax", "--seq", "32", "--batch", "2", "--vocab", "2000", "--warmup", "2",
        "--steps", "2", "--padding", "none", "--override", "engine.compile=true", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["families"]
    assert "error" not in row, row
    assert row["kinds"]["fused by the compiler"]["ms"] > 0
    assert row["kinds"]["matrix products"]["ms"] > 0
    assert row["top_kernels"] == []  # host time on the CPU: no device kernels
