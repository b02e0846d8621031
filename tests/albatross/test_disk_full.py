"""A full disk, on a real small file system (a tmpfs these tests mount; root only): pretraining
ends in seconds with exit 2 and a message naming the path and what was being written, the
previous complete checkpoint stays ``latest``, no partial checkpoint is left, and the same command
resumes and completes once there is space; the atomic writers (albatross/files.py) that every
status, shard, release and export file goes through keep the old file and leave nothing."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from pretrain_support import REPO, env, make_shards, pretrain_command


@pytest.fixture
def small_fs(tmp_path):
    """A 900 KiB tmpfs: room for the run's config, events and two checkpoints of the tiny model
    (about 364 KiB each), not three."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(mnt)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.integration
def test_full_disk_while_checkpointing_keeps_latest_and_resumes(tmp_path, small_fs):
    shards = make_shards(tmp_path / "data")
    run_dir = small_fs / "run"
    cmd = pretrain_command(shards, run_dir, 8, "train.checkpoint_every=2")
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert time.monotonic() - start < 120
    assert "no space left on the device" in proc.stderr, proc.stderr[-3000:]
    assert str(run_dir / "checkpoints") in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    latest = (checkpoints / "latest").read_text().strip()
    assert (checkpoints / latest / "COMPLETE.json").is_file()
    assert not [p.name for p in checkpoints.iterdir() if "partial" in p.name]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and "no space left" in status["reason"]

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_fs)], check=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {checkpoints / latest}" in proc.stderr + proc.stdout
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"


def test_atomic_writers_on_a_full_disk_keep_the_old_content_and_leave_nothing(small_fs):
    from albatross.files import DiskFullError, staged_directory, write_atomically

    status = small_fs / "status.json"
    write_atomically(status, lambda f: f.write(b"old"))
    big = b"x" * (2 << 20)
    with pytest.raises(DiskFullError, match=rf"while writing the status to {status}"):
        write_atomically(status, lambda f: f.write(big), "the status")
    assert status.read_bytes() == b"old"
    release = small_fs / "release"
    with (
        pytest.raises(DiskFullError, match=rf"while writing a release to {release}"),
        staged_directory(release, "a release") as staging,
    ):
        (staging / "model.safetensors").write_bytes(big)
    assert sorted(p.name for p in small_fs.iterdir()) == ["status.json"]
