"""Submission of a ``Spec``: the sbatch script submitit writes (``--dry-run``), the executor
and ``sbatch`` of every step (later steps ``afterok`` on the earlier), or the same run on this
machine (``--local``)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import submitit
from submitit.core.utils import FailedJobError, FailedSubmissionError

from slurm.job import StageJob
from slurm.plan import Spec, Step, UsageError


def submitit_command(folder: Path) -> str:
    """What submitit's sbatch script runs in each task (``SlurmExecutor._submitit_command_str``)."""
    return f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(str(folder))}"


def stage_command(spec: Spec, args: Sequence[str]) -> str:
    return shlex.join(["python", "-m", spec.module, *args])


def sbatch_text(spec: Spec, step: Step, dependency: str | None = None) -> str:
    """The sbatch script submitit writes for ``step`` (its own ``_make_sbatch_string``)."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = dict(spec.parameters)
    if dependency:
        params["dependency"] = dependency
    if len(step.calls) > 1:
        params["map_count"] = len(step.calls)
    folder = spec.log_dir.expanduser().absolute()
    return _make_sbatch_string(command=submitit_command(folder), folder=folder, **params)


def dry_run(spec: Spec) -> int:
    for n, step in enumerate(spec.steps):
        dependency = "afterok:PREVIOUS_JOB_ID" if step.after_previous else None
        print(f"# ---- {step.label}: sbatch script submitit would submit")
        print(sbatch_text(spec, step, dependency).rstrip())
        tasks = spec.nodes * spec.tasks_per_node
        who = "every one of the" if spec.stage != "data-prep" else "rank 0 of the"
        for i, call in enumerate(step.calls):
            where = f"array task {i}: " if len(step.calls) > 1 else ""
            print(f"# {where}{who} {tasks} task(s) runs, in-process: {stage_command(spec, call)}")
        if n + 1 < len(spec.steps):
            print()
    print("# dry run: nothing submitted")
    return 0


def local_commands(spec: Spec, args: Sequence[str]) -> list[str]:
    tasks = spec.tasks_per_node
    if spec.stage != "data-prep" and tasks > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={tasks}",
            "-m",
            spec.module,
            *args,
        ]
    return [sys.executable, "-m", spec.module, *args]


def run_local(spec: Spec) -> int:
    for step in spec.steps:
        for call in step.calls:
            cmd = local_commands(spec, call)
            print(f"python -m slurm: running here: {shlex.join(cmd)}", flush=True)
            code = subprocess.run(cmd).returncode
            if code:
                print(f"python -m slurm: {step.label} failed with status {code}", file=sys.stderr)
                return code
    return 0


def make_executor(spec: Spec, step: Step, dependency: str | None) -> submitit.SlurmExecutor:
    executor = submitit.SlurmExecutor(folder=spec.log_dir, max_num_timeout=spec.max_requeues)
    params = dict(spec.parameters)
    if dependency:
        params["dependency"] = dependency
    executor.update_parameters(**params)
    return executor


def submit(spec: Spec) -> list[list[submitit.Job]]:
    """Submits every step (later steps ``afterok`` on the earlier); returns their jobs."""
    inherited = [n for n in ("MASTER_ADDR", "MASTER_PORT") if os.environ.get(n)]
    if inherited and spec.stage != "data-prep":
        print(
            f"python -m slurm: warning: {' and '.join(inherited)} set here go to the job (sbatch "
            "exports this environment) and override the rendezvous address Slurm's node list "
            "gives; unset them unless that is what you want",
            file=sys.stderr,
        )
    submitted: list[list[submitit.Job]] = []
    for step in spec.steps:
        dependency = None
        if step.after_previous and submitted:
            array_ids = sorted({job.job_id.split("_")[0] for job in submitted[-1]})
            dependency = ",".join(f"afterok:{i}" for i in array_ids)
        executor = make_executor(spec, step, dependency)
        fns = [StageJob(spec.stage, call) for call in step.calls]
        try:
            jobs = [executor.submit(fns[0])] if len(fns) == 1 else executor.submit_array(fns)
        except (FailedJobError, FailedSubmissionError) as e:
            done = " ".join(job.job_id for jobs in submitted for job in jobs)
            also = f" (already submitted: {done}; scancel them if needed)" if done else ""
            raise UsageError(f"sbatch refused {step.label}: {e}{also}") from e
        submitted.append(jobs)
        _print_submitted(spec, step, jobs)
    return submitted


def _print_submitted(spec: Spec, step: Step, jobs: list[submitit.Job]) -> None:
    first = jobs[0]
    base = first.job_id.split("_")[0]
    tasks = spec.nodes * spec.tasks_per_node
    what = f"array {base} ({len(jobs)} jobs)" if len(jobs) > 1 else f"job {first.job_id}"
    print(f"submitted {step.label}: {what}, {spec.nodes} node(s) x {tasks // spec.nodes} task(s)")
    task0 = first.task(0)
    print(f"  logs:   {task0.paths.stdout} (rank 0; stderr: .err; other ranks: _<rank>_)")
    print(f"  follow: squeue -j {base}; tail -f {task0.paths.stdout}")
    print(f"  cancel: scancel {base}")
    sys.stdout.flush()
