"""No host synchronisation in a training step between logging steps, on a GPU: the real trainer
(``pretrain.train.Trainer``, in this process, one rank) on the shipped albert-base recipes
(DeepSpeed, ``bf16-mixed``, their LAMB and compilation) runs 8 steps logging every 4 under
``torch.cuda.set_sync_debug_mode("error")``, which raises at any call that waits for the device
(``item``, ``.cpu()``, blocking copies, ``nonzero``, boolean-mask indexing, ...). The mode is
off only for a logging step's logging, and for the steps up to the first logging step where the
recipe compiles the encoder (Inductor synchronises while it compiles); every other step, and
what the loop does between steps, is checked. The CPU test of the same property counts the
calls instead: tests/engine/test_host_syncs.py."""

from __future__ import annotations

import pytest
import torch
from gpu_support import GPU
from pretrain_support import REPO, SEQ, make_shards, one_process_rendezvous

import pretrain.train as train_module
from engine.recipe import load_recipe
from pretrain.config import pretrain_config

pytestmark = [*GPU, pytest.mark.integration]

STEPS, LOG_EVERY = 8, 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("syncs"))


@pytest.mark.parametrize(
    "zero_stage, family",
    [(0, "softmax"), (0, "tisa"), (0, "kernel"), (0, "transject"), (2, "softmax")],
)
def test_no_host_sync_between_logging_steps_on_a_gpu(shards, tmp_path, monkeypatch, zero_stage,
                                                      family):  # fmt: skip
    one_process_rendezvous(monkeypatch)
    name = "albert-base.yaml" if family == "softmax" else f"albert-base-{family}.yaml"
    overrides = [
        f"data.shards={shards}", f"data.max_seq_length={SEQ}", "data.num_workers=0",
        f"engine.zero_stage={zero_stage}", "engine.device=cuda", "engine.micro_batch_size=16",
        "schedule.warmup_steps=5", "schedule.total_steps=1000", f"train.run_dir={tmp_path}",
        f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}", "train.checkpoint_every=0",
        "train.diagnostics_every=0", "train.export_at_end=false", "train.progress=false",
    ]  # fmt: skip
    trainer = train_module.Trainer(
        pretrain_config(load_recipe(REPO / "configs/pretrain" / name, overrides))
    )
    unchecked = LOG_EVERY if trainer.engine.compiled else 0
    step_fn = trainer._train_step

    def checked_step(*args, **kwargs):
        number = trainer.step + 1
        if number > unchecked:
            torch.cuda.set_sync_debug_mode("error")
        out = step_fn(*args, **kwargs)
        if number % LOG_EVERY == 0 or number == STEPS:
            torch.cuda.set_sync_debug_mode(0)  # the logging that follows reads, on purpose
        return out

    trainer._train_step = checked_step
    try:
        result = trainer.run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert result.state == "completed" and result.step == STEPS
