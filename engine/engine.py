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
Bit for bit the same updates as the synchronising step (tests/test_host_syncs.py). DeepSpeed's
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

import contextlib
import copy
import dataclasses
import functools
import io
import logging
import math
import os
import pickle
import sys
import typing
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as torch_dist
from torch import nn

from engine import ds_config
from engine.checkpoint import CheckpointError
from engine.distributed import DistEnv, detect, export_torch_env
from engine.extensions import import_deepspeed, prepare_extensions
from engine.lamb import Lamb, attach_zero_layouts
from engine.optim import (
    OptimizerConfig,
    ScheduleConfig,
    build_optimizer,
    build_scheduler,
    resolve_lamb_implementation,
)
from engine.orthogonal_sharding import DataParallelMapSharding
from model.orthogonal import (
    OrthogonalStepCache,
    evaluate_orthogonal_maps,
    name_forward_cache_keys,
    orthogonal_cache,
    orthogonal_modules,
)
from model.typed_config import deep_merge

BACKENDS = ("deepspeed", "torch")
PRECISIONS = ("fp32", "bf16-mixed", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")

log = logging.getLogger(__name__)


COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")
"""``torch.compile``'s modes (``EngineConfig.compile_mode``)."""

COMPILE_SCOPES = ("encoder", "layers")
"""What ``engine.compile`` compiles as one graph (``EngineConfig.compile_scope``)."""


def check_compile_scope(scope: str) -> None:
    """A ValueError naming ``engine.compile_scope`` unless ``scope`` is one of `COMPILE_SCOPES`."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(
            f"engine.compile_scope={scope!r} is invalid; valid: " + ", ".join(COMPILE_SCOPES)
        )


@dataclass
class EngineConfig:
    """How the model is trained across processes: backend, ZeRO, precision, batch layout."""

    backend: str = "deepspeed"
    """``"deepspeed"`` (ZeRO 0-3) or ``"torch"`` (plain PyTorch; DDP across processes)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage: 0 (data parallel), 1 (optimizer state partitioned), 2 (+ gradients),
    3 (+ parameters). ``backend="torch"`` accepts only 0."""
    precision: str = "bf16-mixed"
    """``"fp32"``, ``"bf16-mixed"`` (autocast, fp32 weights), ``"bf16"`` (DeepSpeed bf16 weights
    with fp32 master copies) or ``"fp16"`` (dynamic loss scaling; CUDA only)."""
    micro_batch_size: int = 32
    """Sequences per process per forward pass."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step. Global batch = micro_batch_size x this x processes."""
    gradient_clipping: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    activation_checkpointing: bool = False
    """Recompute each layer application in backward (torch non-reentrant checkpoint); memory
    then grows with depth by one hidden state per layer application instead of all
    activations. Works with shared layers and ZeRO-3."""
    compile: bool | Literal["auto"] = False
    """``torch.compile`` the model's encoder (``model.encoder``; the model itself when it has
    none) in place, before training, and in pretraining the objective's loss terms beside it
    (``pretrain.objective.objective_terms``, through ``Engine.compile_beside``: fused, they
    read the bf16 MLM logits a few times where the eager terms upcast them and pass over them
    in fp32 operator by operator: 1.18 instead of 7.10 GB at ALBERT-base's 64 x 77 slots x
    30000 tokens, 3.97x faster on the CPU); the heads stay eager and state-dict keys do not
    change.
    Every attention family compiles without graph breaks, with activation checkpointing too.
    Shapes: batches padded to a fixed length (the pretraining loader's ``static_shapes``, on
    with ``data.masking.static_masked_positions``) compile once; batches padded to their longest
    example (fine-tuning) recompile once, at the second length, with dynamic shapes, then not
    again. Eval mode and no-grad (evaluation) compile one more graph. Unused parameters (e.g.
    the pooler under mean pooling) get zero gradients instead of None. Orthogonal maps
    (TransJect) in training are evaluated eagerly before the compiled encoder (through
    ``orthogonal_step_cache`` and ``orthogonal_shard_maps`` where they apply, by themselves
    otherwise) and enter its graph as inputs: the Cayley maps run as the eager block inverse,
    not as the LU solve a traced map would be.
    Not with ZeRO-3. ``auto``: compile where it was measured to pay, i.e. on a GPU, for an
    attention family whose ``AttentionFamily.compile_auto`` is true (every shipped family:
    softmax, TISA and kernel 1.20-1.73x faster compiled on an H200, TransJect 1.21x on an H100,
    bf16, seq 512, batch 64, the first step paying up to about 85 s of compilation; a family
    added from outside runs eager until measured), never on CPU (1.00-1.07x, not worth the
    compile) nor under ZeRO-3; what the ALBERT recipes set. A run prints what it resolved to."""
    orthogonal_step_cache: bool = True
    """With gradient accumulation, evaluate each orthogonal map (TransJect,
    ``orthogonal: true``) once per optimizer step, forward and backward, instead of once per
    micro-batch: the parameters do not change between a step's micro-batches, and the
    gradient reaches them unchanged (exact to fp32 round-off; docs/methods.md, TransJect;
    ``model.orthogonal.OrthogonalStepCache``). With ``compile`` the step's maps are evaluated
    eagerly before the compiled encoder, which takes them as inputs. Not under ZeRO-3
    (partitioned parameters), where the maps are evaluated once per micro-batch forward as with
    this off; without orthogonal maps, or with accumulation 1, there is nothing to cache."""
    orthogonal_shard_maps: bool = True
    """With several data-parallel ranks, each rank evaluates only its share of the orthogonal
    maps (TransJect, ``orthogonal: true``) in a training step and an all-gather hands every rank
    all of them; the gradient comes back through a reduce-scatter to the rank that mapped it,
    and the usual gradient average makes it the unsharded one (exact to fp32 round-off;
    docs/methods.md, TransJect; ``engine/orthogonal_sharding.py``). Map work per rank drops by
    the number of ranks, for one all-gather and one reduce-scatter of the matrices per step.
    Combines with ``orthogonal_step_cache`` (maps once per step, sharded) and with ``compile``
    (the maps evaluated eagerly before the compiled encoder); not under ZeRO-3. Maps of one
    shape fewer than the ranks, or smaller than ``orthogonal_shard_min_size``, are evaluated
    by all."""
    orthogonal_shard_min_size: int = 256
    """``orthogonal_shard_maps`` shares out only matrices whose both sides are at least this
    long; smaller ones cost less to map than the collectives (2 CPU ranks: 64 x 64 maps were
    slower sharded, 128 x 128 even, 256 x 256 faster; on a GPU a batched solve of small
    matrices costs about the same whatever their number). 0 shares out every size."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend: ``"inductor"`` (generates fused kernels), or a debugging
    backend such as ``"aot_eager"`` (traces forward and backward, runs them eagerly: isolates
    a compiler problem from a tracing one; the tests use it, inductor's C++ build being slow)."""
    compile_mode: str = "default"
    """``torch.compile``'s ``mode`` for Inductor: ``"default"``; ``"max-autotune-no-cudagraphs"``
    (Inductor times candidate kernels for each matrix product, Triton templates among them, and
    may fuse the element-wise work around a product into it: a longer first compilation,
    minutes per family on a GPU); ``"max-autotune"`` (the same with CUDA graphs);
    ``"reduce-overhead"`` (CUDA graphs, which cut the launch cost of small kernels but keep a
    static copy of every input and output). Only ``default`` has been measured with this
    engine on a GPU; the CUDA-graph modes have not run with it (DeepSpeed's hooks and the
    orthogonal maps evaluated before the graph are untested under them). Any other value than
    ``default`` needs ``compile_backend: inductor``."""
    compile_options: dict[str, Any] = field(default_factory=dict)
    """Inductor options (keys of ``torch._inductor.config``, as ``torch.compile(options=...)``
    takes them) applied over ``compile_mode``'s, for the encoder and the loss terms alike. A
    dotted key may be written nested: ``{triton: {cudagraphs: true}}`` is
    ``triton.cudagraphs``. For instance ``{max_autotune_gemm: true}`` autotunes the matrix
    products only (cuBLAS against Inductor's Triton templates, each timed with the element-wise
    work after it fused into the template, such as a bias and GELU), without the tuning of
    every other kernel (pointwise configurations, coordinate descent) that
    ``max-autotune-no-cudagraphs`` adds: that mode did not finish compiling ALBERT-base within
    230 s on an H100. An unknown key or a value of the wrong type is refused at start-up,
    naming the key. Needs ``compile_backend: inductor``. A resumed run may change it."""
    compile_scope: str = "encoder"
    """What is compiled as one graph. ``"encoder"``: the whole encoder, every layer application
    unrolled (embeddings to pooler), so its compilation grows with the depth. ``"layers"``:
    each distinct layer module on its own, compiled once and reused by every application of it
    (ALBERT's shared layer: once, whatever the depth); the rest of the encoder (embeddings, the
    per-forward work such as TISA's scores or TransJect's maps, the pooler) runs eagerly. On
    the CPU (albert-base width, seq 128, a new process's first step, compilation included,
    ``bench/bench_compile_scope.py``): 1.7-2.1x faster at the recipes' 12 applications, 4.8x
    at 48 and 7.0x at 96 (144 s -> 21 s); later steps within 2% for softmax, kernel attention
    and TransJect, 9% slower for TISA and 2-6% with activation checkpointing (the
    recomputation runs the compiled layer again instead of inside the compiled backward), and
    less peak memory with checkpointing at depth (0.99 instead of 2.20 GB at 96); GPU time
    pending. Distinct layers (``num_hidden_groups`` > 1, as TransJect's recipes) are each
    compiled (alike, their graphs come from Inductor's cache after the first); the engine
    raises TorchDynamo's recompile limits of the process to 8 per distinct layer, so that none
    runs eagerly for want of room. A resumed run may change it."""
    compile_cache_dir: str | None = None
    """Where the compiler keeps what it has compiled, for the next process to load instead of
    compiling again: Inductor's compiled graphs (its FX-graph and AOTAutograd caches) and
    Triton's GPU kernels (in ``<dir>/triton``). Null: torch's own place, which is
    ``TORCHINDUCTOR_CACHE_DIR`` when that is set and otherwise a folder under ``/tmp`` of each
    machine, so a run that starts on another node (a requeued or resumed Slurm job, the next
    phase, each GLUE task) compiles everything again. A path (``~`` and ``$VARS`` expanded;
    created if missing) on storage that every node sees lets those runs load the graphs: the
    same model, shapes, options and torch version load them, anything else compiles and adds
    its own. On the CPU (albert-base recipes at seq 128, the first step of a new process, cold
    against warm, ``bench/bench_compile_cache.py``): 7.8x faster for softmax, 9.1x for TISA,
    9.7x for kernel attention, 5.3x for TransJect (whose warm first step is mostly its step);
    GPU time pending. Every process of the run points its
    compiler there at start-up (the environment variables ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` of the
    process, which this overrides); a path that cannot be created or written is refused at
    start-up. Nothing in it is ever deleted by the project: it grows with each new model or
    torch version, and may be removed whole at any time. A resumed run may change it."""
    device: str = "auto"
    """``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda"``."""
    fp16_initial_scale_power: int = 16
    """fp16: the initial loss scale is 2 ** this."""
    fp16_loss_scale_window: int = 1000
    """fp16: steps without overflow before the loss scale doubles."""
    fp16_hysteresis: int = 2
    """fp16: overflows tolerated before the loss scale is lowered (DeepSpeed)."""
    fp16_min_loss_scale: float = 1.0
    """fp16: the loss scale never goes below this."""
    dist_timeout_minutes: float = 30.0
    """Timeout of collective operations (process-group init and every collective)."""
    deepspeed: dict[str, Any] = field(default_factory=dict)
    """Extra DeepSpeed config merged over the generated one (and over ``deepspeed_config``'s
    file), e.g. ``{"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}``. Keys this
    config sets (batch sizes, clipping, precision, ZeRO stage) may repeat its values or be
    ``"auto"``; a different value is an error (``engine/ds_config.py``)."""
    deepspeed_config: str | None = None
    """A DeepSpeed config file (JSON, e.g. a tuned ``ds_config.json``) merged over the generated
    config, with ``deepspeed`` over it. ``"auto"`` values take the recipe's; keys that
    contradict the recipe (batch sizes, gradient clipping, ZeRO stage, bf16 / fp16 vs
    ``precision``, optimizer and scheduler sections with values) are one error listing each
    with both values (``engine/ds_config.py``). ``backend="deepspeed"`` only."""

    def __post_init__(self) -> None:
        _choice("engine.backend", self.backend, BACKENDS)
        _choice("engine.precision", self.precision, PRECISIONS)
        _choice("engine.device", self.device, DEVICES)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"engine.zero_stage={self.zero_stage!r} is invalid; valid: 0, 1, 2, 3")
        if self.backend == "torch" and self.zero_stage != 0:
            raise ValueError(
                f"engine.zero_stage={self.zero_stage} needs engine.backend='deepspeed' "
                "(the torch backend is plain data parallel)"
            )
        if self.backend == "torch" and self.precision == "bf16":
            raise ValueError(
                "engine.precision='bf16' (bf16 weights + fp32 master copies) is DeepSpeed's "
                "mode; with engine.backend='torch' use 'bf16-mixed'"
            )
        for name in ("micro_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"engine.{name}={value!r} is invalid; valid: an integer >= 1")
        if not (isinstance(self.gradient_clipping, (int, float)) and self.gradient_clipping >= 0):
            raise ValueError(
                f"engine.gradient_clipping={self.gradient_clipping!r} is invalid; valid: >= 0"
            )
        if self.dist_timeout_minutes <= 0:
            raise ValueError("engine.dist_timeout_minutes must be > 0")
        if not isinstance(self.compile, bool) and self.compile != "auto":
            raise ValueError(
                f"engine.compile={self.compile!r} is invalid; valid: true, false, auto"
            )
        size = self.orthogonal_shard_min_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(
                f"engine.orthogonal_shard_min_size={size!r} is invalid; valid: an integer >= 0"
            )
        for name in ("orthogonal_step_cache", "orthogonal_shard_maps"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"engine.{name}={getattr(self, name)!r} is invalid; valid: true, false"
                )
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ValueError(
                f"engine.compile_backend={self.compile_backend!r} is invalid; valid: a "
                "torch.compile backend name such as 'inductor' or 'aot_eager'"
            )
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(
                f"engine.compile_mode={self.compile_mode!r} is invalid; valid: "
                + ", ".join(COMPILE_MODES)
            )
        if self.compile_mode != "default" and self.compile_backend != "inductor":
            raise ValueError(
                f"engine.compile_mode={self.compile_mode!r} needs engine.compile_backend="
                f"inductor (got {self.compile_backend!r}): the modes are Inductor's"
            )
        check_compile_scope(self.compile_scope)
        inductor_options(self)  # checks engine.compile_options now: a typo fails at start-up
        cache = self.compile_cache_dir
        if cache is not None and (not isinstance(cache, str) or not cache.strip()):
            raise ValueError(
                f"engine.compile_cache_dir={cache!r} is invalid; valid: a directory path, or "
                "null for torch's own cache folder"
            )
        if self.compile is True and self.zero3:
            raise ValueError(
                "engine.compile=true with engine.zero_stage=3 is not supported: ZeRO-3 "
                "gathers parameters in hooks on every submodule, where the compiled encoder "
                "breaks its graph (27 graphs for the debug model instead of 1), so compiling "
                "gains nothing. Use zero_stage 0-2 (ALBERT-size models gain little from "
                "ZeRO-3) or engine.compile=false"
            )
        if not isinstance(self.deepspeed, dict):
            raise ValueError(
                f"engine.deepspeed={self.deepspeed!r} is invalid; valid: a mapping of DeepSpeed "
                "config keys"
            )
        if self.deepspeed_config is not None:
            if not isinstance(self.deepspeed_config, str) or not self.deepspeed_config:
                raise ValueError(
                    f"engine.deepspeed_config={self.deepspeed_config!r} is invalid; valid: the "
                    "path of a DeepSpeed config JSON file, or null"
                )
            if self.backend != "deepspeed":
                raise ValueError(
                    f"engine.deepspeed_config={self.deepspeed_config!r} needs "
                    f"engine.backend='deepspeed' (it is {self.backend!r})"
                )
        # The file read and reconciled with this config now: a conflict fails at start-up.
        self._deepspeed_extra = ds_config.resolve(self)

    def deepspeed_overrides(self, world_size: int | None = None) -> dict[str, Any]:
        """What ``deepspeed_config`` (the file) and ``deepspeed`` add to the generated DeepSpeed
        config, reconciled with this config (``engine/ds_config.py``). ``world_size``: checks a
        given ``train_batch_size`` against micro-batch x accumulation x processes (ValueError)
        and leaves it out; without it, a given ``train_batch_size`` stays in."""
        extra = copy.deepcopy(self._deepspeed_extra)
        if world_size is not None and "train_batch_size" in extra:
            value = extra.pop("train_batch_size")
            want = self.micro_batch_size * self.gradient_accumulation_steps * world_size
            if value != want:
                raise ValueError(
                    f"the DeepSpeed config's train_batch_size={value} vs "
                    f"engine.micro_batch_size x engine.gradient_accumulation_steps x processes "
                    f"= {self.micro_batch_size} x {self.gradient_accumulation_steps} x "
                    f"{world_size} = {want}: set the batch layout in the recipe, or write "
                    '"auto" in the DeepSpeed config'
                )
        return extra

    def resolved(self) -> EngineConfig:
        """This config with the DeepSpeed file folded into ``deepspeed`` (already reconciled):
        a copy that does not read the file again, e.g. to change the accumulation for a resume
        on another number of processes (``dataclasses.replace`` of it)."""
        return dataclasses.replace(
            self, deepspeed_config=None, deepspeed=self.deepspeed_overrides()
        )

    @property
    def zero3(self) -> bool:
        """DeepSpeed ZeRO-3: parameters partitioned over the ranks (gathered in hooks)."""
        return self.backend == "deepspeed" and self.zero_stage == 3

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype forward runs under ``torch.autocast`` in, or None."""
        if self.precision == "bf16-mixed":
            return torch.bfloat16
        if self.precision == "fp16" and self.backend == "torch":
            return torch.float16
        return None


def _choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is invalid; valid: {list(valid)}")


@dataclass
class StepResult:
    """What one optimizer step did (the same on every rank)."""

    skipped: bool
    """True when the update was not applied (non-finite loss, or an fp16 overflow)."""
    nonfinite_loss: bool
    """True when some rank's loss was not finite in one of the step's micro-batches."""
    grad_norm: float | None
    """Global gradient norm before clipping (None when it was not computed)."""
    lr: float
    """Learning rate the update used (of the first parameter group)."""
    loss_scale: float
    """Current fp16 loss scale (1.0 without loss scaling)."""


@dataclass
class DeferredStep:
    """What one optimizer step did, as device tensors nobody has read yet (``step(defer=True)``):
    read them together, when the host needs them (:meth:`resolve` reads them one by one)."""

    skipped: torch.Tensor
    """0-dim bool: the update was not applied."""
    nonfinite_loss: torch.Tensor
    """0-dim bool: some rank's loss was not finite in one of the step's micro-batches."""
    grad_norm: torch.Tensor | None
    """0-dim float: the global gradient norm before clipping (None: not computed)."""
    lr: float
    """The learning rate of this step as the host knows it: exact unless a step was skipped
    since the host last synchronised the schedule (:meth:`Engine.sync_schedule`)."""
    loss_scale: float
    """Current fp16 loss scale (1.0 without loss scaling)."""

    def resolve(self) -> StepResult:
        """The host values (synchronises)."""
        return StepResult(
            skipped=bool(self.skipped),
            nonfinite_loss=bool(self.nonfinite_loss),
            grad_norm=None if self.grad_norm is None else float(self.grad_norm),
            lr=self.lr,
            loss_scale=self.loss_scale,
        )


class _StepGuard:
    """Lets the engine veto the wrapped optimizer's update while DeepSpeed still runs its step
    bookkeeping (zeroing and re-partitioning gradients) around it."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.skip = False
        original = optimizer.step

        @functools.wraps(original)
        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            if self.skip:
                return None
            return original(*args, **kwargs)

        optimizer.step = guarded_step  # instance attribute: the class is untouched


def resolve_device(cfg: EngineConfig, dist: DistEnv) -> torch.device:
    """The device this process trains on (``cuda:<local_rank>`` or ``cpu``)."""
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("engine.device='cuda' but torch.cuda.is_available() is False")
    return torch.device("cuda", dist.local_rank % torch.cuda.device_count())


def check_compatible(cfg: EngineConfig, opt_cfg: OptimizerConfig, device: torch.device) -> None:
    """Start-up checks that need the device: fail before any work, warn on silent changes."""
    if cfg.precision == "fp16" and device.type != "cuda":
        raise ValueError(
            "engine.precision='fp16' needs a CUDA device (DeepSpeed's CPU accelerator has no "
            "fp16); on CPU use 'bf16-mixed', 'bf16' or 'fp32'"
        )
    if cfg.backend == "deepspeed":
        try:
            import_deepspeed()
        except ImportError as e:
            raise RuntimeError(
                "engine.backend='deepspeed' but DeepSpeed is not importable "
                f"({e}); pip install deepspeed, or use engine.backend='torch'"
            ) from e
    if opt_cfg.name != "lamb":
        return
    exact, why = lamb_exactness(cfg, opt_cfg, device.type)
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
        "'fp32' / 'bf16-mixed' or ZeRO-2 in any precision (see README, Engine).",
        stacklevel=2,
    )


def lamb_exactness(
    cfg: EngineConfig, opt_cfg: OptimizerConfig, device_type: str = "cpu"
) -> tuple[bool, str]:
    """Whether LAMB's trust ratio is per parameter tensor in this configuration, and if not
    why. The optimizer sees parameter tensors on the torch backend and on DeepSpeed ZeRO-0 in
    fp32 / bf16-mixed; flat buffers otherwise, where only the project's LAMB, given the layout
    of DeepSpeed's ZeRO 1-2 optimizer (``DeepSpeedZeroOptimizer``: ZeRO-2 in any precision,
    ZeRO-1 except in bf16, which DeepSpeed gives its BF16_Optimizer), is still per tensor."""
    if cfg.backend == "torch" or (cfg.zero_stage == 0 and cfg.precision in ("fp32", "bf16-mixed")):
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


def batch_to_device(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """``batch`` with its tensors on ``device``, every ``attention_mask*`` entry without padding
    replaced by None (read on the host, before the copy): what `Engine.to_device` does, for
    code that feeds a model without an engine (the benchmarks)."""
    unpadded = {
        k: None
        for k, v in batch.items()
        if k.startswith("attention_mask")  # also the LRA pair's attention_mask_b
        and isinstance(v, torch.Tensor)
        and v.device.type == "cpu"
        and bool(v.numpy().all())  # host memory (numpy fails on a device tensor)
    }
    batch = {**batch, **unpadded}
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


def compile_wanted(cfg: EngineConfig, model: nn.Module, device_type: str) -> bool:
    """Whether the engine compiles ``model``: ``engine.compile`` itself when true or false;
    for ``auto``, on CUDA only, not under ZeRO-3, and only when the model says its attention
    family compiles well there (``model.compile_auto``, from ``AttentionFamily.compile_auto``;
    a model without it is not compiled)."""
    if cfg.compile != "auto":
        return bool(cfg.compile)
    if device_type != "cuda" or cfg.zero3:
        return False
    return bool(getattr(model, "compile_auto", False))


def compile_encoder(
    model: nn.Module,
    backend: str = "inductor",
    mode: str = "default",
    options: dict[str, Any] | None = None,
    scope: str = "encoder",
) -> nn.Module:
    """Compiles ``model.encoder`` (or ``model`` when it has no encoder) in place with
    ``nn.Module.compile``: parameters and state-dict keys stay as they are (no ``_orig_mod.``
    prefix), so optimizers, DeepSpeed, checkpoints and releases see the same module. ``mode``:
    one of `COMPILE_MODES` (``EngineConfig.compile_mode``, which checks it; torch itself names
    the valid modes for a direct caller); ``options``: Inductor options over the mode's
    (`inductor_options`); ``scope``: `COMPILE_SCOPES` (``EngineConfig.compile_scope``):
    ``"layers"`` compiles each distinct module of the encoder's ``layer_applications()``
    instead of the encoder. Returns the encoder. With `compile_function`, the one place the
    project applies ``torch.compile``."""
    check_compile_scope(scope)
    target = getattr(model, "encoder", model)
    modules = [target]
    if scope == "layers":
        modules = distinct_layers(target)
        _allow_recompiles(len(modules))
    kwargs = _compile_kwargs(mode, options)
    _widen_autograd_cache(backend)
    # Stable keys of the forward's cache: what the compiled graphs read from it becomes part
    # of their key in AOTAutograd's cache (model.orthogonal, `forward_cache_key`).
    name_forward_cache_keys(model)
    with _named_backend(backend):
        for module in modules:
            module.compile(backend=backend, **kwargs)
    return target


def distinct_layers(encoder: nn.Module) -> list[nn.Module]:
    """The distinct layer modules of ``encoder``'s ``layer_applications()``, in the order of
    their first application (ALBERT's shared layer once). A ValueError naming
    ``engine.compile_scope`` when the module has no layers to compile."""
    applications = getattr(encoder, "layer_applications", None)
    if applications is None:
        raise ValueError(
            f"engine.compile_scope=layers: {type(encoder).__name__} has no layer_applications() "
            "to compile layer by layer; use engine.compile_scope=encoder"
        )
    return list({id(layer): layer for _, layer in applications()}.values())


COMPILES_PER_LAYER = 8
"""TorchDynamo's own recompile limit (``recompile_limit``) for one compiled function: the
variants a compiled layer may need (training and evaluation, padded batches and not, ...)."""


def _allow_recompiles(layers: int) -> None:
    """Raises TorchDynamo's per-function and total recompile limits of this process to
    `COMPILES_PER_LAYER` times ``layers`` where they are lower. Distinct layers of one class
    run one ``forward`` whose compiled entries TorchDynamo counts together, and each layer
    needs an entry of its own (the per-forward caches of the encoder are looked up by module,
    so each entry is guarded on its layer's modules): with torch's limit of 8 the ninth
    distinct layer would run eagerly, silently."""
    from torch._dynamo import config as dynamo_config

    wanted = COMPILES_PER_LAYER * layers
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, wanted)
    dynamo_config.accumulated_recompile_limit = max(
        dynamo_config.accumulated_recompile_limit, 2 * wanted
    )


AUTOCAST_REGION_FUNCTIONS = (
    "torch.amp.autocast_mode._enter_autocast",
    "torch.amp.autocast_mode._exit_autocast",
)
"""What a ``with torch.autocast(...)`` inside a compiled region becomes in TorchDynamo's graph
(kernel attention's and TransJect's fp32 products switch autocast off so)."""


def _widen_autograd_cache(backend: str) -> None:
    """Lets AOTAutograd's cache keep two kinds of graph that torch 2.13 leaves out, so that a
    new process loads them instead of tracing and partitioning them again. Set, never unset,
    for the process; only for Inductor (the other backends have no such cache).

    * Graphs that switch autocast on or off inside (`AUTOCAST_REGION_FUNCTIONS`; kernel
      attention's warm first step on the CPU, albert-base at seq 128: 13.3 s before, 3.9 s
      with it; cold 38 s). Sound because the cache key holds what these calls depend on: each
      call's arguments (device, dtype, on or off) are constants of the hashed graph, and the
      key records the autocast state around the graph. Inductor's
      ``unsafe_marked_cacheable_functions`` is torch's way to mark a function so; added to,
      never replaced (a user's own entries stay).
    * Graphs with custom autograd Functions inside
      (``torch._functorch.config.autograd_cache_allow_custom_autograd_functions``, torch 2.7+):
      TransJect's encoder (its gate's `PooledAt`, its eigen-state's `Bf16x3Product`; with the
      forward cache's keys by name, `model.orthogonal.forward_cache_key`, its warm first step
      15.7 -> 8.8 s). Sound because TorchDynamo traces a Function's forward and backward into
      subgraphs of the hashed graph (the higher-order operator ``autograd_function_apply``,
      pure in its inputs): a changed forward or backward is a new key (tested).
    """
    if backend != "inductor":
        return
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    marked = inductor_config.unsafe_marked_cacheable_functions
    missing = {name: torch.__version__ for name in AUTOCAST_REGION_FUNCTIONS if name not in marked}
    if missing:
        inductor_config.unsafe_marked_cacheable_functions = {**marked, **missing}
    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = True


def compile_function(
    fn: Callable,
    backend: str = "inductor",
    mode: str = "default",
    options: dict[str, Any] | None = None,
) -> Callable:
    """``fn`` compiled (``torch.compile``) with the encoder's backend, mode and options: for a
    function of tensors that runs beside the model, such as the pretraining objective's loss
    terms (``pretrain.objective.objective_terms``). Compiled lazily, at its first call."""
    _widen_autograd_cache(backend)
    with _named_backend(backend):
        return torch.compile(fn, backend=backend, **_compile_kwargs(mode, options))


def _compile_kwargs(mode: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """``torch.compile``'s ``mode`` alone, or, with options, the mode's Inductor options with
    ``options`` over them (torch refuses a mode and options together; it merges them the same
    way itself)."""
    if not options:
        return {"mode": None if mode == "default" else mode}
    from torch._inductor import list_mode_options

    base = {} if mode == "default" else list_mode_options(mode)
    return {"options": {**base, **options}}


def use_compile_cache(path: str | None) -> Path:
    """Points this process's compiler caches at ``path`` (``engine.compile_cache_dir``): sets
    ``TORCHINDUCTOR_CACHE_DIR`` to it and ``TRITON_CACHE_DIR`` to its ``triton`` folder, before
    anything is compiled (Inductor reads both when it compiles; the compile workers it starts
    inherit them). ``None`` leaves torch's choice alone. Returns the cache folder in use.
    A path that cannot be created or written is a ValueError naming the key, at start-up rather
    than at the first compilation."""
    if path is None:  # where torch will put it (without creating it: nothing may compile)
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()).absolute()
    folder = Path(os.path.expandvars(os.path.expanduser(path))).absolute()
    try:
        (folder / "triton").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"engine.compile_cache_dir={path!r}: cannot create {folder}: {e.strerror or e}"
        ) from e
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"engine.compile_cache_dir={path!r}: {folder} is not writable")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    return folder


def compile_cache_counts() -> dict[str, int]:
    """Process-wide counts of Inductor's compiled graphs so far: ``loaded`` from its FX-graph
    cache, ``compiled`` (looked up and missed), ``uncached`` (not cacheable, compiled); and of
    AOTAutograd's joint graphs (forward and backward of one compiled region): ``joint_loaded``
    from its cache, ``joint_traced`` traced again (missed, or left out of the cache)."""
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "loaded": int(inductor["fxgraph_cache_hit"]),
        "compiled": int(inductor["fxgraph_cache_miss"]),
        "uncached": int(inductor["fxgraph_cache_bypass"]),
        "joint_loaded": int(aot["autograd_cache_hit"]),
        "joint_traced": int(aot["autograd_cache_miss"] + aot["autograd_cache_bypass"]),
    }


def inductor_options(cfg: EngineConfig) -> dict[str, Any]:
    """``engine.compile_options`` as flat Inductor option names (nested mappings joined with
    dots, as OmegaConf's dotted overrides nest them), each checked against
    ``torch._inductor.config``: an unknown key (with the nearest known ones) or a value of the
    wrong type is a ValueError naming ``engine.compile_options``."""
    options = cfg.compile_options
    if not isinstance(options, dict):
        raise ValueError(
            f"engine.compile_options={options!r} is invalid; valid: a mapping of Inductor "
            "options (torch._inductor.config keys), e.g. {max_autotune_gemm: true}"
        )
    if not options:
        return {}
    if cfg.compile_backend != "inductor":
        raise ValueError(
            f"engine.compile_options needs engine.compile_backend=inductor (got "
            f"{cfg.compile_backend!r}): the options are Inductor's"
        )
    import difflib

    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and prefix not in known:
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
            return
        name = prefix.replace("-", "_")
        if name not in known:
            near = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise ValueError(
                f"engine.compile_options: {prefix!r} is not an Inductor option "
                f"(torch._inductor.config){hint}"
            )
        get_type = getattr(inductor_config, "get_type", None)  # older torch: no type check
        expected = get_type(name) if get_type is not None else None
        plain = isinstance(expected, type) and typing.get_origin(expected) is None
        if plain and not isinstance(value, expected):
            raise ValueError(
                f"engine.compile_options: {prefix}={value!r} is a {type(value).__name__}; "
                f"Inductor wants a {expected.__name__}"
            )
        flat[name] = value

    walk("", options)
    return flat


@contextlib.contextmanager
def _named_backend(backend: str) -> Iterator[None]:
    """Turns torch's InvalidBackend (a RuntimeError) for an unknown backend into a ValueError
    that names the config key and the valid backends."""
    try:
        yield
    except Exception as e:
        if type(e).__name__ != "InvalidBackend":
            raise
        valid = torch._dynamo.list_backends(exclude_tags=())
        raise ValueError(f"engine.compile_backend={backend!r} is invalid; valid: {valid}") from e


def init_distributed(dist: DistEnv, cfg: EngineConfig, device: torch.device) -> None:
    """Joins the process group once (gloo on CPU, NCCL on CUDA); a no-op for one process
    with the torch backend. DeepSpeed always wants a group, even of one."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        return
    if not dist.is_distributed and cfg.backend == "torch":
        return
    export_torch_env(dist)
    if dist.is_distributed:  # one line per process: where each rank runs, for the job log
        print(f"distributed: {dist.describe()}", file=sys.stderr, flush=True)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(minutes=cfg.dist_timeout_minutes)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if cfg.backend == "deepspeed":
        deepspeed = import_deepspeed()
        deepspeed.init_distributed(
            dist_backend=backend, auto_mpi_discovery=False, timeout=timeout, verbose=False
        )
    else:
        torch_dist.init_process_group(backend=backend, timeout=timeout)


class Engine:
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
        check_compatible(cfg, optimizer, self.device)
        if cfg.backend == "deepspeed":  # before any work: a train_batch_size for another world
            cfg.deepspeed_overrides(self.dist.world_size)
        if cfg.backend == "deepspeed" or self.device.type == "cuda":
            # DeepSpeed JIT-builds ops in init_distributed (CPU: shm collectives) and
            # build_optimizer (CUDA: fused LAMB): never wait forever on a killed build's lock.
            prepare_extensions()
        init_distributed(self.dist, cfg, self.device)
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
        self._guard = _StepGuard(self.optimizer)
        self.micro_step = 0  # backward() calls so far
        self._accumulated = 0  # backward() calls since the last step()
        self._poisoned = False
        self._scaler: torch.amp.GradScaler | None = None
        self._ds: Any = None
        self._ddp: nn.Module | None = None
        if cfg.backend == "deepspeed":
            deepspeed = import_deepspeed()

            # DeepSpeed's ZeRO calls an API torch deprecated, once per step: not the user's
            # business, and it would flood every log.
            warnings.filterwarnings(
                "ignore",
                message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                category=FutureWarning,
            )
            self._ds, _, _, _ = deepspeed.initialize(
                model=model,
                optimizer=self.optimizer,
                config=self.deepspeed_config(),
                dist_init_required=False,
            )
        else:
            if self.dist.is_distributed:
                ids = [self.device.index] if self.device.type == "cuda" else None
                self._ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
            if cfg.precision == "fp16":
                self._scaler = torch.amp.GradScaler(
                    "cuda",
                    init_scale=2.0**cfg.fp16_initial_scale_power,
                    growth_interval=cfg.fp16_loss_scale_window,
                )
        self.schedule_cfg = schedule
        self._lamb: Lamb | None = self.optimizer if isinstance(self.optimizer, Lamb) else None
        self.flat_layouts = 0
        """Flat ZeRO partitions whose tensor layout the LAMB was given (0: none, or not LAMB)."""
        if self._lamb is not None and self._ds is not None and cfg.zero_stage in (1, 2):
            zero_optimizer = self._ds.optimizer
            if type(zero_optimizer).__name__ == "DeepSpeedZeroOptimizer":
                self.flat_layouts = attach_zero_layouts(self._lamb, zero_optimizer)
        if self._clips_flat() and not self.flat_layouts:  # DeepSpeed's clipping is off
            raise RuntimeError(
                f"ZeRO-{cfg.zero_stage} gave the optimizer a {type(self._ds.optimizer).__name__}, "
                "not the DeepSpeedZeroOptimizer whose layout the LAMB reads"
            )
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
        self._orthogonal_across_micro_batches = (
            cfg.orthogonal_step_cache and cfg.gradient_accumulation_steps > 1
        )
        maps = [] if cfg.zero3 else orthogonal_modules(model)
        self._orthogonal_maps = bool(maps)
        shard = (
            cfg.orthogonal_shard_maps
            and self.dist.world_size > 1
            and any(  # some matrices large enough to share out
                min(module.parametrizations[name].original.shape[-2:])
                >= cfg.orthogonal_shard_min_size
                for _, module, name in maps
            )
        )
        self.orthogonal_steps: OrthogonalStepCache | None = (
            OrthogonalStepCache(
                DataParallelMapSharding(
                    self.dist.rank, self.dist.world_size, cfg.orthogonal_shard_min_size
                )
                if shard
                else None
            )
            if (self._orthogonal_across_micro_batches or shard) and maps
            else None
        )
        """The orthogonal maps of a training step: evaluated once per optimizer step
        (``orthogonal_step_cache``) and/or in shards over the ranks (``orthogonal_shard_maps``;
        then once per micro-batch without the step cache); None where every forward evaluates
        them itself."""

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
    def orthogonal_summary(self) -> str | None:
        """One line on how a training step evaluates the orthogonal maps, or None where every
        forward evaluates them itself (no maps, or neither option applies)."""
        steps = self.orthogonal_steps
        if steps is None:
            return None
        how = []
        if self._orthogonal_across_micro_batches:
            how.append(
                f"once per optimizer step ({self.cfg.gradient_accumulation_steps} micro-batches)"
            )
        if steps.sharding is not None:
            size = self.cfg.orthogonal_shard_min_size
            how.append(
                f"shared out over {self.dist.world_size} ranks"
                + (f" (matrices from {size} x {size})" if size else "")
            )
        return (
            "orthogonal maps "
            + ", ".join(how)
            + (", before the compiled encoder" if self.compiled else "")
        )

    # -- configuration -------------------------------------------------------------------------

    def deepspeed_config(self) -> dict[str, Any]:
        """The DeepSpeed config dict this engine passes to ``deepspeed.initialize``."""
        cfg = self.cfg
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            # ZeRO-0 in fp32 / bf16-mixed: the gradients sit on the parameters and the engine
            # clips them itself (one norm, kept on the device), so DeepSpeed does not.
            "gradient_clipping": (
                0.0
                if self._clips_gradients() or self._clips_flat()
                else float(cfg.gradient_clipping)
            ),
            "zero_optimization": {"stage": cfg.zero_stage},
            # Our LAMB / AdamW are ordinary torch optimizers: ZeRO partitions their state fine.
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**62,  # the trainer logs; DeepSpeed stays quiet
            "wall_clock_breakdown": False,
            # DeepSpeed's throughput timer synchronises the device at every forward and step
            # (a host stall twice per step on a GPU); the trainer measures throughput itself.
            "timers": {"throughput": {"enabled": False}},
        }
        if self._clips_flat():
            # ZeRO 1-2 with the foreach LAMB: the engine measures the norm (on the device) and
            # the LAMB scales the gradients; DeepSpeed's own norm check reads it on the host.
            config["zero_optimization"]["compute_grad_norm"] = False
        if cfg.precision == "bf16":
            config["bf16"] = {"enabled": True}
        elif cfg.precision == "bf16-mixed":
            # DeepSpeed's forward turns an autocast that it did not configure OFF on CUDA
            # (deepspeed.runtime.torch_autocast.autocast_if_enabled): without this section the
            # "mixed" forward ran in fp32 on a GPU (measured on an H100, albert-base seq 512:
            # 0.44 s per step instead of 0.075 s). No lower-precision modules: gradients are
            # reduced in fp32, as the parameters are fp32 (the LAMB's flat layout stays one dtype).
            config["torch_autocast"] = {
                "enabled": True,
                "dtype": "bfloat16",
                "lower_precision_safe_modules": [],
            }
        elif cfg.precision == "fp16":
            config["fp16"] = {
                "enabled": True,
                "loss_scale": 0,  # dynamic
                "initial_scale_power": cfg.fp16_initial_scale_power,
                "loss_scale_window": cfg.fp16_loss_scale_window,
                "hysteresis": cfg.fp16_hysteresis,
                "min_loss_scale": cfg.fp16_min_loss_scale,
            }
        return deep_merge(config, cfg.deepspeed_overrides(self.world_size))

    def _clips_gradients(self) -> bool:
        """True when the engine clips the gradients itself (torch backend; DeepSpeed ZeRO-0 in
        fp32 / bf16-mixed, where the reduced gradients sit on the parameters)."""
        cfg = self.cfg
        return cfg.backend == "torch" or (
            cfg.zero_stage == 0 and cfg.precision in ("fp32", "bf16-mixed")
        )

    def _clips_flat(self) -> bool:
        """True when the engine measures the gradient norm on DeepSpeed's ZeRO 1-2 partitions
        and the ``foreach`` LAMB applies the clipping (fp32 / bf16-mixed)."""
        cfg = self.cfg
        return (
            cfg.backend == "deepspeed"
            and cfg.zero_stage in (1, 2)
            and cfg.precision in ("fp32", "bf16-mixed")
            and isinstance(getattr(self, "optimizer", None), Lamb)
        )

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
        if self._ds is not None and self.cfg.precision == "fp16":
            opt = self._ds.optimizer
            return float(getattr(opt, "cur_scale", None) or getattr(opt, "loss_scale", 1.0))
        if self._scaler is not None:
            return float(self._scaler.get_scale())
        return 1.0

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    # -- the step ------------------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.cfg.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        # With DeepSpeed, its forward enters its own autocast (the config's torch_autocast)
        # inside this one. Keeping this outer one too matters: without it, activation
        # checkpointing under ZeRO-3 recomputed a different number of tensors (the recompute
        # runs outside DeepSpeed's forward).
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` with its tensors on ``self.device``; an ``attention_mask`` without any
        padding (read on the host, where it is free, before the copy) becomes None, and so does
        any other ``attention_mask*`` entry without padding.

        A model cannot read a mask on an accelerator without stopping the host until the
        device catches up, so it treats such a mask as "may be padded"
        (``model.attention.base.batch_is_padded``) and the attention keeps a mask, which rules
        out SDPA's flash and cuDNN kernels. None says "no padding" for free: every model of
        this project reads a missing mask as all real tokens."""
        return batch_to_device(batch, self.device)

    def compile_beside(self, fn: Callable) -> Callable:
        """``fn`` compiled like the encoder when the engine compiles it (`compile_function`,
        ``engine.compile_backend``, ``compile_mode`` and ``compile_options``), else ``fn``
        itself: for the tensor work each step runs beside the model, such as the objective's
        loss terms."""
        if not self.compiled:
            return fn
        cfg = self.cfg
        return compile_function(fn, cfg.compile_backend, cfg.compile_mode, inductor_options(cfg))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on this rank's micro-batch (tensors must be on ``self.device``)."""
        with self.autocast(), self._orthogonal_micro_batch():
            if self._ds is not None:
                return self._ds(*args, **kwargs)
            if self._ddp is not None:
                # DDP decides in its forward whether the backward all-reduces (it prepares the
                # reducer there), so no_sync must hold around the forward, not only the
                # backward: the micro-batches before the last reduce nothing, and their
                # backward need not reach every parameter (the orthogonal step cache's does not).
                with (
                    self._ddp.no_sync()
                    if not self._next_is_boundary()
                    else contextlib.nullcontext()
                ):
                    return self._ddp(*args, **kwargs)
            return self.module(*args, **kwargs)

    def _orthogonal_micro_batch(self) -> contextlib.AbstractContextManager:
        """Tells the model which micro-batch of the step a training forward runs, so that it
        takes its orthogonal maps from the step's cache (``orthogonal_step_cache``). Forwards in
        eval mode or without gradients (evaluation) run without it: they evaluate the maps of
        the current parameters themselves and leave the step's matrices alone."""
        steps = self.orthogonal_steps
        if (
            not self.module.training
            or not torch.is_grad_enabled()
            or self._accumulated >= self.cfg.gradient_accumulation_steps
        ):
            return contextlib.nullcontext()
        if steps is None:  # every forward maps for itself: eagerly too, when compiled
            if self.compiled and self._orthogonal_maps:
                return self._maps_up_front()
            return contextlib.nullcontext()
        if not self._orthogonal_across_micro_batches:  # sharded, each micro-batch its own maps
            index, last = 0, True
        else:
            index, last = self._accumulated, self._next_is_boundary()
        if self.compiled:
            return self._step_maps_up_front(steps, index, last)
        return steps.micro_batch(index, last)

    @contextlib.contextmanager
    def _step_maps_up_front(
        self, steps: OrthogonalStepCache, index: int, last: bool
    ) -> Iterator[None]:
        """``compile``: the step's orthogonal maps, evaluated eagerly (with the step cache and
        the sharding) before the compiled encoder runs (``_maps_up_front``)."""
        with steps.micro_batch(index, last), self._maps_up_front():
            yield

    @contextlib.contextmanager
    def _maps_up_front(self) -> Iterator[None]:
        """``compile``: the orthogonal maps evaluated eagerly into the forward's orthogonal
        cache before the compiled encoder runs; the compiled graph takes them as inputs instead
        of evaluating its own (it skips maps already in the active cache), and their gradient
        leaves the graph into the eager maps. Eagerly, the Cayley maps run as the block inverse
        (matrix products); traced into the graph they would be the LU solve (2.05x slower for
        TransJect's 121 maps on an H100)."""
        with orthogonal_cache() as store:
            evaluate_orthogonal_maps(self.module, store)
            yield

    def all_finite(self, loss: torch.Tensor) -> bool:
        """True when ``loss`` is finite on every rank (one small all-reduce when distributed)."""
        bad = torch.tensor([0.0 if bool(torch.isfinite(loss.detach()).all()) else 1.0])
        if self._collective:
            bad = bad.to(self.device)
            torch_dist.all_reduce(bad, op=torch_dist.ReduceOp.MAX)
        return bad.item() == 0.0

    def backward(self, loss: torch.Tensor, defer: bool = False) -> bool | None:
        """Backpropagates one micro-batch's loss (averaged over accumulation steps by the engine).
        Returns False when some rank's loss is not finite; that step's update will be skipped.
        ``defer=True``: no host synchronisation; the finiteness goes into a device flag that
        the step reads (all ranks agree there), and None is returned."""
        finite: bool | None
        if defer:
            ok = torch.isfinite(loss.detach()).all()
            self._bad = ~ok if self._bad is None else self._bad | ~ok
            loss = torch.where(ok, loss, torch.zeros_like(loss))  # = loss * 0 when not finite
            finite = None
        else:
            finite = self.all_finite(loss)
            if not finite:
                self._poisoned = True
                loss = loss * 0.0  # keeps DeepSpeed's per-micro-step bookkeeping intact
        last = self._next_is_boundary()
        if self._ds is not None:
            self._ds.backward(loss)
            # DeepSpeed counts micro-steps in its step(), which updates only at the boundary;
            # the boundary's step() is ours (below), so the update can be vetoed.
            if not last:
                self._ds.step()
        else:
            loss = loss / self.cfg.gradient_accumulation_steps
            if self._scaler is not None:
                loss = self._scaler.scale(loss)
            no_sync = (
                self._ddp.no_sync()
                if self._ddp is not None and not last
                else contextlib.nullcontext()
            )
            with no_sync:
                loss.backward()
        self.micro_step += 1
        self._accumulated += 1
        if self.orthogonal_steps is not None and (
            last or not self._orthogonal_across_micro_batches
        ):
            # The maps' gradients reached the parameters in this backward: drop the maps.
            self.orthogonal_steps.finish()
        return finite

    def _next_is_boundary(self) -> bool:
        return self._accumulated + 1 == self.cfg.gradient_accumulation_steps

    def step(self, defer: bool = False) -> Any:
        """The optimizer step at an accumulation boundary: clip, update (unless skipped),
        advance the schedule, zero the gradients. Returns a :class:`StepResult`; with
        ``defer=True`` a :class:`DeferredStep` of device tensors, decided without a host
        synchronisation where ``self.deferred`` (else the synchronising step's result)."""
        if not self.at_boundary:
            raise RuntimeError(
                f"Engine.step() after {self._accumulated} backward() calls since the last step: "
                f"call it once every {self.cfg.gradient_accumulation_steps} backward() calls"
            )
        self._accumulated = 0
        if self.orthogonal_steps is not None:  # the parameters change: the next step maps anew
            self.orthogonal_steps.reset()
        if defer and self.deferred:
            return self._deferred_step()
        result = self._synchronising_step()
        if not defer:
            return result
        return DeferredStep(
            skipped=torch.tensor(result.skipped),
            nonfinite_loss=torch.tensor(result.nonfinite_loss),
            grad_norm=None if result.grad_norm is None else torch.tensor(result.grad_norm),
            lr=result.lr,
            loss_scale=result.loss_scale,
        )

    def _synchronising_step(self) -> StepResult:
        poisoned, self._poisoned = self._poisoned, False
        if self._bad is not None:  # from backward(defer=True): ask the host now
            bad, self._bad = self._bad, None
            poisoned = self._any_rank_flag(bad) or poisoned
        self.sync_schedule()  # the host decides this step: it needs the schedule's position
        self._guard.skip = poisoned
        lr = self.lr
        grad_norm: float | None
        try:
            if self._ds is not None:
                norm = self._clip_gradients() if self._clips_gradients() else None
                if self._clips_flat():
                    norm = self._clip_flat_gradients()
                grad_norm = None if norm is None else float(norm)
                if grad_norm is not None and not math.isfinite(grad_norm):
                    self._guard.skip = True  # as DeepSpeed skips a non-finite gradient norm
                self._ds.step()
                applied = not self._guard.skip and bool(self._ds.was_step_applied())
                if grad_norm is None:
                    norm = self._ds.get_global_grad_norm()
                    grad_norm = None if norm is None else float(norm)
            else:
                grad_norm, applied = self._torch_step(poisoned)
        finally:
            self._guard.skip = False
            if self._lamb is not None:
                self._lamb.grad_scale = None
        if applied:
            self.scheduler.step()
            if self._applied is not None:
                self._applied += 1
        if grad_norm is not None and not math.isfinite(grad_norm):
            grad_norm = float("nan") if math.isnan(grad_norm) else float("inf")
        return StepResult(
            skipped=not applied,
            nonfinite_loss=poisoned,
            grad_norm=grad_norm,
            lr=lr,
            loss_scale=self.loss_scale,
        )

    def _deferred_step(self) -> DeferredStep:
        """The step decided on the device (see the module docstring)."""
        lamb = self._lamb
        assert lamb is not None
        self._schedule_on_device()
        assert self._applied is not None and self._lr_table is not None
        bad = self._bad
        if bad is None:  # made on the device: a copy from the host would synchronise
            bad = torch.zeros((), dtype=torch.bool, device=self.device)
        self._bad = None
        if self._poisoned:  # a synchronising backward() in this step saw a non-finite loss
            bad = torch.ones_like(bad)
            self._poisoned = False
        if self._collective:
            flag = bad.to(torch.float32)
            torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX)
            bad = flag > 0
        grad_norm: Any = None
        ok = ~bad
        if self._clips_gradients():
            grad_norm = self._clip_gradients()
            ok = ok & torch.isfinite(grad_norm)
        elif self._clips_flat():
            grad_norm = self._clip_flat_gradients()
            ok = ok & torch.isfinite(grad_norm)
        position = self._applied.clamp(max=self._lr_table.numel() - 1).reshape(1)
        lamb.skip = ~ok
        lamb.lr_multiplier = self._lr_table.index_select(0, position).reshape(())
        lr = self.lr
        try:
            if self._ds is not None:
                self._ds.step()
                if self.cfg.zero_stage > 0:  # DeepSpeed checked the norm itself (on the host)
                    if not self._ds.was_step_applied():
                        ok = torch.zeros_like(ok)
                    norm = self._ds.get_global_grad_norm()
                    if norm is not None:
                        grad_norm = norm if torch.is_tensor(norm) else torch.tensor(float(norm))
            else:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        finally:
            lamb.skip = None
            lamb.lr_multiplier = None
            lamb.grad_scale = None
        self._applied += ok.to(self._applied.dtype)
        # The host's schedule advances as if the update was applied; sync_schedule() corrects it
        # to the device's count when the host reads it (logging, checkpoints).
        self.scheduler.step()
        self._unsynced_steps += 1
        return DeferredStep(
            skipped=~ok, nonfinite_loss=bad, grad_norm=grad_norm, lr=lr, loss_scale=1.0
        )

    def _schedule_on_device(self) -> None:
        """The schedule's multipliers for positions 0 .. total_steps (its first group's
        lambda; held after the end, as ``lr_multiplier``) and the count of applied updates, on
        the device. Made through pinned memory: no host synchronisation."""
        if self._lr_table is None:
            fn = self.scheduler.lr_lambdas[0]
            values = [fn(k) for k in range(self.schedule_cfg.total_steps + 1)]
            self._lr_table = _to_device(torch.tensor(values, dtype=torch.float64), self.device)
        if self._applied is None:
            self._applied = _to_device(
                torch.tensor(self.scheduler.last_epoch, dtype=torch.long), self.device
            )

    @property
    def unsynced_schedule(self) -> torch.Tensor | None:
        """The device's count of applied updates while the host's scheduler has not caught up
        with it (deferred steps since the last :meth:`sync_schedule`), else None: a caller that
        reads device values anyway can read this one with them and pass it to
        :meth:`sync_schedule`."""
        return self._applied if self._unsynced_steps and self._applied is not None else None

    def sync_schedule(self, applied: int | None = None) -> None:
        """Bring the host's scheduler (and the optimizer's ``lr``) to the number of updates the
        device applied, after deferred steps (synchronises once, unless ``applied``, the value
        of :attr:`unsynced_schedule`, was read already; nothing to do without deferred steps)."""
        if not self._unsynced_steps or self._applied is None:
            return
        applied = int(self._applied) if applied is None else int(applied)
        self._unsynced_steps = 0
        sched = self.scheduler
        if sched.last_epoch == applied:
            return
        sched.last_epoch = applied
        sched._step_count = applied + 1  # what as many scheduler.step() calls leave
        lrs = [
            base * fn(applied) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)
        ]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs

    def _any_rank_flag(self, flag: torch.Tensor) -> bool:
        """Collective when distributed: whether the device flag is set on any rank."""
        t = flag.to(device=self.device, dtype=torch.float32).reshape(1)
        if self._collective:
            torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def _clip_gradients(self) -> torch.Tensor:
        """The global norm of the gradients on the parameters (a device tensor), which are then
        clipped to ``gradient_clipping`` (no host synchronisation: torch's foreach clip)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.device)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if self.cfg.gradient_clipping > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.gradient_clipping, norm)
        return norm

    def _clip_flat_gradients(self) -> torch.Tensor:
        """ZeRO 1-2 with the foreach LAMB: the global norm of the reduced gradient partitions
        (DeepSpeed's ``averaged_gradients``, summed over the data-parallel group: what its own
        norm reads), kept on the device; the LAMB scales the gradients by
        ``min(1, gradient_clipping / (norm + 1e-6))`` as it steps (DeepSpeed's formula)."""
        zero = self._ds.optimizer
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for i in range(len(zero.bit16_groups)):
            grads = [
                g
                for g in (zero.averaged_gradients.get(i) or [])
                if not getattr(g, "_zero_padding", False)
            ]
            squares = (
                torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()
                if grads
                else torch.zeros((), dtype=torch.float32, device=self.device)
            )  # every rank joins the all-reduce, with or without gradients here
            group = zero.real_dp_process_group[i]
            if self._collective and torch_dist.get_world_size(group) > 1:
                torch_dist.all_reduce(squares, group=group)
            total = total + squares
        norm = total.sqrt()
        if self.cfg.gradient_clipping > 0 and self._lamb is not None:
            self._lamb.grad_scale = (self.cfg.gradient_clipping / (norm + 1e-6)).clamp(max=1.0)
        return norm

    def _torch_step(self, poisoned: bool) -> tuple[float, bool]:
        if self._scaler is not None:
            self._scaler.unscale_(self.optimizer)
        norm = float(self._clip_gradients())
        applied = not poisoned
        if self._scaler is not None:
            if poisoned:
                self._scaler.update()
            else:
                scale = self._scaler.get_scale()
                self._scaler.step(self.optimizer)
                self._scaler.update()
                applied = self._scaler.get_scale() >= scale  # lowered scale = overflow skip
        elif applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, applied

    # -- state ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[nn.Module]:
        """Collective. Inside, ``self.module`` holds full parameters on every rank (ZeRO-3
        gathers them; otherwise nothing to do). Read-only: changes are not written back."""
        if self._ds is not None and self.cfg.zero_stage == 3:
            deepspeed = import_deepspeed()
            params = list(self.module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                yield self.module
        else:
            yield self.module

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective. The model's full state dict in fp32 on CPU, on every rank: fp32 master
        weights where DeepSpeed keeps them (ZeRO 1-3, bf16, fp16), buffers as they are."""
        master: dict[str, torch.Tensor] = {}
        if self._ds is not None and (
            self.cfg.zero_stage > 0 or self.cfg.precision in ("bf16", "fp16")
        ):
            from deepspeed.utils import safe_get_full_fp32_param

            by_id: dict[int, torch.Tensor] = {}
            for name, p in self.module.named_parameters(remove_duplicate=False):
                if id(p) not in by_id:  # every rank calls this in the same order (collective)
                    full = safe_get_full_fp32_param(p)
                    if full is None:
                        raise RuntimeError(f"DeepSpeed returned no fp32 master weights for {name}")
                    by_id[id(p)] = full.detach().float().cpu().clone()
                master[name] = by_id[id(p)]
        with self.gathered_parameters() as module:
            state = {}
            for name, value in module.state_dict().items():
                state[name] = master.get(name, value).detach().float().cpu().clone()
        return state

    def save(self, directory: Path) -> None:
        """Collective. Writes the engine state (model, optimizer, loss scaler; schedule) into
        ``directory`` (an existing, empty staging directory shared by all ranks)."""
        directory = Path(directory)
        self.sync_schedule()
        extra = {
            "scheduler": self.scheduler.state_dict(),
            "micro_step": int(self.micro_step),
            "layout": self.layout(),
        }
        if self._ds is not None:
            self._ds.save_checkpoint(
                str(directory.parent),
                tag=directory.name,
                client_state={"albatross": extra},
                save_latest=False,
            )
            return
        if self.rank == 0:
            _check_weights_only(extra, "the engine's 'albatross' state (schedule, counters)")
            state = {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": None if self._scaler is None else self._scaler.state_dict(),
                "albatross": extra,
            }
            tmp = directory / "engine.pt.tmp"
            torch.save(state, tmp)
            os.replace(tmp, directory / "engine.pt")

    def layout(self) -> dict[str, Any]:
        """How this engine splits the global batch and its state: recorded in every checkpoint
        (the ``"albatross"`` state's ``"layout"``) so that a load on another world size can
        convert the counters."""
        return {
            "world_size": int(self.world_size),
            "micro_batch_size": int(self.cfg.micro_batch_size),
            "gradient_accumulation_steps": int(self.cfg.gradient_accumulation_steps),
            "backend": self.cfg.backend,
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
        from engine import reshard

        if self._accumulated:
            # The micro-batches' gradients so far (on the parameters, and the orthogonal step
            # cache's on its matrices) belong to the weights being replaced.
            raise RuntimeError(
                f"Engine.load({directory}) between two micro-batches of an optimizer step "
                f"({self._accumulated} of {self.cfg.gradient_accumulation_steps} backward() "
                "calls done): load at a step boundary, before the first forward or after step()"
            )
        directory = Path(directory)
        if self._ds is not None:
            saved_world = reshard.saved_world_size(directory)
            if saved_world is not None and saved_world != self.world_size:
                extra = self._load_universal(directory, universal_dir)
            else:
                path, client = self._ds.load_checkpoint(
                    str(directory.parent),
                    tag=directory.name,
                    load_optimizer_states=True,
                    load_lr_scheduler_states=False,
                )
                if path is None or client is None or "albatross" not in client:
                    raise RuntimeError(f"DeepSpeed could not load the checkpoint in {directory}")
                extra = client["albatross"]
        else:
            state = load_engine_file(directory / "engine.pt", self.device)
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self._scaler is not None and state.get("scaler") is not None:
                self._scaler.load_state_dict(state["scaler"])
            extra = state["albatross"]
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
        if self.orthogonal_steps is not None:  # maps of the loaded parameters from now on
            self.orthogonal_steps.reset()

    def _load_universal(self, directory: Path, universal_dir: Path | None) -> dict[str, Any]:
        """Collective: convert (rank 0; cached) and load ``directory`` in DeepSpeed's universal
        mode. Returns the ``"albatross"`` client state."""
        from engine import reshard

        target = reshard.universal_path(directory) if universal_dir is None else universal_dir
        error: Exception | None = None
        if self.rank == 0:
            try:
                reshard.to_universal(directory, target)
            except Exception as exc:  # reported on every rank below, not left in a barrier
                error = exc
        (failed,) = self.all_reduce_max([float(error is not None)])
        if error is not None:
            raise error
        if failed:
            raise reshard.ReshardError(
                f"{directory}: the conversion to a universal checkpoint failed on rank 0"
            )
        config = self._ds._config
        config.load_universal_checkpoint = True
        try:
            path, client = self._ds.load_checkpoint(
                str(target.parent),
                tag=target.name,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
            )
        finally:
            config.load_universal_checkpoint = False
        if self.cfg.zero_stage == 3:
            reshard.repair_zero3_load(self._ds.optimizer, target)
        if path is None or client is None or "albatross" not in client:
            raise RuntimeError(
                f"DeepSpeed could not load the universal checkpoint in {target} "
                f"(converted from {directory})"
            )
        return client["albatross"]

    # -- collectives for the trainer -----------------------------------------------------------

    def barrier(self) -> None:
        if self._collective:
            torch_dist.barrier()

    def all_reduce_max(self, values: list[float]) -> list[float]:
        """Element-wise max of ``values`` over ranks (for flags: stop requested, budget hit).
        Host values, exchanged without touching the GPU: one process needs no exchange, and on
        NCCL they go through a gloo group made for them (an NCCL all-reduce would wait for the
        GPU to finish its queued work: a host synchronisation at every step)."""
        if not self._collective:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64)
        group = self._flags_group()
        if group is None and torch_dist.get_backend() != "gloo":
            t = t.to(self.device)
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX, group=group)
        return t.cpu().tolist()

    def _flags_group(self) -> Any:
        """Collective on first use: a gloo process group for host flags when the default group
        is not gloo (None: use the default group, on the device, when gloo is not available)."""
        if torch_dist.get_backend() == "gloo":
            return None
        if self._host_group is None:
            try:
                timeout = timedelta(minutes=self.cfg.dist_timeout_minutes)
                self._host_group = torch_dist.new_group(backend="gloo", timeout=timeout)
            except Exception as e:  # no gloo in this build: the device path, synchronising
                log.warning("no gloo group for host flags (%s); using the default group", e)
                self._host_group = False
        return self._host_group or None

    def any_rank(self, flag: bool) -> bool:
        """Collective: whether ``flag`` is true on any rank."""
        return bool(self.all_reduce_max([float(flag)])[0])

    def all_reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean of a float64 CPU vector over ranks (for logged metrics)."""
        t = values.detach().to(torch.float64)
        if self._collective:
            t = t.to(self.device)
            torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
            t = t / self.world_size
        return t.cpu()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the CPU) on ``device``, copied without a host synchronisation on CUDA."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


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


def _check_weights_only(obj: Any, what: str) -> None:
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


def shutdown() -> None:
    """Leaves the process group (if any), so the process exits cleanly, and forgets the groups
    DeepSpeed cached on it: a later engine in the same process (a sweep, the tests) then joins
    a new group instead of failing on a destroyed one ("Group ... is not registered")."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        for name in (
            "_WORLD_GROUP",
            "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
            "_DATA_PARALLEL_GROUP",
            "_MODEL_PARALLEL_GROUP",
            "_TENSOR_MODEL_PARALLEL_GROUP",
        ):
            if hasattr(groups, name):
                setattr(groups, name, None)
        for name in (
            "_EXPERT_PARALLEL_GROUP",
            "_EXPERT_PARALLEL_GROUP_RANKS",
            "_EXPERT_DATA_PARALLEL_GROUP",
            "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
            "_ALL_TO_ALL_GROUP",
        ):
            cached = getattr(groups, name, None)
            if isinstance(cached, dict):
                cached.clear()
