"""The interface of the engine's two backends (`engine/backends/deepspeed.py`,
`engine/backends/torch.py`): what differs between DeepSpeed and plain PyTorch when the engine
joins the process group, wraps the model and optimizer, runs forward and backward over the
micro-batches of a step, clips, steps the optimizer, and saves or loads the optimizer's state.
What does not differ (the finite check, the skip decision, the schedule, the device-side
deferred step, the model's step hooks) stays in the `Engine` (`engine/step.py`), which picks
one backend at start-up (`engine.backends.backend_class`) and calls it without asking which
one it holds."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as torch_dist
from torch import nn

from engine.extensions import prepare_extensions

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.distributed import DistEnv
    from engine.lamb import Lamb
    from engine.step import StepGuard


AnyRank = Callable[[bool], bool]
"""The engine's collective OR of a flag: true on every rank when true on one."""
State = dict[str, Any]
"""The engine's own ``"albatross"`` state in a checkpoint (schedule position, counters)."""


class Backend(ABC):
    """One way of distributing and stepping the engine's model. Made by the `Engine` before
    the process group exists (``prepare``, ``init_process_group``), then given the model and
    the optimizer (``wrap``); from there on the engine calls it for each micro-batch
    (``forward``, ``backward``), at each accumulation boundary (``clip_gradients``, ``step``
    or ``deferred_step``) and for checkpoints (``save``, ``load``)."""

    name: ClassVar[str]
    """The ``engine.backend`` value that selects this backend."""

    def __init__(self, cfg: EngineConfig, dist: DistEnv, device: torch.device) -> None:
        self.cfg = cfg
        self.dist = dist
        self.device = device
        self.module: nn.Module | None = None
        """The model, unwrapped (set by ``wrap``)."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.lamb: Lamb | None = None
        """The optimizer when it is the project's LAMB (clipping may be handed to it)."""
        self.guard: StepGuard | None = None
        """Vetoes the optimizer's update while the backend's step runs around it."""
        self.flat_layouts = 0
        """Flat ZeRO partitions whose tensor layout the LAMB was given (0: none)."""

    # -- before the model ----------------------------------------------------------------------

    @classmethod
    def check_available(cls) -> None:
        """Raise ``RuntimeError`` (saying what to do) when this backend cannot run here;
        plain PyTorch runs wherever the engine does."""
        return None

    @classmethod
    @abstractmethod
    def gradients_on_parameters(cls, cfg: EngineConfig) -> bool:
        """True when the reduced gradients of a step sit on the parameters themselves (each
        tensor its own), so that the engine clips them there and the optimizer sees parameter
        tensors (LAMB's trust ratio is per tensor); False when the backend hands the optimizer
        flat buffers instead."""

    def prepare(self) -> None:
        """Start-up work before the process group is joined: on CUDA the extensions' build
        locks are checked (the fused LAMB is JIT-built in ``build_optimizer``: never wait
        forever on a killed build's lock; `engine.extensions`)."""
        if self.device.type == "cuda":
            prepare_extensions()

    def needs_process_group(self) -> bool:
        """Whether this process joins a process group (always with several processes)."""
        return self.dist.is_distributed

    @abstractmethod
    def init_process_group(self, backend: str, timeout: timedelta) -> None:
        """Joins the default process group (``backend``: ``nccl`` or ``gloo``)."""

    # -- the model -----------------------------------------------------------------------------

    @abstractmethod
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, guard: StepGuard) -> None:
        """Takes the model (on its device) and its optimizer for training."""

    @abstractmethod
    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], last: bool) -> Any:
        """The model's forward on a micro-batch; ``last``: the step's last micro-batch (where
        the gradients are reduced over the ranks)."""

    @abstractmethod
    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backpropagates a micro-batch's loss (as the caller computed it: the backend divides
        by the accumulation and applies loss scaling); ``last`` as in ``forward``."""

    @abstractmethod
    def clip_gradients(self) -> torch.Tensor | None:
        """At the boundary: the global gradient norm (a device tensor) with the gradients
        clipped to ``gradient_clipping``, or None where the backend's own step does both."""

    @abstractmethod
    def step(self, poisoned: bool) -> tuple[float | None, bool]:
        """The synchronising step at the boundary: clip, update unless ``poisoned`` (or the
        backend itself skips, e.g. an fp16 overflow), zero the gradients. Returns the
        gradient norm before clipping (None if not known) and whether the update was
        applied."""

    @abstractmethod
    def deferred_step(
        self, ok: torch.Tensor, grad_norm: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The optimizer step of a deferred step, the LAMB told on the device whether to apply
        it (``ok``) and at which schedule position; zeroes the gradients. Returns ``ok`` and
        the gradient norm, either replaced where the backend decided more itself."""

    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without loss scaling)."""
        return 1.0

    # -- state ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[nn.Module]:
        """Collective. The model with full parameters on every rank inside the block."""
        assert self.module is not None
        yield self.module

    def master_weights(self) -> dict[str, torch.Tensor]:
        """Collective. {name: fp32 CPU tensor} of the parameters whose fp32 values live outside
        the model (master weights of a lower-precision or partitioned model); {} otherwise."""
        return {}

    @abstractmethod
    def save(self, directory: Path, extra: dict[str, Any]) -> None:
        """Collective. Writes the model, optimizer (and loss scaler) state and ``extra`` (the
        engine's own ``"albatross"`` state) into the staging ``directory``."""

    @abstractmethod
    def load(self, directory: Path, universal: Path | None, any_failed: AnyRank) -> State:
        """Collective. Restores what ``save`` wrote into the model and optimizer; returns the
        ``"albatross"`` state. ``any_failed``: the engine's collective OR of a flag."""

    # -- helpers for both ----------------------------------------------------------------------

    @property
    def collective(self) -> bool:
        """True when there are other ranks to talk to."""
        return (
            torch_dist.is_available() and torch_dist.is_initialized() and self.dist.world_size > 1
        )

    def clip_parameter_gradients(self) -> torch.Tensor:
        """The global norm of the gradients on the parameters (a device tensor), which are then
        clipped to ``gradient_clipping`` (no host synchronisation: torch's foreach clip)."""
        assert self.module is not None
        params = [p for p in self.module.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.device)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if self.cfg.gradient_clipping > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.gradient_clipping, norm)
        return norm
