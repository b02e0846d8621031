"""The forward's cache: what one forward of a model makes once and every application of a
shared layer reuses (ALBERT's sharing runs one layer L times): the orthogonal matrices of
`model.orthogonal` and the fused Q/K/V weight and bias of
`model.attention.base.MultiHeadAttention`. Models open it around their forward
(`forward_cache()`); a module reads and fills it through `active_forward_cache()`, under its
`forward_cache_key`. Activation checkpointing recomputes layers during backward, after the
forward's block has closed: the encoder hands each layer the forward's dict (``store``) so the
recomputation sees the very same tensors.

Entries are keyed by `forward_cache_key(module)`: the module's name in the model once
`name_forward_cache_keys` has named it (the engine names the model it compiles), its `id`
before that. A compiled graph that reads an entry made before it runs (orthogonal maps put
there before the compiled encoder; the fused Q/K/V weights before each compiled layer) records
the key in the source of that input, and AOTAutograd's cache key holds the sources: with `id`
keys, memory addresses, no new process ever found the graph it had saved, and traced and
partitioned it again; names are the same in every process.

The active cache is held in a module-level list of one entry (not a `contextvars.ContextVar`,
nor an attribute of some object): TorchDynamo traces list and dict operations but graph-breaks
on `ContextVar.get`, so with a ContextVar a compiled encoder (`EngineConfig.compile`) would
split at every cached weight; compiled code reading the list is guarded on which cache is
active. Like `torch.nn.utils.parametrize.cached()`, which also keeps global state, it assumes
that threads of one process do not run forwards concurrently (the autograd thread that
recomputes checkpointed layers runs while the caller waits in backward; DataLoader workers are
processes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

_ACTIVE: list[dict[str | int, Any] | None] = [None]
"""The cache of the innermost `forward_cache()` block (None outside every block), in a list
of one entry (module docstring); each block restores the outer one. Compiled code reading it
is guarded on which cache is active, not on how deep the blocks nest, as it was through a
stack's top: a layer compiled on its own (``engine.compile_scope: layers``) and recomputed by
activation checkpointing re-enters its forward's cache one block shallower, and was compiled
again."""

FORWARD_CACHE_KEY = "_forward_cache_key"
"""The attribute `name_forward_cache_keys` sets on a module: its key in the forward's cache."""


def forward_cache_key(module: nn.Module) -> str | int:
    """The key of `module`'s entries in the forward's cache: its name in the model
    `name_forward_cache_keys` named, the same in every process, or its `id` if it was never
    named (then a compiled graph that reads the entry cannot be found again by a new process
    in the compiler's cache; eager code does not mind)."""
    return getattr(module, FORWARD_CACHE_KEY, None) or id(module)


def name_forward_cache_keys(model: nn.Module) -> None:
    """Keys every module of `model` in the forward's cache by its qualified name in `model`
    (the root by its class name), so that a compiled graph reading cached entries has the same
    cache key in every process (module docstring). Names are unique within `model`, so two of
    its modules never share an entry; call it on the whole model a forward runs (the engine
    calls it on the model it compiles), not on two models whose forwards share one cache."""
    for name, module in model.named_modules():
        object.__setattr__(module, FORWARD_CACHE_KEY, name or f"<{type(model).__name__}>")


@contextlib.contextmanager
def forward_cache(
    store: dict[str | int, Any] | None = None,
) -> Iterator[dict[str | int, Any]]:
    """Within the block the forward's cache is active; yields its dict, keyed by
    `forward_cache_key(module)`. Without `store`, an already active cache is reused (nesting)
    or a new one started; with `store`, that dict becomes the active cache (to re-enter a
    forward's cache in a recompute)."""
    outer = _ACTIVE[0]
    if store is None:
        store = outer if outer is not None else {}
    _ACTIVE[0] = store
    try:
        yield store
    finally:
        _ACTIVE[0] = outer


def active_forward_cache() -> dict[str | int, Any] | None:
    """The cache of the enclosing `forward_cache()` block, or None outside one."""
    return _ACTIVE[0]
