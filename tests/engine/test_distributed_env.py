"""engine.distributed: hostlist expansion, launcher detection, env:// export."""

from __future__ import annotations

import os

import pytest
from pretrain_support import free_port

from engine.distributed import (
    DistEnv,
    detect,
    expand_nodelist,
    export_torch_env,
    parse_tasks_per_node,
)

TORCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# -------------------------------------------------------------------------------- nodelist


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-100]", ["n098", "n099", "n100"]),
        ("gpu-a[1-2]-b[3-4]", ["gpu-a1-b3", "gpu-a1-b4", "gpu-a2-b3", "gpu-a2-b4"]),
        ("a[1-2],b3,c[05-06]", ["a1", "a2", "b3", "c05", "c06"]),
        ("x[1,3],y[2-3]z", ["x1", "x3", "y2z", "y3z"]),
    ],
)
def test_expand_nodelist(spec, hosts):
    assert expand_nodelist(spec) == hosts


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "node[01-03",
        "node01-03]",
        "node[5-3]",
        "node[a-b]",
        "node[]",
        "a,,b",
        "n[1-[2]]",
        "n[1-]",
    ],
)
def test_expand_nodelist_rejects_malformed(spec):
    with pytest.raises(ValueError):
        expand_nodelist(spec)


def test_parse_tasks_per_node():
    assert parse_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert parse_tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node("4(2)")


# -------------------------------------------------------------------------------- detect


def test_detect_torchrun():
    env = detect(
        {
            "RANK": "5",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.3",
            "MASTER_PORT": "29400",
            # torchrun inside an srun task: torchrun's variables win
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_JOB_ID": "1234",
        }
    )
    assert env == DistEnv(5, 1, 8, 4, 1, "10.0.0.3", 29400, "torchrun")


def test_detect_torchrun_node_rank_fallback():
    env = detect({"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert (env.node_rank, env.master_addr, env.launcher) == (1, "127.0.0.1", "torchrun")


def _srun_env(**over):
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_PROCID": "6",
        "SLURM_LOCALID": "2",
        "SLURM_NTASKS": "8",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[007-008]",
        "SLURM_STEP_NODELIST": "gpu[007-008]",
    }
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


def test_detect_srun_two_nodes_four_tasks():
    env = detect(_srun_env())
    assert env == DistEnv(
        rank=6,
        local_rank=2,
        world_size=8,
        local_world_size=4,
        node_rank=1,
        master_addr="gpu007",
        master_port=10000 + 123456 % 20000,
        launcher="slurm",
    )
    assert 10000 <= env.master_port < 30000


def test_detect_srun_master_port_and_step_nodelist_precedence():
    env = detect(_srun_env(MASTER_PORT="23456", SLURM_STEP_NODELIST="gpu[008,007]"))
    assert (env.master_addr, env.master_port) == ("gpu008", 23456)


def test_detect_srun_uneven_tasks_per_node():
    base = dict(SLURM_NTASKS="11", SLURM_NNODES="3", SLURM_TASKS_PER_NODE="4(x2),3")
    last = detect(_srun_env(**base, SLURM_PROCID="10", SLURM_LOCALID="2", SLURM_NODEID="2"))
    assert last.local_world_size == 3 and last.node_rank == 2
    first = detect(_srun_env(**base, SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_NODEID="0"))
    assert first.local_world_size == 4
    # SLURM_NTASKS_PER_NODE (a single number) is used when present
    ntpn = detect(_srun_env(SLURM_NTASKS_PER_NODE="4", SLURM_TASKS_PER_NODE=None))
    assert ntpn.local_world_size == 4


def test_detect_sbatch_shell_is_single():
    env = _srun_env(SLURM_PROCID=None, SLURM_LOCALID=None, SLURM_NODEID=None)
    got = detect(env)
    assert got == DistEnv(0, 0, 1, 1, 0, "127.0.0.1", got.master_port, "single")
    assert got.master_port != 29500  # a free port, not a fixed one (two runs would collide)


def test_detect_no_env_is_single():
    got = detect({})
    assert got == DistEnv(0, 0, 1, 1, 0, "127.0.0.1", got.master_port, "single")


@pytest.mark.parametrize(
    ("environ", "var"),
    [
        ({"RANK": "8", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, "RANK"),
        (
            {"RANK": "1", "LOCAL_RANK": "4", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"},
            "LOCAL_RANK",
        ),
        ({"RANK": "-1", "LOCAL_RANK": "0", "WORLD_SIZE": "8"}, "RANK"),
        ({"RANK": "one", "LOCAL_RANK": "0", "WORLD_SIZE": "8"}, "RANK"),
        ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE"),
        ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "x"}, "MASTER_PORT"),
        (_srun_env(SLURM_PROCID="8"), "SLURM_PROCID"),
        (_srun_env(SLURM_LOCALID="4"), "SLURM_LOCALID"),
        (_srun_env(SLURM_LOCALID="-1"), "SLURM_LOCALID"),
        (_srun_env(SLURM_NTASKS="eight"), "SLURM_NTASKS"),
        (_srun_env(SLURM_NODEID="2"), "SLURM_NODEID"),
        (_srun_env(SLURM_TASKS_PER_NODE="4(x)"), "SLURM_TASKS_PER_NODE"),
    ],
)
def test_detect_inconsistent_values_raise(environ, var):
    with pytest.raises(ValueError, match=var):
        detect(environ)


# -------------------------------------------------------------------------------- export


def test_export_torch_env_round_trip():
    src = detect(_srun_env())
    environ: dict[str, str] = {"SLURM_JOB_ID": "123456", "MASTER_ADDR": "gpu007"}
    export_torch_env(src, environ)
    assert {k: environ[k] for k in TORCH_VARS} == {
        "RANK": "6",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu007",
        "MASTER_PORT": str(src.master_port),
    }
    back = detect(environ)
    assert back == DistEnv(**{**src.__dict__, "launcher": "torchrun"})
    export_torch_env(src, environ)  # idempotent: same values are fine


def test_export_torch_env_conflict():
    src = detect(_srun_env())
    environ = {"RANK": "3", "MASTER_ADDR": "elsewhere"}
    with pytest.raises(ValueError, match="RANK"):
        export_torch_env(src, environ)
    assert environ == {"RANK": "3", "MASTER_ADDR": "elsewhere"}  # nothing half-written


# -------------------------------------------------------------------------------- real init


def test_gloo_init_from_detected_env(monkeypatch):
    import torch
    import torch.distributed as dist

    for name in (*TORCH_VARS, "GROUP_RANK", "NODE_RANK", "SLURM_PROCID"):
        # setenv first so that undo() also removes what export_torch_env adds below
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    port = free_port()
    env = detect({"MASTER_PORT": str(port)})
    assert (env.launcher, env.world_size, env.master_addr) == ("single", 1, "127.0.0.1")
    export_torch_env(env)
    assert os.environ["MASTER_PORT"] == str(port) and os.environ["RANK"] == "0"
    from engine.engine import shutdown

    # A group left by an in-process engine test that ran before: shutdown() also forgets the
    # groups DeepSpeed cached on it, or the next in-process engine fails on a destroyed group.
    shutdown()
    dist.init_process_group("gloo", init_method="env://")
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        shutdown()
    assert not dist.is_initialized()


# -------------------------------------------------------------------------------- lost peer


def test_a_dead_peer_is_named_as_such(tmp_path):
    """A process of a 2-process gloo group dies; the survivor's collective fails and
    lost_peer recognises it; the message names the rank, the node and the checkpoint."""
    import subprocess
    import sys

    from pretrain_support import REPO, env

    port = str(free_port())
    procs = []
    for rank in (0, 1):
        e = {**env(), "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
        e.update(MASTER_PORT=port, LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "multiproc" / "lost_peer.py")],
                env=e,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out, err = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=120)
    assert procs[0].returncode == 0, out + err
    assert "lost_peer: True" in out
    assert "rank 0/2 on node" in out and "lost contact with another process of the job" in out
    assert "the last complete checkpoint is run/checkpoints/step_00000010" in out


def test_a_bug_is_not_a_lost_peer(monkeypatch):
    from engine.distributed import lost_peer

    two = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    for name, value in {**two, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert not lost_peer(ValueError("Connection reset by peer"))  # not a backend error
    assert not lost_peer(RuntimeError("shape mismatch"))
    assert lost_peer(RuntimeError("gloo: Connection closed by peer [127.0.0.1]:5"))
    for name in two:
        monkeypatch.delenv(name)
    assert not lost_peer(RuntimeError("Connection closed by peer"))  # one process: no peer
