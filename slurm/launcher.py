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
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError, FailedSubmissionError

STAGES = {"pretrain": "pretrain", "finetune": "finetune", "data-prep": "data_prep"}
"""CLI stage name -> the module that ``python -m`` runs."""

DEFAULT_TIME = "01:00:00"
DEFAULT_LOG_DIR = "runs/slurm"
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
OMP_SETUP = "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
"""torchrun sets OMP_NUM_THREADS for several processes per node; srun does not: without it
every task would start one thread per core of the node."""
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "CROSS_RANK",
)
"""Set by torchrun / DeepSpeed's launcher; ``engine.distributed.detect`` prefers them to Slurm's."""
RUN_DIR_KEYS = {"pretrain": "train.run_dir"}
"""Stages whose runs live in a directory given by a dotted override (``--sweep`` needs one)."""


class UsageError(ValueError):
    """A mistake on the command line: printed, exit code 2, nothing submitted."""


# ---------------------------------------------------------------------------- parsing


def parse_time(text: str) -> int:
    """Slurm's ``--time`` syntax -> whole minutes (rounded up): ``MM``, ``MM:SS``, ``HH:MM:SS``,
    ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``. Raises ``UsageError`` on anything else or zero."""
    s = text.strip()
    days, hours, minutes, seconds = 0, 0, 0, 0
    m = re.fullmatch(r"(\d+)-(\d+)(?::(\d+))?(?::(\d+))?", s)
    if m:
        days, hours = int(m.group(1)), int(m.group(2))
        minutes, seconds = int(m.group(3) or 0), int(m.group(4) or 0)
        bad = hours >= 24 or minutes >= 60 or seconds >= 60
    else:
        parts = s.split(":")
        if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
            bad = True
        else:
            values = [int(p) for p in parts]
            if len(values) == 1:
                (minutes,) = values
            elif len(values) == 2:
                minutes, seconds = values
            else:
                hours, minutes, seconds = values
            bad = seconds >= 60 or (len(values) == 3 and minutes >= 60)
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if bad or total <= 0:
        raise UsageError(
            f"--time {text!r} is not a Slurm time limit > 0; use minutes, MM:SS, HH:MM:SS, "
            "D-HH, D-HH:MM or D-HH:MM:SS (e.g. 90, 04:00:00, 2-00:00:00)"
        )
    return math.ceil(total / 60)


def _parse_sbatch_extra(items: Sequence[str]) -> dict[str, Any]:
    """``--sbatch KEY=VALUE`` / ``--sbatch FLAG`` -> submitit's ``additional_parameters``."""
    extra: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not key:
            raise UsageError(f"--sbatch {item!r}: expected KEY=VALUE or FLAG (e.g. mail-type=END)")
        extra[key] = value if sep else True
    return extra


def _parse_sweep(items: Sequence[str]) -> list[list[str]]:
    """``--sweep KEY=V1,V2`` (repeatable) -> the cartesian product as override lists."""
    axes: list[list[str]] = []
    for item in items:
        key, sep, values = item.partition("=")
        choices = [v for v in values.split(",") if v]
        if not sep or not key.strip() or not choices:
            raise UsageError(f"--sweep {item!r}: expected dotted.key=V1,V2,... (e.g. lr=1e-3,3e-3)")
        axes.append([f"{key.strip()}={v}" for v in choices])
    return [list(combo) for combo in itertools.product(*axes)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m slurm",
        usage="python -m slurm {pretrain,finetune,data-prep} [options] -- STAGE_ARGS",
        description="Submit an albatross stage to Slurm through submitit (one task per GPU, "
        "preemption -> checkpoint -> requeue), or run it here with --local.",
        epilog="Everything after `--` goes to `python -m <stage>` unchanged. "
        "See slurm/launcher.py for the preemption protocol.",
    )
    p.add_argument("stage", choices=list(STAGES), help="the stage to run")
    res = p.add_argument_group("resources")
    res.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes (default 1)")
    res.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        metavar="G",
        help="GPUs per node; one task per GPU. Required for pretrain/finetune (0: CPU job)",
    )
    res.add_argument(
        "--tasks-per-node",
        type=int,
        default=None,
        metavar="T",
        help="tasks per node when --gpus-per-node is 0 (default 1); with GPUs it equals them",
    )
    res.add_argument("--cpus-per-task", type=int, default=None, metavar="C", help="CPUs per task")
    res.add_argument(
        "--mem", default=None, metavar="MEM", help="memory per node, Slurm syntax (e.g. 64G)"
    )
    res.add_argument(
        "--time",
        default=DEFAULT_TIME,
        metavar="TIME",
        help=f"time limit, Slurm syntax: minutes, HH:MM:SS, D-HH:MM:SS (default {DEFAULT_TIME})",
    )
    res.add_argument("--partition", default=None, metavar="NAME")
    res.add_argument("--account", default=None, metavar="NAME")
    res.add_argument("--qos", default=None, metavar="NAME")
    res.add_argument(
        "--constraint", default=None, metavar="FEATURES", help="node features (e.g. a100)"
    )
    job = p.add_argument_group("job")
    job.add_argument("--job-name", default=None, metavar="NAME", help="default albatross-<stage>")
    job.add_argument(
        "--log-dir",
        default=DEFAULT_LOG_DIR,
        metavar="DIR",
        help=f"submitit folder: sbatch scripts, pickles, per-task logs (default {DEFAULT_LOG_DIR})",
    )
    job.add_argument(
        "--signal-delay",
        type=int,
        default=120,
        metavar="S",
        help="seconds before the time limit that SIGUSR2 arrives (checkpoint+requeue; default 120)",
    )
    job.add_argument(
        "--max-requeues",
        type=int,
        default=10,
        metavar="K",
        help="how many time-limit requeues a job may use (preemptions do not count; default 10)",
    )
    job.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="LINE",
        help="shell line run in the sbatch script before the tasks (repeatable), "
        "e.g. 'module load cuda/12.4'",
    )
    job.add_argument(
        "--dependency", default=None, metavar="DEP", help="Slurm dependency, e.g. afterok:1234"
    )
    job.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other #SBATCH option (repeatable), e.g. mail-type=END or exclusive",
    )
    job.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="pretrain: a job array over the product of these override values, one run dir "
        "each; --wait gathers the results into one table (repeatable)",
    )
    job.add_argument(
        "--max-parallel",
        type=int,
        default=None,
        metavar="N",
        help="array jobs running at once (%%N)",
    )
    mode = p.add_argument_group("mode")
    how = mode.add_mutually_exclusive_group()
    how.add_argument("--dry-run", action="store_true", help="print the job(s), submit nothing")
    how.add_argument("--local", action="store_true", help="run on this machine without Slurm")
    mode.add_argument("--wait", action="store_true", help="wait for the end and print the result")
    mode.add_argument(
        "--wait-timeout", type=float, default=None, metavar="S", help="seconds --wait waits at most"
    )
    return p


# ---------------------------------------------------------------------------- the plan


@dataclass
class Step:
    """One sbatch submission: a plain job (one call) or a job array (several calls)."""

    label: str
    calls: list[list[str]]
    """The stage arguments of each array element."""
    names: list[str] | None = None
    """What tells the array elements apart (a sweep's overrides), for the results table."""
    after_previous: bool = False
    """Start only after the previous step's jobs all succeeded (``afterok``)."""


@dataclass
class Spec:
    """A validated command line."""

    stage: str
    stage_args: list[str]
    nodes: int
    gpus_per_node: int
    tasks_per_node: int
    time_min: int
    parameters: dict[str, Any]
    """SlurmExecutor parameters shared by every step."""
    log_dir: Path
    max_requeues: int
    steps: list[Step] = field(default_factory=list)
    dry_run: bool = False
    local: bool = False
    wait: bool = False
    wait_timeout: float | None = None

    @property
    def module(self) -> str:
        return STAGES[self.stage]


def _split_argv(argv: list[str]) -> tuple[list[str], list[str] | None]:
    if "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def finetune_available() -> bool:
    spec = importlib.util.find_spec("finetune")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(d) / "__main__.py").is_file() for d in spec.submodule_search_locations)


def _check_pretrain_args(stage_args: list[str]) -> str:
    """Parses and validates the pretraining config now, so a typo fails here and not after
    hours in the queue. Returns the run directory."""
    from engine.recipe import load_recipe
    from pretrain.__main__ import parse_args
    from pretrain.config import pretrain_config

    try:
        args = parse_args(stage_args)
    except SystemExit as e:  # argparse printed the message
        raise UsageError("the pretrain arguments after -- are invalid (see above)") from e
    try:
        cfg = pretrain_config(load_recipe(args.config, args.overrides))
    except (ValueError, OSError) as e:
        raise UsageError(f"pretrain config error: {e}") from e
    return cfg.train.run_dir


def _check_stage_args(stage: str, stage_args: list[str]) -> None:
    """Parses the arguments with the stage's own parser (when it exposes ``build_parser``)."""
    module = importlib.import_module(STAGES[stage] + ".__main__")
    if hasattr(module, "build_parser"):
        try:
            module.build_parser().parse_args(stage_args)
        except SystemExit as e:
            raise UsageError(f"the {stage} arguments after -- are invalid (see above)") from e


def _data_prep_steps(stage_args: list[str]) -> list[Step]:
    """``shards --num-jobs k`` (without ``--job-index``): an array of k jobs, then ``finalize``."""
    from data_prep.__main__ import build_parser as data_prep_parser

    try:
        args = data_prep_parser().parse_args(stage_args)
    except SystemExit as e:
        raise UsageError("the data-prep arguments after -- are invalid (see above)") from e
    explicit_index = any(a == "--job-index" or a.startswith("--job-index=") for a in stage_args)
    if args.command == "shards" and args.num_jobs > 1 and not explicit_index:
        k = args.num_jobs
        calls = [[*stage_args, "--job-index", str(i)] for i in range(k)]
        return [
            Step(f"data-prep shards (array of {k})", calls),
            Step("data-prep finalize", [["finalize", "--out", args.out]], after_previous=True),
        ]
    return [Step(f"data-prep {args.command}", [stage_args])]


def make_spec(argv: list[str]) -> Spec:
    """Parses and checks the command line (``UsageError`` for mistakes; argparse's own errors
    exit with 2 through ``SystemExit``)."""
    ours, stage_args = _split_argv(argv)
    ns = build_parser().parse_args(ours)
    if not stage_args:
        raise UsageError(
            f"give the stage's own arguments after `--`, e.g. python -m slurm {ns.stage} "
            "--gpus-per-node 8 -- --config configs/pretrain/debug.yaml"
        )
    if ns.stage == "finetune" and not finetune_available():
        raise UsageError("python -m finetune is not available yet (issue #6)")
    nodes, gpus, tasks = _layout(ns)
    time_min = _check_limits(ns)
    parameters: dict[str, Any] = {
        "job_name": ns.job_name or f"albatross-{ns.stage}",
        "nodes": nodes,
        "ntasks_per_node": tasks,
        "time": time_min,
        "signal_delay_s": ns.signal_delay,
        "setup": [OMP_SETUP, *ns.setup],
    }
    optional = {
        "gpus_per_node": gpus or None,
        "cpus_per_task": ns.cpus_per_task,
        "mem": ns.mem,
        "partition": ns.partition,
        "account": ns.account,
        "qos": ns.qos,
        "constraint": ns.constraint,
        "dependency": ns.dependency,
        "array_parallelism": ns.max_parallel,
        "additional_parameters": _parse_sbatch_extra(ns.sbatch) or None,
    }
    parameters.update({k: v for k, v in optional.items() if v is not None})
    return Spec(
        stage=ns.stage,
        stage_args=stage_args,
        nodes=nodes,
        gpus_per_node=gpus,
        tasks_per_node=tasks,
        time_min=time_min,
        parameters=parameters,
        log_dir=Path(ns.log_dir),
        max_requeues=ns.max_requeues,
        steps=_plan(ns, stage_args),
        dry_run=ns.dry_run,
        local=ns.local,
        wait=ns.wait,
        wait_timeout=ns.wait_timeout,
    )


def _layout(ns: argparse.Namespace) -> tuple[int, int, int]:
    """(nodes, GPUs per node, tasks per node): one task per GPU; data prep is one task."""
    if ns.nodes < 1:
        raise UsageError(f"--nodes must be >= 1, got {ns.nodes}")
    if ns.local and ns.nodes != 1:
        raise UsageError("--local runs on this machine only: --nodes must be 1")
    gpus = ns.gpus_per_node
    if gpus is None:
        if ns.stage != "data-prep":
            raise UsageError(
                f"--gpus-per-node is required for {ns.stage} (one task per GPU; 0 for a CPU job)"
            )
        gpus = 0
    if gpus < 0:
        raise UsageError(f"--gpus-per-node must be >= 0, got {gpus}")
    if gpus > 0 and ns.tasks_per_node not in (None, gpus):
        raise UsageError(
            f"one task per GPU: --tasks-per-node {ns.tasks_per_node} differs from "
            f"--gpus-per-node {gpus}; leave --tasks-per-node out"
        )
    tasks = gpus or (1 if ns.tasks_per_node is None else ns.tasks_per_node)
    if tasks < 1:
        raise UsageError(f"--tasks-per-node must be >= 1, got {tasks}")
    if ns.stage == "data-prep" and (tasks > 1 or ns.nodes > 1):
        print(
            "python -m slurm: warning: data-prep runs as one task on one node; split the work "
            "with `shards --num-jobs K` (a job array) instead",
            file=sys.stderr,
        )
        return 1, gpus, 1
    return ns.nodes, gpus, tasks


def _check_limits(ns: argparse.Namespace) -> int:
    """Checks the numeric options; returns the time limit in minutes."""
    time_min = parse_time(ns.time)
    if not 0 <= ns.signal_delay <= 65535:
        raise UsageError(f"--signal-delay must be in [0, 65535] seconds, got {ns.signal_delay}")
    if ns.signal_delay >= time_min * 60:
        raise UsageError(
            f"--signal-delay {ns.signal_delay} s leaves no time to run within --time {ns.time}"
        )
    for name in ("cpus_per_task", "max_parallel"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if ns.max_requeues < 0:
        raise UsageError(f"--max-requeues must be >= 0, got {ns.max_requeues}")
    return time_min


def _plan(ns: argparse.Namespace, stage_args: list[str]) -> list[Step]:
    """The submissions: one job; a sweep array; or a data-prep array + finalize."""
    if ns.sweep and ns.stage not in RUN_DIR_KEYS:
        raise UsageError(f"--sweep is supported for {sorted(RUN_DIR_KEYS)}, not {ns.stage}")
    if ns.stage == "data-prep":
        return _data_prep_steps(stage_args)
    if ns.stage != "pretrain":
        _check_stage_args(ns.stage, stage_args)
        return [Step(ns.stage, [stage_args])]
    run_dir = _check_pretrain_args(stage_args)
    if not ns.sweep:
        return [Step(ns.stage, [stage_args])]
    combos = _parse_sweep(ns.sweep)
    key = RUN_DIR_KEYS[ns.stage]
    calls = [
        [*stage_args, *combo, f"{key}={run_dir}/{_sweep_tag(i, combo)}"]
        for i, combo in enumerate(combos)
    ]
    for call in calls:
        _check_pretrain_args(call)
    names = [" ".join(combo) for combo in combos]
    return [Step(f"{ns.stage} sweep (array of {len(calls)})", calls, names)]


def _sweep_tag(index: int, combo: list[str]) -> str:
    """``3, ["optimizer.lr=1e-3", "train.seed=1"]`` -> ``003_lr=1e-3_seed=1``."""
    parts = []
    for override in combo:
        key, _, value = override.partition("=")
        parts.append(f"{key.rsplit('.', 1)[-1]}={value}")
    return f"{index:03d}_" + re.sub(r"[^A-Za-z0-9._=-]+", "-", "_".join(parts))


# ---------------------------------------------------------------------------- the job


class StageJob(submitit.helpers.Checkpointable):
    """The callable every Slurm task of the job runs: ``python -m <stage> ARGS`` in-process.

    ``checkpoint()`` (inherited) returns the same call, so a requeued job runs it again; the
    stage resumes by itself (pretrain: the run dir's ``latest`` checkpoint; finetune: the
    stopped run's checkpoint, finished runs of a sweep skipped; data-prep shards: shards
    already done are verified and skipped).
    """

    def __init__(self, stage: str, args: Sequence[str]):
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; valid: {sorted(STAGES)}")
        self.stage = stage
        self.args = list(args)

    def __repr__(self) -> str:
        return f"StageJob({self.stage!r}, {self.args!r})"

    def __call__(self) -> dict[str, Any]:
        if os.environ.get("SLURM_PROCID"):
            # sbatch exports the submitter's environment; torchrun variables from there (a
            # shell inside torchrun, an earlier in-process run) would override SLURM_PROCID.
            for name in TORCHRUN_VARIABLES:
                os.environ.pop(name, None)
        runner: Callable[[], dict[str, Any]] = {
            "pretrain": self._pretrain,
            "finetune": self._module_main,
            "data-prep": self._data_prep,
        }[self.stage]
        return runner()

    def _pretrain(self) -> dict[str, Any]:
        from engine.distributed import detect
        from engine.recipe import load_recipe
        from pretrain.__main__ import parse_args
        from pretrain.config import pretrain_config
        from pretrain.train import run

        args = parse_args(self.args)
        cfg = pretrain_config(load_recipe(args.config, args.overrides))
        rank = detect().rank
        handler = signal.getsignal(signal.SIGUSR2)  # submitit's checkpoint-and-requeue handler
        result = run(cfg)  # the trainer's StopWatch owns SIGUSR2 while it runs
        if signal.getsignal(signal.SIGUSR2) is not handler:
            signal.signal(signal.SIGUSR2, handler)  # someone did not restore it: do it here
        out = {
            "stage": self.stage,
            "state": result.state,
            "reason": result.reason,
            "step": result.step,
            "run_dir": str(result.run_dir),
            "last": dict(result.last_losses),
            "rank": rank,
        }
        if result.state == "stopped" and result.reason.startswith("signal") and rank == 0:
            request_requeue(handler)
        return out

    def _data_prep(self) -> dict[str, Any]:
        from engine.distributed import detect

        rank = detect().rank
        if rank == 0:
            from data_prep.__main__ import main as data_prep_main

            _check_exit(data_prep_main(self.args), "data_prep", self.args)
        return {"stage": self.stage, "state": "completed", "args": self.args, "rank": rank}

    def _module_main(self) -> dict[str, Any]:
        from finetune.trainer import EXIT_STOPPED

        module = importlib.import_module(STAGES[self.stage] + ".__main__")
        handler = signal.getsignal(signal.SIGUSR2)  # submitit's checkpoint-and-requeue handler
        code = module.main(self.args)  # fine-tuning's StopWatch owns SIGUSR2 while it trains
        if signal.getsignal(signal.SIGUSR2) is not handler:
            signal.signal(signal.SIGUSR2, handler)
        if code == EXIT_STOPPED:  # a checkpoint was saved; the requeued job resumes from it
            from engine.distributed import detect

            if detect().rank == 0:
                request_requeue(handler)
            return {"stage": self.stage, "state": "stopped", "args": self.args}
        _check_exit(code, STAGES[self.stage], self.args)
        return {"stage": self.stage, "state": "completed", "args": self.args}


def _check_exit(code: int | None, module: str, args: list[str]) -> None:
    if code:
        raise RuntimeError(f"python -m {module} {shlex.join(args)} exited with status {code}")


def request_requeue(handler: Any) -> None:
    """Rank 0, after the trainer stopped on a signal and saved a checkpoint: hand over to
    submitit's ``SIGUSR2`` handler (checkpoint() + ``scontrol requeue`` + exit), now that no
    step is in flight. Nothing happens outside a submitit job or when Slurm is ending the job
    anyway (``scancel``: requeueing it would undo the cancel)."""
    if not callable(handler):
        print("slurm: not a submitit job; not requeueing (re-run to resume)", flush=True)
        return
    state = _own_job_state()
    if state not in (None, "RUNNING"):
        print(f"slurm: job is {state}; not requeueing (the checkpoint is saved)", flush=True)
        return
    print("slurm: checkpoint saved; requeueing through submitit", flush=True)
    signal.raise_signal(signal.SIGUSR2)  # the handler runs before this returns


def _own_job_state() -> str | None:
    """This job's state as squeue sees it, or None when it cannot tell."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if not job_id:
        return None
    found = squeue_state(job_id)
    return None if found is None else found[0]


# ---------------------------------------------------------------------------- Slurm queries


def squeue_state(job_id: str) -> tuple[str, str] | None:
    """(state, reason) of a job from ``squeue`` (finished jobs too, while Slurm keeps them) or,
    failing that, ``sacct``; None when neither knows it."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc = subprocess.run(
            ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%r"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        line = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and line:
            state, _, reason = line[0].partition("|")
            return state.strip(), reason.strip()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        line = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and line:
            return line[0].split()[0], ""
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


# ---------------------------------------------------------------------------- the modes


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
