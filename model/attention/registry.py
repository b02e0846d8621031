"""The attention registry: a config string -> its `AttentionFamily`. It imports no family (the
families import the config, which looks names up here), so the config can check a family's
name and settings without an import cycle; `model/attention/__init__.py` registers the shipped
families, `register_attention` a user's."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model.attention.base import AttentionFamily


class AttentionRegistry:
    """Maps a config string to an `AttentionFamily`. Unknown names raise ValueError."""

    def __init__(self) -> None:
        self._families: dict[str, AttentionFamily] = {}

    def register(self, family: AttentionFamily) -> AttentionFamily:
        if family.name in self._families:
            raise ValueError(f"attention family {family.name!r} is already registered")
        if (family.kernel is None) == (family.layer is None):
            raise ValueError(f"family {family.name!r} must give exactly one of kernel= or layer=")
        self._families[family.name] = family
        return family

    def get(self, name: str) -> AttentionFamily:
        if name not in self._families:
            raise ValueError(f"unknown attention {name!r}; valid: {sorted(self._families)}")
        return self._families[name]

    def names(self) -> list[str]:
        return sorted(self._families)

    def __contains__(self, name: object) -> bool:
        return name in self._families


ATTENTION_REGISTRY = AttentionRegistry()


def register_attention(family: AttentionFamily) -> AttentionFamily:
    """Adds a user-defined family to the registry (call before building a config that names it)."""
    return ATTENTION_REGISTRY.register(family)
