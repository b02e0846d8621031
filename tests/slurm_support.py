"""A real 2-node Slurm for the tests (two slurmd daemons on this machine, accounting through
slurmdbd + MariaDB), started with the project's own script.

``slurm_cluster`` (a session fixture) runs ``bash slurm/cluster.sh start --nodes 2 --install``
(one-node tests run on either node); where it
cannot run (not root, no packages and no apt-get, another cluster's slurm.conf) the tests that
use it are skipped with the script's reason, printed in the pytest summary (``-ra``). A start
that fails for another reason is an error, not a skip.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CANNOT_RUN_HERE = 3  # cluster.sh's exit code for "not possible on this machine"


def start_cluster() -> None:
    proc = subprocess.run(
        ["bash", str(REPO / "slurm" / "cluster.sh"), "start", "--nodes", "2", "--install"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode == CANNOT_RUN_HERE:
        pytest.skip(f"no local Slurm: {proc.stderr.strip()}")
    if proc.returncode != 0:
        raise RuntimeError(f"slurm/cluster.sh start failed:\n{proc.stdout}\n{proc.stderr}")


def job_state(job_id: str) -> str | None:
    """The job's state from squeue, or None once it has left the queue. A squeue that fails
    for another reason than an unknown job id (slurmctld busy: a socket timeout) is asked again:
    its empty answer does not mean that the job has ended."""
    for _ in range(20):
        proc = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True
        )
        if proc.returncode == 0 or "Invalid job id" in proc.stderr:
            return proc.stdout.strip() or None
        time.sleep(1)
    raise RuntimeError(f"squeue -j {job_id} keeps failing: {proc.stderr.strip()}")


def wait_for_job(job_id: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job_state(job_id) is None:
            return
        time.sleep(0.25)
    subprocess.run(["scancel", job_id])
    raise TimeoutError(f"Slurm job {job_id} still queued/running after {timeout} s")


def submit(args: list[str], cwd: Path = REPO, env: dict | None = None) -> str:
    """``sbatch --parsable ...``; returns the job id."""
    proc = subprocess.run(
        ["sbatch", "--parsable", *args], cwd=cwd, capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed: {proc.stderr}")
    return proc.stdout.strip().split(";")[0]
