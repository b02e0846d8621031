"""YAML recipes with dotted command-line overrides, turned into typed config dataclasses.

    python -m pretrain --config configs/pretrain/debug.yaml optimizer.lr=1e-3 engine.zero_stage=2

A recipe is a YAML mapping (OmegaConf: ``${...}`` interpolation works) whose top-level keys are
the sections of a config dataclass. A recipe may start from another one with
``defaults: other.yaml`` (a path relative to the recipe; the recipe's keys override it), and
a top-level section may be given as the path of a YAML file holding it
(``model: ../model/albert-base-tisa.yaml``).
Overrides are ``dotted.key=value`` with YAML values (``true``, ``1e-3``, ``[1, 2]``, ``null``).
Unknown keys, wrong types and bad values raise ``ValueError`` naming the key, with a
"did you mean" where one is close, before any work starts.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from model.config import config_from_dict

T = TypeVar("T")

MAX_DEFAULTS_DEPTH = 8


def _read_yaml(path: Path, depth: int = 0) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"config file {path} not found")
    try:
        node = OmegaConf.load(path)
    except (OmegaConfBaseException, OSError, ValueError, yaml.YAMLError) as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from e
    data = OmegaConf.to_container(node, resolve=False)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping at the top level")
    for key, value in list(data.items()):
        if key != "defaults" and isinstance(value, str) and value.endswith((".yaml", ".yml")):
            data[key] = _read_yaml((path.parent / value).resolve(), depth + 1)
    base = data.pop("defaults", None)
    if base is None:
        return data
    if depth >= MAX_DEFAULTS_DEPTH:
        raise ValueError(f"config file {path}: 'defaults' chain deeper than {MAX_DEFAULTS_DEPTH}")
    if not isinstance(base, str):
        raise ValueError(f"config file {path}: 'defaults' must be a path to another recipe")
    parent = _read_yaml((path.parent / base).resolve(), depth + 1)
    return _merge(parent, data)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(override))
    return OmegaConf.to_container(merged, resolve=False)  # type: ignore[return-value]


def load_recipe(path: str | os.PathLike | None, overrides: list[str] = ()) -> dict[str, Any]:
    """The recipe at ``path`` (or ``{}``) with ``overrides`` applied, interpolations resolved."""
    data = _read_yaml(Path(path)) if path is not None else {}
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ValueError(
                f"override {item!r} is not of the form dotted.key=value (e.g. optimizer.lr=1e-3)"
            )
    try:
        node = OmegaConf.merge(OmegaConf.create(data), OmegaConf.from_dotlist(list(overrides)))
        resolved = OmegaConf.to_container(node, resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise ValueError(f"bad config or override: {e}") from e
    return resolved  # type: ignore[return-value]


def build_config(cls: type[T], data: dict[str, Any]) -> T:
    """``cls`` built from ``data`` (nested dataclasses recursively); ValueError on bad input."""
    return config_from_dict(cls, data)


def config_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict of a config dataclass (lists for tuples, so it round-trips through YAML)."""

    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(cfg))


def to_yaml(data: dict[str, Any]) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(data))


def diff_keys(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts (missing counts as differing)."""
    keys: list[str] = []
    for key in sorted(set(a) | set(b), key=str):
        where = f"{prefix}.{key}" if prefix else str(key)
        va, vb = a.get(key, _MISSING), b.get(key, _MISSING)
        if isinstance(va, dict) and isinstance(vb, dict):
            keys.extend(diff_keys(va, vb, where))
        elif va != vb:
            keys.append(where)
    return keys


_MISSING = object()
