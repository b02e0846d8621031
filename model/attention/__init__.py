"""The attention registry: one entry per family, one file per family.

`ATTENTION_REGISTRY.get(name)` returns the `AttentionFamily` for a config string; an unknown name
raises ValueError naming the valid ones. Users can add a family with `register_attention`.
See `model/attention/base.py` for the contract.
"""

from model.attention import kernel, softmax, tisa, transject
from model.attention.base import (
    Attention,
    AttentionFamily,
    AttentionOutput,
    AttentionRegistry,
    FamilyState,
    LayerContext,
    MultiHeadAttention,
    ScoreKernel,
)

ATTENTION_REGISTRY = AttentionRegistry()
for _module in (softmax, tisa, kernel, transject):
    ATTENTION_REGISTRY.register(_module.FAMILY)


def register_attention(family: AttentionFamily) -> AttentionFamily:
    """Adds a user-defined family to the registry (call before building a config that names it)."""
    return ATTENTION_REGISTRY.register(family)


__all__ = [
    "ATTENTION_REGISTRY",
    "Attention",
    "AttentionFamily",
    "AttentionOutput",
    "AttentionRegistry",
    "FamilyState",
    "LayerContext",
    "MultiHeadAttention",
    "ScoreKernel",
    "register_attention",
]
