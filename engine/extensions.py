"""Torch-extension builds: stale build locks and a per-environment extensions directory.

DeepSpeed builds its C++/CUDA ops at start-up, on CPU the shared-memory
collectives (``deepspeed_shm_comm``, in ``deepspeed.init_distributed``), on CUDA the fused LAMB,
with ``torch.utils.cpp_extension.load``, which serializes builds through a ``lock`` file in the
op's build directory (``$TORCH_EXTENSIONS_DIR/<op>/lock``; torch's ``FileBaton``). A process
killed mid-build leaves the file behind, and every later start waits on it forever, silently.
Before DeepSpeed starts, ``Engine`` therefore calls ``check_extension_locks``: it waits while a
lock is younger than ``ALBATROSS_EXTENSION_LOCK_MINUTES`` (default 10) or held open by a live
process on this host, and raises ``StaleExtensionLockError`` (a ``ValueError``: the CLIs exit
2) naming the file once a lock is older than that and no process here holds it. The file is not
deleted automatically: ``FileBaton`` records no owner, so on a shared home directory a lock of
that age may belong to a slow build on another host, and deleting it there would crash that
build (its release fails) or let this run import a half-built library; the error says to delete
it when no other build is running. Ten minutes is many times a CPU build of
``deepspeed_shm_comm`` and several times a typical CUDA op build; set the variable higher for
slower builds (many CUDA architectures, a loaded login node), or to 0 to turn the check off.

Also before DeepSpeed starts, when ``TORCH_EXTENSIONS_DIR`` is unset and Python runs in a
virtual environment it can write to, ``use_environment_extensions_dir`` sets it to
``<venv>/torch_extensions/<py/accelerator tag>``: builds of two environments (other torch or
DeepSpeed versions, which torch's default ``~/.cache/torch_extensions/py311_cu121`` does not
tell apart, so they rebuild over each other's libraries and share their locks) then never share
a directory. The cost is one build per new environment; an explicit ``TORCH_EXTENSIONS_DIR`` is
kept, and outside a virtual environment (or in a read-only one) torch's default stays.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import types
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EXTENSION_LOCK_MINUTES_ENV = "ALBATROSS_EXTENSION_LOCK_MINUTES"
"""Environment variable: the age (minutes) at which a torch-extensions build lock that no
process on this host holds is taken as stale; 0 turns the check off."""
DEFAULT_EXTENSION_LOCK_MINUTES = 10.0


class StaleExtensionLockError(ValueError):
    """A torch-extensions build lock left by a killed build (see the module docstring)."""

    def __init__(self, lock: Path, age_s: float, max_age_s: float) -> None:
        self.lock = Path(lock)
        self.age_s = age_s
        super().__init__(
            f"{self.lock}: a torch-extensions build lock {age_s / 60:.1f} minutes old that no "
            f"process on this host holds open (the limit is {max_age_s / 60:g} minutes, "
            f"{EXTENSION_LOCK_MINUTES_ENV}). A build of the '{self.lock.parent.name}' op was "
            "probably killed; torch would wait on this file forever. If no other build of it "
            f"is running (on any host sharing this directory), delete it: rm {self.lock}"
        )


def _extension_lock_max_age_s() -> float:
    raw = os.environ.get(EXTENSION_LOCK_MINUTES_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_EXTENSION_LOCK_MINUTES * 60
    try:
        minutes = float(raw)
    except ValueError:
        minutes = float("nan")
    if not math.isfinite(minutes) or minutes < 0:
        raise ValueError(
            f"{EXTENSION_LOCK_MINUTES_ENV}={raw!r} is invalid; valid: minutes >= 0 (0: no check)"
        )
    return minutes * 60


def _build_folder() -> str:
    """The per-Python, per-accelerator folder torch puts under its default extensions root
    (``torch.utils.cpp_extension._get_build_directory``): ``py311_cpu``, ``py311_cu128``, ..."""
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return f"{python}_{accelerator}"


def torch_extensions_root() -> Path:
    """The directory under which ``torch.utils.cpp_extension`` builds JIT extensions (one
    sub-directory per op, e.g. DeepSpeed's): ``$TORCH_EXTENSIONS_DIR``, else torch's default
    (``torch.utils.cpp_extension.get_default_build_root()/<py/accelerator tag>``)."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit is not None:
        return Path(explicit)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / _build_folder()


def use_environment_extensions_dir(
    prefix: str | os.PathLike[str] | None = None,
    base_prefix: str | os.PathLike[str] | None = None,
) -> Path | None:
    """Point ``TORCH_EXTENSIONS_DIR`` into the virtual environment, ``<prefix>/torch_extensions/
    <py/accelerator tag>``, when it is unset, Python runs in a virtual environment (``prefix``,
    default ``sys.prefix``, differs from ``base_prefix``, default ``sys.base_prefix``) and that
    environment is writable. Returns the directory set, or None when nothing was changed (an
    explicit ``TORCH_EXTENSIONS_DIR``, no virtual environment, a read-only one)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR") is not None:
        return None
    prefix = Path(sys.prefix if prefix is None else prefix)
    base = Path(sys.base_prefix if base_prefix is None else base_prefix)
    if prefix.resolve() == base.resolve() or not os.access(prefix, os.W_OK | os.X_OK):
        return None
    directory = prefix / "torch_extensions" / _build_folder()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(directory)
    return directory


def _lock_holders(lock: Path) -> list[int]:
    """PIDs of the processes on this host that have ``lock`` open (torch's FileBaton keeps its
    lock file open while it builds). Linux only, and only processes whose ``/proc/<pid>/fd``
    this user may read (the same user's); elsewhere []."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    try:
        target = os.path.realpath(lock)
    except OSError:
        return []
    holders = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    holders.append(int(entry.name))
                    break
            except OSError:
                continue
    return holders


def _still_there(lock: Path, stat: os.stat_result, delay_s: float) -> bool:
    """True when ``lock`` is, after ``delay_s``, still the same file and held by no process
    here: FileBaton.release closes the file before it removes it, so a finishing build is
    briefly an old lock that nobody holds."""
    time.sleep(delay_s)
    try:
        now = lock.stat()
    except FileNotFoundError:
        return False
    same = (now.st_ino, now.st_dev, now.st_mtime) == (stat.st_ino, stat.st_dev, stat.st_mtime)
    return same and not _lock_holders(lock)


def check_extension_locks(
    root: str | os.PathLike[str] | None = None,
    max_age_s: float | None = None,
    poll_s: float = 1.0,
) -> None:
    """Wait while the ``<op>/lock`` files under ``root`` (default ``torch_extensions_root()``)
    belong to builds in progress; raise ``StaleExtensionLockError`` for one older than
    ``max_age_s`` (default ``$ALBATROSS_EXTENSION_LOCK_MINUTES`` or 10 minutes; 0 turns the
    check off) that no process on this host holds open. A lock held open here is never stale,
    however old. Returns at once when there are no locks (the usual case); see the module
    docstring for why the lock is not deleted."""
    max_age = _extension_lock_max_age_s() if max_age_s is None else float(max_age_s)
    if max_age <= 0:
        return
    root = torch_extensions_root() if root is None else Path(root)
    announced: set[Path] = set()
    while True:
        locks = sorted(root.glob("*/lock")) if root.is_dir() else []
        if not locks:
            return
        for lock in locks:
            try:
                stat = lock.stat()
            except FileNotFoundError:  # released since the listing
                continue
            age = time.time() - stat.st_mtime
            holders = _lock_holders(lock)
            if age >= max_age and not holders and _still_there(lock, stat, min(poll_s, 0.2)):
                raise StaleExtensionLockError(lock, age, max_age)
            if lock not in announced:
                announced.add(lock)
                by = f"process {holders}" if holders else "no process on this host"
                log.warning(
                    "waiting for the torch-extensions build lock %s (%.0f s old, held by %s); "
                    "it is taken as stale once it is %g minutes old and no process here "
                    "holds it",
                    lock,
                    age,
                    by,
                    max_age / 60,
                )
        time.sleep(poll_s)


def import_deepspeed() -> types.ModuleType:
    """``import deepspeed``, without its autotuner's import of MLflow (module docstring)."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    from albatross.compat import module_hidden

    with module_hidden("mlflow"):  # `import mlflow` raises inside
        import deepspeed
    return deepspeed


def prepare_extensions() -> None:
    """Before DeepSpeed builds or loads its ops: a per-environment extensions directory
    (``use_environment_extensions_dir``), then ``check_extension_locks``."""
    use_environment_extensions_dir()
    check_extension_locks()
