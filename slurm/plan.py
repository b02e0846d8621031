"""What ``python -m slurm`` submits, independent of how it was asked for: the stages, the
validated command line (``Spec``), its submissions (``Step``: one job or a job array) and how a
stage's arguments become them (the stage's own parser checks them now; ``--sweep`` -> an array
with a run dir each; sharded data prep -> an array + ``finalize``)."""

from __future__ import annotations

import importlib
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAGES = {"pretrain": "pretrain", "finetune": "finetune", "data-prep": "data_prep"}
"""CLI stage name -> the module that ``python -m`` runs."""
RUN_DIR_KEYS = {"pretrain": "train.run_dir"}
"""Stages whose runs live in a directory given by a dotted override (``--sweep`` needs one)."""


class UsageError(ValueError):
    """A mistake on the command line: printed, exit code 2, nothing submitted."""


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


def _check_pretrain_args(stage_args: list[str]) -> str:
    """Parses and validates the pretraining config now, so a typo fails here and not after
    hours in the queue. Returns the run directory."""
    from pretrain.__main__ import config_from_args, parse_args

    try:
        args = parse_args(stage_args)
    except SystemExit as e:  # argparse printed the message
        raise UsageError("the pretrain arguments after -- are invalid (see above)") from e
    try:
        cfg = config_from_args(args)
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


def plan_steps(stage: str, stage_args: list[str], sweep: Sequence[str] = ()) -> list[Step]:
    """The submissions: one job; a sweep array (``--sweep`` items); or a data-prep array +
    finalize."""
    if sweep and stage not in RUN_DIR_KEYS:
        raise UsageError(f"--sweep is supported for {sorted(RUN_DIR_KEYS)}, not {stage}")
    if stage == "data-prep":
        return _data_prep_steps(stage_args)
    if stage != "pretrain":
        _check_stage_args(stage, stage_args)
        return [Step(stage, [stage_args])]
    run_dir = _check_pretrain_args(stage_args)
    if not sweep:
        return [Step(stage, [stage_args])]
    combos = _parse_sweep(sweep)
    key = RUN_DIR_KEYS[stage]
    calls = [
        [*stage_args, *combo, f"{key}={run_dir}/{_sweep_tag(i, combo)}"]
        for i, combo in enumerate(combos)
    ]
    for call in calls:
        _check_pretrain_args(call)
    names = [" ".join(combo) for combo in combos]
    return [Step(f"{stage} sweep (array of {len(calls)})", calls, names)]


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


def _sweep_tag(index: int, combo: list[str]) -> str:
    """``3, ["optimizer.lr=1e-3", "train.seed=1"]`` -> ``003_lr=1e-3_seed=1``."""
    parts = []
    for override in combo:
        key, _, value = override.partition("=")
        parts.append(f"{key.rsplit('.', 1)[-1]}={value}")
    return f"{index:03d}_" + re.sub(r"[^A-Za-z0-9._=-]+", "-", "_".join(parts))
