"""Shared test setup: no network, deterministic torch, and the test tiers.

Tiers (markers, see docs/development.md):
    unit         in-process, seconds: the edit-test loop (``bash scripts/test.sh -m unit``,
                 under 2 minutes on 2 cores)
    integration  end-to-end runs of the command-line stages (subprocesses, real training to
                 the end, several runs compared)
    slow         several processes (torchrun, DeepSpeed over gloo), the local Slurm cluster,
                 long runs
A test is ``integration`` or ``slow`` by its marker (on the test, or ``pytestmark`` for its
module) and ``unit`` when it carries neither. CI runs all three.
"""

import functools
import os
import sys
from pathlib import Path

# Before anything imports transformers / huggingface_hub: tests never download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

# The tests live in folders that mirror the packages (tests/engine, tests/model, ...) and share
# helpers and fixtures by module name (``from test_engine import ONE``), as the support modules
# here (``pretrain_support``) are: every folder is importable.
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if "integration" not in item.keywords and "slow" not in item.keywords:
            item.add_marker(pytest.mark.unit)


@functools.cache
def _uses_slurm(module: Path) -> bool:
    """Whether a test module uses the local Slurm cluster (the `slurm_cluster` fixture)."""
    return "slurm_cluster" in module.read_text()


def pytest_xdist_make_scheduler(config, log):
    """With workers (scripts/test.sh: ``-n 2``) each module runs on one worker, so its module
    fixtures (shards, background runs) are made once; every module that uses the local Slurm
    cluster runs on the same worker, one test at a time, because their jobs share the cluster's
    two nodes and one test kills a node. Workers take the groups with the most tests first (the
    Slurm group among them), and the small modules fill the end."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleOrSlurm(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return "slurm" if _uses_slurm(Path(config.rootpath, module)) else module

    return ModuleOrSlurm(config, log)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same torch RNG state."""
    torch.manual_seed(0)


RESTORED_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
RESTORED_VARS += ("LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "OMP_NUM_THREADS")


@pytest.fixture(autouse=True)
def _no_environment_leaks():
    """Every later subprocess inherits this process's environment, so a test leaves these
    variables as it found them. A test that starts an engine in this process exports MASTER_PORT
    etc. and joins a one-process group: that rendezvous must not reach the launchers and jobs of
    later tests (the group itself stays: DeepSpeed caches its groups, so a later in-process
    DeepSpeed engine needs the same one). A module imported by a test may set OMP_NUM_THREADS,
    which GNU nproc answers, and which would size the local Slurm cluster's nodes."""
    before = {name: os.environ.get(name) for name in RESTORED_VARS}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running 2-node Slurm (see tests/slurm_support.py); skipped where it cannot run."""
    import subprocess

    from slurm_support import REPO, start_cluster

    running_before = (
        subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0
    )
    hosts = Path("/etc/hosts")
    hosts_before = hosts.read_bytes() if hosts.exists() else None
    start_cluster()
    yield
    if not running_before:  # leave a cluster that was already up alone
        subprocess.run(["bash", str(REPO / "slurm" / "cluster.sh"), "stop"], capture_output=True)
        # start + stop leave /etc/hosts as they found it, byte for byte (an error here, at the
        # session's end, names the last Slurm test)
        after = hosts.read_bytes() if hosts.exists() else None
        assert after == hosts_before, f"/etc/hosts changed by cluster.sh start + stop:\n{after!r}"
