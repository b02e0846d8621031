"""The attention registry: a config string -> its `AttentionFamily`. It imports no family (the
families import the config, which looks names up here), so the config can check a family's
name and settings without an import cycle; `model/attention/__init__.py` registers the shipped
families, then every family an installed package declares (`load_installed_families`), and
`register_attention` adds one in-process.

A package adds families through the entry-point group ``albatross.attention``, each entry point
naming an `AttentionFamily` (or a module holding one as ``FAMILY``):

    # the family package's pyproject.toml
    [project.entry-points."albatross.attention"]
    mean = "my_family:FAMILY"

Installed (``pip install my-family``), the family is in every process that imports ``model``:
``albatross pretrain ... model.attention=mean`` on the command line, in a torchrun rank, in a
Slurm job.

A family's settings (``AttentionFamily.options``, a dataclass) are a section of the encoder
config under the family's key (``model.tisa.num_kernels``): `option_sections` names them, and
`model.config.EncoderConfig` asks for them each time it parses a config, so the config imports
no family and a plugin's settings work as the built-in ones do.
"""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points
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
        key = options_key(family)
        if key is not None:
            theirs = self.option_sections().get(key)
            if theirs is not None and theirs is not family.options:
                raise ValueError(
                    f"family {family.name!r}: the config key {key!r} of its options is taken by "
                    f"{theirs.__module__}.{theirs.__qualname__}"
                )
        self._families[family.name] = family
        return family

    def option_sections(self) -> dict[str, type]:
        """``{config key: options dataclass}`` of the registered families that have settings,
        in the order they were registered (the order of the sections in a saved config)."""
        sections: dict[str, type] = {}
        for family in self._families.values():
            key = options_key(family)
            if key is not None:
                sections.setdefault(key, family.options)
        return sections

    def get(self, name: str) -> AttentionFamily:
        if name not in self._families:
            raise ValueError(f"unknown attention {name!r}; valid: {sorted(self._families)}")
        return self._families[name]

    def names(self) -> list[str]:
        return sorted(self._families)

    def __contains__(self, name: object) -> bool:
        return name in self._families


def options_key(family: AttentionFamily) -> str | None:
    """The encoder config's key for the family's settings (None: it has none)."""
    if family.options is None:
        return None
    return family.options_key or family.name


ATTENTION_REGISTRY = AttentionRegistry()


def register_attention(family: AttentionFamily) -> AttentionFamily:
    """Adds a user-defined family to the registry (call before building a config that names it)."""
    return ATTENTION_REGISTRY.register(family)


ENTRY_POINT_GROUP = "albatross.attention"


def load_installed_families(registry: AttentionRegistry = ATTENTION_REGISTRY) -> list[str]:
    """Registers the families installed packages declare (``ENTRY_POINT_GROUP``); returns their
    names. One that fails to load, is not an `AttentionFamily` or takes a registered name is
    left out with a warning naming its package and entry point (the other families work)."""
    added = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {point.name} = {point.value!r} ({ENTRY_POINT_GROUP})"
        try:
            family = point.load()
            family = getattr(family, "FAMILY", family)
            if not hasattr(family, "kernel") or not hasattr(family, "name"):
                raise TypeError(f"{family!r} is not an AttentionFamily")
            registry.register(family)
        except Exception as e:  # a broken plugin must not take down every command
            warnings.warn(f"attention family not loaded from {where}: {e}", stacklevel=2)
            continue
        added.append(family.name)
    return added
