"""Every Slurm path across nodes, on a real 2-node cluster on this machine (slurm/cluster.sh: one
slurmd per node, each node its own loopback address, accounting through slurmdbd on MariaDB),
2 tasks per node (world size 4): pretrain.sbatch with ZeRO-2, the submitit launcher with ZeRO-3,
preemption -> requeue -> exact resume, resume of a 2-node run on 1 node and back, GLUE
fine-tuning through finetune.sbatch, data_prep split over the nodes of one job, and a node that
dies mid-job. Skipped with the reason where the cluster cannot run (not root, no packages)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import submitit
from pretrain_support import REPO, base_overrides, env, make_shards, torchrun_cmd
from slurm_support import job_state, submit, wait_for_job
from test_glue_finetune import release, tokenizer_file, write_sst2  # noqa: F401 (fixtures)
from test_slurm_sbatch import sbatch_env, wait_for_lines

from data_prep.shards import ShardConfig, build_shards
from engine.checkpoint import step_of
from engine.metrics import read_jsonl
from slurm.launcher import main as launcher_main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

NODES = ("albatross-node1", "albatross-node2")
CPU = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=00:15:00"]
TWO_NODES = ["--nodes=2", "--ntasks-per-node=2", *CPU]
ONE_NODE = ["--nodes=1", "--ntasks-per-node=2", *CPU]
CONFIG = str(REPO / "configs" / "pretrain" / "debug.yaml")
CLUSTER = ["bash", str(REPO / "slurm" / "cluster.sh")]
RANK_LINE = re.compile(
    r"distributed: rank (\d+)/(\d+) on node (\S+) \(node (\d+), local rank (\d+)/(\d+)\), "
    r"rendezvous (\S+):(\d+) \(slurm\)"
)


@pytest.fixture(scope="module", autouse=True)
def two_nodes():
    """The session's cluster must have both nodes up (a multi-node test never runs on one)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True)
    up = {line.split()[0] for line in out.stdout.splitlines() if "down" not in line}
    assert set(NODES) <= up, f"the local cluster lacks a node: {out.stdout}"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("data"))


def pretrain_job(shards: Path, run_dir: Path, steps: int, log: Path, *extra: str, nodes=TWO_NODES):
    args = [*nodes, f"--output={log}", str(REPO / "slurm" / "pretrain.sbatch"), "--config", CONFIG]
    return submit([*args, *base_overrides(shards, run_dir, steps), *extra], env=sbatch_env())


def sacct_history(job: str) -> list[tuple[str, str]]:
    """(state, node list) of every run of the job, requeues included (sacct -D), oldest first.
    (The node list can lag behind the state for a short job: placement is checked in the
    logs.)"""
    for _ in range(50):  # slurmctld hands the records to slurmdbd asynchronously
        out = subprocess.run(
            ["sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "State,NodeList"],
            capture_output=True,
            text=True,
        ).stdout
        rows = [tuple(line.split("|")) for line in out.splitlines() if line.strip()]
        if rows and rows[-1][0] not in ("RUNNING", "PENDING"):
            return rows
        time.sleep(0.2)
    return rows


def rank_placement(log: str) -> dict[int, tuple[str, int, str]]:
    """rank -> (node, local rank, rendezvous host) from the ranks' 'distributed:' lines."""
    out: dict[int, tuple[str, int, str]] = {}
    for m in RANK_LINE.finditer(log):
        rank, _, node, _, local, _, master, _ = m.groups()
        out[int(rank)] = (node, int(local), master)
    return out


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss/mlm"] for s, r in read_jsonl(run_dir / "tensorboard").items()}


def job_tasks(job: str, node: str) -> list[int]:
    """The PIDs of the job's Python tasks on `node` (their environment names both)."""
    want = {f"SLURM_JOB_ID={job}".encode(), f"SLURMD_NODENAME={node}".encode()}
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and (proc / "comm").read_text().startswith("python")
                and want <= set((proc / "environ").read_bytes().split(b"\0"))
            ):
                pids.append(int(proc.name))
        except OSError:  # the process has ended
            continue
    return pids


def freeze_between_checkpoints(job: str, run_dir: Path, every: int) -> tuple[int, int]:
    """Stops (SIGSTOP) the job's tasks on node 2 at a step between two checkpoints, so that a
    kill of that node loses steps for the resumed run to redo; returns (the last step logged,
    the last checkpoint's step). Once node 2 is stopped, node 1's ranks cannot finish another
    step (each needs node 2's gradients); what they log meanwhile is read after a pause. The
    state is checked while stopped (a kill that only follows a poll of the log can land right
    after a checkpoint), and the tasks go on if it is not the wanted one."""
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if max(losses(run_dir)) % every not in range(3, every - 2):
            time.sleep(0.05)
            continue
        pids = job_tasks(job, NODES[1])
        assert pids, f"no task of job {job} found on {NODES[1]}"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(1.0)
        logged = max(losses(run_dir))
        saved = step_of(latest.read_text().strip()) if latest.is_file() else 0
        if logged % every and saved == logged - logged % every:
            return logged, saved
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    pytest.fail(f"job {job} did not stop between two checkpoints: {sorted(losses(run_dir))}")


def assert_two_node_placement(log: str) -> None:
    placement = rank_placement(log)
    assert placement == {
        0: (NODES[0], 0, NODES[0]),
        1: (NODES[0], 1, NODES[0]),
        2: (NODES[1], 0, NODES[0]),
        3: (NODES[1], 1, NODES[0]),
    }, log[-3000:]


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory) -> tuple[Path, str, str]:
    """An uninterrupted 2-node x 2-task ZeRO-2 run of the debug recipe through pretrain.sbatch."""
    root = tmp_path_factory.mktemp("reference")
    job = pretrain_job(shards, root / "run", 24, root / "job.out", "engine.zero_stage=2")
    wait_for_job(job)
    return root / "run", (root / "job.out").read_text(), job


def assert_one_writer_every_step_once(run_dir: Path, steps: int, zero: int) -> None:
    """A completed 4-rank run: its last checkpoint complete for world size 4 and ZeRO-`zero`;
    TensorBoard written once, by rank 0: one event file, every step exactly once."""
    complete = json.loads(
        (run_dir / "checkpoints" / f"step_{steps:08d}" / "COMPLETE.json").read_text()
    )
    assert complete["world_size"] == 4 and complete["meta"]["zero_stage"] == zero
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, events
    lines = [
        json.loads(x) for x in (run_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [row["step"] for row in lines if "loss/mlm" in row] == list(range(1, steps + 1))


def test_pretrain_sbatch_on_two_nodes(reference):
    """pretrain.sbatch, ZeRO-2 (the reference run of the tests below). ZeRO-3 across the two
    nodes runs in the submitit launcher's test."""
    run_dir, log, job = reference
    assert f"4 tasks on {NODES[0][:-1]}[1-2]" in log and "run state: completed" in log, log[-3000:]
    assert "4 process(es) on cpu, global batch 16, ZeRO-2" in log
    assert_two_node_placement(log)
    assert [state for state, _ in sacct_history(job)] == ["COMPLETED"]
    assert_one_writer_every_step_once(run_dir, 24, zero=2)


def test_submitit_launcher_on_two_nodes(shards, tmp_path, monkeypatch, capsys):
    """`python -m slurm pretrain --nodes 2`, with ZeRO-3 (parameters partitioned over the
    ranks of both nodes)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    argv = ["pretrain", "--nodes", "2", "--tasks-per-node", "2", "--gpus-per-node", "0"]
    argv += ["--time", "10", "--log-dir", str(logs), "--wait", "--wait-timeout", "300"]
    argv += ["--", "--config", CONFIG, *base_overrides(shards, run_dir, 6), "engine.zero_stage=3"]
    assert launcher_main(argv) == 0
    out = capsys.readouterr().out
    assert "completed at step 6" in out, out
    assert "squeue -j" in out and "tail -f" in out  # how to follow the job
    job_id = out.split("job ", 1)[1].split(",")[0]
    # submitit reads the state from sacct (the accounting database): the true final state.
    job = submitit.SlurmJob(folder=logs, job_id=job_id, tasks=(0, 1, 2, 3))
    for _ in range(50):
        if job.state == "COMPLETED":
            break
        time.sleep(0.2)
    assert job.state == "COMPLETED"
    ranks = "".join((logs / f"{job_id}_{t}_log.err").read_text() for t in range(4))
    assert_two_node_placement(ranks)
    logged = ranks + (logs / f"{job_id}_0_log.out").read_text()
    assert "4 process(es) on cpu, global batch 16, ZeRO-3" in logged, logged[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 6
    assert_one_writer_every_step_once(run_dir, 6, zero=3)


def test_preemption_of_a_two_node_job_resumes_exactly(reference, shards, tmp_path):
    ref_dir, _, _ = reference
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    job = pretrain_job(shards, run_dir, 24, log, "engine.zero_stage=2")
    wait_for_lines(run_dir / "tensorboard" / "metrics.jsonl", 4, job, log)
    # What Slurm sends <margin> seconds before the time limit (--signal=USR1@margin), to every
    # task on both nodes.
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    wait_for_job(job)
    text = log.read_text()
    assert "run state: stopped" in text and f"requeueing job {job}" in text, text[-3000:]
    assert "restart 1" in text and "resumed from" in text
    history = sacct_history(job)
    assert [state for state, _ in history] == ["REQUEUED", "COMPLETED"], history
    # None lost, none repeated: every step once, each step's loss (a function of that step's
    # examples) equal to the uninterrupted run's, and the same number of tokens in all.
    ours, ref = losses(run_dir), losses(ref_dir)
    assert sorted(ours) == list(range(1, 25))
    assert all(abs(ours[s] - ref[s]) <= 1e-6 for s in ref), (ours, ref)
    a = json.loads((run_dir / "status.json").read_text())
    b = json.loads((ref_dir / "status.json").read_text())
    assert a["tokens"] == b["tokens"] and a["step"] == b["step"] == 24


def test_two_node_run_resumes_on_one_node_and_back(reference, shards, tmp_path):
    """2 nodes x 2 tasks (steps 1-8) -> 1 node x 2 tasks (9-16, twice the gradient
    accumulation) -> 2 nodes again (17-24): the global batch is kept, the losses follow the
    uninterrupted 2-node run (the same examples in every step; other micro-batch grouping).
    (The engine's state across world sizes, without Slurm: tests/engine/test_elastic_resume.py.)"""
    ref_dir, _, _ = reference
    run_dir, accumulation = tmp_path / "run", {}
    for i, (steps, nodes) in enumerate([(8, TWO_NODES), (16, ONE_NODE), (24, TWO_NODES)]):
        log = tmp_path / f"job{i}.out"
        job = pretrain_job(shards, run_dir, steps, log, "engine.zero_stage=2", nodes=nodes)
        wait_for_job(job)
        text = log.read_text()
        assert "run state: completed" in text, text[-3000:]
        world = 4 if nodes is TWO_NODES else 2
        assert f"{world} process(es) on cpu, global batch 16" in text
        if i:
            resumed = run_dir / "checkpoints" / f"step_{steps - 8:08d}"
            assert f"resumed from {resumed}" in text, text[-3000:]
        complete = run_dir / "checkpoints" / f"step_{steps:08d}" / "COMPLETE.json"
        complete = json.loads(complete.read_text())
        assert complete["world_size"] == world
        accumulation[world] = complete["meta"]["gradient_accumulation_steps"]
    assert accumulation[2] == 2 * accumulation[4]  # half the ranks, twice the micro-batches
    ours, ref = losses(run_dir), losses(ref_dir)
    assert sorted(ours) == list(range(1, 25))
    # Steps 1-8 ran as the reference did; after the steps on one node the losses differ by
    # about 4e-4 relative (measured): the same examples in every step, grouped into
    # micro-batches differently, and the MLM loss is a mean per micro-batch.
    assert all(abs(ours[s] - ref[s]) <= 1e-6 for s in range(1, 9)), (ours, ref)
    assert all(ours[s] == pytest.approx(ref[s], rel=2e-3) for s in ref), (ours, ref)


def test_glue_finetuning_on_two_nodes(tmp_path, release):  # noqa: F811 (fixture)
    """finetune.sbatch on 2 nodes x 1 task (DeepSpeed ZeRO-2): the same history and dev
    accuracy as the same run on 2 processes of one machine (torchrun), which reaches 80% on
    the dev set and writes its best weights and the submission file from rank 0."""
    data = write_sst2(tmp_path / "glue")
    args = ["glue", "--task", "sst2", "--data", str(data), "--init", str(release)]
    args += ["engine.backend=deepspeed", "engine.zero_stage=2", "engine.precision=fp32"]
    args += ["engine.device=cpu", "engine.micro_batch_size=8", "data.max_length=32"]
    args += ["schedule.warmup_steps=5", "schedule.total_steps=60", "train.eval_every=30"]
    args += ["optimizer.lr=0.002"]
    local = tmp_path / "local"
    proc = subprocess.run(
        torchrun_cmd(2, "-m", "finetune", *args, f"train.run_dir={local}"),
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]

    run_dir, log = tmp_path / "slurm", tmp_path / "job.out"
    nodes = ["--nodes=2", "--ntasks-per-node=1", *CPU, f"--output={log}"]
    job = submit(
        [*nodes, str(REPO / "slurm" / "finetune.sbatch"), *args, f"train.run_dir={run_dir}"],
        env={**sbatch_env(), "OMP_NUM_THREADS": "1"},
    )
    wait_for_job(job)
    text = log.read_text()
    placement = rank_placement(text)
    assert {r: p[0] for r, p in placement.items()} == {0: NODES[0], 1: NODES[1]}, text[-3000:]
    assert [state for state, _ in sacct_history(job)] == ["COMPLETED"]
    (ours,) = json.loads((run_dir / "results.json").read_text())["runs"]
    (ref,) = json.loads((local / "results.json").read_text())["runs"]
    assert ours["dev"] == ref["dev"] and ours["dev"]["dev"]["accuracy"] >= 0.8, (ours, ref)
    for row in (ours, ref):  # rank 0 wrote the best weights
        assert (Path(row["run_dir"]) / "best" / "model.safetensors").is_file(), row
    assert (run_dir / "submission" / "SST-2.tsv").read_bytes() == (
        local / "submission" / "SST-2.tsv"
    ).read_bytes()


def test_data_prep_split_over_the_nodes_of_one_job(tmp_path):
    from data_prep.tokenizer import write_tokenizer

    write_tokenizer(tmp_path / "tok", inputs=["embedded:80"], vocab_size=300)
    tok = tmp_path / "tok" / "tokenizer.json"
    single = tmp_path / "single"
    cfg = ShardConfig(inputs=("embedded:80",), num_shards=4, max_seq_length=32, seed=3)
    build_shards(cfg, tok, single, workers=1)

    out, log = tmp_path / "nodes", tmp_path / "dp.out"
    args = ["shards", "--input", "embedded:80", "--tokenizer", str(tok), "--out", str(out)]
    args += ["--num-shards", "4", "--max-seq-length", "32", "--seed", "3", "--workers", "1"]
    nodes = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--output={log}"]
    job = submit([*nodes, str(REPO / "slurm" / "data_prep.sbatch"), *args], env=sbatch_env())
    wait_for_job(job)
    text = log.read_text()
    assert f"task 0 on {NODES[0]}: shards s % 2 == 0" in text, text[-3000:]
    assert f"task 1 on {NODES[1]}: shards s % 2 == 1" in text
    assert [state for state, _ in sacct_history(job)] == ["COMPLETED"]
    files = sorted(p.relative_to(single) for p in single.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    for f in files:
        assert (out / f).read_bytes() == (single / f).read_bytes(), f


def test_a_node_dies_mid_job(shards, tmp_path):
    """kill-node: node 2's slurmd, step daemons and tasks die (SIGKILL). The ranks on node 1
    fail with a clear message, Slurm marks the node down and requeues the job (NODE_FAIL);
    the last checkpoint stays loadable: once the node is back, the job resumes from it and
    recomputes the lost steps exactly."""
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    # The kill lands at step 24-38 (below); 60 steps leave the job running when it does.
    job = pretrain_job(shards, run_dir, 60, log, "engine.zero_stage=2", "train.checkpoint_every=10")
    try:
        wait_for_lines(run_dir / "tensorboard" / "metrics.jsonl", 25, job, log)
        logged, saved = freeze_between_checkpoints(job, run_dir, every=10)
        t0 = time.monotonic()
        subprocess.run([*CLUSTER, "kill-node", NODES[1]], check=True, capture_output=True)
        # The job's first run ends (rank 0 fails, Slurm declares the node down: NODE_FAIL).
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            states = [s for s, _ in sacct_history(job)]
            if states and states[0] in ("NODE_FAIL", "FAILED", "REQUEUED"):
                break
            time.sleep(1)
        ended = time.monotonic() - t0
        assert states and states[0] in ("NODE_FAIL", "FAILED", "REQUEUED"), states
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        stopped_at = step_of(latest)
        assert stopped_at == saved >= 20 and stopped_at % 10 == 0
        first = losses(run_dir)
        assert max(first) >= logged > stopped_at, (first, logged, stopped_at)
        subprocess.run([*CLUSTER, "revive-node", NODES[1]], check=True, capture_output=True)
        if job_state(job) is None:  # not requeued by Slurm by itself: what a user would do
            subprocess.run(["scontrol", "requeue", job], check=True)
        wait_for_job(job)
    finally:
        subprocess.run([*CLUSTER, "revive-node", NODES[1]], capture_output=True)
        subprocess.run(["scancel", job], capture_output=True)
    text = log.read_text()
    assert f"resumed from {run_dir / 'checkpoints' / latest}" in text, text[-4000:]
    # The ranks that saw their peers vanish said so, and where the run would resume from.
    assert "rank 0/4 on node albatross-node1 lost contact with another process" in text
    assert f"the last complete checkpoint is {run_dir / 'checkpoints' / latest}" in text
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 60
    again = losses(run_dir)
    redone = [s for s in first if s > stopped_at]
    assert redone and all(abs(again[s] - first[s]) <= 1e-6 for s in redone)
    print(f"node death: first run ended {ended:.1f} s after the kill; states {sacct_history(job)}")
