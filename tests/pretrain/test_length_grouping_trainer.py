"""`data.group_by_length` through the real trainer (`pretrain.train.Trainer`, DeepSpeed, one
process): more micro-batches reach the model without padding, so without a mask
(`Engine.to_device`), and a run stopped at a checkpoint resumes to the very losses of the
uninterrupted run. The loader-level properties (each example once per epoch, elastic resume,
the old stream bit for bit when off) are tests/data_prep/test_length_grouping.py."""

from __future__ import annotations

import pytest
from pretrain_support import base_overrides, make_shards, one_process_rendezvous

import pretrain.train as train_module
from engine.engine import Engine
from engine.metrics import read_jsonl
from engine.recipe import load_recipe
from pretrain.config import pretrain_config

pytestmark = pytest.mark.integration
GROUPED = [
    "data.group_by_length=true",
    "data.group_by_length_window=128",
    "data.group_by_length_chunk=16",  # = micro-batch 16 x 1 process
    "engine.micro_batch_size=16",
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("grouping"))


def train(shards, run_dir, steps, extra, monkeypatch):
    """Runs the trainer; returns (metrics by step, the share of micro-batches sent unmasked)."""
    one_process_rendezvous(monkeypatch)
    sent = []
    real = Engine.to_device

    def recording(self, batch):
        moved = real(self, batch)
        if "mlm_labels" in batch:  # training and validation batches
            sent.append(moved["attention_mask"] is None)
        return moved

    monkeypatch.setattr(Engine, "to_device", recording)
    overrides = [
        *base_overrides(shards, run_dir, steps),
        "data.verify_checksums=false",
        "train.export_at_end=false",
        "train.checkpoint_every=4",
        *extra,
    ]
    result = train_module.Trainer(pretrain_config(load_recipe(None, overrides))).run()
    assert result.state == "completed" and result.step == steps
    return read_jsonl(run_dir / "tensorboard"), sum(sent) / len(sent)


def test_grouped_batches_reach_the_model_unmasked(shards, tmp_path, monkeypatch):
    _, plain = train(shards, tmp_path / "plain", 12, ["engine.micro_batch_size=16"], monkeypatch)
    _, grouped = train(shards, tmp_path / "grouped", 12, GROUPED, monkeypatch)
    print(f"unmasked micro-batches: {plain:.0%} -> {grouped:.0%}")
    assert grouped >= plain + 0.3, (plain, grouped)


def test_grouped_run_resumes_exactly(shards, tmp_path, monkeypatch):
    whole, _ = train(shards, tmp_path / "whole", 8, GROUPED, monkeypatch)
    train(shards, tmp_path / "cut", 4, GROUPED, monkeypatch)
    resumed, _ = train(shards, tmp_path / "cut", 8, GROUPED, monkeypatch)
    for step in range(5, 9):
        for key in ("loss/mlm", "loss/sop", "optim/grad_norm", "throughput/tokens_seen"):
            assert resumed[step][key] == pytest.approx(whole[step][key], abs=1e-6), (step, key)
