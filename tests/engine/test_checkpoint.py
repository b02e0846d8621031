"""engine.checkpoint: atomic saves, crash and corruption fallback, pruning, 2 ranks, RNG state.

torch is imported inside the tests that need it: the spawned 2-rank workers import this module,
and skipping torch keeps them starting in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import (
    CHECKPOINT_DIR_PATTERN,
    CheckpointError,
    CheckpointStore,
    file_checksum,
    load_rank_state,
    rng_state,
    save_rank_state,
    set_rng_state,
    step_of,
    tag_for,
)


@pytest.fixture(autouse=True)
def fsynced(monkeypatch) -> list[str]:
    """Record fsync calls (as paths) instead of making them: a real fsync costs ~10 ms on a disk
    and proves nothing in a test that does not cut the power. The spawned ranks fsync for real."""
    calls: list[str] = []

    def record(fd: int) -> None:
        calls.append(os.readlink(f"/proc/self/fd/{fd}") if sys.platform == "linux" else str(fd))

    monkeypatch.setattr(os, "fsync", record)
    return calls


def save(store: CheckpointStore, step: int, payload: bytes = b"weights", **meta) -> Path:
    """One complete save, as the trainer does it: DeepSpeed-like files + a rank file + commit."""
    staging = store.begin(step)
    (staging / "mp_rank_00_model_states.pt").write_bytes(payload + str(step).encode())
    (staging / "zero").mkdir()
    (staging / "zero" / "optim_states.pt").write_bytes(b"optim" * step)
    (staging / f"rank_{store.rank:05d}.pt").write_bytes(b"rank state")
    return store.commit(step, {"step_seen": step, **meta})


def read_payload(path: Path) -> bytes:
    return (path / "mp_rank_00_model_states.pt").read_bytes()


# ------------------------------------------------------------------------------------ tags


def test_tags():
    assert CHECKPOINT_DIR_PATTERN % 7 == "step_00000007"
    assert tag_for(100) == "step_00000100"
    assert tag_for(123_456_789) == "step_123456789"
    assert step_of("step_00000100") == 100
    assert step_of("step_100") is None  # not what tag_for makes
    assert step_of("step_00000100.partial") is None
    assert CheckpointStore("x").staging_tag(100) == "step_00000100.partial"
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="step"):
            tag_for(bad)


@pytest.mark.parametrize(
    "kwargs",
    [{"rank": 2, "world_size": 2}, {"rank": -1}, {"world_size": 0}, {"keep_last": -1}],
)
def test_store_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        CheckpointStore("x", **kwargs)


# ------------------------------------------------------------------------------------ saving


def test_commit_writes_complete_json_and_latest(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", world_size=1)
    assert store.resolve() is None  # the root does not even exist yet: a fresh run
    final = save(store, 100, loss=1.5)

    assert final == tmp_path / "ckpt" / "step_00000100"
    assert not (tmp_path / "ckpt" / "step_00000100.partial").exists()
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_00000100"
    record = json.loads((final / "COMPLETE.json").read_text())
    assert record["step"] == 100 and record["tag"] == "step_00000100"
    assert record["world_size"] == 1 and isinstance(record["time"], str)
    assert record["meta"] == {"step_seen": 100, "loss": 1.5}
    assert record["files"] == {
        "mp_rank_00_model_states.pt": len(b"weights100"),
        "rank_00000.pt": len(b"rank state"),
        "zero/optim_states.pt": 500,
    }
    assert store.read_complete("step_00000100") == record
    assert store.complete_steps() == [100]
    assert store.latest_tag() == "step_00000100"
    assert store.resolve() == (final, None)


@pytest.mark.skipif(sys.platform != "linux", reason="names fsynced files through /proc")
def test_commit_fsyncs_files_before_sealing(tmp_path, fsynced):
    store = CheckpointStore(tmp_path)
    save(store, 100)
    staging = tmp_path / "step_00000100.partial"  # fsyncs happen before the rename
    seal = fsynced.index(str(staging / "COMPLETE.json.tmp"))
    for rel in store.read_complete("step_00000100")["files"]:
        assert fsynced.index(str(staging / rel)) < seal
    for directory in (staging, staging / "zero"):
        assert fsynced.index(str(directory)) < seal
    renamed = fsynced.index(str(tmp_path), seal)  # the root, after the rename
    assert fsynced.index(str(tmp_path / "latest.tmp")) > renamed


def test_commit_without_begin_and_bad_meta(tmp_path):
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match=r"step_00000005\.partial.*begin\(5\)"):
        store.commit(5, {})
    store.begin(5)
    with pytest.raises(ValueError, match="JSON"):
        store.commit(5, {"x": object()})
    assert store.complete_steps() == []


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    first = save(store, 100)
    staging = store.begin(200)  # the crash: files written, commit never called
    (staging / "mp_rank_00_model_states.pt").write_bytes(b"half")

    # a new process resumes
    store = CheckpointStore(tmp_path)
    assert (tmp_path / "latest").read_text() == "step_00000100"
    assert store.candidates() == ["step_00000100"]
    assert store.complete_steps() == [100]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a crash leftover is no reason to warn
        assert store.resolve(loader=read_payload) == (first, b"weights100")

    # saving step 200 again starts from an empty staging dir, and the commit works
    staging = store.begin(200)
    assert list(staging.iterdir()) == []
    (staging / "mp_rank_00_model_states.pt").write_bytes(b"full")
    store.commit(200, {})
    assert store.resolve(loader=read_payload) == (tmp_path / "step_00000200", b"full")


def test_commit_removes_stale_partials_of_older_steps_only(tmp_path):
    store = CheckpointStore(tmp_path)
    store.begin(50)  # crashed saves
    store.begin(300)
    save(store, 100)
    assert not (tmp_path / "step_00000050.partial").exists()
    assert (tmp_path / "step_00000300.partial").is_dir()


# ------------------------------------------------------------------------------------ fallback


def truncate_file(directory: Path) -> None:
    with open(directory / "zero" / "optim_states.pt", "r+b") as f:
        f.truncate(3)


def delete_seal(directory: Path) -> None:
    (directory / "COMPLETE.json").unlink()


def garble_seal(directory: Path) -> None:
    (directory / "COMPLETE.json").write_text("{not json")


def delete_file(directory: Path) -> None:
    (directory / "rank_00000.pt").unlink()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            truncate_file,
            r"step_00000200 is unusable \(is damaged: zero/optim_states.pt has 3 bytes",
        ),
        (delete_file, r"step_00000200 is unusable \(is damaged: rank_00000.pt is missing"),
        (garble_seal, r"step_00000200 is unusable \(COMPLETE.json is unreadable"),
        (delete_seal, r"step_00000200 is incomplete \(no COMPLETE.json\); skipping it"),
    ],
)
def test_damaged_latest_falls_back_to_previous(tmp_path, damage, message):
    store = CheckpointStore(tmp_path)
    save(store, 100)
    save(store, 200)
    damage(tmp_path / "step_00000200")
    with pytest.warns(UserWarning, match=message):
        found = store.resolve(loader=read_payload)
    assert found == (tmp_path / "step_00000100", b"weights100")
    assert (tmp_path / "latest").read_text() == "step_00000200"  # resolving changes nothing


def test_loader_failure_falls_back_and_all_failing_raises(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 100)
    save(store, 200)
    calls = []

    def picky(path: Path) -> str:
        calls.append(path.name)
        if path.name == "step_00000200":
            raise KeyError("optimizer state")
        return "ok"

    with pytest.warns(UserWarning, match=r"KeyError.*falling back to .*step_00000100"):
        assert store.resolve(loader=picky) == (tmp_path / "step_00000100", "ok")
    assert calls == ["step_00000200", "step_00000100"]

    def broken(path: Path) -> None:
        raise RuntimeError(f"bad {path.name}")

    with (
        pytest.warns(UserWarning, match="falling back"),
        pytest.raises(CheckpointError, match=r"step_00000200: .*bad step_00000200.*step_00000100"),
    ):
        store.resolve(loader=broken)


def test_latest_first_then_newest(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    for step in (100, 300, 200):  # 200 is latest (a resume from 100 re-saved past it)
        save(store, step)
    assert store.latest_tag() == "step_00000200"
    assert store.candidates() == ["step_00000200", "step_00000300", "step_00000100"]

    (tmp_path / "latest").write_text("step_00000999")  # names nothing
    assert store.latest_tag() is None
    with pytest.warns(UserWarning, match="latest does not name"):
        assert store.candidates() == ["step_00000300", "step_00000200", "step_00000100"]


def test_explicit_step_has_no_fallback(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 100)
    save(store, 200)
    assert store.resolve(step=100, loader=read_payload) == (
        tmp_path / "step_00000100",
        b"weights100",
    )
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 150.*\[100, 200\]"):
        store.resolve(step=150)
    truncate_file(tmp_path / "step_00000100")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError, match="step_00000100: is damaged"):
            store.resolve(step=100)
    delete_seal(tmp_path / "step_00000100")
    with pytest.raises(CheckpointError, match="incomplete"):
        store.candidates(step=100)


def test_fresh_run_versus_nothing_usable(tmp_path):
    store = CheckpointStore(tmp_path)
    store.begin(100)  # only a crashed first save: still a fresh run
    assert store.resolve() is None
    save(store, 200)
    delete_seal(tmp_path / "step_00000200")
    with (
        pytest.warns(UserWarning, match="incomplete"),
        pytest.raises(CheckpointError, match="none is complete"),
    ):
        store.resolve()


def test_verify_reports_world_size_but_does_not_check_it(tmp_path):
    save(CheckpointStore(tmp_path, rank=0, world_size=4), 100)
    store = CheckpointStore(tmp_path, world_size=1)
    store.verify("step_00000100")
    assert store.read_complete("step_00000100")["world_size"] == 4
    with pytest.raises(ValueError, match="not a checkpoint tag"):
        store.verify("step_00000100.partial")
    record = json.loads((tmp_path / "step_00000100" / "COMPLETE.json").read_text())
    record["files"]["../escape"] = 1
    (tmp_path / "step_00000100" / "COMPLETE.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="not inside the checkpoint"):
        store.verify("step_00000100")


# ------------------------------------------------------------------------------------ checksums

BIG = 3 * (1 << 20) + 12345  # > HASH_CHUNK_BYTES / 2: the middle byte is in the first chunk


def save_big(store: CheckpointStore, step: int) -> Path:
    """A checkpoint whose weights file is a few MiB of random bytes (several hash chunks)."""
    payload = np.random.default_rng(step).integers(0, 256, BIG, dtype=np.uint8).tobytes()
    return save(store, step, payload=payload)


def flip_middle_byte(path: Path) -> None:
    """Corrupt a file without changing its size (what a size-only seal cannot see)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert path.stat().st_size == size


MISMATCH = (
    r"step_00000200/mp_rank_00_model_states.pt: content checksum mismatch "
    r"\(sha256 [0-9a-f]{64} recorded, [0-9a-f]{64} found\): "
    r"the file was modified or corrupted after it was saved"
)


def test_seal_records_the_content_checksum_of_every_file(tmp_path):
    store = CheckpointStore(tmp_path)
    final = save_big(store, 100)
    record = json.loads((final / "COMPLETE.json").read_text())
    assert record["files"]["mp_rank_00_model_states.pt"] == BIG + 3  # sizes are still there
    assert record["checksums"] == {
        "algorithm": "sha256",
        "digests": {
            rel: hashlib.sha256((final / rel).read_bytes()).hexdigest() for rel in record["files"]
        },
    }
    weights = final / "mp_rank_00_model_states.pt"
    assert file_checksum(weights) == record["checksums"]["digests"][weights.name]
    if shutil.which("sha256sum"):  # the recorded digest is checkable by hand
        out = subprocess.run(["sha256sum", weights], capture_output=True, text=True, check=True)
        assert out.stdout.split()[0] == record["checksums"]["digests"][weights.name]


def test_flipped_byte_of_the_same_size_is_caught_and_resolve_falls_back(tmp_path):
    store = CheckpointStore(tmp_path)
    save_big(store, 100)
    save_big(store, 200)
    flip_middle_byte(tmp_path / "step_00000200" / "mp_rank_00_model_states.pt")

    with pytest.raises(CheckpointError, match=MISMATCH) as caught:
        store.verify("step_00000200")
    assert caught.value.path == tmp_path / "step_00000200" / "mp_rank_00_model_states.pt"
    with pytest.raises(CheckpointError, match=MISMATCH):
        store.read_complete("step_00000200")
    with pytest.warns(
        UserWarning,
        match=r"step_00000200 is unusable \(mp_rank_00_model_states.pt: content checksum "
        r"mismatch .*falling back to .*step_00000100",
    ):
        path, payload = store.resolve(loader=read_payload)
    assert path == tmp_path / "step_00000100"
    assert payload[-3:] == b"100"
    with pytest.raises(
        CheckpointError, match=r"step_00000200: mp_rank_00_model_states.pt: content checksum"
    ):
        store.resolve(step=200)  # an explicit step has no fallback
    flip_middle_byte(tmp_path / "step_00000200" / "zero" / "optim_states.pt")
    with pytest.raises(CheckpointError, match=MISMATCH + r"; 1 more differ: zero/optim_states.pt"):
        store.verify("step_00000200")  # every file is hashed (in parallel); all are reported


def test_checksums_false_checks_sizes_only(tmp_path):
    store = CheckpointStore(tmp_path)
    save_big(store, 100)
    save_big(store, 200)
    flip_middle_byte(tmp_path / "step_00000200" / "mp_rank_00_model_states.pt")

    store.verify("step_00000200", checksums=False)
    record = store.read_complete("step_00000200", checksums=False)  # the cheap metadata read
    assert record["meta"] == {"step_seen": 200} and record["checksums"]["algorithm"] == "sha256"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.resolve(checksums=False) == (tmp_path / "step_00000200", None)
        lax = CheckpointStore(tmp_path, verify_checksums=False)  # the store-level default
        lax.verify("step_00000200")
        assert lax.resolve() == (tmp_path / "step_00000200", None)
    with pytest.raises(CheckpointError, match="content checksum mismatch"):
        lax.verify("step_00000200", checksums=True)  # the keyword overrides the default
    truncate_file(tmp_path / "step_00000200")
    with pytest.raises(CheckpointError, match=r"optim_states\.pt has 3 bytes"):
        store.verify("step_00000200", checksums=False)  # sizes are always checked


def test_old_seal_without_checksums_still_verifies_by_size(tmp_path):
    store = CheckpointStore(tmp_path)
    final = save_big(store, 100)
    seal = final / "COMPLETE.json"
    record = json.loads(seal.read_text())
    del record["checksums"]  # exactly what a seal written before checksums existed holds
    seal.write_text(json.dumps(record, indent=2))

    store.verify("step_00000100")  # checksums=True by default: nothing to compare, sizes pass
    assert store.read_complete("step_00000100") == record
    flip_middle_byte(final / "mp_rank_00_model_states.pt")
    store.verify("step_00000100")  # undetectable without checksums: why they were added
    assert store.resolve() == (final, None)
    truncate_file(final)
    with pytest.raises(CheckpointError, match=r"optim_states\.pt has 3 bytes"):
        store.verify("step_00000100")


def test_store_checksum_algorithm_and_none(tmp_path):
    blake = CheckpointStore(tmp_path / "blake", checksum="blake2b")
    final = save_big(blake, 100)
    record = blake.read_complete("step_00000100")
    assert record["checksums"]["algorithm"] == "blake2b"
    weights = final / "mp_rank_00_model_states.pt"
    assert record["checksums"]["digests"][weights.name] == (
        hashlib.blake2b(weights.read_bytes()).hexdigest()
    )
    flip_middle_byte(weights)
    # the algorithm comes from the seal, not from the reading store's own setting
    with pytest.raises(CheckpointError, match=r"content checksum mismatch \(blake2b "):
        CheckpointStore(tmp_path / "blake").verify("step_00000100")

    plain = CheckpointStore(tmp_path / "plain", checksum=None)
    final = save_big(plain, 100)
    assert "checksums" not in plain.read_complete("step_00000100")
    assert "checksum=None" in repr(plain)
    for bad in ("crc32", "shake_128", "", 256):
        with pytest.raises(ValueError, match="checksum"):
            CheckpointStore(tmp_path, checksum=bad)
    with pytest.raises(ValueError, match="verify_checksums"):
        CheckpointStore(tmp_path, verify_checksums="yes")


def test_malformed_or_unknown_checksums_in_a_seal(tmp_path):
    store = CheckpointStore(tmp_path)
    final = save(store, 100)
    seal = final / "COMPLETE.json"
    good = json.loads(seal.read_text())

    record = json.loads(json.dumps(good))
    del record["checksums"]["digests"]["rank_00000.pt"]
    seal.write_text(json.dumps(record))
    for checksums in (True, False):  # the section's shape is checked either way (cheap)
        with pytest.raises(CheckpointError, match=r"malformed \('checksums'"):
            store.verify("step_00000100", checksums=checksums)

    record = json.loads(json.dumps(good))
    record["checksums"]["algorithm"] = "sha3_1024"
    seal.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="sha3_1024 checksums, which this Python"):
        store.verify("step_00000100")
    store.verify("step_00000100", checksums=False)


# ------------------------------------------------------------------------------------ replace


def test_resaving_a_step_replaces_it_only_at_commit(tmp_path):
    store = CheckpointStore(tmp_path)
    save(store, 100, payload=b"old")
    staging = store.begin(100)
    (staging / "mp_rank_00_model_states.pt").write_bytes(b"new")
    # until the commit, the old checkpoint is the one that loads
    assert store.resolve(loader=read_payload) == (tmp_path / "step_00000100", b"old100")
    store.commit(100, {"again": True})
    assert store.resolve(loader=read_payload) == (tmp_path / "step_00000100", b"new")
    assert store.read_complete("step_00000100")["meta"] == {"again": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000100"]

    with pytest.raises(CheckpointError, match="step_00000100: a complete checkpoint"):
        store.begin(100, replace=False)


# ------------------------------------------------------------------------------------ pruning


def test_keep_last_keeps_exactly_the_newest(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in range(1, 6):
        save(store, step)
    assert store.complete_steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_00000004",
        "step_00000005",
    ]


def test_pruning_never_deletes_latest(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=1)
    save(store, 500)
    save(store, 200)  # resumed from an older checkpoint: 200 is latest, 500 the newest step
    assert store.latest_tag() == "step_00000200"
    assert store.complete_steps() == [200, 500]
    save(store, 300)
    assert store.complete_steps() == [300, 500]


def test_keep_last_zero_keeps_all(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0)
    for step in range(1, 5):
        save(store, step)
    assert store.complete_steps() == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------ 2 ranks


def _rank_worker(root: str, rank: int, barrier, errors) -> None:
    try:
        store = CheckpointStore(root, rank=rank, world_size=2, barrier=barrier.wait)
        # rank 0 starts late (begin must wait for it), rank 1 writes late (so must commit)
        time.sleep(0.3 if rank == 0 else 0.0)
        staging = store.begin(10)
        time.sleep(0.1 if rank == 1 else 0.0)
        (staging / f"rank_{rank:05d}.pt").write_bytes(b"r" * (rank + 1))
        (staging / f"zero_pp_rank_{rank}_optim_states.pt").write_bytes(b"o" * (10 + rank))
        final = store.commit(10, {"by": "two ranks"})
        # after the collective commit, every rank sees the sealed checkpoint
        assert store.resolve() == (final, None)
    except BaseException as exc:
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        barrier.abort()  # do not leave the other rank waiting
        raise


def test_two_ranks_share_one_checkpoint(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2, timeout=60)
    errors = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_worker, args=(str(tmp_path), rank, barrier, errors))
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    assert errors.empty(), errors.get()
    assert [p.exitcode for p in procs] == [0, 0]

    store = CheckpointStore(tmp_path, world_size=2)
    record = store.read_complete("step_00000010")
    assert record["files"] == {
        "rank_00000.pt": 1,
        "rank_00001.pt": 2,
        "zero_pp_rank_0_optim_states.pt": 10,
        "zero_pp_rank_1_optim_states.pt": 11,
    }
    assert record["world_size"] == 2 and record["meta"] == {"by": "two ranks"}
    # rank 0 hashed the files of both ranks when it sealed
    assert record["checksums"]["digests"] == {
        rel: hashlib.sha256((tmp_path / "step_00000010" / rel).read_bytes()).hexdigest()
        for rel in record["files"]
    }
    assert (tmp_path / "latest").read_text() == "step_00000010"
    assert not (tmp_path / "step_00000010.partial").exists()


# ------------------------------------------------------------------------------------ RNG


def draw() -> tuple:
    import torch

    return (
        [random.random() for _ in range(3)],
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.randn(),
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (4,)).tolist(),
    )


def test_rng_state_round_trip_through_a_weights_only_file(tmp_path):
    import torch

    random.seed(1)
    np.random.seed(2)
    random.gauss(0, 1)  # leaves a cached gaussian in both generators
    np.random.randn()
    saved = save_rank_state(tmp_path, 3, {"rng": rng_state(), "epoch": 2})
    assert saved == tmp_path / "rank_00003.pt"
    assert [p.name for p in tmp_path.iterdir()] == ["rank_00003.pt"]  # no tmp file left
    first = draw()
    assert draw() != first  # the generators move on

    loaded = torch.load(saved, weights_only=True)  # also what load_rank_state does
    state = load_rank_state(tmp_path, 3)
    assert state["epoch"] == 2 and loaded["epoch"] == 2
    set_rng_state(state["rng"])
    assert draw() == first


def test_set_rng_state_rejects_malformed_without_changing_anything():
    import torch

    good = rng_state()
    malformed = [
        {"python": good["python"]},
        {**good, "python": {**good["python"], "state": [1, 2, 3]}},
        {**good, "numpy": {**good["numpy"], "key": torch.zeros(5, dtype=torch.int64)}},
        {**good, "numpy": {**good["numpy"], "key": torch.full((624,), -1)}},
        {**good, "torch": torch.zeros(3)},
        {**good, "cuda": "not a list"},
    ]
    for state in malformed:
        before = rng_state()
        with pytest.raises(ValueError, match="malformed RNG state"):
            set_rng_state(state)
        after = rng_state()
        assert after["python"] == before["python"]
        assert torch.equal(after["torch"], before["torch"])


def test_cuda_rng_state_ignored_with_a_warning_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the warning of a CPU-only process")
    state = {**rng_state(), "cuda": [torch.zeros(16, dtype=torch.uint8)]}
    with pytest.warns(UserWarning, match="CUDA RNG state is ignored"):
        set_rng_state(state)


def test_load_rank_state_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"rank_00001\.pt: is missing"):
        load_rank_state(tmp_path, 1)
    (tmp_path / "rank_00001.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=r"rank_00001\.pt: cannot be read"):
        load_rank_state(tmp_path, 1)
    save_rank_state(tmp_path, 2, {"fn": random.random})  # not loadable with weights_only
    with pytest.raises(CheckpointError, match=r"rank_00002\.pt: cannot be read"):
        load_rank_state(tmp_path, 2)
