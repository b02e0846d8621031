"""The plain-PyTorch backend (``engine.backend: torch``): ``DistributedDataParallel`` across
processes (none for one), autocast + ``torch.amp.GradScaler`` for fp16, the engine's own
clipping, and ``engine.pt`` for checkpoints (loaded with ``weights_only=True``;
`engine/state.py`). No ZeRO; useful without DeepSpeed and as the reference the engine is
benchmarked against."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as torch_dist
from torch import nn

from albatross.files import atomic_file
from engine.backends.base import AnyRank, Backend, State
from engine.config import EngineConfig
from engine.state import check_weights_only, load_engine_file

if TYPE_CHECKING:
    from engine.step import StepGuard


class TorchBackend(Backend):
    """Plain PyTorch: DDP across processes, GradScaler for fp16, ``engine.pt`` checkpoints."""

    name = "torch"

    @classmethod
    def gradients_on_parameters(cls, cfg: EngineConfig) -> bool:
        return True

    def init_process_group(self, backend: str, timeout: timedelta) -> None:
        torch_dist.init_process_group(backend=backend, timeout=timeout)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, guard: StepGuard) -> None:
        from engine.lamb import Lamb

        self.module, self.optimizer, self.guard = model, optimizer, guard
        self.lamb = optimizer if isinstance(optimizer, Lamb) else None
        self.ddp: nn.Module | None = None
        if self.dist.is_distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.scaler: torch.amp.GradScaler | None = None
        if self.cfg.precision == "fp16":
            self.scaler = torch.amp.GradScaler(
                "cuda",
                init_scale=2.0**self.cfg.fp16_initial_scale_power,
                growth_interval=self.cfg.fp16_loss_scale_window,
            )

    def _no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP's ``no_sync`` before the step's last micro-batch: those reduce nothing."""
        if self.ddp is None or last:
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], last: bool) -> Any:
        if self.ddp is None:
            return self.module(*args, **kwargs)
        # DDP decides in its forward whether the backward all-reduces (it prepares the reducer
        # there), so no_sync must hold around the forward, not only the backward: the
        # micro-batches before the last reduce nothing, and their backward need not reach every
        # parameter (a model's step hooks may hand some gradients on to the last one).
        with self._no_sync(last):
            return self.ddp(*args, **kwargs)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss = loss / self.cfg.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        with self._no_sync(last):
            loss.backward()

    def clip_gradients(self) -> torch.Tensor:
        return self.clip_parameter_gradients()

    def step(self, poisoned: bool) -> tuple[float | None, bool]:
        optimizer, scaler = self.optimizer, self.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm = float(self.clip_gradients())
        applied = not poisoned
        if scaler is not None:
            if poisoned:
                scaler.update()
            else:
                scale = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                applied = scaler.get_scale() >= scale  # lowered scale = overflow skip
        elif applied:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm, applied

    def deferred_step(
        self, ok: torch.Tensor, grad_norm: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return ok, grad_norm

    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else float(self.scaler.get_scale())

    def save(self, directory: Path, extra: dict[str, Any]) -> None:
        if self.dist.rank != 0:
            return
        check_weights_only(extra, "the engine's 'albatross' state (schedule, counters)")
        state = {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "albatross": extra,
        }
        with atomic_file(directory / "engine.pt", "the engine state") as tmp:
            torch.save(state, tmp)

    def load(self, directory: Path, universal: Path | None, any_failed: AnyRank) -> State:
        state = load_engine_file(directory / "engine.pt", self.device)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        return state["albatross"]
