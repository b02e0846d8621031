"""Shared test setup: no network, deterministic torch."""

import os

# Before anything imports transformers / huggingface_hub: tests never download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same torch RNG state."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running one-node Slurm (see tests/slurm_support.py); skipped where it cannot run."""
    import subprocess

    from slurm_support import REPO, start_cluster

    running_before = (
        subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0
    )
    start_cluster()
    yield
    if not running_before:  # leave a cluster that was already up alone
        subprocess.run(["bash", str(REPO / "slurm" / "cluster.sh"), "stop"], capture_output=True)
