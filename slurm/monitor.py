"""Watching submitted jobs: their state from ``squeue`` / ``sacct``, task 0's result that
submitit wrote (``Outcome``), waiting for all of them (``wait_for``) and a sweep's table."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import submitit

TERMINAL_STATES = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "REVOKED",
    "SPECIAL_EXIT",
    "TIMEOUT",
}
"""squeue/sacct states after which a job does not run again (PREEMPTED may be requeued)."""


def squeue_state(job_id: str) -> tuple[str, str] | None:
    """(state, reason) of a job from ``squeue`` (finished jobs too, while Slurm keeps them) or,
    failing that, ``sacct``; None when neither knows it."""
    line = _first_line(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%r"])
    if line is not None:
        state, _, reason = line.partition("|")
        return state.strip(), reason.strip()
    line = _first_line(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    if line is not None:
        return line.split()[0], ""
    return None


def _first_line(cmd: list[str]) -> str | None:
    """The first line a Slurm query printed, or None when it failed or printed nothing."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and lines:
            return lines[0]
    return None


@dataclass
class Outcome:
    job_id: str
    state: str
    """``completed`` / ``stopped`` (the stage's own words) or a Slurm state / ``failed``."""
    result: dict[str, Any] | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.state == "completed"


def read_outcome(job: submitit.Job) -> Outcome | None:
    """Task 0's result once submitit wrote it, else None."""
    from submitit.core.utils import pickle_load

    path = job.task(0).paths.result_pickle
    if not path.exists():
        return None
    try:
        kind, value = pickle_load(path)
    except Exception:  # half-written: look again later
        return None
    if kind == "success":
        value = value if isinstance(value, dict) else {"state": "completed", "value": value}
        return Outcome(job.job_id, str(value.get("state", "completed")), result=value)
    return Outcome(job.job_id, "failed", error=str(value))


def wait_for(
    jobs: Sequence[submitit.Job],
    timeout: float | None = None,
    poll: float = 2.0,
    log: Callable[[str], None] = print,
) -> list[Outcome]:
    """Waits until every job has a result or has left for good; logs state changes."""
    deadline = None if timeout is None else time.monotonic() + timeout
    outcomes: dict[str, Outcome] = {}
    seen: dict[str, tuple[str, str] | None] = {}
    ended_at: dict[str, float] = {}
    while len(outcomes) < len(jobs):
        for job in jobs:
            jid = job.job_id
            if jid in outcomes:
                continue
            outcome = read_outcome(job)
            if outcome is not None:
                outcomes[jid] = outcome
                continue
            state = squeue_state(jid)
            if state != seen.get(jid, ("", "")):
                seen[jid] = state
                if state is not None:
                    reason = f" ({state[1]})" if state[1] not in ("", "None") else ""
                    log(f"job {jid}: {state[0]}{reason}")
            never = state is not None and state[1].startswith("DependencyNeverSatisfied")
            if state is not None and state[0] not in TERMINAL_STATES and not never:
                ended_at.pop(jid, None)
            if state is None or state[0] in TERMINAL_STATES or never:
                # Give submitit's result file a moment to appear on a shared file system, and
                # squeue a minute to answer again before a job counts as gone.
                first = ended_at.setdefault(jid, time.monotonic())
                grace = 60 if state is None else 15
                if time.monotonic() - first > grace or never:
                    if never:
                        subprocess.run(["scancel", jid], capture_output=True)
                    name = "DependencyNeverSatisfied" if never else (state or ("gone", ""))[0]
                    outcomes[jid] = Outcome(jid, name, error=_log_tail(job))
                    log(f"job {jid}: {name} without a result")
        if len(outcomes) < len(jobs):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"jobs still running after {timeout} s: {_ids(jobs)}")
            time.sleep(poll)
    return [outcomes[job.job_id] for job in jobs]


def _ids(jobs: Sequence[submitit.Job]) -> str:
    return " ".join(job.job_id for job in jobs)


def _log_tail(job: submitit.Job, lines: int = 20) -> str:
    path = job.task(0).paths.stderr
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def results_table(outcomes: Sequence[Outcome], names: Sequence[str]) -> str:
    """One markdown table over the jobs of an array: what differs, job, state, step, the last
    logged losses and accuracies, run dir."""
    keys = ("loss/mlm", "loss/sop", "accuracy/mlm", "accuracy/sop")
    header = ["run", "job", "state", "step", *keys, "run dir"]
    rows = [header, ["---"] * len(header)]
    for outcome, name in zip(outcomes, names):
        r = outcome.result or {}
        last = r.get("last") or {}
        rows.append(
            [
                name,
                outcome.job_id,
                outcome.state,
                str(r.get("step", "")),
                *(f"{last[k]:.4f}" if k in last else "" for k in keys),
                str(r.get("run_dir", "")),
            ]
        )
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)
