"""The Slurm executor: one job per stage, a job array per fine-tuning grid (one element per
learning rate x seed), submitted through submitit and ordered by Slurm's own dependencies
(``--dependency=afterok:...``, ``--kill-on-invalid-dep=yes``: the dependents of a failed stage
are cancelled, none waits forever). No scheduler of our own: ``run`` submits and returns.

Each job runs its stage in-process in every Slurm task (``NodeJob``: ``slurm.job.StageJob``
for pretraining and fine-tuning, which hands preemption to submitit's checkpoint-and-requeue;
rank 0 alone for the single-process stages), then rank 0 marks the element done. Elements
whose job is still queued or running (``ledger.json`` + squeue/sacct) are not submitted again:
their jobs are what the new ones depend on.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import submitit
from submitit.core.utils import FailedJobError, FailedSubmissionError

from slurm.cli import OMP_SETUP, parse_time
from slurm.monitor import TERMINAL_STATES
from study.graph import Graph, Node, write_done, write_stage_files
from study.ledger import read_ledger, record
from study.settings import Settings

SIGNAL_DELAY_S = 120
"""Seconds between Slurm's warning signal (SIGUSR2) and the time limit: a checkpoint's time."""
MAX_REQUEUES = 10
STAGE_OF_MODULE = {"pretrain": "pretrain", "finetune": "finetune"}


class NodeJob(submitit.helpers.Checkpointable):
    """What every Slurm task of one element's job runs."""

    def __init__(self, node: Node, element: str, args: list[str]):
        self.module, self.args, self.element = node.module, list(args), element
        self.node = node

    def __repr__(self) -> str:
        return f"NodeJob({self.node.id}, {self.element})"

    def __call__(self) -> dict[str, Any]:
        from engine.distributed import detect

        rank = detect().rank
        if self.module in STAGE_OF_MODULE:
            from slurm.job import StageJob

            result = StageJob(STAGE_OF_MODULE[self.module], self.args)()  # raises on failure
            if result.get("state") != "completed":
                return result  # stopped: requeued by submitit, resumes from its checkpoint
        elif rank == 0:
            code = int(_module_main(self.module)(self.args) or 0)
            if code:
                raise RuntimeError(f"{self.node.id}: python -m {self.module} exited with {code}")
        if rank == 0:
            write_done(self.node, self.element, {"executor": "slurm",
                                                 "job": os.environ.get("SLURM_JOB_ID")})  # fmt: skip
        return {"state": "completed", "node": self.node.id, "element": self.element}


def _module_main(module: str):
    """``main(argv)`` of a single-process stage's module (``python -m <module>``)."""
    import importlib

    return importlib.import_module(module).main


def parameters(node: Node, settings: Settings, dependency: str | None) -> dict[str, Any]:
    r = node.resources
    params: dict[str, Any] = {
        "job_name": f"study-{node.id}",
        "nodes": r.nodes,
        "ntasks_per_node": r.tasks(),
        "cpus_per_task": r.cpus_per_task,
        "time": parse_time(r.time),
        "signal_delay_s": SIGNAL_DELAY_S,
        "setup": [OMP_SETUP],
        "additional_parameters": {"kill-on-invalid-dep": "yes", **settings.slurm.sbatch},
    }
    if r.gpus_per_node:
        params["gpus_per_node"] = r.gpus_per_node
    for key in ("partition", "account"):
        value = getattr(settings.slurm, key)
        if value:
            params[key] = value
    if dependency:
        params["dependency"] = dependency
    return params


ACTIVE = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED",
          "RESIZING", "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED", "STOPPED", "SIGNALING",
          "STAGE_OUT")  # fmt: skip


def job_states(ids) -> dict[str, str]:
    """Job id -> its state, for many jobs in two queries (the user's jobs from squeue, then sacct
    for the jobs squeue has forgotten); a job neither knows is absent. A pending job whose dependency can never be
    satisfied counts as CANCELLED (Slurm cancels it with --kill-on-invalid-dep)."""
    ids = sorted(set(ids))
    states: dict[str, str] = {}
    if not ids:
        return states
    import getpass

    wanted = set(ids)  # the user's jobs, array elements one by one (-r); squeue -j fails whole
    for line in _lines(["squeue", "-h", "-r", "-t", "all", "-u", getpass.getuser(),
                        "-o", "%i|%T|%r"]):  # fmt: skip
        job, state, reason = [*line.split("|"), "", ""][:3]
        if job in wanted:
            states[job] = "CANCELLED" if reason.startswith("DependencyNeverSatisfied") else state
    rest = [i for i in ids if i not in states]
    if rest:
        for line in _lines(["sacct", "-n", "-X", "-P", "-j", ",".join(rest), "-o", "JobID,State"]):
            job, _, state = line.partition("|")
            if job in rest and state:
                states.setdefault(job, state.split()[0])
    return states


def _lines(cmd: list[str]) -> list[str]:
    import subprocess

    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return []
    return proc.stdout.strip().splitlines() if proc.returncode == 0 else []


def job_state(job_id: str) -> str | None:
    return job_states([job_id]).get(job_id)


def active_jobs(graph: Graph, node: Node, states: dict[str, str]) -> dict[str, str]:
    """Element -> the job id of a queued or running job that runs it (from the ledger)."""
    out = {}
    for element, entry in read_ledger(graph.out).get(node.id, {}).items():
        job = entry.get("job")
        if entry.get("executor") != "slurm" or not job or entry.get("identity") != node.identity:
            continue
        state = states.get(job)
        if state is not None and state not in TERMINAL_STATES and state in ACTIVE:
            out[element] = job
    return out


def ledger_jobs(graph: Graph) -> list[str]:
    """Every Slurm job the study's ledger names."""
    return [e["job"] for entries in read_ledger(graph.out).values() for e in entries.values()
            if e.get("executor") == "slurm" and e.get("job")]  # fmt: skip


def submit_nodes(graph: Graph, nodes: list[Node], settings: Settings) -> dict[str, list[str]]:
    """Submits every missing element of ``nodes`` (in graph order) that no live job runs;
    returns node id -> its jobs (new and live ones). Raises ``RuntimeError`` when sbatch
    refuses a job, naming what was submitted before it."""
    jobs: dict[str, list[str]] = {}
    folder = graph.out / "slurm"
    submitted: list[str] = []
    states = job_states(ledger_jobs(graph))
    for node in nodes:
        live = active_jobs(graph, node, states)
        missing = [e for e in node.missing() if e.key not in live]
        deps = sorted({j.split("_")[0] for d in node.deps for j in jobs.get(d, [])})
        jobs[node.id] = sorted(set(live.values()))
        if not missing:
            continue
        write_stage_files(graph, [node])
        node.run_dir.parent.mkdir(parents=True, exist_ok=True)
        dependency = "afterok:" + ":".join(deps) if deps else None
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=MAX_REQUEUES)
        executor.update_parameters(**parameters(node, settings, dependency))
        fns = [NodeJob(node, e.key, e.args) for e in missing]
        try:
            new = [executor.submit(fns[0])] if len(fns) == 1 else executor.submit_array(fns)
        except (FailedJobError, FailedSubmissionError) as e:
            before = f" (submitted before it: {' '.join(submitted)})" if submitted else ""
            raise RuntimeError(f"sbatch refused {node.id}: {e}{before}") from e
        for element, job in zip(missing, new):
            record(graph.out, node.id, element.key, {"executor": "slurm", "job": job.job_id,
                                                     "identity": node.identity,
                                                     "stdout": str(job.paths.stdout),
                                                     "stderr": str(job.paths.stderr)})  # fmt: skip
        ids = [job.job_id for job in new]
        submitted += ids
        jobs[node.id] += ids
        base = ids[0].split("_")[0]
        what = f"array {base} ({len(ids)} jobs)" if len(ids) > 1 else f"job {base}"
        after = f", after {dependency[len('afterok:') :]}" if dependency else ""
        print(f"study: {node.id}: {what}{after}", flush=True)
    if submitted:
        print(f"study: {len(submitted)} job(s) submitted; follow them with `study status` or "
              f"sacct -j {','.join(sorted({j.split('_')[0] for j in submitted}))}",
              file=sys.stdout, flush=True)  # fmt: skip
    return jobs
