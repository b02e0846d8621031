"""One writer per directory (albatross/writer_lock.py), with real processes: a second writer is
refused at once naming the holder; a SIGKILLed holder blocks nothing; Slurm's requeue of the
same job waits for its earlier incarnation instead of being refused."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from albatross import writer_lock
from albatross.writer_lock import DirectoryBusy, one_writer, read_holder

REPO = Path(__file__).resolve().parents[2]
HOLD = """
import sys, time
from albatross.writer_lock import one_writer
with one_writer(sys.argv[1], "test writer"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(directory: Path, seconds: float, **env: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory), str(seconds)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_writer_refused_at_once_naming_the_holder(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    proc = _holder(tmp_path, 60, SLURM_JOB_ID="4242")
    try:
        start = time.monotonic()
        with (
            pytest.raises(DirectoryBusy, match=rf"pid {proc.pid}, Slurm job 4242"),
            one_writer(tmp_path, "pretraining run"),
        ):
            pass
        assert time.monotonic() - start < 5
        assert read_holder(tmp_path)["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_holder_blocks_nothing(tmp_path):
    proc = _holder(tmp_path, 60)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with one_writer(tmp_path, "pretraining run"):
        assert read_holder(tmp_path)["pid"] == os.getpid()


def test_slurm_requeue_of_the_same_job_waits_for_its_earlier_incarnation(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_lock, "REQUEUE_WAIT_S", 30.0)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    proc = _holder(tmp_path, 2, SLURM_JOB_ID="77")  # the earlier incarnation, ending
    start = time.monotonic()
    with one_writer(tmp_path, "pretraining run"):  # waited for it, not refused
        assert time.monotonic() - start > 1
        assert read_holder(tmp_path)["pid"] == os.getpid()
    proc.wait()
    monkeypatch.setenv("SLURM_JOB_ID", "78")  # another job: refused at once
    proc = _holder(tmp_path, 60, SLURM_JOB_ID="77")
    try:
        with (
            pytest.raises(DirectoryBusy, match="Slurm job 77"),
            one_writer(tmp_path, "pretraining run"),
        ):
            pass
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.integration
def test_a_second_pretraining_job_in_the_same_run_directory_is_refused(tmp_path):
    """The same command started twice: the second exits 2 in seconds naming the first; once
    the first is SIGKILLed, the directory is free again."""
    from pretrain_support import base_overrides, env, make_shards

    shards = make_shards(tmp_path / "data")
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "pretrain", *base_overrides(shards, run_dir, steps=100000)]
    first = subprocess.Popen(command, cwd=REPO, env=env(), stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while read_holder(run_dir).get("pid") != first.pid:
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.2)
        start = time.monotonic()
        second = subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True)
        assert second.returncode == 2, second.stderr[-2000:]
        assert (
            f"written by another pretraining run (host {socket.gethostname()}, pid {first.pid}"
            in second.stderr
        )
        assert time.monotonic() - start < 60
    finally:
        first.kill()
        first.wait()
    command = [sys.executable, "-m", "pretrain", *base_overrides(shards, run_dir, steps=2)]
    again = subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
