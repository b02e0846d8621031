"""Pretraining and fine-tuning runs with ``train.trackers=[tensorboard,wandb,mlflow]``, as users
run them (``python -m pretrain``, ``python -m finetune lra``): W&B (offline) and MLflow (a
local ``file:`` store) hold the same scalars at the same steps as TensorBoard, including after
a resume with more steps and after a crash (the same W&B run id, the same MLflow run)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pretrain_support import REPO, base_overrides, make_shards
from tracker_support import assert_same_history, read_mlflow, read_wandb_offline

from data_prep.listops import write_splits
from engine.metrics import read_scalars

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("wandb") is None or importlib.util.find_spec("mlflow") is None,
        reason="wandb or mlflow is not installed (pip install -e '.[wandb,mlflow]')",
    ),
]

CONFIG = str(REPO / "configs/pretrain/debug.yaml")
TRACKERS = "train.trackers=[tensorboard,wandb,mlflow]"


@pytest.fixture(autouse=True)
def _file_store(monkeypatch):
    """This process reads the local MLflow store back (MLflow 3 refuses file: stores without)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def _env(tmp: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith(("WANDB_", "MLFLOW_"))
    }
    env.update(
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_CONSOLE="off",
        WANDB_DISABLE_GIT="true",
        WANDB_CACHE_DIR=str(tmp / "wandb-cache"),
        WANDB_CONFIG_DIR=str(tmp / "wandb-config"),
        MLFLOW_ALLOW_FILE_STORE="true",
    )
    return env


def _run(module: str, args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _check_trackers(run_dir: Path, uri: str, experiment: str, values: set[str] | None = None):
    """W&B and MLflow hold TensorBoard's tags and steps (``values``: compare these tags'
    values; all of them when None); one W&B run id, one MLflow run, finished."""
    tensorboard = read_scalars(run_dir / "tensorboard")
    wandb = read_wandb_offline(run_dir)
    assert len(set(wandb["ids"])) == 1, wandb["ids"]
    assert_same_history(wandb["history"], tensorboard, "W&B", values)
    runs = [r for r in read_mlflow(uri, experiment) if r["name"] == wandb["names"][0]]
    assert len(runs) == 1, [r["name"] for r in read_mlflow(uri, experiment)]
    assert runs[0]["status"] == "FINISHED"
    assert_same_history(runs[0]["history"], tensorboard, "MLflow", values)
    return tensorboard, wandb, runs[0]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("data"))


def _pretrain(shards: Path, run_dir: Path, tmp: Path, steps: int, *extra: str):
    args = ["--config", CONFIG, *base_overrides(shards, run_dir, steps)]
    args += [
        "engine.backend=torch",
        "engine.zero_stage=0",
        "train.checkpoint_every=2",
        "train.diagnostics_every=2",
        TRACKERS,
        f"train.mlflow_tracking_uri=file:{tmp / 'mlruns'}",
        *extra,
    ]
    return _run("pretrain", args, tmp)


def test_pretraining_resumed_with_more_steps_logs_one_run_everywhere(shards, tmp_path):
    run_dir = tmp_path / "albert"
    proc = _pretrain(shards, run_dir, tmp_path, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _pretrain(shards, run_dir, tmp_path, 6)  # train.steps raised: resumes at step 4
    assert proc.returncode == 0, proc.stderr[-3000:]
    tensorboard, wandb, run = _check_trackers(run_dir, f"file:{tmp_path / 'mlruns'}", "albatross")
    assert [s for s, _ in tensorboard["loss/mlm"]] == list(range(1, 7))
    assert "diagnostics/entropy/layer_00" in tensorboard  # the diagnostics scalars too
    assert len(wandb["ids"]) == 2 and wandb["names"] == ["albert", "albert"]
    assert run["params"]["train.steps"] == "4"  # the config the run started with
    assert wandb["config"]["engine"]["backend"] == "torch"


def test_pretraining_after_a_crash_keeps_one_value_per_step(shards, tmp_path):
    """A crash after step 3 with a checkpoint at step 2: the resume redoes step 3. TensorBoard
    keeps the redone step, W&B and MLflow the first one; the training scalars are the same
    (the resume is exact), the timings are not compared."""
    run_dir = tmp_path / "run"
    proc = _pretrain(shards, run_dir, tmp_path, 5, "train.fail_at_step=3", "train.run_name=crash")
    assert proc.returncode == 1 and "failing on purpose" in proc.stderr, proc.stderr[-3000:]
    (crashed,) = read_mlflow(f"file:{tmp_path / 'mlruns'}")
    assert crashed["status"] == "FAILED"
    proc = _pretrain(shards, run_dir, tmp_path, 5, "train.run_name=crash")
    assert proc.returncode == 0, proc.stderr[-3000:]
    exact = {
        tag
        for tag in read_scalars(run_dir / "tensorboard")
        if tag.startswith(("loss/", "accuracy/", "optim/", "diagnostics/"))
    }
    tensorboard, _, run = _check_trackers(
        run_dir, f"file:{tmp_path / 'mlruns'}", "albatross", exact
    )
    assert run["id"] == crashed["id"]
    assert [s for s, _ in tensorboard["loss/mlm"]] == [1, 2, 3, 4, 5]


def test_finetuning_logs_the_same_scalars_everywhere(tmp_path):
    data = tmp_path / "listops"
    write_splits(data, {"train": 48, "val": 16, "test": 16}, min_length=5, max_length=30, seed=0)
    run_dir = tmp_path / "lra"
    args = ["lra", "--task", "listops", "--data", str(data)]
    args += [
        "model.hidden_size=32",
        "model.embedding_size=32",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        "engine.precision=fp32",
        "engine.backend=torch",
        "engine.micro_batch_size=8",
        "schedule.total_steps=6",
        "schedule.warmup_steps=2",
        "train.eval_every=3",
        "train.log_every=1",
        "data.max_length=40",
        f"train.run_dir={run_dir}",
        TRACKERS,
        f"train.mlflow_tracking_uri=file:{tmp_path / 'mlruns'}",
        "train.mlflow_experiment=lra",
        "train.wandb_project=lra",
    ]
    proc = _run("finetune", args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tensorboard, wandb, run = _check_trackers(
        run_dir / "seed_0", f"file:{tmp_path / 'mlruns'}", "lra"
    )
    assert "train/loss" in tensorboard and "eval/val/accuracy" in tensorboard
    assert wandb["names"] == ["lra/seed_0"] and run["name"] == "lra/seed_0"
    assert run["params"]["task"] == "listops" and run["params"]["seed"] == "0"
