"""The model's step hooks (`model.hooks.StepHooks`) for the training engine: those of the
orthogonal maps (`model.orthogonal_step`) and of any provider registered from outside the
package (`register_step_hooks`, e.g. by an attention family from an installed package)."""

from __future__ import annotations

from torch import nn

from model.hooks import HookContext, HookProvider, StepHooks
from model.orthogonal_step import orthogonal_step_hooks

_PROVIDERS: list[HookProvider] = [orthogonal_step_hooks]


def register_step_hooks(provider: HookProvider) -> HookProvider:
    """Adds ``provider`` to those `step_hooks` asks (once per provider); returns it (usable as
    a decorator)."""
    if provider not in _PROVIDERS:
        _PROVIDERS.append(provider)
    return provider


def step_hooks(model: nn.Module, context: HookContext) -> list[StepHooks]:
    """The hooks the providers give ``model`` in ``context`` (in registration order; empty
    where none has anything to do)."""
    found = (provider(model, context) for provider in _PROVIDERS)
    return [hooks for hooks in found if hooks is not None]


__all__ = ["HookContext", "StepHooks", "register_step_hooks", "step_hooks"]
