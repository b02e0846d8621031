"""The command line of ``python -m slurm``: the argparse parser, Slurm's ``--time`` syntax and
``make_spec``, which checks everything (usage errors: ``UsageError``) and returns the ``Spec``."""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm.plan import STAGES, Spec, UsageError, plan_steps

DEFAULT_TIME = "01:00:00"
DEFAULT_LOG_DIR = "runs/slurm"
OMP_SETUP = "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
"""torchrun sets OMP_NUM_THREADS for several processes per node; srun does not: without it
every task would start one thread per core of the node."""


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
        raise UsageError(
            "python -m finetune is not available in this installation (no finetune/__main__.py)"
        )
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
        steps=plan_steps(ns.stage, stage_args, ns.sweep),
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
