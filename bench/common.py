"""What the benchmarks share: timing with warm-up (median and minimum of interleaved runs),
the machine a figure was measured on, and writing a result to JSON with the command, the
machine and the date.

The benchmarks are modules of the package ``bench``; run them from the repository root:

    python -m bench.bench_model --help
    albatross bench model --help            # the same, from any folder of a clone
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (the folder that holds ``bench/``)."""


def sync(device: str) -> None:
    """Waits for the device's queued work (CUDA), so that a host clock times it."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one function: every timed run, their median and minimum."""

    runs: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def min(self) -> float:
        return min(self.runs)


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    warmup: int,
    repeats: int,
    device: str = "cpu",
    device_time: bool = False,
) -> dict[str, Timing]:
    """Each function run `warmup` times untimed, then `repeats` timed runs taken in turn (a, b,
    a, b, ...), so that a change of the machine's load hits every variant alike. Host clock,
    the device synchronised before and after each run; with `device_time` on CUDA, the device's
    own time between two CUDA events instead (what the host adds around the launches left out)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            runs[name].append(_seconds(fn, device, device_time))
    return {name: Timing(tuple(r)) for name, r in runs.items()}


def _seconds(fn: Callable[[], object], device: str, device_time: bool) -> float:
    if device_time and str(device).startswith("cuda"):
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    sync(device)
    start_s = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start_s


def median_seconds(
    fns: dict[str, Callable[[], object]], warmup: int, repeats: int, device: str = "cpu"
) -> dict[str, float]:
    """`time_interleaved`'s medians: {name: median seconds per call}."""
    return {k: t.median for k, t in time_interleaved(fns, warmup, repeats, device).items()}


def machine() -> dict:
    """The machine and the software versions a figure comes from."""
    info: dict = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import torch
    except ImportError:
        return info
    info.update(torch=torch.__version__, threads=torch.get_num_threads())
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return info


def command() -> str:
    """The command line that runs this process, as ``python -m bench.<name> ...``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    return shlex.join([*head, *sys.argv[1:]])


def write_result(path: Path | str | None, payload: dict) -> None:
    """Writes `payload` as JSON to `path` (nothing when None), with the command that made it,
    the machine and the date (UTC) first. Call it again as results come in: what is done
    survives a kill."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": command(),
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **payload,
    }
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs a module of this repository with this Python (``subprocess_env``
    makes the repository importable for it)."""
    return [sys.executable, "-m", module, *args]


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH (so that a
    subprocess imports ``bench`` and the project's packages from this checkout), plus
    `extra`."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def free_port() -> int:
    """A free local TCP port (a one-process rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
