"""The job: ``StageJob``, the callable submitit pickles and every Slurm task runs (``python -m
<stage> ARGS`` in-process), and the hand-over to submitit's checkpoint-and-requeue handler after
the stage stopped on a signal (the protocol: ``slurm/launcher.py``)."""

from __future__ import annotations

import importlib
import os
import shlex
import signal
from collections.abc import Callable, Sequence
from typing import Any

import submitit

from slurm.monitor import squeue_state
from slurm.plan import STAGES

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
        from pretrain.__main__ import config_from_args, parse_args
        from pretrain.train import run

        args = parse_args(self.args)
        cfg = config_from_args(args)
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
