"""The attention families: one file per family, registered in `registry.py`.

`ATTENTION_REGISTRY.get(name)` returns the `AttentionFamily` for a config string; an unknown name
raises ValueError naming the valid ones. Users can add a family with `register_attention`.
See `model/attention/base.py` for the contract.
"""

from model.attention import kernel, softmax, tisa, transject
from model.attention.base import (
    Attention,
    AttentionFamily,
    AttentionOutput,
    FamilyState,
    LayerContext,
    MultiHeadAttention,
    ScoreKernel,
)
from model.attention.registry import (
    ATTENTION_REGISTRY,
    ENTRY_POINT_GROUP,
    AttentionRegistry,
    load_installed_families,
    register_attention,
)

for _module in (softmax, tisa, kernel, transject):
    ATTENTION_REGISTRY.register(_module.FAMILY)
load_installed_families()  # families of other installed packages (entry points)


__all__ = [
    "ATTENTION_REGISTRY",
    "ENTRY_POINT_GROUP",
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
