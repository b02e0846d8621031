"""``python -m slurm``: the submitit launcher.

Fast: the sbatch script of a dry run, time parsing, usage errors (exit 2), the requeue guard
(requeue only while the job still runs), inherited torchrun variables, ``--local`` data prep.
Slow: the StopWatch -> submitit handler hand-over in one process; ``--local`` pretraining under
torchrun; and on the real one-node Slurm (``slurm_cluster``): an sbatch refusal, the debug
pretraining recipe with 2 tasks preempted (signal -> checkpoint -> requeue -> exact resume,
then checkpoint + TensorBoard as in any run), the sharded data-prep array + finalize, a sweep
array and its table (`--wait`'s hints and end line: the launcher on two nodes,
test_slurm_multinode.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import submitit
from pretrain_support import REPO, base_overrides, free_port, make_shards, run_pretrain

from data_prep.shards import ShardConfig, build_shards
from engine.metrics import read_jsonl, read_scalars
from slurm import cli
from slurm.job import StageJob, request_requeue
from slurm.launcher import main
from slurm.monitor import squeue_state, wait_for
from slurm.plan import UsageError
from slurm.submit import submit

CONFIG = str(REPO / "configs" / "pretrain" / "debug.yaml")
POLL_TIMEOUT = 300  # the queue is shared with other tests on 2 CPU cores


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("data"))


@pytest.fixture
def job_env(monkeypatch):
    """The environment sbatch hands to the job (it exports the submitter's)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _rows(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl rows with losses, by step (empty before the file exists)."""
    if not (run_dir / "tensorboard" / "metrics.jsonl").is_file():
        return {}
    return {s: r for s, r in read_jsonl(run_dir / "tensorboard").items() if "loss/mlm" in r}


def _status(run_dir: Path, ignore: str = "") -> dict:
    """status.json; {} while it is missing, being written or in the state ``ignore``."""
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return {} if status.get("state") == ignore else status


def _wait_until(predicate, what: str, timeout: float = POLL_TIMEOUT, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"waited {timeout} s for {what}")


# ----------------------------------------------------------------------------- fast


def test_dry_run_prints_the_sbatch_script(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch/srun: a dry run needs neither
    logs = tmp_path / "logs"
    argv = ["pretrain", "--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu"]
    argv += ["--account", "proj42", "--qos", "high", "--constraint", "a100", "--mem", "200G"]
    argv += ["--time", "1-12:00:00", "--log-dir", str(logs), "--setup", "module load cuda"]
    argv += ["--sbatch", "mail-type=END", "--dry-run", "--", "--config", CONFIG]
    argv += ["train.steps=77", "optimizer.lr=1e-4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj42",
        "#SBATCH --qos=high",
        "#SBATCH --constraint=a100",
        "#SBATCH --time=2160",  # 1 day 12 hours, in minutes
        "#SBATCH --mem=200G",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --mail-type=END",
        "#SBATCH --job-name=albatross-pretrain",
        f"#SBATCH --output={logs.absolute()}/%j_0_log.out",
        "module load cuda",
    ):
        assert line in out.splitlines(), f"{line!r} missing from:\n{out}"
    assert "-m submitit.core._submit" in out and "srun --unbuffered" in out
    assert f"python -m pretrain --config {CONFIG} train.steps=77 optimizer.lr=1e-4" in out
    assert "every one of the 16 task(s)" in out
    assert "nothing submitted" in out
    assert not logs.exists()  # nothing was written, let alone submitted


def test_dry_run_cpu_tasks_and_data_prep_array(tmp_path, capsys):
    argv = ["pretrain", "--gpus-per-node", "0", "--tasks-per-node", "3", "--signal-delay", "30"]
    argv += ["--time", "45", "--dry-run", "--", "--config", CONFIG]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "#SBATCH --ntasks-per-node=3" in out and "#SBATCH --signal=USR2@30" in out
    assert "#SBATCH --time=45" in out
    assert not any("gpus" in line for line in out)

    argv = ["data-prep", "--dry-run", "--", "shards", "--input", "embedded", "--tokenizer"]
    argv += ["t.json", "--out", str(tmp_path / "s"), "--num-shards", "4", "--num-jobs", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --array=0-1%2" in out  # one array job per --job-index
    assert "--num-jobs 2 --job-index 0" in out and "--num-jobs 2 --job-index 1" in out
    assert "#SBATCH --dependency=afterok:PREVIOUS_JOB_ID" in out
    assert f"python -m data_prep finalize --out {tmp_path / 's'}" in out


@pytest.mark.parametrize(
    ("text", "minutes"),
    [
        ("90", 90),
        ("1:30", 2),  # MM:SS, rounded up
        ("04:00:00", 240),
        ("2-0", 2880),
        ("1-02:30", 1590),
        ("0-00:00:30", 1),
        ("1-00:00:00", 1440),
    ],
)
def test_parse_time(text, minutes):
    assert cli.parse_time(text) == minutes


@pytest.mark.parametrize("text", ["", "0", "abc", "1:2:3:4", "10:60", "1-24:00:00", "-5", "2h"])
def test_parse_time_rejects(text):
    with pytest.raises(UsageError, match="not a Slurm time limit"):
        cli.parse_time(text)


CPU = ["pretrain", "--gpus-per-node", "0"]
RECIPE = ["--", "--config", CONFIG]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--", "x"], "invalid choice: 'train'"),
        ([*CPU, "--time", "soon", *RECIPE], "--time 'soon' is not a Slurm time limit"),
        (CPU, "arguments after `--`"),
        ([*CPU, "--"], "arguments after `--`"),
        (["pretrain", *RECIPE], "--gpus-per-node is required"),
        (["pretrain", "--gpus-per-node", "4", "--tasks-per-node", "2", *RECIPE], "one task per"),
        ([*CPU, *RECIPE, "model.nope=1"], "pretrain config error"),
        ([*CPU, "--", "--config", "no/such/recipe.yaml"], "pretrain config error"),
        ([*CPU, "--time", "5", "--signal-delay", "300", *RECIPE], "--signal-delay 300 s"),
        ([*CPU, "--nodes", "2", "--local", *RECIPE], "--nodes must be 1"),
        ([*CPU, "--nodes", "0", *RECIPE], "--nodes must be >= 1"),
        (["data-prep", "--", "shards", "--out", "x"], "data-prep arguments after -- are"),
        ([*CPU, "--sweep", "optimizer.lr", *RECIPE], "--sweep 'optimizer.lr'"),
        ([*CPU, "--dry-run", "--local", *RECIPE], "not allowed with argument"),
    ],
)
def test_usage_errors_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_finetune_unavailable_then_available(monkeypatch, capsys):
    """Without finetune/__main__.py: a clear message. With it: its own parser checks the
    arguments at submission, and the job runs `python -m finetune ...` in every task."""
    glue = ["glue", "--task", "sst2", "--data", "glue_data", "--init", "release"]
    with monkeypatch.context() as m:
        m.setattr(cli, "finetune_available", lambda: False)
        assert main(["finetune", "--gpus-per-node", "1", "--dry-run", "--", *glue]) == 2
        assert "python -m finetune is not available in this installation" in capsys.readouterr().err
    if not cli.finetune_available():
        return
    assert main(["finetune", "--gpus-per-node", "1", "--", "glue", "--task", "sst2"]) == 2
    assert "finetune arguments after -- are invalid" in capsys.readouterr().err
    assert main(["finetune", "--gpus-per-node", "2", "--dry-run", "--", *glue]) == 0
    assert f"every one of the 2 task(s) runs, in-process: python -m finetune {' '.join(glue)}" in (
        capsys.readouterr().out
    )


def test_missing_sbatch_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    argv = ["pretrain", "--gpus-per-node", "0", "--log-dir", str(tmp_path / "l"), "--"]
    assert main([*argv, "--config", CONFIG]) == 2
    err = capsys.readouterr().err
    assert "sbatch and srun not found" in err and "--local" in err and "--dry-run" in err
    assert not (tmp_path / "l").exists()


def test_local_data_prep_array_matches_a_single_job(tmp_path, capsys):
    """``--local`` runs the array's jobs one after the other, then finalize: same manifest."""
    from data_prep.tokenizer import write_tokenizer

    write_tokenizer(tmp_path / "tok", inputs=["embedded:40"], vocab_size=200)
    tok = tmp_path / "tok" / "tokenizer.json"
    config = ShardConfig(inputs=("embedded:40",), num_shards=3, max_seq_length=32, seed=0)
    build_shards(config, tok, tmp_path / "single", workers=1)
    argv = ["data-prep", "--local", "--", "shards", "--input", "embedded:40"]
    argv += ["--tokenizer", str(tok), "--out", str(tmp_path / "multi"), "--num-shards", "3"]
    argv += ["--max-seq-length", "32", "--num-jobs", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("running here:") == 3 and "finalize --out" in out
    single = (tmp_path / "single" / "manifest.json").read_bytes()
    assert (tmp_path / "multi" / "manifest.json").read_bytes() == single


def _fake_squeue(tmp_path: Path, monkeypatch, line: str) -> None:
    """An ``squeue`` on PATH that prints ``line`` for any job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "squeue"
    script.write_text(f"#!/bin/sh\necho '{line}'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize(
    ("squeue_says", "requeues"),
    [("RUNNING|None", True), ("COMPLETING|None", False), ("CANCELLED|None", False)],
)
def test_requeue_only_while_the_job_still_runs(
    tmp_path, monkeypatch, capsys, squeue_says, requeues
):
    """A stop signal while the job runs (preemption, time-limit warning) requeues; a job that
    Slurm is already ending (scancel) is left alone: requeueing would undo the cancel."""
    _fake_squeue(tmp_path, monkeypatch, squeue_says)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    calls = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    try:
        request_requeue(signal.getsignal(signal.SIGUSR2))
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert calls == ([signal.SIGUSR2] if requeues else [])
    out = capsys.readouterr().out
    assert ("requeueing through submitit" in out) == requeues
    # Outside a submitit job (default handler) nothing is raised: SIG_DFL would kill us.
    request_requeue(signal.SIG_DFL)
    assert "not a submitit job" in capsys.readouterr().out


def test_stage_job_drops_inherited_torchrun_variables(tmp_path, monkeypatch):
    """sbatch exports the submitter's environment; in an srun task SLURM_PROCID must win."""
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(name, value)
    job = StageJob("data-prep", ["inspect", str(tmp_path / "missing")])
    with pytest.raises(RuntimeError, match=r"python -m data_prep inspect .* exited with status 2"):
        job()
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} & set(os.environ)


# ----------------------------------------------------------------------------- slow: one process


@pytest.mark.slow
def test_stop_signal_is_handed_to_submitits_handler_after_the_run(
    shards, tmp_path, job_env, monkeypatch
):
    """In one process, no Slurm: a SIGUSR2 mid-run stops the trainer at a step boundary (its
    StopWatch owns the signal meanwhile), then StageJob raises SIGUSR2 again for the handler
    that was there before (submitit's, here a recorder) exactly once, after the checkpoint."""
    run_dir = tmp_path / "run"
    calls: list[Path | None] = []

    def submitit_like_handler(signum, frame):
        latest = run_dir / "checkpoints" / "latest"
        calls.append(latest if latest.is_file() else None)

    previous = signal.signal(signal.SIGUSR2, submitit_like_handler)
    stop = threading.Event()

    def send_when_running():
        _wait_until(lambda: len(_rows(run_dir)) >= 3 or stop.is_set(), "3 steps", 120)
        if not stop.is_set():
            os.kill(os.getpid(), signal.SIGUSR2)

    sender = threading.Thread(target=send_when_running, daemon=True)
    sender.start()
    # The engine exports RANK, MASTER_PORT, ... into os.environ: put it back afterwards.
    args = ["--config", CONFIG, *base_overrides(shards, run_dir, 5000)]
    # The engine exports RANK, MASTER_PORT, ... into os.environ: put it back afterwards.
    with mock.patch.dict(os.environ, {"MASTER_PORT": str(free_port())}):
        try:
            result = StageJob("pretrain", args)()
        finally:
            stop.set()
            sender.join()
            restored = signal.getsignal(signal.SIGUSR2)
            signal.signal(signal.SIGUSR2, previous)
    assert "RANK" not in os.environ
    assert result["state"] == "stopped" and result["reason"] == "signal SIGUSR2"
    assert 3 <= result["step"] < 5000
    assert restored is submitit_like_handler  # the trainer put it back
    assert len(calls) == 1 and calls[0] is not None  # once, and after the checkpoint
    assert calls[0].read_text().strip() == f"step_{result['step']:08d}"


@pytest.mark.slow
def test_finetune_stop_signal_is_handed_to_submitits_handler(tmp_path, job_env, monkeypatch):
    """The same hand-over for fine-tuning: SIGUSR2 mid-run -> a checkpoint -> ``python -m
    finetune`` returns 75 -> StageJob raises SIGUSR2 for submitit's handler once, after the
    checkpoint; the requeued call (the same StageJob again) resumes and finishes."""
    from data_prep.listops import write_splits

    data = tmp_path / "listops"
    write_splits(data, {"train": 96, "val": 24, "test": 24}, min_length=5, max_length=30, seed=0)
    run_dir = tmp_path / "run"
    args = ["lra", "--task", "listops", "--data", str(data), "model.hidden_size=32"]
    args += ["model.embedding_size=32", "model.num_attention_heads=2", "data.max_length=40"]
    args += ["model.intermediate_size=64", "engine.precision=fp32", "engine.backend=torch"]
    args += ["engine.micro_batch_size=8", "schedule.total_steps=400", "schedule.warmup_steps=5"]
    args += ["train.eval_every=100"]
    args += ["train.log_every=1", "train.checkpoint_every=0", f"train.run_dir={run_dir}"]
    metrics = run_dir / "seed_0" / "tensorboard"
    checkpoints = run_dir / "seed_0" / "checkpoints"
    calls: list[str | None] = []

    def submitit_like_handler(signum, frame):
        latest = checkpoints / "latest"
        calls.append(latest.read_text().strip() if latest.is_file() else None)

    previous = signal.signal(signal.SIGUSR2, submitit_like_handler)
    stop = threading.Event()

    def logged() -> int:
        return len(read_jsonl(metrics)) if (metrics / "metrics.jsonl").is_file() else 0

    def send_when_running():
        _wait_until(lambda: logged() >= 3 or stop.is_set(), "3 steps", 120)
        if not stop.is_set():
            os.kill(os.getpid(), signal.SIGUSR2)

    sender = threading.Thread(target=send_when_running, daemon=True)
    sender.start()
    with mock.patch.dict(os.environ, {"MASTER_PORT": str(free_port())}):
        try:
            first = StageJob("finetune", args)()
        finally:
            stop.set()
            sender.join()
            restored = signal.getsignal(signal.SIGUSR2)
        try:
            second = StageJob("finetune", args)()  # what the requeued job runs
        finally:
            signal.signal(signal.SIGUSR2, previous)
    assert first["state"] == "stopped" and second["state"] == "completed"
    assert restored is submitit_like_handler
    assert len(calls) == 1 and calls[0] is not None and calls[0].startswith("step_")
    results = json.loads((run_dir / "seed_0" / "results.json").read_text())
    assert results["finished"] and results["history"][-1]["step"] == 400


@pytest.mark.slow
def test_local_pretrain_with_two_tasks_uses_torchrun(shards, tmp_path, job_env, capsys):
    run_dir = tmp_path / "run"
    argv = ["pretrain", "--gpus-per-node", "0", "--tasks-per-node", "2", "--local", "--"]
    assert main([*argv, "--config", CONFIG, *base_overrides(shards, run_dir, 3)]) == 0
    assert "torch.distributed.run --standalone --nproc_per_node=2 -m pretrain" in (
        capsys.readouterr().out
    )
    assert _status(run_dir)["state"] == "completed"
    complete = json.loads((run_dir / "checkpoints" / "step_00000003" / "COMPLETE.json").read_text())
    assert complete["world_size"] == 2


# ----------------------------------------------------------------------------- slow: Slurm


def _submit(argv: list[str]) -> list[submitit.Job]:
    spec = cli.make_spec(argv)
    (jobs,) = submit(spec)
    return jobs


@pytest.mark.slow
def test_sbatch_refusal_is_a_clean_error(slurm_cluster, tmp_path, capsys):
    argv = ["pretrain", "--gpus-per-node", "0", "--partition", "no-such-partition"]
    assert main([*argv, "--log-dir", str(tmp_path / "logs"), *RECIPE]) == 2
    err = capsys.readouterr().err
    assert "python -m slurm: error: sbatch refused pretrain" in err
    assert "partition" in err.lower()


@pytest.mark.slow
def test_preemption_requeues_and_resumes_exactly(slurm_cluster, shards, tmp_path, job_env):
    """The debug recipe with 2 tasks, stopped by submitit's preemption signal mid-run:
    checkpoint, requeue, exact resume to the end; the finished run as any other (status,
    sealed checkpoint of both ranks, every step once in TensorBoard, a log per task)."""
    steps = 100
    reference = tmp_path / "reference"
    proc = run_pretrain(base_overrides(shards, reference, steps))
    assert proc.returncode == 0, proc.stderr[-3000:]

    run_dir = tmp_path / "run"
    logs = tmp_path / "logs"
    argv = ["pretrain", "--gpus-per-node", "0", "--tasks-per-node", "2", "--time", "10"]
    argv += ["--log-dir", str(logs), "--", "--config", CONFIG]
    (job,) = _submit([*argv, *base_overrides(shards, run_dir, steps)])
    try:
        _wait_until(lambda: len(_rows(run_dir)) >= 5, "5 logged steps")
        job._interrupt()  # submitit's preemption: SIGTERM, then SIGUSR2, to every task
        stopped = _wait_until(lambda: _status(run_dir, ignore="running"), "the stop")
        assert stopped["state"] == "stopped", stopped
        assert stopped["reason"].startswith("signal SIG")
        stop_step = stopped["step"]
        assert 5 <= stop_step < steps
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stop_step:08d}"
        # The requeued job waits for its old credential to expire (cluster.sh: 10 s) and runs.
        _wait_until(lambda: squeue_state(job.job_id)[0] == "PENDING", "the requeue")
        (outcome,) = wait_for([job], timeout=POLL_TIMEOUT, log=lambda _: None)
    finally:
        subprocess.run(["scancel", job.job_id], capture_output=True)
    assert outcome.state == "completed", outcome
    assert outcome.result["step"] == steps
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == steps
    rank0 = (logs / f"{job.job_id}_0_log.out").read_text()
    assert f"pretrain: stopped at step {stop_step}" in rank0
    assert f"Requeued job {job.job_id}" in rank0
    assert rank0.count("Starting with JobEnvironment") == 2  # the same job ran twice
    assert "fresh start" not in rank0.split("Requeued job")[1]  # ... and resumed
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{steps:08d}"
    complete = json.loads((run_dir / "checkpoints" / latest / "COMPLETE.json").read_text())
    assert complete["world_size"] == 2 and complete["meta"]["reason"] == "end"
    assert (run_dir / "checkpoints" / latest / "rank_00001.pt").is_file()  # both ranks saved
    scalars = read_scalars(run_dir / "tensorboard")  # the event file, read back
    assert [step for step, _ in scalars["loss/mlm"]] == list(range(1, steps + 1))
    assert (logs / f"{job.job_id}_1_log.out").is_file()  # each task has its own submitit log
    rows, ref = _rows(run_dir), _rows(reference)
    assert sorted(rows) == list(range(1, steps + 1))  # no step lost or repeated
    assert abs(rows[steps]["loss/mlm"] - ref[steps]["loss/mlm"]) <= 1e-6
    assert abs(rows[steps]["loss/total"] - ref[steps]["loss/total"]) <= 1e-6


@pytest.mark.slow
def test_data_prep_array_then_finalize(slurm_cluster, tmp_path, job_env, capsys):
    from data_prep.tokenizer import write_tokenizer

    write_tokenizer(tmp_path / "tok", inputs=["embedded:40"], vocab_size=200)
    tok = tmp_path / "tok" / "tokenizer.json"
    config = ShardConfig(inputs=("embedded:40",), num_shards=3, max_seq_length=32, seed=0)
    build_shards(config, tok, tmp_path / "single", workers=1)
    argv = ["data-prep", "--log-dir", str(tmp_path / "logs"), "--wait"]
    argv += ["--wait-timeout", str(POLL_TIMEOUT), "--", "shards", "--input", "embedded:40"]
    argv += ["--tokenizer", str(tok), "--out", str(tmp_path / "multi"), "--num-shards", "3"]
    argv += ["--max-seq-length", "32", "--num-jobs", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "data-prep shards (array of 2)" in out and "data-prep finalize" in out
    assert out.count(": completed") == 3, out
    single = (tmp_path / "single" / "manifest.json").read_bytes()
    assert (tmp_path / "multi" / "manifest.json").read_bytes() == single


@pytest.mark.slow
def test_sweep_array_gathers_one_table(slurm_cluster, shards, tmp_path, job_env, capsys):
    run_dir = tmp_path / "sweep"
    logs = tmp_path / "logs"
    argv = ["pretrain", "--gpus-per-node", "0", "--tasks-per-node", "1", "--time", "10"]
    argv += ["--log-dir", str(logs), "--sweep", "optimizer.lr=0.001,0.01", "--wait"]
    argv += ["--wait-timeout", str(POLL_TIMEOUT), "--", "--config", CONFIG]
    assert main([*argv, *base_overrides(shards, run_dir, 4)]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == 4, out  # header, rule, 2 runs
    assert table[2].startswith("| optimizer.lr=0.001 |") and "| completed | 4 |" in table[2]
    assert table[3].startswith("| optimizer.lr=0.01 |") and "| completed | 4 |" in table[3]
    for tag in ("000_lr=0.001", "001_lr=0.01"):
        status = json.loads((run_dir / tag / "status.json").read_text())
        assert status["state"] == "completed" and status["step"] == 4
    (md,) = logs.glob("*_results.md")
    assert md.read_text().strip() == "\n".join(table)
    losses = [json.loads((run_dir / t / "status.json").read_text())["last"]["loss/mlm"]
              for t in ("000_lr=0.001", "001_lr=0.01")]  # fmt: skip
    assert losses[0] != losses[1]
