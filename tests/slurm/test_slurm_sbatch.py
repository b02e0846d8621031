"""The sbatch templates on a real one-node Slurm (started by slurm/cluster.sh): fine-tuning's
preemption -> checkpoint -> requeue -> exact resume, and sharded data_prep as an array with a
dependent finalize. pretrain.sbatch (one node and two, preemption included) is tested in
test_slurm_multinode.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pretrain_support import REPO
from slurm_support import job_state, submit, wait_for_job

from data_prep.shards import ShardConfig, build_shards

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]


def sbatch_env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["ALBATROSS_DIR"] = str(REPO)
    env["ALBATROSS_SETUP"] = f"source {sys.prefix}/bin/activate"
    env["HF_HUB_OFFLINE"] = "1"
    return env


def wait_for_lines(metrics: Path, lines: int, job: str, log: Path, timeout: float = 300) -> None:
    """Until the job has logged ``lines`` metric lines (it trains); fails if the job vanished."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= lines:
            return
        assert job_state(job) is not None, log.read_text() if log.exists() else "job vanished"
        time.sleep(0.2)
    pytest.fail("the job did not start training in time")


def test_data_prep_array_then_finalize_matches_one_process(tmp_path):
    from data_prep.tokenizer import write_tokenizer

    write_tokenizer(tmp_path / "tok", inputs=["embedded:80"], vocab_size=300)
    tok = tmp_path / "tok" / "tokenizer.json"
    single = tmp_path / "single"
    cfg = ShardConfig(inputs=("embedded:80",), num_shards=4, max_seq_length=32, seed=3)
    build_shards(cfg, tok, single, workers=1)

    out = tmp_path / "array"
    template = str(REPO / "slurm" / "data_prep.sbatch")
    shards_args = [
        "shards",
        "--input",
        "embedded:80",
        "--tokenizer",
        str(tok),
        "--out",
        str(out),
        "--num-shards",
        "4",
        "--max-seq-length",
        "32",
        "--seed",
        "3",
        "--workers",
        "1",
    ]
    logs = f"--output={tmp_path}/dp-%A_%a.out"
    array = submit(
        ["--array=0-1", "--cpus-per-task=1", logs, template, *shards_args], env=sbatch_env()
    )
    final = submit(
        [
            f"--dependency=afterok:{array}",
            "--cpus-per-task=1",
            logs,
            template,
            "finalize",
            "--out",
            str(out),
        ],
        env=sbatch_env(),
    )
    wait_for_job(final)
    wait_for_job(array)
    texts = "".join(p.read_text() for p in sorted(tmp_path.glob("dp-*.out")))
    assert "--job-index 0 --num-jobs 2" in texts and "--job-index 1 --num-jobs 2" in texts
    assert (out / "manifest.json").read_bytes() == (single / "manifest.json").read_bytes(), texts


def _lra_args(data: Path, run_dir: Path) -> list[str]:
    return [
        "lra", "--task", "listops", "--data", str(data), "model.hidden_size=32",
        "model.embedding_size=32", "model.num_attention_heads=2", "model.intermediate_size=64",
        "model.hidden_dropout_prob=0.1", "engine.precision=fp32", "engine.backend=torch",
        "engine.micro_batch_size=8", "schedule.total_steps=150", "schedule.warmup_steps=5",
        "train.eval_every=25", "train.log_every=1", "train.checkpoint_every=0",
        "data.max_length=40", f"train.run_dir={run_dir}",
    ]  # fmt: skip


def test_finetune_preemption_requeues_and_resumes_exactly(tmp_path):
    """finetune.sbatch: SIGUSR1 (the time-limit warning) mid-run -> a checkpoint, exit 75 ->
    the script requeues the job -> the requeued job resumes and ends exactly where an
    uninterrupted run ends (evaluation history and best-dev weights)."""
    import os

    import torch
    from safetensors.torch import load_file

    from data_prep.listops import write_splits

    data = tmp_path / "listops"
    write_splits(data, {"train": 96, "val": 24, "test": 24}, min_length=5, max_length=30, seed=0)
    reference = tmp_path / "reference"
    env = {**sbatch_env(), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", *_lra_args(data, reference)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]

    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    args = ["--cpus-per-task=1", "--time=00:15:00", "--gpus-per-node=0", f"--output={log}"]
    job = submit(
        [*args, str(REPO / "slurm" / "finetune.sbatch"), *_lra_args(data, run_dir)],
        env=sbatch_env(),
    )
    wait_for_lines(run_dir / "seed_0" / "tensorboard" / "metrics.jsonl", 5, job, log)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    wait_for_job(job)
    text = log.read_text()
    assert "stopped at step" in text and f"requeueing job {job}" in text, text[-3000:]
    assert "restart 1" in text and "resumed from" in text
    ours = json.loads((run_dir / "seed_0" / "results.json").read_text())
    ref = json.loads((reference / "seed_0" / "results.json").read_text())
    assert ours["history"] == ref["history"] and ours["best_step"] == ref["best_step"]
    wa = load_file(str(run_dir / "seed_0" / "best" / "model.safetensors"))
    wb = load_file(str(reference / "seed_0" / "best" / "model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0) for k in wa)
    assert os.path.isfile(run_dir / "results.md")
