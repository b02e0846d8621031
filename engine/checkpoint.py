"""A run directory's checkpoint store: atomic multi-rank saves, verified loads with fallback.

On-disk layout::

    run_dir/checkpoints/
      latest                       # text: the tag of the newest complete checkpoint
      step_00000100/               # complete: DeepSpeed's files + rank_00000.pt ... + COMPLETE.json
      step_00000200.partial/       # being written (or left by a crash): never loaded

A checkpoint is a directory named by its tag (``step_%08d``). It is written under a staging
name (``<tag>.partial``) by every rank, sealed by rank 0 with ``COMPLETE.json`` (the step, the
world size, the caller's ``meta``, the size and content checksum of every file in the
directory), and only then renamed to its tag; ``latest`` is replaced atomically after that. The
protocol, on every rank::

    staging = store.begin(step)                       # rank 0 makes an empty staging dir
    engine.save_checkpoint(store.root, tag=store.staging_tag(step), save_latest=False)
    save_rank_state(staging, rank, {"rng": rng_state(), "loader": loader.state_dict()})
    store.commit(step, meta={"loss": loss})           # seal, rename, move `latest`, prune

and to resume::

    found = store.resolve()                           # None: fresh run
    if found is not None:
        path, _ = found
        engine.load_checkpoint(store.root, tag=path.name)
        set_rng_state(load_rank_state(path, rank)["rng"])

Crash safety. A crash before the rename leaves a ``.partial`` directory that is never a
candidate (and is removed by the next ``begin`` of that step or a later ``commit``). A crash
between the rename and the update of ``latest`` leaves a complete checkpoint that ``latest`` does
not name yet; it is still found (the other complete checkpoints follow ``latest``, newest first).
Every file is fsynced before ``COMPLETE.json`` is written, and ``COMPLETE.json`` before the
rename, so a complete-looking checkpoint never has missing data after a power loss.

Checksums. The seal records every file's size (``files``) and, by default, a content checksum
(``checksums``: ``{"algorithm": "sha256", "digests": {path: hex digest}}``), computed by rank 0
while it fsyncs each file (it reads every byte once, in 8 MiB chunks; files are hashed in
parallel threads, and each file's fsync runs beside its hashing). Loading checks the sizes
first (a ``stat`` per file: a truncated or missing file), then re-reads and hashes every file:
a file changed without a change of size (flipped bytes, a bad disk block, a copy that went
wrong) raises ``CheckpointError`` naming that file, e.g. ``step_00000100/rank_00000.pt: content
checksum mismatch (sha256 ... recorded, ... found): the file was modified or corrupted after it
was saved``, and ``resolve`` falls back to the previous checkpoint with a warning.

sha256 was chosen by measurement (docs/benchmarks.md#decisions-whose-measurements-are-in-the-history):
with SHA extensions (AMD Zen, Intel Ice Lake and later) it is the fastest sound hash in hashlib
(sha1 is a little faster but broken, md5 slower; zlib's crc32 is a 32-bit check, not a content
hash), and ``sha256sum`` checks a file by hand. ``CheckpointStore(checksum="blake2b")`` suits
CPUs without SHA extensions (where sha256 is about half as fast as blake2b), ``checksum=None``
seals with sizes only. The algorithm is recorded in each seal, so checkpoints sealed with
another one (or none: seals written before checksums existed, which are checked by size only)
keep loading.

Cost: on a fast local disk the seal takes about the hashing time, longer than its fsync (which
runs beside the hashing), so a save with checksums takes longer than one sealed by sizes; files
are hashed in parallel threads, which helps when cores are free. A verified load reads and
hashes everything (hashing, not the disk, is the bound there), against microseconds for the
sizes alone. On a slower disk or a parallel filesystem the ratio is smaller, the I/O taking more of
the time. Rank 0 hashes while the other ranks wait in the barrier. ``verify(tag,
checksums=False)`` / ``read_complete(tag, checksums=False)`` check the sizes only (a cheap
metadata read), e.g. on every rank but the one that verifies content;
``CheckpointStore(verify_checksums=False)`` makes that the store's default. The checksums
detect corruption, not tampering: whoever can rewrite a file can rewrite the seal.

Saving a step that already has a complete checkpoint replaces it (``begin(step, replace=True)``,
the default). This happens after a resume from an older checkpoint (a fallback, or an explicit
step), when training reaches the same step again; refusing would make a requeued job fail
forever. The old directory stays loadable until the new one is sealed: ``commit`` then moves it
aside (``<tag>.removing``), renames the new one into place and deletes the old one. The only
unprotected moment is between those two renames; a crash there loses that step and ``resolve``
falls back to an older one. ``replace=False`` raises ``CheckpointError`` instead.

Multi-rank. The store makes no ``torch.distributed`` calls: ``begin`` and ``commit`` are
collective through the ``barrier`` callable, all other methods are local reads. Every rank must
see the same shared filesystem (Lustre, GPFS, NFS with close-to-open consistency; not
DeepSpeed's node-local storage). An exception raised on rank 0 inside ``commit`` (a full disk)
leaves the other ranks waiting in the barrier until the process group times out.

torch is imported inside the functions that need it (RNG and per-rank state), so the store
itself is cheap to import from tools and subprocesses that never touch tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from albatross.files import (  # re-exported: the store's file operations
    DEFAULT_CHECKSUM,
    CheckpointError,
    check_algorithm,
    file_checksum,
    fsync_dir,
    fsync_file,
    hash_files,
    remove_tree,
    write_atomically,
    write_json_atomically,
)
from engine.rank_state import (  # re-exported: per-rank state
    load_rank_state,
    rank_state_path,
    rng_state,
    save_rank_state,
    set_rng_state,
)

__all__ = [
    "CHECKPOINT_DIR_PATTERN",
    "COMPLETE_FILE",
    "DEFAULT_CHECKSUM",
    "LATEST_FILE",
    "CheckpointError",
    "CheckpointStore",
    "file_checksum",
    "load_rank_state",
    "rank_state_path",
    "remove_tree",
    "resume_collectively",
    "rng_state",
    "same_world_size",
    "save_rank_state",
    "set_rng_state",
    "step_of",
    "tag_for",
    "write_json_atomically",
]

CHECKPOINT_DIR_PATTERN = "step_%08d"
"""``%``-format of a checkpoint tag (the directory name under the store's root)."""
STAGING_SUFFIX = ".partial"
"""Suffix of a checkpoint directory that is being written (or was left by a crash)."""
REMOVING_SUFFIX = ".removing"
"""Suffix of a checkpoint directory that is being deleted (replaced or pruned)."""
COMPLETE_FILE = "COMPLETE.json"
"""The seal written last into a checkpoint directory; lists every other file, its size and
(unless the store seals without them) its content checksum."""
LATEST_FILE = "latest"
"""Text file under the root holding the tag of the newest complete checkpoint (DeepSpeed reads
the same name and format when ``load_checkpoint`` gets no tag)."""

_TAG_RE = re.compile(r"step_(\d{8,})")
_RECORD_KEYS = ("step", "tag", "world_size", "time", "meta", "files")

T = TypeVar("T")


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step={step!r} is invalid; valid: an integer >= 0")
    return step


def tag_for(step: int) -> str:
    """The tag (directory name) of the checkpoint of ``step``: ``tag_for(100) == "step_00000100"``."""
    return CHECKPOINT_DIR_PATTERN % _check_step(step)


def step_of(tag: str) -> int | None:
    """The step that ``tag`` names, or None when ``tag`` is not exactly what ``tag_for`` makes."""
    m = _TAG_RE.fullmatch(tag)
    if m is None or tag_for(int(m.group(1))) != tag:
        return None
    return int(m.group(1))


def _step_of_prefixed(name: str, suffix: str) -> int | None:
    """The step of ``<tag><suffix>`` (a staging or removing directory name), else None."""
    return step_of(name[: -len(suffix)]) if name.endswith(suffix) else None


def _remove_via_rename(path: Path) -> None:
    """Delete a checkpoint directory so that a crash midway never leaves a half-deleted
    directory under its tag: rename it to ``<tag>.removing`` first."""
    aside = path.with_name(path.name + REMOVING_SUFFIX)
    remove_tree(aside)
    os.replace(path, aside)
    remove_tree(aside)


def _file_sizes(directory: Path) -> dict[str, int]:
    """``{relative posix path: size}`` of every file under ``directory`` except the seal."""
    sizes: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath, name)
            rel = path.relative_to(directory).as_posix()
            if rel != COMPLETE_FILE:
                sizes[rel] = path.stat().st_size
    return sizes


def _json_copy(meta: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise ValueError(f"checkpoint meta must be a dict, got {type(meta).__name__}")
    try:
        return json.loads(json.dumps(meta))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint meta must be JSON-serializable: {exc}") from None


# ---------------------------------------------------------------------------------------------
# the store


def _no_barrier() -> None:
    """The barrier of a single-process run."""


class CheckpointStore:
    """The checkpoints of one run under ``root`` (see the module docstring for the protocol).

    ``rank``/``world_size`` say which process this is; only rank 0 writes the store's own files.
    ``keep_last`` complete checkpoints are kept (newest steps; the one ``latest`` names is never
    deleted); 0 keeps all. ``barrier`` is called by ``begin`` and ``commit`` on every rank, e.g.
    ``torch.distributed.barrier``; the default does nothing (single process).

    ``checksum`` is the hashlib algorithm rank 0 records each file's content checksum with when
    it seals a checkpoint (``"sha256"``; None: sizes only). ``verify_checksums`` is the default
    of ``verify``/``read_complete``/``resolve``'s ``checksums`` keyword: True re-hashes every
    file of a checkpoint whose seal has checksums; False checks sizes only.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        keep_last: int = 3,
        barrier: Callable[[], object] = _no_barrier,
        checksum: str | None = DEFAULT_CHECKSUM,
        verify_checksums: bool = True,
    ) -> None:
        for name, value, minimum in (("world_size", world_size, 1), ("keep_last", keep_last, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}={value!r} is invalid; valid: an integer >= {minimum}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} is invalid; valid: an integer in [0, {world_size})")
        if not callable(barrier):
            raise ValueError(f"barrier must be callable, got {type(barrier).__name__}")
        if checksum is not None:
            check_algorithm(checksum)
        if not isinstance(verify_checksums, bool):
            raise ValueError(
                f"verify_checksums={verify_checksums!r} is invalid; valid: True, False"
            )
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep_last = keep_last
        self._barrier = barrier
        self.checksum = checksum
        self.verify_checksums = verify_checksums

    def __repr__(self) -> str:
        return (
            f"CheckpointStore({str(self.root)!r}, rank={self.rank}, "
            f"world_size={self.world_size}, keep_last={self.keep_last}, "
            f"checksum={self.checksum!r}, verify_checksums={self.verify_checksums})"
        )

    # ---------------------------------------------------------------------------- saving

    def staging_tag(self, step: int) -> str:
        """Name of the directory under ``root`` that the checkpoint of ``step`` is written to."""
        return tag_for(step) + STAGING_SUFFIX

    def begin(self, step: int, *, replace: bool = True) -> Path:
        """Start saving ``step`` (collective): returns the empty staging directory to write into.

        Rank 0 deletes a stale staging directory of the same step (left by a crash) and creates
        it; the other ranks wait in the barrier. An existing complete checkpoint of ``step`` is
        replaced by ``commit`` (and stays loadable until then); with ``replace=False`` it raises
        ``CheckpointError`` instead, on every rank alike.
        """
        tag = tag_for(step)
        if not replace and self._is_complete(tag):
            raise CheckpointError(
                self.root / tag,
                "a complete checkpoint of this step exists and begin(replace=False) was asked",
            )
        staging = self.root / self.staging_tag(step)
        if self.rank == 0:
            remove_tree(staging)
            staging.mkdir(parents=True)
            fsync_dir(self.root)
        self._barrier()
        return staging

    def commit(self, step: int, meta: dict[str, Any]) -> Path:
        """Finish saving ``step`` (collective, after every rank wrote its files): returns the
        checkpoint directory ``root/<tag>``.

        After the barrier, rank 0 seals the staging directory with ``COMPLETE.json`` (hashing
        and fsyncing every file first), renames it to its tag (an old checkpoint of the same
        step is moved aside first and deleted after), replaces ``latest``, prunes beyond
        ``keep_last`` and deletes stale staging directories of older steps. ``meta``
        (JSON-serializable) is stored in ``COMPLETE.json`` and comes back from
        ``read_complete``.
        """
        tag = tag_for(step)
        meta = _json_copy(meta)
        staging = self.root / self.staging_tag(step)
        if not staging.is_dir():  # checked on every rank, before the barrier: all fail alike
            raise CheckpointError(staging, f"does not exist; call begin({step}) before commit")
        self._barrier()
        final = self.root / tag
        if self.rank == 0:
            self._seal(staging, step, meta)
            self._publish(staging, final)
            self._write_latest(tag)
            self._prune(step)
        self._barrier()
        return final

    def _seal(self, staging: Path, step: int, meta: dict[str, Any]) -> None:
        files = _file_sizes(staging)
        digests: dict[str, str] = {}
        if self.checksum is None:
            for rel in files:
                fsync_file(staging / rel)
        else:
            results = hash_files([staging / rel for rel in files], self.checksum, fsync=True)
            for (rel, size), (hashed, digest) in zip(files.items(), results):
                if hashed != size:  # the size listed must be the content hashed
                    raise CheckpointError(
                        staging / rel,
                        f"changed while the checkpoint was sealed ({size} bytes listed, "
                        f"{hashed} hashed): is a rank still writing?",
                    )
                digests[rel] = digest
        record: dict[str, Any] = {
            "step": step,
            "tag": tag_for(step),
            "world_size": self.world_size,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "meta": meta,
            "files": files,
        }
        if self.checksum is not None:
            record["checksums"] = {"algorithm": self.checksum, "digests": digests}
        data = json.dumps(record, indent=2).encode()
        for dirpath, _, _ in os.walk(staging):  # entries of nested directories are durable too
            fsync_dir(Path(dirpath))
        write_atomically(staging / COMPLETE_FILE, lambda f: f.write(data))

    def _publish(self, staging: Path, final: Path) -> None:
        aside = final.with_name(final.name + REMOVING_SUFFIX)
        if final.exists():
            remove_tree(aside)
            os.replace(final, aside)  # the new checkpoint is sealed: the old one may go
        os.replace(staging, final)
        fsync_dir(self.root)
        remove_tree(aside)

    def _prune(self, step: int) -> None:
        latest = self.latest_tag()
        steps = self.complete_steps()
        keep = set(steps[-self.keep_last :]) if self.keep_last else set(steps)
        for old in steps:  # ascending: a crash midway leaves the newer ones
            if old not in keep and tag_for(old) != latest:
                _remove_via_rename(self.root / tag_for(old))
        for path in self.root.iterdir():
            staged = _step_of_prefixed(path.name, STAGING_SUFFIX)
            if (staged is not None and staged < step) or _step_of_prefixed(
                path.name, REMOVING_SUFFIX
            ) is not None:
                remove_tree(path)

    # ---------------------------------------------------------------------------- reading

    def _tag_dirs(self) -> Iterator[tuple[str, int]]:
        """``(tag, step)`` of every checkpoint directory (complete or not), in no order."""
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            step = step_of(path.name)
            if step is not None and path.is_dir():
                yield path.name, step

    def _is_complete(self, tag: str) -> bool:
        return (self.root / tag / COMPLETE_FILE).is_file()

    def _write_latest(self, tag: str) -> None:
        write_atomically(self.root / LATEST_FILE, lambda f: f.write(tag.encode()))

    def set_aside_after(self, step: int, suffix: str) -> list[str]:
        """Collective: the checkpoints of steps after ``step`` renamed to ``<tag><suffix>``
        (kept, never loaded: a rollback's diverged states) and ``latest`` naming ``step``'s.
        Returns the new names."""
        moved: list[str] = []
        if self.rank == 0:
            for tag, later in sorted(self._tag_dirs(), key=lambda item: item[1]):
                if later > step:
                    os.replace(self.root / tag, self.root / f"{tag}{suffix}")
                    moved.append(f"{tag}{suffix}")
            self._write_latest(tag_for(step))
            fsync_dir(self.root)
        self._barrier()
        return moved

    def complete_steps(self) -> list[int]:
        """Steps that have a sealed (``COMPLETE.json``) checkpoint directory, ascending. The files
        are not checked here: see ``verify``."""
        return sorted(step for tag, step in self._tag_dirs() if self._is_complete(tag))

    def latest_tag(self) -> str | None:
        """The tag in ``latest`` when it names an existing checkpoint directory, else None."""
        try:
            text = (self.root / LATEST_FILE).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
        if step_of(text) is None or not (self.root / text).is_dir():
            return None
        return text

    def _directory(self, tag: str) -> Path:
        if not isinstance(tag, str) or step_of(tag) is None:
            raise ValueError(f"{tag!r} is not a checkpoint tag; valid: like {tag_for(100)!r}")
        return self.root / tag

    def _checked_record(self, tag: str, checksums: bool | None) -> dict[str, Any]:
        """The parsed ``COMPLETE.json`` of ``tag`` after checking it and the files it lists:
        their sizes, then (``checksums``, None: the store's default) their content."""
        if checksums is None:
            checksums = self.verify_checksums
        directory = self._directory(tag)
        seal = directory / COMPLETE_FILE
        try:
            record = json.loads(seal.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(directory, f"is incomplete: no {COMPLETE_FILE}") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(directory, f"{COMPLETE_FILE} is unreadable ({exc})") from None
        if not isinstance(record, dict) or any(key not in record for key in _RECORD_KEYS):
            raise CheckpointError(
                directory, f"{COMPLETE_FILE} is malformed (needs keys {list(_RECORD_KEYS)})"
            )
        if record["tag"] != tag or record["step"] != step_of(tag):
            raise CheckpointError(
                directory,
                f"{COMPLETE_FILE} describes {record['tag']!r} (step {record['step']!r}), "
                "not this directory",
            )
        files = record["files"]
        if not isinstance(files, dict):
            raise CheckpointError(directory, f"{COMPLETE_FILE} is malformed ('files')")
        problems = [p for rel, size in files.items() if (p := _file_problem(directory, rel, size))]
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise CheckpointError(directory, "is damaged: " + "; ".join(problems[:3]) + more)
        digests = _recorded_digests(directory, record)  # checked even when not compared
        if checksums and digests is not None:
            algorithm, expected = digests
            try:
                hashlib.new(algorithm).hexdigest()
            except (ValueError, TypeError):  # unknown here, or a variable-length shake_*
                raise CheckpointError(
                    directory,
                    f"{COMPLETE_FILE} records {algorithm} checksums, which this Python's hashlib "
                    "cannot compute (verify with checksums=False to check sizes only)",
                ) from None
            rels = sorted(expected)
            try:
                found = [
                    d for _, d in hash_files([directory / r for r in rels], algorithm, fsync=False)
                ]
            except OSError as exc:  # e.g. deleted since the sizes were checked
                raise CheckpointError(exc.filename or directory, f"cannot be read ({exc})") from exc
            bad = [rel for rel, digest in zip(rels, found) if digest != expected[rel]]
            if bad:
                rel = bad[0]
                others = f"; {len(bad) - 1} more differ: {', '.join(bad[1:4])}" if bad[1:] else ""
                raise CheckpointError(
                    directory / rel,
                    f"content checksum mismatch ({algorithm} {expected[rel]} recorded, "
                    f"{found[rels.index(rel)]} found): the file was modified or corrupted after "
                    f"it was saved{others}",
                )
        return record

    def verify(self, tag: str, *, checksums: bool | None = None) -> None:
        """Raise ``CheckpointError`` (naming the directory, or the damaged file, and why) unless
        checkpoint ``tag`` is sealed, every file listed in ``COMPLETE.json`` exists with its
        recorded size and, with ``checksums`` (None: the store's ``verify_checksums``), has the
        recorded content checksum (re-reads every file; seals without checksums are checked by
        size only). The world size is not compared: it is in ``read_complete(tag)``."""
        self._checked_record(tag, checksums)

    def read_complete(self, tag: str, *, checksums: bool | None = None) -> dict[str, Any]:
        """The ``COMPLETE.json`` of checkpoint ``tag`` (``step``, ``tag``, ``world_size``,
        ``time``, ``meta``, ``files`` and, when sealed with them, ``checksums``), after
        ``verify(tag, checksums=checksums)``. ``checksums=False`` makes it a cheap metadata
        read (sizes are still checked)."""
        return self._checked_record(tag, checksums)

    def candidates(self, step: int | None = None) -> list[str]:
        """Tags to try loading, best first.

        With ``step``: ``[tag_for(step)]``, or ``CheckpointError`` when that checkpoint does not
        exist or is not sealed. Without: the tag in ``latest``, then the other sealed
        checkpoints, newest step first. Unsealed checkpoint directories are skipped with a
        warning; staging directories are never candidates.
        """
        if step is not None:
            tag = tag_for(step)
            if not (self.root / tag).is_dir():
                raise CheckpointError(
                    self.root / tag,
                    f"no checkpoint of step {step} (complete steps: {self.complete_steps()})",
                )
            if not self._is_complete(tag):
                raise CheckpointError(self.root / tag, f"is incomplete: no {COMPLETE_FILE}")
            return [tag]
        latest = self.latest_tag()
        if latest is None and (self.root / LATEST_FILE).exists():
            warnings.warn(
                f"{self.root / LATEST_FILE} does not name an existing checkpoint; ignoring it",
                stacklevel=2,
            )
        tags = [tag for tag, _ in sorted(self._tag_dirs(), key=lambda ts: ts[1], reverse=True)]
        if latest is not None:
            tags.remove(latest)
            tags.insert(0, latest)
        usable = []
        for tag in tags:
            if self._is_complete(tag):
                usable.append(tag)
            else:
                warnings.warn(
                    f"checkpoint {self.root / tag} is incomplete (no {COMPLETE_FILE}); skipping it",
                    stacklevel=2,
                )
        return usable

    def resolve(
        self,
        step: int | None = None,
        loader: Callable[[Path], T] | None = None,
        *,
        checksums: bool | None = None,
    ) -> tuple[Path, T | None] | None:
        """The checkpoint to resume from: ``(directory, loader(directory) or None)``.

        Candidates are tried in order (``candidates``): ``verify(tag, checksums=checksums)``,
        then ``loader`` if given.
        When one fails, a warning names it and the reason and the next one is tried; ``loader``
        must therefore fully overwrite whatever a failed attempt loaded. Returns None when there
        is no checkpoint directory at all (a fresh run); raises ``CheckpointError`` listing every
        reason when checkpoints exist but none is usable. With ``step`` there is no fallback:
        that checkpoint or ``CheckpointError``.

        Ranks resolve independently. ``verify`` sees the same shared files on every rank, but a
        ``loader`` may fail on one rank only; in a multi-rank job, resolve without a loader (or
        agree on the step across ranks) before loading.
        """
        if step is not None:
            tag = self.candidates(step)[0]
            try:
                return self.root / tag, self._attempt(tag, loader, checksums)
            except Exception as exc:
                raise CheckpointError(self.root / tag, _reason(exc, self.root / tag)) from exc
        tags = self.candidates()
        if not tags:
            if any(True for _ in self._tag_dirs()):
                raise CheckpointError(self.root, "has checkpoint directories but none is complete")
            return None
        reasons = []
        for i, tag in enumerate(tags):
            try:
                return self.root / tag, self._attempt(tag, loader, checksums)
            except Exception as exc:
                reason = _reason(exc, self.root / tag)
                reasons.append(f"{tag}: {reason}")
                if i + 1 < len(tags):
                    warnings.warn(
                        f"checkpoint {self.root / tag} is unusable ({reason}); "
                        f"falling back to {self.root / tags[i + 1]}",
                        stacklevel=2,
                    )
        raise CheckpointError(self.root, "no usable checkpoint: " + "; ".join(reasons))

    def _attempt(
        self, tag: str, loader: Callable[[Path], T] | None, checksums: bool | None
    ) -> T | None:
        self.verify(tag, checksums=checksums)
        return None if loader is None else loader(self.root / tag)


def resume_collectively(
    store: CheckpointStore,
    restore: Callable[[Path, dict[str, Any]], T],
    any_failed: Callable[[bool], bool],
    *,
    checksums: bool,
) -> tuple[Path, T] | None:
    """Collective resume of a multi-rank job: the newest usable checkpoint, loaded on every
    rank, or None for a fresh start (no checkpoint directory at all).

    Candidates come newest first (``latest`` first, see ``candidates``). On every rank the
    seal and sizes are checked (the content checksums where ``checksums``: rank 0 in the
    trainers), then ``restore(directory, record)`` loads it (``record``: its
    ``COMPLETE.json``; raise to refuse it, e.g. for another world size). ``any_failed(failed)``
    must return whether any rank failed (an all-reduce): a checkpoint that fails anywhere is
    reported with a warning and the next older one is tried on all ranks together.
    ``restore`` must overwrite everything a failed attempt loaded. ``CheckpointError`` lists
    every reason when none is usable."""
    tags = store.candidates()
    if not tags and any(True for _ in store._tag_dirs()):
        raise CheckpointError(store.root, "has checkpoint directories but none is complete")
    reasons = []
    for tag in tags:
        path = store.root / tag
        error: Exception | None = None
        result: Any = None
        try:
            result = restore(path, store.read_complete(tag, checksums=checksums))
        except Exception as e:  # reported below, on every rank alike
            error = e
        if not any_failed(error is not None):
            return path, result
        reason = f"{path}: {error or 'failed on another rank'}"
        reasons.append(reason)
        warnings.warn(f"checkpoint unusable ({reason}); falling back", stacklevel=2)
    if reasons:
        raise CheckpointError(store.root, "no usable checkpoint: " + "; ".join(reasons))
    return None


def same_world_size(record: dict[str, Any], world_size: int) -> None:
    """Refuse a checkpoint written by another number of processes (ValueError)."""
    saved = record.get("world_size")
    if saved != world_size:
        raise ValueError(
            f"written by {saved} processes; this run has {world_size} (an exact resume needs "
            "the same number)"
        )


def _file_problem(directory: Path, rel: object, size: object) -> str | None:
    """What is wrong with one file listed in a seal, or None."""
    if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in Path(rel).parts:
        return f"listed path {rel!r} is not inside the checkpoint"
    try:
        actual = (directory / rel).stat().st_size
    except FileNotFoundError:
        return f"{rel} is missing"
    if actual != size:
        return f"{rel} has {actual} bytes, {size} expected"
    return None


def _recorded_digests(directory: Path, record: dict[str, Any]) -> tuple[str, dict] | None:
    """``(algorithm, {path: hex digest})`` of a seal, None for a seal without checksums (written
    before they existed, or with ``checksum=None``); ``CheckpointError`` when malformed."""
    if "checksums" not in record:
        return None
    section = record["checksums"]
    files = record["files"]
    if not (
        isinstance(section, dict)
        and isinstance(section.get("algorithm"), str)
        and isinstance(section.get("digests"), dict)
        and all(isinstance(d, str) for d in section["digests"].values())
        and set(section["digests"]) == set(files)
    ):
        raise CheckpointError(
            directory,
            f"{COMPLETE_FILE} is malformed ('checksums' must be {{'algorithm': name, "
            "'digests': {path: hex digest}} for exactly the listed files)",
        )
    return section["algorithm"], section["digests"]


def _reason(exc: BaseException, directory: Path | None = None) -> str:
    """Why a candidate failed, for a warning about ``directory``: a ``CheckpointError`` about a
    file inside it keeps that file's relative path."""
    if isinstance(exc, CheckpointError):
        if directory is not None and directory in exc.path.parents:
            return f"{exc.path.relative_to(directory).as_posix()}: {exc.reason}"
        return exc.reason
    return f"{type(exc).__name__}: {exc}"
