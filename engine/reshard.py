"""Resuming on another number of processes: what in a checkpoint depends on the world size, and
the conversion that removes that dependency.

What depends on the world size:

- ``backend="torch"``: nothing. ``engine.pt`` holds the full model and the full (replicated)
  optimizer state; it loads on any number of processes.
- ``backend="deepspeed"``, ZeRO-0 (any precision): nothing either. DeepSpeed keeps the whole
  optimizer state in ``mp_rank_00_model_states.pt``, written by rank 0 alone.
- ``backend="deepspeed"``, ZeRO 1-3 (and DeepSpeed's bf16 optimizer): the fp32 master weights
  and the optimizer moments are partitioned, one ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt``
  per data-parallel rank, each holding a flat slice of every parameter group (ZeRO-3: the
  model weights too). DeepSpeed refuses to load them on another world size ("The checkpoint
  being loaded used a DP world size of 2 but the current world size is 1 ...").

The conversion is DeepSpeed's own universal checkpoint (``deepspeed.checkpoint.ds_to_universal``,
loaded with the ``"checkpoint": {"load_universal": true}`` mode of ``load_checkpoint``): it
gathers every parameter's fp32 weights and optimizer moments (``exp_avg``, ``exp_avg_sq``,
``step``) out of the rank files into one file per parameter and state (``universal/zero/<param
name>/{fp32,exp_avg,exp_avg_sq,step}.pt``), plus the optimizer's global state (parameter
groups, loss scaler, clipping) and a copy of the model-state files (client state: the engine's
schedule and counters). Every rank of the new world size then takes its own slice from those
files. ``to_universal`` writes it into ``<checkpoint>/universal`` once and reuses it after;
``Engine.load`` calls it (on rank 0, the other ranks wait) when the checkpoint's world size
differs from the run's, so nothing needs to be done by hand. ``python -m engine.reshard
CHECKPOINT_DIR`` converts ahead of time, e.g. on a login node, with several worker processes.

Optimizer state: ``ds_to_universal`` carries ``exp_avg``, ``exp_avg_sq`` and ``step`` per
parameter, plus the parameter groups (``lr``, ``betas``, ``weight_decay``, ...): AdamW's state,
exactly. pytorch-optimizer's LAMB (``optimizer.implementation: torch``, the CPU one) keeps 0-dim
``weight_norm``/``adam_norm`` tensors per parameter and its step in the parameter group, which
DeepSpeed 0.19.8 cannot convert (ZeRO-1/2: ``RuntimeError: narrow() cannot be applied to a 0-dim
tensor`` in ``zero_checkpoint._strip_tensor_paddings``; ZeRO-3: ``KeyError: 'step'`` in the
load); ``to_universal`` refuses such a checkpoint before converting, naming the state, with
the way out: the world size it was saved with, or ZeRO-0 (which the LAMB recipes use anyway,
for an exact trust ratio), whose checkpoints need no conversion. Fused LAMB on CUDA (DeepSpeed
or apex) was not tried here.

Verified on CPU (DeepSpeed 0.19.8, gloo; ``tests/engine/test_elastic_resume.py``): ZeRO-1, ZeRO-2 and
ZeRO-3, fp32 and bf16, 2 -> 1 and 1 -> 2 processes. Cost: see ``bench/results`` and the report
in ``tests/engine/test_elastic_resume.py``; the conversion reads every rank file once and writes about
the same number of bytes again (the universal copy is as large as the optimizer state: 3 fp32
tensors per parameter).

The data loader's side (which samples come next on the new world size) is
``data_prep.loader.PretrainingLoader``'s global offset; the global batch stays the same with
``gradient_accumulation_for``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from albatross import compat
from engine.extensions import import_deepspeed

UNIVERSAL_DIR = "universal"
"""The sub-directory of a checkpoint that ``to_universal`` writes (and reuses once complete)."""
UNIVERSAL_RECORD = "albatross_universal.json"
"""Written last into a finished universal directory: its source world size and the time the
conversion took. A universal directory without it is incomplete and is rebuilt."""

_RANK_FILE = re.compile(r"(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt")
_OPTIMIZER_KEYS = frozenset({"exp_avg", "exp_avg_sq", "step"})
"""The per-parameter optimizer state ``ds_to_universal`` carries (besides the fp32 weights)."""


class ReshardError(ValueError):
    """A checkpoint that cannot be re-partitioned for another world size (names it and why). A
    ``ValueError``: the command-line tools exit 2, as for other unusable input."""


def gradient_accumulation_for(
    global_batch_size: int, micro_batch_size: int, world_size: int
) -> int:
    """The gradient accumulation that keeps ``global_batch_size`` (= micro-batch x accumulation x
    processes) on ``world_size`` processes with the same ``micro_batch_size``. Raises
    ``ValueError`` naming the world sizes that would work when there is none."""
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
        ("world_size", world_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid; valid: an integer >= 1")
    if global_batch_size % micro_batch_size:
        raise ValueError(
            f"the global batch {global_batch_size} is not a multiple of the micro-batch "
            f"{micro_batch_size}"
        )
    per_micro = global_batch_size // micro_batch_size  # = accumulation x processes
    if per_micro % world_size:
        valid = [w for w in range(1, per_micro + 1) if per_micro % w == 0]
        raise ValueError(
            f"{world_size} processes cannot keep the global batch of {global_batch_size} "
            f"sequences with micro-batches of {micro_batch_size}: the number of processes must "
            f"divide {per_micro} (global batch / micro-batch); valid: {valid}"
        )
    return per_micro // world_size


def saved_world_size(directory: str | os.PathLike[str]) -> int | None:
    """The number of data-parallel ranks whose partitions a DeepSpeed checkpoint directory
    holds (counted from its ``*zero_pp_rank_<r>_mp_rank_*_optim_states.pt`` files), or None when
    its state is not partitioned (ZeRO-0, ``backend="torch"``'s ``engine.pt``): such a
    checkpoint loads on any number of processes as it is."""
    ranks = {
        int(m.group(1))
        for path in Path(directory).iterdir()
        if (m := _RANK_FILE.fullmatch(path.name)) is not None
    }
    if not ranks:
        return None
    if ranks != set(range(len(ranks))):
        raise ReshardError(
            f"{directory}: ZeRO rank files for ranks {sorted(ranks)}: some are missing"
        )
    return len(ranks)


def needs_conversion(directory: str | os.PathLike[str], world_size: int) -> bool:
    """True when the checkpoint in ``directory`` is partitioned for another world size than
    ``world_size`` (a DeepSpeed ZeRO 1-3 checkpoint): ``to_universal`` first."""
    saved = saved_world_size(directory)
    return saved is not None and saved != world_size


def universal_path(directory: str | os.PathLike[str]) -> Path:
    """Where ``to_universal`` puts (and looks for) the universal form of ``directory``."""
    return Path(directory) / UNIVERSAL_DIR


def is_converted(universal: str | os.PathLike[str]) -> bool:
    """True when ``universal`` is a finished conversion (its record was written last)."""
    return (Path(universal) / UNIVERSAL_RECORD).is_file()


def read_record(universal: str | os.PathLike[str]) -> dict[str, Any]:
    """The record ``to_universal`` wrote into a finished universal directory."""
    return json.loads((Path(universal) / UNIVERSAL_RECORD).read_text(encoding="utf-8"))


def to_universal(
    directory: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    *,
    workers: int = 1,
    quiet: bool = True,
) -> Path:
    """Converts the DeepSpeed ZeRO checkpoint in ``directory`` (written by any number of
    processes) into DeepSpeed's universal checkpoint at ``output`` (default
    ``<directory>/universal``) and returns ``output``; a finished conversion there is reused.

    One process converts: in a multi-process job, rank 0 (``Engine.load`` does this). The
    conversion is written under a temporary name beside ``output`` and renamed when complete,
    so a conversion killed midway is never loaded (it is redone). ``workers`` > 1 extracts and
    merges with that many worker processes (DeepSpeed's ``ProcessPoolExecutor``, started with
    ``spawn``: each imports torch and DeepSpeed first, a few seconds); 1 works in this process
    (what ``Engine.load`` uses). ``quiet`` keeps DeepSpeed's prints and progress bars out of the output (they are
    in the error when the conversion fails). Raises ``ReshardError`` naming the directory and
    the reason for a checkpoint that is not a partitioned DeepSpeed checkpoint or that the
    conversion cannot carry over."""
    directory = Path(directory)
    output = universal_path(directory) if output is None else Path(output)
    if is_converted(output):
        return output
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} is invalid; valid: an integer >= 1")
    saved = check_convertible(directory)
    # ds_to_universal writes `latest_universal` into the parent of its output folder: give it
    # a private parent, renamed into place when done.
    scratch = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    staged = scratch / output.name
    args = argparse.Namespace(
        input_folder=str(directory),
        output_folder=str(staged),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # our modules carry no universal_checkpoint_info
    )
    log = io.StringIO()
    start = time.perf_counter()
    try:
        import_deepspeed()  # DeepSpeed without MLflow (engine/extensions.py)
        from deepspeed.checkpoint import ds_to_universal

        with contextlib.ExitStack() as stack:
            if quiet:
                stack.enter_context(contextlib.redirect_stdout(log))
                stack.enter_context(contextlib.redirect_stderr(log))
            if workers > 1:
                stack.enter_context(compat.spawned_process_pools(ds_to_universal))
            ds_to_universal.main(args)
    except Exception as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        tail = log.getvalue()[-2000:].strip()
        raise ReshardError(
            f"{directory}: DeepSpeed's universal-checkpoint conversion failed "
            f"({type(exc).__name__}: {exc})" + (f"; its output ended with:\n{tail}" if tail else "")
        ) from exc
    seconds = time.perf_counter() - start
    record = {
        "source_world_size": saved,
        "seconds": round(seconds, 3),
        "bytes": sum(p.stat().st_size for p in staged.rglob("*") if p.is_file()),
        "workers": workers,
    }
    (staged / UNIVERSAL_RECORD).write_text(json.dumps(record, indent=2))
    if not is_converted(output):  # else another process finished first: keep (and use) its
        if output.exists():  # not a finished conversion (they appear by rename, complete)
            shutil.rmtree(output)
        os.replace(staged, output)
    shutil.rmtree(scratch, ignore_errors=True)
    return output


def repair_zero3_load(ds_optimizer: Any, universal: str | os.PathLike[str]) -> None:
    """After DeepSpeed's universal load under ZeRO-3, undo two mistakes it makes (DeepSpeed
    0.19.8, ``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``;
    both fixes are harmless where it does not make them):

    - it gives every parameter group the hyperparameters of the first one (``param_groups[0]``),
      so the ``no_decay`` group (biases, LayerNorm) would be decayed with the ``decay`` group's
      ``weight_decay``: each group gets its own saved values back;
    - it puts one and the same ``step`` tensor into every flat partition's state, which torch's
      optimizers increment in place, once per partition: the step count (Adam's bias
      correction) would advance by the number of partitions per update: each state gets its
      own copy.
    """
    import torch

    path = Path(universal) / "zero" / "optimizer_state.pt"
    saved = torch.load(path, map_location="cpu", weights_only=False)
    groups = saved.get("param_groups") or saved.get("optimizer_state_dict", {}).get("param_groups")
    base = ds_optimizer.optimizer
    if not isinstance(groups, list) or len(groups) != len(base.param_groups):
        raise ReshardError(
            f"{path}: expected the {len(base.param_groups)} parameter groups of the optimizer, "
            f"found {len(groups) if isinstance(groups, list) else 'none'}"
        )
    for group, values in zip(base.param_groups, groups):
        for key, value in values.items():
            if key != "params":
                group[key] = value
    for state in base.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            state["step"] = step.clone()


def check_convertible(directory: str | os.PathLike[str]) -> int:
    """The world size a partitioned DeepSpeed checkpoint was saved with, after checking that
    ``to_universal`` can convert it (cheap: the first rank file's optimizer state is read
    memory-mapped). Raises ``ReshardError`` naming the directory and the reason otherwise: no
    ZeRO rank files (nothing to convert: it loads on any world size as it is), or optimizer
    state the universal checkpoint cannot carry. For start-up checks, before any work."""
    directory = Path(directory)
    saved = saved_world_size(directory)
    if saved is None:
        raise ReshardError(
            f"{directory}: no DeepSpeed ZeRO rank files (*zero_pp_rank_*_optim_states.pt): the "
            "state is not partitioned (ZeRO-0 or backend='torch') and loads on any number of "
            "processes without a conversion"
        )
    _check_optimizer_state(directory)
    return saved


def _check_optimizer_state(directory: Path) -> None:
    """Refuse, before converting, a checkpoint whose optimizer state DeepSpeed's conversion
    cannot carry: per parameter it takes ``exp_avg``, ``exp_avg_sq`` and (ZeRO-3: required)
    ``step``, nothing else. Other tensors would be lost, and 0-dim ones crash it (DeepSpeed
    0.19.8, measured with pytorch-optimizer's LAMB, which keeps ``weight_norm``/``adam_norm``
    tensors per parameter and its step in the parameter group: ZeRO-1/2 fail in
    ``zero_checkpoint._strip_tensor_paddings`` with "narrow() cannot be applied to a 0-dim
    tensor", ZeRO-3 in the load with ``KeyError: 'step'``)."""
    import torch

    first = min(
        (p for p in directory.iterdir() if _RANK_FILE.fullmatch(p.name)),
        key=lambda p: int(_RANK_FILE.fullmatch(p.name).group(1)),  # type: ignore[union-attr]
    )
    try:  # mmap: only the small optimizer-state dicts are read, not the flat tensors
        state = torch.load(first, map_location="cpu", weights_only=False, mmap=True)
    except Exception as exc:
        raise ReshardError(f"{first}: cannot be read ({type(exc).__name__}: {exc})") from exc
    optim = state.get("optimizer_state_dict", {}) if isinstance(state, dict) else {}
    stage3 = "fp32_flat_groups" in optim
    base = optim.get("optimizer_state_dict" if stage3 else "base_optimizer_state", {})
    per_param = base.get("state", {}) if isinstance(base, dict) else {}
    keys: set[str] = set()
    problems = []
    for value in per_param.values() if isinstance(per_param, dict) else []:
        if not isinstance(value, dict):
            continue
        keys |= {k for k, v in value.items() if isinstance(v, torch.Tensor)}
        missing = {"exp_avg", "exp_avg_sq"} - set(value)
        if missing:
            problems.append(f"it has no {sorted(missing)} (not an Adam-type optimizer)")
        if stage3 and "step" not in value:
            problems.append("ZeRO-3 needs a per-parameter 'step', which it does not keep")
    extra = sorted(keys - _OPTIMIZER_KEYS)
    if extra:
        problems.append(f"its per-parameter state {extra} would be lost or break the conversion")
    if problems:
        raise ReshardError(
            f"{directory}: DeepSpeed's universal checkpoint carries only exp_avg, exp_avg_sq and "
            "step per parameter (AdamW's state) and cannot re-partition this optimizer's: "
            + "; ".join(dict.fromkeys(problems))
            + f". Resume on the {saved_world_size(directory)} processes it was saved with, or "
            "train with ZeRO-0 (the LAMB recipes' setting), whose checkpoints load on any "
            "number of processes"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.reshard",
        description="Convert a DeepSpeed ZeRO checkpoint directory (e.g. run_dir/checkpoints/"
        "step_00001000) into DeepSpeed's universal checkpoint in its 'universal' sub-directory, "
        "so that a run can resume from it on another number of processes (the training run "
        "does this itself when needed; converting ahead of time saves that time).",
    )
    parser.add_argument("checkpoint", type=Path, help="the checkpoint directory")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    args = parser.parse_args(argv)
    try:
        out = to_universal(args.checkpoint, workers=args.workers, quiet=True)
    except (ReshardError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    record = read_record(out)
    print(
        f"{out}: universal checkpoint of {record['source_world_size']} rank(s), "
        f"{record['bytes'] / 2**20:.1f} MiB, converted in {record['seconds']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    from engine.process_exit import exit_process

    exit_process(main())
