"""Held-out validation during pretraining: every ``train.eval_every`` steps the MLM loss and
accuracy and SOP accuracy on the shards' validation split (fixed examples and masks) go to
TensorBoard and status.json; the evaluation changes nothing of the training trajectory, is
part of an exact resume, runs on the real DeepSpeed engine with 2 processes (ZeRO-3), and
shards without a split are a clear error at start-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pretrain_support import REPO, SEQ, base_overrides, env, torchrun_cmd

from data_prep.shards import ShardConfig, build_shards
from data_prep.tokenizer import write_tokenizer
from engine.metrics import read_jsonl

pytestmark = pytest.mark.integration

CONFIG = str(REPO / "configs" / "pretrain" / "debug.yaml")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_tokenizer(root / "tokenizer", inputs=["embedded:60"], vocab_size=300)
    cfg = ShardConfig(
        inputs=("embedded:60",), num_shards=2, max_seq_length=SEQ, seed=0, validation_fraction=0.1
    )
    build_shards(cfg, root / "tokenizer" / "tokenizer.json", root / "shards", workers=1)
    return root / "shards"


def _run(shards: Path, run_dir: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    overrides = [
        *base_overrides(shards, run_dir, steps),
        "engine.backend=torch",
        "engine.zero_stage=0",
        "model.hidden_dropout_prob=0.1",
        "train.eval_every=2",
        "data.validation_batches=3",
        *extra,
    ]
    cmd = [sys.executable, "-m", "pretrain", "--config", CONFIG, *overrides]
    e = {k: v for k, v in env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=300)


def test_validation_is_logged_and_changes_nothing_of_the_training(shards, tmp_path):
    with_eval = _run(shards, tmp_path / "eval", 6)
    assert with_eval.returncode == 0, with_eval.stderr[-3000:]
    rows = read_jsonl(tmp_path / "eval" / "tensorboard")
    assert [s for s in sorted(rows) if "eval/loss/mlm" in rows[s]] == [2, 4, 6]
    for step in (2, 4, 6):
        assert 0 < rows[step]["eval/loss/mlm"] < 10 and 0 <= rows[step]["eval/accuracy/sop"] <= 1
        assert rows[step]["eval/masked_tokens"] > 0
    status = json.loads((tmp_path / "eval" / "status.json").read_text())
    assert status["validation"]["step"] == 6
    assert status["validation"]["eval/loss/mlm"] == rows[6]["eval/loss/mlm"]
    assert "validation mlm" in with_eval.stderr

    without = _run(shards, tmp_path / "plain", 6, "train.eval_every=0")
    assert without.returncode == 0, without.stderr[-3000:]
    plain = read_jsonl(tmp_path / "plain" / "tensorboard")
    assert [rows[s]["loss/mlm"] for s in range(1, 7)] == [plain[s]["loss/mlm"] for s in range(1, 7)]

    # The same weights give the same validation numbers: fixed examples and masks.
    again = _run(shards, tmp_path / "again", 6)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        read_jsonl(tmp_path / "again" / "tensorboard")[4]["eval/loss/mlm"]
        == (rows[4]["eval/loss/mlm"])
    )

    # A resume reproduces the uninterrupted run's validation curve.
    first = _run(shards, tmp_path / "resumed", 3, "train.checkpoint_every=3")
    assert first.returncode == 0, first.stderr[-3000:]
    second = _run(shards, tmp_path / "resumed", 6)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = read_jsonl(tmp_path / "resumed" / "tensorboard")
    assert [resumed[s]["eval/loss/mlm"] for s in (4, 6)] == [
        rows[s]["eval/loss/mlm"] for s in (4, 6)
    ]


def test_shards_without_a_validation_split_are_a_clear_error(tmp_path):
    from pretrain_support import make_shards

    plain = make_shards(tmp_path / "data")
    proc = _run(plain, tmp_path / "run", 2)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--validation-fraction" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_validation_on_deepspeed_zero3_with_two_processes(shards, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [
        *base_overrides(shards, run_dir, 4),
        "engine.zero_stage=3",
        "train.eval_every=2",
        "data.validation_batches=2",
    ]
    cmd = torchrun_cmd(2, "-m", "pretrain", "--config", CONFIG, *overrides)
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(run_dir / "tensorboard")
    assert 0 < rows[4]["eval/loss/mlm"] < 10 and rows[4]["eval/masked_tokens"] > 0
