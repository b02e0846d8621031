"""The engine's state on disk: the consolidated weights, ``engine.pt`` (model, optimizer, scaler
and the engine's own counters; loaded with ``weights_only``), the layout recorded with it, and
loading on another number of processes (DeepSpeed universal checkpoints). `EngineState` holds the
`Engine`'s methods for this job."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.checkpoint import CheckpointError


def _rescaled_micro_step(saved: int, layout: Any, accumulation: int) -> int:
    """``micro_step`` (backward calls on each rank) of a checkpoint written with the gradient
    accumulation in ``layout``, for an engine that accumulates ``accumulation`` micro-batches
    per step: the same number of optimizer steps. Unchanged without a layout (checkpoints
    written before layouts were recorded) or with the same accumulation."""
    if not isinstance(layout, dict):
        return saved
    before = int(layout.get("gradient_accumulation_steps", accumulation))
    if before == accumulation or before < 1:
        return saved
    steps, within = divmod(saved, before)
    return steps * accumulation + within


ENGINE_STATE_KEYS = ("model", "optimizer", "scaler", "albatross")
"""The keys of ``engine.pt`` (``backend="torch"``)."""


def _weights_only_detail(exc: BaseException) -> str:
    """The informative line of torch's weights_only error (it also explains the default)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line:
            return line
    return lines[-1] if lines else type(exc).__name__


def load_engine_file(file: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """The state in an ``engine.pt``, loaded with ``torch.load(weights_only=True)``. Raises
    ``CheckpointError`` naming the file when it is missing, unreadable, holds objects that
    ``weights_only`` refuses (a pickle that could run code when loaded) or is not an engine
    state."""
    file = Path(file)
    if not file.is_file():
        raise CheckpointError(file, "is missing (was the checkpoint saved with backend='torch'?)")
    try:
        state = torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = _weights_only_detail(exc)
        if "GLOBAL" not in detail:  # not a pickle of objects: a damaged or foreign file
            raise CheckpointError(file, f"cannot be read ({detail})") from exc
        raise CheckpointError(
            file,
            "refused: it holds objects that torch.load(weights_only=True) does not load "
            f"(unpickling them could run arbitrary code): {detail}",
        ) from exc
    except Exception as exc:
        raise CheckpointError(file, f"cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or any(key not in state for key in ENGINE_STATE_KEYS):
        raise CheckpointError(
            file, f"is not an engine state (needs keys {list(ENGINE_STATE_KEYS)})"
        )
    return state


def check_weights_only(obj: Any, what: str) -> None:
    """Raise ``TypeError`` unless ``obj`` round-trips through ``torch.load(weights_only=True)``
    (for small objects: it is serialized in memory)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise TypeError(
            f"{what} would not load with torch.load(weights_only=True): "
            f"{_weights_only_detail(exc)}; keep it to tensors and plain Python data"
        ) from exc


class EngineState:
    """The `Engine`'s state methods (a mixin: the state they use is set up by `Engine`)."""

    # -- state ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[nn.Module]:
        """Collective. Inside, ``self.module`` holds full parameters on every rank (ZeRO-3
        gathers them; otherwise nothing to do). Read-only: changes are not written back."""
        with self.backend.gathered_parameters() as module:
            yield module

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective. The model's full state dict in fp32 on CPU, on every rank: fp32 master
        weights where DeepSpeed keeps them (ZeRO 1-3, bf16, fp16), buffers as they are."""
        master = self.backend.master_weights()
        with self.gathered_parameters() as module:
            state = {}
            for name, value in module.state_dict().items():
                state[name] = master.get(name, value).detach().float().cpu().clone()
        return state

    def save(self, directory: Path) -> None:
        """Collective. Writes the engine state (model, optimizer, loss scaler; schedule) into
        ``directory`` (an existing, empty staging directory shared by all ranks)."""
        self.sync_schedule()
        extra = {
            "scheduler": self.scheduler.state_dict(),
            "micro_step": int(self.micro_step),
            "layout": self.layout(),
        }
        self.backend.save(Path(directory), extra)

    def layout(self) -> dict[str, Any]:
        """How this engine splits the global batch and its state: recorded in every checkpoint
        (the ``"albatross"`` state's ``"layout"``) so that a load on another world size can
        convert the counters."""
        return {
            "world_size": int(self.world_size),
            "micro_batch_size": int(self.cfg.micro_batch_size),
            "gradient_accumulation_steps": int(self.cfg.gradient_accumulation_steps),
            "backend": self.backend.name,
            "zero_stage": int(self.cfg.zero_stage),
            "precision": self.cfg.precision,
        }

    def load(self, directory: Path, *, universal_dir: Path | None = None) -> None:
        """Collective. Restores what ``save`` wrote; raises when it cannot. ``engine.pt``
        (``backend="torch"``) is loaded with ``weights_only=True``: a file holding anything but
        tensors and plain data raises ``CheckpointError`` naming it. DeepSpeed loads its own
        files with ``weights_only=False`` (see the module docstring). Only at a step boundary:
        between two micro-batches of a step it raises (their gradients belong to the old
        weights).

        Another world size. ``engine.pt`` and DeepSpeed ZeRO-0 checkpoints hold the whole
        optimizer state and load on any number of processes as they are. A DeepSpeed ZeRO 1-3
        checkpoint written by another number of processes is converted first into DeepSpeed's
        universal checkpoint (``engine.reshard.to_universal``: by rank 0, into
        ``universal_dir``, default ``<directory>/universal``, reused when already there; the
        other ranks wait) and loaded from there with DeepSpeed's ``load_universal`` mode:
        weights, fp32 master weights and optimizer moments re-partitioned for this world size;
        the schedule and the counters come from the checkpoint as usual (``micro_step`` is
        rescaled to this engine's gradient accumulation). The caller keeps the global batch
        (``engine.reshard.gradient_accumulation_for``) and moves the data loader
        (``PretrainingLoader.load_state_dict`` with a state of another world size)."""
        if self._accumulated:
            # The micro-batches' gradients so far (on the parameters, and what the model's step
            # hooks keep for the step) belong to the weights being replaced.
            raise RuntimeError(
                f"Engine.load({directory}) between two micro-batches of an optimizer step "
                f"({self._accumulated} of {self.cfg.gradient_accumulation_steps} backward() "
                "calls done): load at a step boundary, before the first forward or after step()"
            )
        extra = self.backend.load(
            Path(directory), universal_dir, lambda flag: bool(self.all_reduce_max([float(flag)])[0])
        )
        self.scheduler.load_state_dict(extra["scheduler"])
        # load_state_dict restores the schedule's counters but not the lr it last set; DeepSpeed
        # does not restore param-group lrs under ZeRO either. Put the schedule's lr back.
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        self.micro_step = _rescaled_micro_step(
            int(extra["micro_step"]), extra.get("layout"), self.cfg.gradient_accumulation_steps
        )
        # Deferred steps restart from the loaded schedule position.
        self._applied, self._unsynced_steps, self._bad = None, 0, None
        for hooks in self.step_hooks:  # the parameters were replaced
            hooks.after_load()
