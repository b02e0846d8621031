"""The training engine shared by pretraining and fine-tuning: one object that owns the model's
distribution, mixed precision, gradient accumulation, clipping, the optimizer step and the
learning-rate schedule. Model code stays single-device; this is the one place that applies
DeepSpeed (or plain PyTorch) from outside.

Backends (``EngineConfig.backend``):

- ``"deepspeed"``: ``deepspeed.initialize`` with ZeRO stage 0-3, the config below turned into a
  DeepSpeed config dict (a DeepSpeed JSON file, ``EngineConfig.deepspeed_config``, and
  ``EngineConfig.deepspeed`` are merged over it for anything else, e.g. offload, once
  reconciled with this config: ``engine/ds_config.py``). Runs on CUDA (NCCL) and on CPU (gloo;
  DeepSpeed's CPU accelerator).
- ``"torch"``: plain PyTorch, ``DistributedDataParallel`` when there is more than one process.
  No ZeRO; useful without DeepSpeed and as the reference the engine is benchmarked against.

Precision (``EngineConfig.precision``):

- ``"fp32"``.
- ``"bf16-mixed"``: fp32 weights and optimizer, ``torch.autocast`` to bf16 in forward. The
  optimizer sees each parameter tensor as it is, so LAMB's per-tensor trust ratio is exact.
- ``"bf16"``: DeepSpeed's bf16 mode: bf16 weights, activations and gradients, fp32 master
  weights inside the optimizer wrapper (``backend="deepspeed"`` only).
- ``"fp16"``: fp16 with dynamic loss scaling (DeepSpeed's fp16 mode, or autocast +
  ``torch.amp.GradScaler`` with ``backend="torch"``). CUDA only.

LAMB and ZeRO: ZeRO stage >= 1, and DeepSpeed's ``bf16``/``fp16`` modes, hand the optimizer
flattened fp32 buffers instead of parameter tensors, so a LAMB that does not know where the
tensors lie computes its trust ratio per flat partition rather than per tensor. The project's
LAMB (``engine.lamb.Lamb``, ``optimizer.implementation`` ``auto`` / ``foreach`` /
``compiled``) is told the layout of DeepSpeed's ZeRO 1-2 partitions
(``engine.lamb.attach_zero_layouts``) and stays per tensor there, the pieces of a tensor split
across ranks joined by an all-reduce of their squared norms. Where LAMB is exact
(:func:`lamb_exactness`):

    backend / ZeRO stage     fp32, bf16-mixed     bf16                 fp16
    torch, 0                 exact (per tensor)   -                    exact (per tensor)
    deepspeed, 0             exact (per tensor)   flat: inexact        flat: inexact
    deepspeed, 1             exact (layout)       flat: inexact        exact (layout)
    deepspeed, 2             exact (layout)       exact (layout)       exact (layout)
    deepspeed, 3             inexact              inexact              inexact

("layout": ``foreach`` and ``compiled`` only; DeepSpeed's FusedLamb and apex's FusedLAMB are
refused where the buffers are flat, ``pytorch_optimizer.Lamb`` runs with a warning; the inexact
cells warn.)

Non-finite losses: ``backward`` agrees across ranks whether every rank's loss is finite. If
not, the micro-batch is backpropagated as ``0 * loss`` (DeepSpeed needs the backward call to
keep its state consistent), and at the accumulation boundary the optimizer update is skipped:
the weights, the optimizer state and the schedule stay as they were and ``StepResult.skipped``
says so. The caller counts skips and decides when to give up.

Without host synchronisation (``backward(loss, defer=True)``, ``step(defer=True)``): the same,
decided on the device. Each loss's finiteness goes into a device flag (all-reduced across ranks
at the boundary, on the device), the gradient norm and clipping stay tensors, and the optimizer
is told on the device whether to apply the update (``engine.lamb.Lamb.skip``) and at which
schedule position (``Lamb.lr_multiplier``: a device table of the schedule indexed by a device
count of the applied steps, so a skipped step does not advance it). ``step`` then returns a
:class:`DeferredStep` of device tensors; nothing reads them until the caller does (the trainer:
once per logging window), and :meth:`Engine.sync_schedule` brings the host's scheduler to the
device's count (``save`` does it). Available with the project's LAMB (``foreach``,
``compiled``) on the torch backend and DeepSpeed ZeRO 0-2 in fp32 / ``bf16-mixed``
(``Engine.deferred``); elsewhere ``defer=True`` falls back to the synchronising step and returns
its result as a :class:`DeferredStep`.
Bit for bit the same updates as the synchronising step (tests/engine/test_host_syncs.py). DeepSpeed's
ZeRO 1-2 step still reads its own gradient-norm check back to the host (inside DeepSpeed).

Checkpoint files and pickles. ``save``/``load`` with ``backend="torch"`` write and read
``engine.pt`` (model, optimizer and loss-scaler state dicts, plus an ``"albatross"`` dict of the
schedule's state and the micro-step counter: tensors, numbers, strings, lists, tuples, dicts,
None). It is loaded with ``torch.load(weights_only=True)``, which unpickles only those types, so
a tampered or foreign file cannot run code; anything else is refused with a ``CheckpointError``
naming the file (``save`` checks that the small ``"albatross"`` dict round-trips that way, so a
schedule whose state is not plain data fails at the first save, not at the resume). With
``backend="deepspeed"`` the files are DeepSpeed's own (``mp_rank_*_model_states.pt``,
``*_optim_states.pt``), read by ``engine.load_checkpoint``: DeepSpeed (checked in 0.19.8) loads
them in ``TorchCheckpointEngine.load`` with ``torch.load(..., weights_only=False)`` (its ZeRO-3
and universal-checkpoint paths likewise), i.e. a full unpickle that can run code, because its
files hold more than plain data (its config, version and optimizer objects). Load DeepSpeed
checkpoints only from run directories you trust; the store's checksums (engine.checkpoint)
catch corruption, not tampering. The per-rank state files (``engine.checkpoint.
load_rank_state``) are loaded with ``weights_only=True``.

Torch-extension build locks and the per-environment extensions directory are checked before
DeepSpeed starts (``engine.extensions.prepare_extensions``; see that module).
"""

from __future__ import annotations

import sys
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from albatross import compat
from engine.backends import backend_class
from engine.backends.base import Backend
from engine.backends.deepspeed import deepspeed_config
from engine.collectives import Collectives
from engine.compile import (
    COMPILES_PER_LAYER,
    compile_cache_counts,
    compile_encoder,
    compile_function,
    compile_wanted,
    distinct_layers,
    use_compile_cache,
)
from engine.config import COMPILE_SCOPES, EngineConfig, inductor_options
from engine.distributed import DistEnv, detect, export_torch_env
from engine.lamb import Lamb
from engine.optim import (
    OptimizerConfig,
    ScheduleConfig,
    build_optimizer,
    build_scheduler,
    resolve_lamb_implementation,
)
from engine.state import EngineState
from engine.step import DeferredStep, StepGuard, Stepping, batch_to_device
from model.hooks import HookContext, StepHooks
from model.step_hooks import step_hooks


def resolve_device(cfg: EngineConfig, dist: DistEnv) -> torch.device:
    """The device this process trains on (``cuda:<local_rank>`` or ``cpu``)."""
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("engine.device='cuda' but torch.cuda.is_available() is False")
    return torch.device("cuda", dist.local_rank % torch.cuda.device_count())


def check_compatible(
    cfg: EngineConfig,
    opt_cfg: OptimizerConfig,
    device: torch.device,
    backend: type[Backend] | None = None,
) -> None:
    """Start-up checks that need the device: fail before any work, warn on silent changes.
    ``backend``: the backend class the engine picked (None: the one ``cfg`` names)."""
    if cfg.precision == "fp16" and device.type != "cuda":
        raise ValueError(
            "engine.precision='fp16' needs a CUDA device (DeepSpeed's CPU accelerator has no "
            "fp16); on CPU use 'bf16-mixed', 'bf16' or 'fp32'"
        )
    backend = backend_class(cfg) if backend is None else backend
    backend.check_available()
    if opt_cfg.name != "lamb":
        return
    exact, why = lamb_exactness(cfg, opt_cfg, device.type, backend)
    if exact:
        return
    try:
        impl = resolve_lamb_implementation(opt_cfg.implementation, device.type)
    except RuntimeError:  # not usable here: build_optimizer says why
        impl = opt_cfg.implementation
    if impl in ("deepspeed", "apex"):
        raise ValueError(
            f"optimizer.implementation={opt_cfg.implementation!r} with engine.zero_stage="
            f"{cfg.zero_stage} and engine.precision={cfg.precision!r}: {why}, so its fused "
            "LAMB would compute the trust ratio per flat buffer, not per tensor. Use "
            "optimizer.implementation='foreach' (exact on ZeRO 0-2), or zero_stage=0 with "
            "precision 'bf16-mixed' or 'fp32'"
        )
    warnings.warn(
        f"LAMB ({impl}) with engine.zero_stage={cfg.zero_stage} and engine.precision="
        f"{cfg.precision!r}: {why}, so the trust ratio is computed per flat partition, not per "
        "tensor. Exact LAMB: optimizer.implementation 'foreach' (the default) with ZeRO 0-2 in "
        "'fp32' / 'bf16-mixed' or ZeRO-2 in any precision (docs/engine.md).",
        stacklevel=2,
    )


def lamb_exactness(
    cfg: EngineConfig,
    opt_cfg: OptimizerConfig,
    device_type: str = "cpu",
    backend: type[Backend] | None = None,
) -> tuple[bool, str]:
    """Whether LAMB's trust ratio is per parameter tensor in this configuration, and if not
    why. The optimizer sees parameter tensors on the torch backend and on DeepSpeed ZeRO-0 in
    fp32 / bf16-mixed; flat buffers otherwise, where only the project's LAMB, given the layout
    of DeepSpeed's ZeRO 1-2 optimizer (``DeepSpeedZeroOptimizer``: ZeRO-2 in any precision,
    ZeRO-1 except in bf16, which DeepSpeed gives its BF16_Optimizer), is still per tensor.
    ``backend``: the backend class (None: the one ``cfg`` names)."""
    backend = backend_class(cfg) if backend is None else backend
    if backend.gradients_on_parameters(cfg):
        return True, ""
    try:
        impl = resolve_lamb_implementation(opt_cfg.implementation, device_type)
    except RuntimeError:
        impl = opt_cfg.implementation
    if cfg.zero_stage == 3:
        why = "ZeRO-3 hands the optimizer flat partitions (no per-tensor layout is read there)"
    elif cfg.zero_stage == 0:
        why = f"DeepSpeed's {cfg.precision} mode on ZeRO-0 hands the optimizer flat buffers"
    elif cfg.zero_stage == 1 and cfg.precision == "bf16":
        why = "DeepSpeed's bf16 mode on ZeRO-1 hands the optimizer flat buffers (BF16_Optimizer)"
    elif impl not in ("foreach", "compiled"):
        why = f"ZeRO-{cfg.zero_stage} hands the optimizer flat partitions"
    else:
        return True, ""
    return False, why


def init_distributed(
    dist: DistEnv, cfg: EngineConfig, device: torch.device, backend: Backend
) -> None:
    """Joins the process group once (gloo on CPU, NCCL on CUDA) through ``backend``; a no-op
    where the backend needs no group (one process with the torch backend)."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        return
    if not backend.needs_process_group():
        return
    export_torch_env(dist)
    if dist.is_distributed:  # one line per process: where each rank runs, for the job log
        print(f"distributed: {dist.describe()}", file=sys.stderr, flush=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timedelta(minutes=cfg.dist_timeout_minutes),
    )


class Engine(Stepping, EngineState, Collectives):
    """Wraps ``model`` for training: ``forward`` -> ``backward`` for each micro-batch, then
    ``step`` at every ``gradient_accumulation_steps``-th micro-batch.

    >>> out = engine.forward(input_ids, attention_mask)       # doctest: +SKIP
    >>> engine.backward(loss_of(out))                         # doctest: +SKIP
    >>> if engine.at_boundary: result = engine.step()         # doctest: +SKIP

    The model is built on CPU in fp32 by the caller with the same seed on every rank; the
    engine moves it to the device and shards it.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: EngineConfig,
        optimizer: OptimizerConfig,
        schedule: ScheduleConfig,
        dist: DistEnv | None = None,
    ):
        self.cfg = cfg
        self.dist = detect() if dist is None else dist
        self.device = resolve_device(cfg, self.dist)
        backend = backend_class(cfg)  # the one choice of backend: everything else delegates
        check_compatible(cfg, optimizer, self.device, backend)
        self.backend: Backend = backend(cfg, self.dist, self.device)
        """The backend (DeepSpeed or plain PyTorch) that wraps, steps and saves the model."""
        self.backend.prepare()  # before any work (the extensions' locks; DeepSpeed's layout)
        init_distributed(self.dist, cfg, self.device, self.backend)
        self.module = model
        if cfg.activation_checkpointing:
            encoder = getattr(model, "encoder", model)
            if not hasattr(encoder, "enable_activation_checkpointing"):
                raise ValueError(
                    f"engine.activation_checkpointing: {type(model).__name__} has no encoder "
                    "with enable_activation_checkpointing()"
                )
            encoder.enable_activation_checkpointing()
        self.compile_cache = use_compile_cache(cfg.compile_cache_dir)
        """The folder of the compiler's caches in this process (``engine.compile_cache_dir``
        or torch's own)."""
        self._cache_counts_at_start = compile_cache_counts()
        self.compiled = compile_wanted(cfg, model, self.device.type)
        """Whether the encoder is compiled (``engine.compile``, ``auto`` resolved)."""
        if self.compiled:
            compile_encoder(
                model,
                cfg.compile_backend,
                cfg.compile_mode,
                inductor_options(cfg),
                cfg.compile_scope,
            )
        model.to(self.device)
        self.optimizer = build_optimizer(model, optimizer, device_type=self.device.type)
        self.scheduler = build_scheduler(self.optimizer, schedule)  # wraps optimizer.step too
        self._guard = StepGuard(self.optimizer)
        self.micro_step = 0  # backward() calls so far
        self._accumulated = 0  # backward() calls since the last step()
        self._poisoned = False
        self.backend.wrap(model, self.optimizer, self._guard)
        self.schedule_cfg = schedule
        self._lamb: Lamb | None = self.optimizer if isinstance(self.optimizer, Lamb) else None
        self.flat_layouts = self.backend.flat_layouts
        """Flat ZeRO partitions whose tensor layout the LAMB was given (0: none, or not LAMB)."""
        self.deferred = (
            self._lamb is not None
            and cfg.precision in ("fp32", "bf16-mixed")
            and cfg.zero_stage <= 2
            and (cfg.zero_stage == 0 or self.flat_layouts > 0)
        )
        """True when ``step(defer=True)`` decides skips and the schedule on the device (the
        ``foreach`` LAMB; torch backend or DeepSpeed ZeRO 0-2; fp32 or bf16-mixed)."""
        self._bad: torch.Tensor | None = None  # some loss of this step was not finite (device)
        self._applied: torch.Tensor | None = None  # optimizer updates applied (device)
        self._lr_table: torch.Tensor | None = None  # the schedule's multiplier per position
        self._unsynced_steps = 0  # deferred steps since the host's schedule was last synced
        self._host_group: Any = None  # a gloo group for host flags when the default is NCCL
        self.step_hooks: list[StepHooks] = step_hooks(
            model,
            HookContext(
                rank=self.rank,
                world_size=self.world_size,
                accumulation=cfg.gradient_accumulation_steps,
                compiled=self.compiled,
                zero3=cfg.zero3,
                gather=self.all_gather_with_autograd if self._collective else None,
            ),
        )
        """What the model's parts do around each training step (`model.step_hooks`: e.g. the
        orthogonal maps evaluated once per optimizer step); called without knowing whose."""

    def compile_cache_activity(self) -> dict[str, int]:
        """Graphs Inductor loaded from its cache (``loaded``), compiled into it (``compiled``)
        or compiled without it (``uncached``) since this engine started."""
        now = compile_cache_counts()
        return {k: now[k] - self._cache_counts_at_start[k] for k in now}

    def first_step_report(self, seconds: float) -> str | None:
        """The run log's line after this process's first step (``seconds``, the host's time:
        the compilation is inside it), or None when nothing was compiled."""
        if not self.compiled:
            return None
        return f"first step {seconds:.1f} s, compilation included; {self.compile_cache_summary()}"

    def compile_cache_summary(self) -> str:
        """One line for the run's log: the compiler's cache folder and how many of the graphs
        compiled since this engine started were loaded from it."""
        counts = self.compile_cache_activity()
        where = (
            "engine.compile_cache_dir"
            if self.cfg.compile_cache_dir is not None
            else "torch's default; engine.compile_cache_dir on shared storage keeps it across nodes"
        )
        return (
            f"compiler cache {self.compile_cache} ({where}): {counts['loaded']} graph(s) "
            f"loaded from it, {counts['compiled']} compiled into it"
            + (f", {counts['uncached']} not cacheable" if counts["uncached"] else "")
        )

    @property
    def hooks_summary(self) -> str | None:
        """What the model's step hooks do in a training step, for the run's log (one line), or
        None when they change nothing worth saying."""
        lines = [line for hooks in self.step_hooks if (line := hooks.summary()) is not None]
        return "; ".join(lines) if lines else None

    # -- configuration -------------------------------------------------------------------------

    def deepspeed_config(self) -> dict[str, Any]:
        """The DeepSpeed config dict an engine of ``self.cfg`` (``backend="deepspeed"``)
        passes to ``deepspeed.initialize`` (`engine.backends.deepspeed.deepspeed_config`)."""
        return deepspeed_config(self.cfg, self.world_size, self.optimizer)

    # -- properties ----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def _collective(self) -> bool:
        """True when there are other ranks to talk to."""
        return torch_dist.is_available() and torch_dist.is_initialized() and self.world_size > 1

    @property
    def global_batch_size(self) -> int:
        return self.cfg.micro_batch_size * self.cfg.gradient_accumulation_steps * self.world_size

    @property
    def at_boundary(self) -> bool:
        """True when the micro-batches since the last ``step`` make a full accumulation."""
        return self._accumulated == self.cfg.gradient_accumulation_steps

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def loss_scale(self) -> float:
        return self.backend.loss_scale()

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)


def shutdown() -> None:
    """Leaves the process group (if any), so the process exits cleanly, and forgets the groups
    DeepSpeed cached on it: a later engine in the same process (a sweep, the tests) then joins
    a new group instead of failing on a destroyed one ("Group ... is not registered")."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    compat.forget_deepspeed_groups()


__all__ = [  # the engine, and the names its users import from here (config, compile, step)
    "COMPILES_PER_LAYER",
    "COMPILE_SCOPES",
    "DeferredStep",
    "Engine",
    "EngineConfig",
    "batch_to_device",
    "check_compatible",
    "compile_encoder",
    "compile_function",
    "compile_wanted",
    "distinct_layers",
    "inductor_options",
    "lamb_exactness",
    "shutdown",
    "use_compile_cache",
]
