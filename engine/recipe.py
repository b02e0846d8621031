"""YAML recipes with dotted command-line overrides, turned into typed config dataclasses.

    python -m pretrain --config configs/pretrain/debug.yaml optimizer.lr=1e-3 engine.zero_stage=2

A recipe is a YAML mapping (OmegaConf: ``${...}`` interpolation works) whose top-level keys are
the sections of a config dataclass. A recipe may start from another one with
``defaults: other.yaml`` (a path relative to the recipe; the recipe's keys override it; or a list
of paths, merged in order, e.g. ``[debug.yaml, ../families/tisa.yaml]``), and
a top-level section may be given as the path of a YAML file holding it
(``model: ../model/albert-base-tisa.yaml``).
Overrides are ``dotted.key=value`` with YAML values (``true``, ``1e-3``, ``[1, 2]``, ``null``).
Unknown keys, wrong types and bad values raise ``ValueError`` naming the key, with a
"did you mean" where one is close, before any work starts.

Renamed keys (``MOVED_KEYS``, old dotted key -> new dotted key): a key that moved, e.g. the
fine-tuning suites' top-level ``run_dir`` (now ``train.run_dir``, as in pretraining) or
``engine.orthogonal_step_cache`` (now ``model.orthogonal_step_cache``, a setting of the model's
orthogonal maps), is still accepted for now with a ``FutureWarning`` naming the new key: each
recipe file's old key and each ``old=value`` override is moved to the new place before
merging, so it overrides exactly what it used to. A run's saved config (its config.yaml or
run.json) is read through the same table (``move_saved_keys``), so run directories written
with the old keys still resume. An old key at the default it had (``MOVED_DEFAULTS``; a saved
config wrote every key of its section) is dropped rather than moved: it says nothing the new
key's default does not.

The typed building blocks (``config_from_dict``, ``config_dict``) are generic and live in
``model.typed_config``; ``build_config`` here adds the recipe policy (moved keys) on top.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from model.typed_config import config_dict as config_dict  # re-exported for the stages
from model.typed_config import config_from_dict

T = TypeVar("T")

MAX_DEFAULTS_DEPTH = 8

MOVED_KEYS: dict[str, str] = {
    "run_dir": "train.run_dir",
    "engine.orthogonal_step_cache": "model.orthogonal_step_cache",
    "engine.orthogonal_shard_maps": "model.orthogonal_shard_maps",
    "engine.orthogonal_shard_min_size": "model.orthogonal_shard_min_size",
}
"""Dotted keys that moved -> their dotted new place. The old spelling still works, with a
FutureWarning (see ``move_keys``); it will be refused in a later version."""

MOVED_DEFAULTS: dict[str, Any] = {
    "engine.orthogonal_step_cache": True,
    "engine.orthogonal_shard_maps": True,
    "engine.orthogonal_shard_min_size": 256,
}
"""The default an old key of ``MOVED_KEYS`` had in a section that writes every key (the
``engine`` section of a saved config): at that value the key is dropped, not moved."""


def _moved_message(old: str, new: str, where: str, fix: str) -> str:
    which = "the old key" if "." in old else "the top-level key"
    return (
        f"{where}: {old} is now {new}; {which} is accepted for now ({fix}). "
        f"It will be refused in a later version."
    )


def _is_moved_default(old: str, value: Any) -> bool:
    """True when ``value`` is the default ``old`` had (``MOVED_DEFAULTS``), in type too."""
    if old not in MOVED_DEFAULTS:
        return False
    default = MOVED_DEFAULTS[old]
    return type(value) is type(default) and value == default


def _section(data: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    """The mapping at ``path`` in ``data`` (``data`` itself for ``[]``), or None where a part
    is missing or not a mapping."""
    node: Any = data
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def move_keys(data: dict[str, Any], where: str, warn: bool = True) -> dict[str, Any]:
    """``data`` (not changed) with every key of ``MOVED_KEYS`` moved to its new dotted place
    (or dropped at its old default, ``MOVED_DEFAULTS``), with a FutureWarning naming ``where``
    unless ``warn`` is false (a run's saved config, which the user does not write). The old and
    the new key both given with different values is a ``ValueError`` (which one was meant is
    not known)."""
    out = copy.deepcopy(data)
    for old, new in MOVED_KEYS.items():
        *old_parents, old_last = old.split(".")
        source = _section(out, old_parents)
        if source is None or old_last not in source:
            continue
        value = source.pop(old_last)
        *parents, last = new.split(".")
        node = out
        for part in parents:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):  # not a mapping: for the typed config to refuse
                source[old_last] = value
                break
        else:
            if last in node and node[last] != value:
                raise ValueError(
                    f"{where}: both {old}={value!r} and {new}={node[last]!r} are given; "
                    f"{old} is now {new}: give only {new}"
                )
            if not _is_moved_default(old, value):
                node[last] = value
        if warn:
            fix = f"write {last}: under {'.'.join(parents)}:" if parents else f"write {new}"
            warnings.warn(_moved_message(old, new, where, fix), FutureWarning, stacklevel=2)
    return out


def move_saved_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A run's saved config (``data`` not changed) with its moved keys (``MOVED_KEYS``) where a
    config written now has them, without warnings: compare it with the config of a resume."""
    return move_keys(data, "saved config", warn=False)


def _move_override(item: str) -> str | None:
    """A dotted override with a moved key renamed (``run_dir=x`` -> ``train.run_dir=x``), or
    None when it sets an old key to its old default (``MOVED_DEFAULTS``: nothing to set)."""
    key, value = item.split("=", 1)
    if key in MOVED_KEYS:
        new = MOVED_KEYS[key]
        warnings.warn(
            _moved_message(key, new, f"override {item}", f"write {new}={value}"),
            FutureWarning,
            stacklevel=2,
        )
        if _is_moved_default(key, yaml.safe_load(value)):
            return None
        return f"{new}={value}"
    return item


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
    data = move_keys(data, f"config file {path}")  # before merging: it overrides as it did
    base = data.pop("defaults", None)
    if base is None:
        return data
    if depth >= MAX_DEFAULTS_DEPTH:
        raise ValueError(f"config file {path}: 'defaults' chain deeper than {MAX_DEFAULTS_DEPTH}")
    bases = [base] if isinstance(base, str) else base
    if not isinstance(bases, list) or not bases or not all(isinstance(b, str) for b in bases):
        raise ValueError(
            f"config file {path}: 'defaults' must be a path to another recipe or a list of them"
        )
    merged: dict[str, Any] = {}
    for item in bases:  # in order: a later one overrides an earlier one
        merged = _merge(merged, _read_yaml((path.parent / item).resolve(), depth + 1))
    return _merge(merged, data)


def recipe_overrides(path: str | os.PathLike) -> list[str]:
    """The recipe file at ``path`` (its defaults applied) as dotted ``key=value`` overrides,
    e.g. a family's settings (``configs/families/tisa.yaml``) for a command line."""
    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out.append(f"{prefix}={yaml.safe_dump(node, default_flow_style=True).strip()}")
            if out[-1].endswith("\n..."):
                out[-1] = out[-1][: -len("\n...")]

    walk(_read_yaml(Path(path)), "")
    return out


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
    overrides = [moved for item in overrides if (moved := _move_override(item)) is not None]
    try:
        node = OmegaConf.create(data)
        for item in overrides:
            # One at a time, into the recipe's own structure: an index reaches into a list
            # (phases.1.shards=...), which a merge of a dotted dict cannot do.
            key, value = item.split("=", 1)
            parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={value}"]))["value"]
            try:
                OmegaConf.update(node, key, parsed, merge=True)
            except (IndexError, TypeError) as e:
                raise ValueError(
                    f"override {item!r}: {key} does not fit the recipe (a list index past its "
                    f"end, or a key under a value that is not a section): "
                    f"{str(e).splitlines()[0]}"
                ) from e
        resolved = OmegaConf.to_container(node, resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError, TypeError, IndexError, KeyError) as e:
        raise ValueError(f"bad config or override: {e}") from e
    return resolved  # type: ignore[return-value]


def build_config(cls: type[T], data: dict[str, Any]) -> T:
    """``cls`` built from ``data`` (nested dataclasses recursively); ValueError on bad input.
    A moved key (``MOVED_KEYS``) in a dict that did not come through ``load_recipe`` is moved
    here, with the same warning."""
    return config_from_dict(cls, move_keys(data, cls.__name__))


def to_yaml(data: dict[str, Any]) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(data))


def diff_keys(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts (missing counts as differing).
    A section on one side only is compared key by key against an empty one, so the keys are its
    leaves (``model.kernel.inference_backend``, not ``model.kernel``)."""
    keys: list[str] = []
    for key in sorted(set(a) | set(b), key=str):
        where = f"{prefix}.{key}" if prefix else str(key)
        va, vb = a.get(key, _MISSING), b.get(key, _MISSING)
        if isinstance(va, dict) and vb is _MISSING:
            vb = {}
        elif isinstance(vb, dict) and va is _MISSING:
            va = {}
        if isinstance(va, dict) and isinstance(vb, dict):
            keys.extend(diff_keys(va, vb, where))
        elif va != vb:
            keys.append(where)
    return keys


_MISSING = object()
