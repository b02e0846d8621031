"""The optimizer step of the engine: a step's result (`StepResult`, or `DeferredStep` when its
host values are read later), backward with gradient accumulation, the finite check, clipping,
the optimizer and scheduler step on either backend, and the device-side schedule. `Stepping`
holds the `Engine`'s methods for this job (`engine/engine.py` composes it)."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist

from albatross import compat
from engine.compile import compile_function
from engine.config import inductor_options


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


class StepGuard:
    """Lets the engine veto the wrapped optimizer's update while DeepSpeed still runs its step
    bookkeeping (zeroing and re-partitioning gradients) around it."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.skip = False

        def wrap(original: Callable) -> Callable:
            @functools.wraps(original)
            def guarded_step(*args: Any, **kwargs: Any) -> Any:
                if self.skip:
                    return None
                return original(*args, **kwargs)

            return guarded_step

        compat.wrap_optimizer_step(optimizer, wrap)


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


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the CPU) on ``device``, copied without a host synchronisation on CUDA."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@contextlib.contextmanager
def _all_entered(managers: list[contextlib.AbstractContextManager]) -> Iterator[None]:
    """Enters ``managers`` in order (and leaves them in reverse)."""
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


class Stepping:
    """The `Engine`'s step methods (a mixin: the state they use is set up by `Engine`)."""

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
        with self.autocast(), self._hooks_micro_batch():
            return self.backend.forward(args, kwargs, self._next_is_boundary())

    def _hooks_micro_batch(self) -> contextlib.AbstractContextManager:
        """The model's step hooks around a training forward (`model.step_hooks`), told which
        micro-batch of the step it runs. Forwards in eval mode or without gradients
        (evaluation) run outside them: they leave the step alone."""
        hooks = self.step_hooks
        if (
            not hooks
            or not self.module.training
            or not torch.is_grad_enabled()
            or self._accumulated >= self.cfg.gradient_accumulation_steps
        ):
            return contextlib.nullcontext()
        index, last = self._accumulated, self._next_is_boundary()
        if len(hooks) == 1:
            return hooks[0].micro_batch(index, last)
        return _all_entered([each.micro_batch(index, last) for each in hooks])

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
        self.backend.backward(loss, last)
        self.micro_step += 1
        self._accumulated += 1
        for hooks in self.step_hooks:
            hooks.after_backward(last)
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
        for hooks in self.step_hooks:  # the parameters are about to change
            hooks.before_optimizer_step()
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
            grad_norm, applied = self.backend.step(poisoned)
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
        ok = ~bad
        grad_norm = self.backend.clip_gradients()
        if grad_norm is not None:
            ok = ok & torch.isfinite(grad_norm)
        position = self._applied.clamp(max=self._lr_table.numel() - 1).reshape(1)
        lamb.skip = ~ok
        lamb.lr_multiplier = self._lr_table.index_select(0, position).reshape(())
        lr = self.lr
        try:
            ok, grad_norm = self.backend.deferred_step(ok, grad_norm)
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
        compat.set_scheduler_step_count(sched, applied + 1)
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
