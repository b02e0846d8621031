"""``python -m slurm STAGE [options] -- STAGE_ARGS``: submit a stage to Slurm with submitit.

    python -m slurm pretrain --nodes 2 --gpus-per-node 8 --partition gpu --time 1-00:00:00 \\
        -- --config configs/pretrain/albert-base.yaml
    python -m slurm data-prep -- shards --input corpus/*.jsonl --tokenizer tok/tokenizer.json \\
        --out shards --num-shards 64 --num-jobs 8      # an array of 8 jobs + a finalize job
    python -m slurm pretrain --gpus-per-node 0 --tasks-per-node 2 --local -- --config ...
    python -m slurm pretrain ... --dry-run             # print the sbatch script, submit nothing

Everything after ``--`` is what ``python -m <stage>`` takes. The job runs the stage in-process in
each Slurm task (one task per GPU, ``engine.distributed`` reads the rank from ``SLURM_PROCID``).

Preemption and time limits (submitit's checkpoint protocol). The sbatch script asks Slurm for
``SIGUSR2`` ``--signal-delay`` seconds before the time limit; a preempting admin or a test sends
the same signal (``scancel --signal=USR2 JOBID``). submitit's own ``SIGUSR2`` handler would call
``checkpoint()`` from inside the signal handler, i.e. in the middle of a training step; so while
the trainer runs, its ``StopWatch`` owns the signal: every rank finishes the step, all ranks
save a checkpoint together and the trainer returns ``"stopped"`` (fine-tuning: ``python -m
finetune`` returns 75) and restores submitit's handler. Then global rank 0 raises ``SIGUSR2`` again in its own process: submitit's handler now
runs at a safe point, calls ``StageJob.checkpoint()`` (the same call again), requeues the job
and exits; the requeued job resumes from the run directory's ``latest`` checkpoint. A job that
Slurm is already ending (``scancel``, a reached time limit) is not requeued: its checkpoint is
there to resume with the same command.

Slurm holds a requeued job (``Reason=BeginTime``) until the old job credential has expired:
``AuthInfo=cred_expire`` seconds, 120 by default (the local test cluster uses 10).

Job arrays: ``data-prep -- shards ... --num-jobs K`` (no ``--job-index``) becomes an array of K
jobs and a ``finalize`` job that runs after all succeeded; ``--sweep key=v1,v2`` (pretrain)
becomes an array over the product of the values, each run in ``<train.run_dir>/<NNN_key=v>``,
and ``--wait`` gathers their last logged losses into one table (``<log-dir>/<id>_results.md``).
``--local`` runs the same on this machine: ``torchrun --standalone`` for several tasks, arrays
one element after the other.

Exit codes: 0 submitted (``--wait``: completed), 1 the job failed or stopped, 2 a usage error
(nothing was submitted).

The modules: ``cli`` (the parser, ``--time``, ``make_spec``) -> ``plan`` (``Spec``, ``Step``,
arrays and sweeps, ``UsageError``); ``submit`` (sbatch script, executor, ``--dry-run``,
``--local``) -> ``plan``, ``job`` (``StageJob``, the requeue hand-over) -> ``plan``, ``monitor``
(squeue/sacct, ``Outcome``, ``wait_for``, the results table; imports no other part). This
module's ``main`` ties them together; ``python -m slurm`` runs it.
"""

from __future__ import annotations

import json
import shutil
import sys

from slurm.cli import make_spec

# Jobs pickled before StageJob moved to slurm.job name it slurm.launcher.StageJob: still loads.
from slurm.job import StageJob  # noqa: F401
from slurm.monitor import results_table, wait_for
from slurm.plan import Spec, UsageError
from slurm.submit import dry_run, run_local, submit


def submit_and_wait(spec: Spec, wait: bool, timeout: float | None) -> int:
    submitted = submit(spec)
    if not wait:
        return 0
    status = 0
    for step, jobs in zip(spec.steps, submitted):
        outcomes = wait_for(jobs, timeout=timeout)
        for outcome in outcomes:
            r = outcome.result or {}
            if outcome.ok:
                last = r.get("last") or {}
                loss = f", loss/mlm {last['loss/mlm']:.4f}" if "loss/mlm" in last else ""
                where = f" at step {r['step']}" if "step" in r else ""
                print(f"{step.label} job {outcome.job_id}: completed{where}{loss}")
            else:
                status = 1
                detail = r.get("reason") or outcome.error
                print(f"{step.label} job {outcome.job_id}: {outcome.state}\n{detail}".rstrip())
        if step.names:
            table = results_table(outcomes, step.names)
            print(table)
            base = jobs[0].job_id.split("_")[0]
            path = spec.log_dir / f"{base}_results.md"
            path.write_text(table + "\n")
            (spec.log_dir / f"{base}_results.json").write_text(
                json.dumps([o.__dict__ for o in outcomes], indent=2, default=str) + "\n"
            )
            print(f"results table: {path}")
        if status:
            break
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        spec = make_spec(argv)
    except UsageError as e:
        print(f"python -m slurm: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help (0) or a usage error it printed (2)
        return e.code if isinstance(e.code, int) else 2
    if spec.dry_run:
        return dry_run(spec)
    if spec.local:
        return run_local(spec)
    missing = [b for b in ("sbatch", "srun") if shutil.which(b) is None]
    if missing:
        print(
            f"python -m slurm: error: {' and '.join(missing)} not found: this machine is not a "
            "Slurm submit host; use --local to run here or --dry-run to see the job",
            file=sys.stderr,
        )
        return 2
    try:
        return submit_and_wait(spec, spec.wait, spec.wait_timeout)
    except UsageError as e:
        print(f"python -m slurm: error: {e}", file=sys.stderr)
        return 2
    except TimeoutError as e:
        print(f"python -m slurm: {e}", file=sys.stderr)
        return 1
