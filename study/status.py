"""``study status``: every stage's state from its run directory's markers, the ledger and
Slurm (squeue, then sacct): done / running / pending / failed / stopped / not started; for a
failed stage, its log's last lines and the command that shows all of it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from study.graph import Graph, Node
from study.ledger import read_ledger

FAILED_SLURM = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "REVOKED", "SPECIAL_EXIT")  # fmt: skip


@dataclass
class StageState:
    node: Node
    state: str
    done: int
    total: int
    jobs: list[str] = field(default_factory=list)
    log: str = ""
    """The log of a failed element (a file path)."""
    why: str = ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _element_state(node: Node, entry: dict, states: dict[str, str]) -> tuple[str, str, str]:
    """(state, log, why) of an element that is not done, from its ledger entry."""
    if not entry:
        return "not started", "", ""
    if entry.get("executor") == "local":
        state = entry.get("state", "")
        if state == "running" and not _pid_alive(int(entry.get("pid", 0))):
            return "failed", entry.get("log", ""), "the process is gone"
        if state == "done":
            state = "failed"  # done by the ledger, but no marker: an older identity
        return state, entry.get("log", ""), entry.get("why", "")
    if entry.get("identity") != node.identity:
        return "not started", "", ""
    job = entry.get("job", "")
    state = states.get(job)
    if state is None:
        return "failed", entry.get("stderr", ""), f"job {job} unknown to Slurm"
    if state in ("PENDING",):
        return "pending", "", ""
    if state in FAILED_SLURM or state == "COMPLETED":
        why = f"job {job} {state}" + (" without marking it done" if state == "COMPLETED" else "")
        return "failed", entry.get("stderr", ""), why
    return "running", "", ""


PRIORITY = ("failed", "stopped", "running", "pending", "not started")


def stage_states(graph: Graph) -> list[StageState]:
    from study.slurm_exec import job_states, ledger_jobs

    ledger = read_ledger(graph.out)
    slurm = job_states(ledger_jobs(graph)) if ledger else {}
    out = []
    for node in graph.order():
        entries = ledger.get(node.id, {})
        states, jobs, log, why = [], [], "", ""
        done = 0
        for element in node.elements:
            if node.is_done(element.key):
                done += 1
                continue
            entry = entries.get(element.key) or entries.get("all") or {}
            state, elog, ewhy = _element_state(node, entry, slurm)
            states.append(state)
            if entry.get("job"):
                jobs.append(entry["job"])
            if state == "failed" and not log:
                log, why = elog, ewhy
        state = "done" if not states else next(s for s in PRIORITY if s in states)
        out.append(StageState(node, state, done, len(node.elements), jobs, log, why))
    return out


def tail(path: str, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


def format_status(graph: Graph, states: list[StageState]) -> str:
    rows = ["| stage | state | runs done | jobs | directory |", "|---|---|---|---|---|"]
    for s in states:
        jobs = ", ".join(s.jobs[:3]) + (" ..." if len(s.jobs) > 3 else "")
        where = os.path.relpath(s.node.dir, graph.out)
        rows.append(f"| {s.node.id} | {s.state} | {s.done}/{s.total} | {jobs} | {where} |")
    counts: dict[str, int] = {}
    for s in states:
        counts[s.state] = counts.get(s.state, 0) + 1
    text = "\n".join(rows) + "\n\n" + ", ".join(f"{n} {k}" for k, n in counts.items()) + "\n"
    for s in states:
        if s.state != "failed":
            continue
        text += f"\n{s.node.id} failed ({s.why}); the last lines of {s.log or 'its log'}:\n"
        text += tail(s.log) + "\n"
        if s.log:
            text += f"whole log: less {s.log}\n"
        if s.jobs:
            text += f"Slurm's record: sacct -j {s.jobs[0].split('_')[0]}\n"
    return text
