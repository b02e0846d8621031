"""Typed configs: plain dicts (JSON, YAML) to dataclasses and back, with clear errors.

Generic helpers with no knowledge of any particular config, used by every layer:

    config_from_dict(cls, data)   builds dataclass ``cls`` (nested ones included) from a dict;
                                  an unknown key or a wrong type raises ``ValueError`` naming
                                  the dotted key, with a "did you mean" hint where one is close
    config_to_dict(cfg)           ``dataclasses.asdict`` (what ``model.release`` writes as JSON)
    config_dict(cfg)              the same with lists for tuples, so it round-trips through YAML
    deep_merge(base, overrides)   nested dicts merged key by key (presets, DeepSpeed configs)
    field_docs(cls)               each field's docstring (the string literal under it), read
                                  from the source; what docs/config.md is generated from
    _check_choice / _check_positive / _check_prob
                                  one-line field checks for ``__post_init__``; each raises a
                                  ``ValueError`` naming the field and the valid values

It lives in ``model`` because ``model`` is the bottom layer that every other package may import
(pretrain, finetune, slurm -> engine -> model), and it imports nothing of the project, so
``model.config`` (the encoder's config) and ``engine.recipe`` (YAML recipes) both use it
without a cycle. Recipe policy (YAML files, dotted overrides, renamed keys) is
``engine.recipe``'s, not this module's.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import textwrap
import types
import typing
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

T = TypeVar("T")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def _check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _check_prob(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A new dict: ``base`` with ``overrides`` applied, nested dicts merged key by key."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _unknown_key_error(cls: type, key: str, prefix: str) -> ValueError:
    names = [f.name for f in dataclasses.fields(cls)]
    where = f"{prefix}.{key}" if prefix else key
    hint = difflib.get_close_matches(key, names, n=1)
    suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
    return ValueError(
        f"unknown config key {where!r} for {cls.__name__}{suggestion} (valid: {names})"
    )


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Checks (and mildly coerces: int -> float) a value against a field's type annotation."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, got {type(value).__name__}")
        return config_from_dict(tp, value, prefix=where)
    if origin is Literal:
        if value not in get_args(tp):
            raise ValueError(f"{where}={value!r} is not valid; choose one of {list(get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list, got {type(value).__name__}")
        (item_tp, *_) = get_args(tp) or (Any,)
        return type(value)(_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, got {type(value).__name__}")
        args = get_args(tp)
        if len(args) == 2 and args[1] is not Any:  # dict[str, X]: each value checked as an X
            return {k: _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
        return value
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
        return value
    return value


def config_from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Builds dataclass `cls` from a dict, recursively; unknown keys and wrong types raise ValueError."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix or cls.__name__} must be a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            raise _unknown_key_error(cls, key, prefix)
        where = f"{prefix}.{key}" if prefix else key
        kwargs[key] = _coerce(value, hints[key], where)
    return cls(**kwargs)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain, JSON-serialisable dict of a (nested) config dataclass."""
    return dataclasses.asdict(cfg)


def config_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict of a config dataclass (lists for tuples, so it round-trips through YAML)."""

    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(cfg))


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: docstring}`` of a dataclass: the string literal right under each field's
    declaration (an attribute docstring, the convention of every config here), read from the
    source of ``cls`` and of its dataclass bases (a subclass's own docstring wins). Whitespace is
    normalised as in ``inspect.cleandoc``; a field without one is absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # no source (e.g. built interactively)
            continue
        (node,) = ast.parse(source).body
        assert isinstance(node, ast.ClassDef)
        for stmt, after in itertools.pairwise(node.body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    names = {f.name for f in dataclasses.fields(cls)}
    return {name: doc for name, doc in docs.items() if name in names}
