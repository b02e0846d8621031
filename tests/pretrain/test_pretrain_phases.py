"""Two-phase pretraining (short sequences, then long ones, other shards and micro-batch) in one
run: the phases switch at their boundary, TensorBoard says which phase each step was in, and a
crash just before, at and just after the boundary resumes exactly (the same losses as the
uninterrupted run, step for step)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pretrain_support import REPO, base_overrides, env, make_shards

from data_prep.shards import ShardConfig, build_shards
from engine.metrics import read_jsonl

pytestmark = pytest.mark.integration

CONFIG = str(REPO / "configs" / "pretrain" / "debug.yaml")
BOUNDARY, TOTAL = 4, 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("data")
    short = make_shards(root)  # 32-token examples, root/tokenizer/tokenizer.json
    long = root / "shards64"
    cfg = ShardConfig(inputs=("embedded:60",), num_shards=1, max_seq_length=64, seed=0)
    build_shards(cfg, root / "tokenizer" / "tokenizer.json", long, workers=1)
    return short, long


def _pretrain(shards: tuple[Path, Path], run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    short, long = shards
    phases = (
        f"phases=[{{name: short, steps: {BOUNDARY}, shards: {short}, max_seq_length: 32}}, "
        f"{{name: long, steps: {TOTAL - BOUNDARY}, shards: {long}, max_seq_length: 64, "
        "micro_batch_size: 2}]"
    )
    overrides = [
        *base_overrides(short, run_dir, TOTAL),
        "model.max_position_embeddings=64",
        "model.hidden_dropout_prob=0.1",
        "engine.backend=torch",
        "engine.zero_stage=0",
        "train.checkpoint_every=1",
        "train.keep_last=2",
        phases,
        *extra,
    ]
    cmd = [sys.executable, "-m", "pretrain", "--config", CONFIG, *overrides]
    e = {k: v for k, v in env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    proc = _pretrain(shards, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"step {BOUNDARY}: phase long (64 tokens, micro-batch 2" in proc.stderr
    return run_dir


def test_phases_switch_at_the_boundary(uninterrupted):
    rows = read_jsonl(uninterrupted / "tensorboard")
    assert [rows[s]["train/phase"] for s in range(1, TOTAL + 1)] == [0.0] * 4 + [1.0] * 4
    assert rows[BOUNDARY]["train/max_seq_length"] == 32 and rows[TOTAL]["train/max_seq_length"]
    # 4 sequences of at most 32 tokens, then 2 of at most 64: the tokens per step say so.
    seen = [rows[s]["throughput/tokens_seen"] for s in range(1, TOTAL + 1)]
    steps = [b - a for a, b in zip([0.0, *seen], seen)]
    assert max(steps[:BOUNDARY]) <= 4 * 32 and max(steps[BOUNDARY:]) <= 2 * 64


@pytest.mark.parametrize("crash_after", [BOUNDARY, BOUNDARY + 1, BOUNDARY + 2])
def test_a_crash_around_the_boundary_resumes_exactly(shards, uninterrupted, tmp_path, crash_after):
    """A crash after step k leaves the checkpoint of step k - 1: just before the boundary, at
    it (the checkpoint of the first phase's last step) and just after."""
    run_dir = tmp_path / "run"
    crashed = _pretrain(shards, run_dir, f"train.fail_at_step={crash_after}")
    assert crashed.returncode == 1 and "failing on purpose" in crashed.stderr
    resumed = _pretrain(shards, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step_{crash_after - 1:08d}" in resumed.stderr.split("resumed from")[1].splitlines()[0]
    a, b = read_jsonl(uninterrupted / "tensorboard"), read_jsonl(run_dir / "tensorboard")
    for step in range(1, TOTAL + 1):
        assert b[step]["loss/mlm"] == a[step]["loss/mlm"], step
        assert b[step]["train/phase"] == a[step]["train/phase"], step


def test_a_phase_with_another_tokenizer_is_refused(shards, tmp_path):
    from data_prep.tokenizer import write_tokenizer

    short, _ = shards
    write_tokenizer(tmp_path / "tok", inputs=["embedded:30"], vocab_size=200)
    other = tmp_path / "other"
    cfg = ShardConfig(inputs=("embedded:30",), num_shards=1, max_seq_length=64, seed=0)
    build_shards(cfg, tmp_path / "tok" / "tokenizer.json", other, workers=1)
    proc = _pretrain((short, other), tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "another tokenizer" in proc.stderr and "long" in proc.stderr
