"""What a model needs from a training step beyond forward and backward, as a small hook protocol
the training engine calls without knowing what implements it.

A part of the model that wants a say in the step (the orthogonal maps evaluated once per
optimizer step and shared out over the ranks: `model.orthogonal_step`) provides `StepHooks`
through `model.step_hooks`; the engine asks `model.step_hooks.step_hooks(model, context)` once,
at start-up, and calls every `StepHooks` it got at fixed points of each step:

    for each training micro-batch i of a step (last: the step's last one):
        with hooks.micro_batch(i, last):     # around the forward (training forwards only)
            forward
        backward; hooks.after_backward(last)
    hooks.before_optimizer_step()            # at the boundary: the parameters will change
    (checkpoint load)  hooks.after_load()    # the parameters were replaced

The `HookContext` says how the step runs (ranks, accumulation, compilation, ZeRO-3) and hands
the one collective a hook may need (a differentiable all-gather over the data-parallel ranks),
so that the model stays single-device code: no process group or DeepSpeed is touched here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class HookContext:
    """How the training step runs, for the providers of `StepHooks`."""

    rank: int = 0
    """This process's rank among the data-parallel ranks."""
    world_size: int = 1
    """Data-parallel ranks (processes)."""
    accumulation: int = 1
    """Micro-batches per optimizer step (``engine.gradient_accumulation_steps``)."""
    compiled: bool = False
    """The model's encoder is compiled (``torch.compile``) by the engine."""
    zero3: bool = False
    """Parameters are partitioned over the ranks (DeepSpeed ZeRO-3) and gathered only around
    each module's own forward."""
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Every rank's tensor concatenated along dim 0 in rank order (each rank passes the same
    shape), differentiable: its backward hands each rank the gradient of its part summed over
    the ranks. None with one process."""


class StepHooks:
    """The hooks of one part of a model; each does nothing unless overridden."""

    def micro_batch(self, index: int, last: bool) -> contextlib.AbstractContextManager:
        """Entered around the forward(s) of training micro-batch ``index`` (0-based) of an
        optimizer step; ``last``: the step's last micro-batch. Only forwards in training mode
        with gradients on: evaluation forwards run outside every hook."""
        return contextlib.nullcontext()

    def after_backward(self, last: bool) -> None:
        """After the backward of a micro-batch (``last``: the step's last one)."""

    def before_optimizer_step(self) -> None:
        """At the accumulation boundary, before the optimizer changes the parameters."""

    def after_load(self) -> None:
        """After a checkpoint replaced the parameters."""

    def summary(self) -> str | None:
        """One line for the run's log on what the hooks do, or None."""
        return None


HookProvider = Callable[[nn.Module, HookContext], "StepHooks | None"]
"""Given the model and the context: its hooks, or None where it has nothing to do."""
