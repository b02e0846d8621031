"""Fine-tuning on bad or awkward input: a clear error in seconds, never a hang or a crash late in
the run. Each test here failed (or hung) before its fix."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_prep.listops import write_splits
from engine.distributed import detect
from finetune.batching import example_lengths
from finetune.lra.data import load_split

pytestmark = pytest.mark.integration  # runs the stages end to end

REPO = Path(__file__).resolve().parents[2]

TINY = [
    "model.hidden_size=32",
    "model.embedding_size=32",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "engine.precision=fp32",
    "engine.backend=torch",
]


def _finetune(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "finetune", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_train_split_smaller_than_a_batch_is_a_clear_error(tmp_path):
    """3 training rows and micro-batches of 16: every epoch dropped its only partial batch and
    the endless epoch loop spun at 100% CPU. Now: exit 2, one line naming both numbers."""
    data = tmp_path / "listops"
    write_splits(data, {"train": 3, "val": 4, "test": 4}, min_length=5, max_length=30, seed=0)
    args = ["lra", "--task", "listops", "--data", str(data), "data.max_length=40", *TINY]
    args += ["engine.micro_batch_size=16", "schedule.total_steps=4", "schedule.warmup_steps=0"]
    args += [f"train.run_dir={tmp_path / 'run'}", "--seeds", "0"]
    proc = _finetune(args, timeout=150)  # the old code never returned
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "3 examples" in proc.stderr and "global batch of 16" in proc.stderr, proc.stderr


def test_group_by_length_on_real_lra_examples(tmp_path):
    """`train.group_by_length=true` read the example set's `lengths` as an array; on the GLUE
    and LRA sets it is a method, and every run crashed. The lengths are now the method's
    values, and a run with grouping trains to the end."""
    data = tmp_path / "listops"
    write_splits(data, {"train": 64, "val": 16, "test": 16}, min_length=5, max_length=30, seed=0)
    split, _ = load_split("listops", data, "train", 40)
    lengths = example_lengths(split)
    assert lengths.shape == (64,) and lengths.dtype == np.int64
    assert (lengths == [len(split[i]["input_ids"]) for i in range(64)]).all()

    run_dir = tmp_path / "run"
    args = ["lra", "--task", "listops", "--data", str(data), "data.max_length=40", *TINY]
    args += ["engine.micro_batch_size=8", "schedule.total_steps=4", "schedule.warmup_steps=0"]
    args += ["train.group_by_length=true", "train.eval_every=4", f"train.run_dir={run_dir}"]
    args += ["--seeds", "0"]
    proc = _finetune(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((run_dir / "results.json").read_text())["runs"]
    assert row["best_step"] == 4


def test_single_process_runs_pick_a_free_port(monkeypatch):
    """Without MASTER_PORT every single process used 29500, so two runs on one machine
    collided (EADDRINUSE). Now each process picks a free port, the same for all its calls."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    first, second = detect({}), detect({})
    assert first.launcher == "single" and first.master_port == second.master_port
    code = "from engine.distributed import detect; print(detect({}).master_port)"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ports = {
        int(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))
        for _ in range(2)
    }
    assert len(ports) == 2, ports  # two processes, two ports
    assert detect({"MASTER_PORT": "12345"}).master_port == 12345  # an explicit one wins


def test_release_directory_follows_the_umask(tmp_path):
    """Releases were written 0700 (mkdtemp's mode): collaborators on a shared file system could
    not read them. Now the directory gets 0777 less the umask, like any mkdir."""
    import torch

    from model.config import EncoderConfig
    from model.heads import EncoderForPretraining
    from model.hub.release import save_release

    old = os.umask(0o022)
    try:
        torch.manual_seed(0)
        out = save_release(
            tmp_path / "release", EncoderForPretraining(EncoderConfig.preset("debug"))
        )
    finally:
        os.umask(old)
    mode = stat.S_IMODE(out.stat().st_mode)
    assert mode == 0o755, oct(mode)
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) & 0o044 == 0o044, (f, oct(f.stat().st_mode))
