"""Helpers for the pretraining tests: a tiny shard directory and a 2-process launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from data_prep.shards import ShardConfig, build_shards
from data_prep.tokenizer import write_tokenizer
from engine.recipe import recipe_overrides

REPO = Path(__file__).resolve().parents[1]
SEQ = 32

# A tiny model: every family trains a few steps in well under a second per step on 2 ranks.
TINY_MODEL = [
    "model.preset=debug",
    "model.hidden_size=32",
    "model.embedding_size=16",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    f"model.max_position_embeddings={SEQ}",
]
FAMILY = {
    family: recipe_overrides(REPO / "configs" / "families" / f"{family}.yaml")
    for family in ("softmax", "tisa", "kernel", "transject")
}
"""Each family's settings for the small runs: configs/families/<family>.yaml (the one source)."""


def make_shards(root: Path) -> Path:
    """tokenizer (vocab 300) + 2 shards of 32-token examples from the embedded corpus."""
    write_tokenizer(root / "tokenizer", inputs=["embedded:60"], vocab_size=300)
    tok = root / "tokenizer" / "tokenizer.json"
    shard_dir = root / "shards"
    cfg = ShardConfig(inputs=("embedded:60",), num_shards=2, max_seq_length=SEQ, seed=0)
    build_shards(cfg, tok, shard_dir, workers=1)
    return shard_dir


def base_overrides(shards: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        *TINY_MODEL,
        f"data.shards={shards}",
        f"data.max_seq_length={SEQ}",
        "data.num_workers=0",
        "data.verify_checksums=true",
        "optimizer.name=adamw",
        "optimizer.lr=0.003",
        "schedule.warmup_steps=2",
        "schedule.total_steps=1000",
        "engine.backend=deepspeed",
        "engine.device=cpu",
        "engine.precision=fp32",
        "engine.micro_batch_size=4",
        f"train.run_dir={run_dir}",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.checkpoint_every=0",
        "train.progress=false",
    ]


def pretrain_command(shards: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    """``python -m pretrain`` of the tiny run (``base_overrides``), then ``extra`` overrides."""
    return [sys.executable, "-m", "pretrain", *base_overrides(shards, run_dir, steps), *extra]


def free_port() -> int:
    """A TCP port nothing listens on now (for launchers that default to a fixed one)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process_rendezvous(monkeypatch) -> None:
    """The variables torchrun would set for a single process (an in-process DeepSpeed engine
    reads LOCAL_RANK and joins a process group of one)."""
    rendezvous = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    rendezvous.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name, value in rendezvous.items():
        monkeypatch.setenv(name, value)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    e.setdefault("HF_HUB_OFFLINE", "1")
    return e


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *args,
    ]


def run_pretrain(overrides: list[str], nproc: int = 2, timeout: float = 300):
    """``python -m pretrain`` under torchrun with ``nproc`` ranks; returns CompletedProcess."""
    cmd = torchrun_cmd(
        nproc, "-m", "pretrain", "--config", str(REPO / "configs/pretrain/debug.yaml"), *overrides
    )
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
