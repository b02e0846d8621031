"""Typed configs: plain dicts (JSON, YAML) to dataclasses and back, with clear errors.

Generic helpers with no knowledge of any particular config, used by every layer:

    config_from_dict(cls, data)   builds dataclass ``cls`` (nested ones included) from a dict;
                                  an unknown key or a wrong type raises ``ValueError`` naming
                                  the dotted key, with a "did you mean" hint where one is close
    config_to_dict(cfg)           ``dataclasses.asdict``, sections as top-level keys (what
                                  ``model.hub.release`` writes as JSON)
    config_dict(cfg)              the same with lists for tuples, so it round-trips through YAML
    deep_merge(base, overrides)   nested dicts merged key by key (presets, DeepSpeed configs)
    field_docs(cls)               each field's docstring (the string literal under it), read
                                  from the source; what docs/config.md is generated from
    with_sections, SECTIONS       a config whose sections are known only when it is parsed
                                  (``EncoderConfig``'s attention-family settings, each family
                                  bringing its own class): ``config_sections(cls)`` names them
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
import copy
import dataclasses
import difflib
import functools
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
    names = config_keys(cls)
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
    store = _sections_store(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init and f is not store}
    sections = config_sections(cls)
    kwargs: dict[str, Any] = {}
    given: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else key
        if key in known:
            kwargs[key] = _coerce(value, hints[key], where)
        elif key in sections:
            given[key] = _coerce(value, sections[key], where)
        else:
            raise _unknown_key_error(cls, key, prefix)
    if store is not None:
        kwargs[store.name] = given
    return cls(**kwargs)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain, JSON-serialisable dict of a (nested) config dataclass; the sections of a
    ``with_sections`` config are top-level keys, as they are written."""
    return _plain_dict(cfg)


def _plain_dict(cfg: Any) -> Any:
    """``dataclasses.asdict``, but with the field of `SECTIONS` replaced by its sections."""

    def plain(x: Any) -> Any:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return _plain_dict(x)
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(plain(v) for v in x)
        return copy.deepcopy(x)

    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if SECTIONS in f.metadata:
            out.update((key, plain(section)) for key, section in value.items())
        else:
            out[f.name] = plain(value)
    return out


def config_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict of a config dataclass (lists for tuples, so it round-trips through YAML)."""

    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(config_to_dict(cfg))


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


# ------------------------------------------------------------------ sections known at parse time

SECTIONS = "config_sections"
"""Metadata key of the field of a `with_sections` config that holds its sections
(``field(default_factory=dict, metadata={SECTIONS: find})``, typed ``dict[str, Any]``): the
value ``find`` names the sections and their dataclasses, ``() -> {key: class}``. It is called
each time a config is built, so classes registered after the config's module was imported (an
attention family's settings, a plugin's) are known without the config importing them. The
sections are written (YAML, JSON, keyword arguments) and read (``cfg.<key>``) as top-level
keys; the field itself is no key of the config."""


def _sections_store(cls: type) -> dataclasses.Field | None:
    found = [f for f in dataclasses.fields(cls) if SECTIONS in f.metadata]
    return found[0] if found else None


def config_sections(cls: type) -> dict[str, type]:
    """``{key: dataclass}`` of the sections a `with_sections` config takes now; {} for others."""
    store = _sections_store(cls)
    return {} if store is None else dict(store.metadata[SECTIONS]())


def config_keys(cls: type) -> list[str]:
    """The keys a config dataclass takes: its init fields, then its sections (if any)."""
    store = _sections_store(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init and f is not store]
    return names + list(config_sections(cls))


def with_sections(cls: type[T]) -> type[T]:
    """Class decorator, above ``@dataclass``, for a config with a field of `SECTIONS`.

    ``cls(**kwargs)`` takes each section as a keyword (a mapping or an instance of its class)
    and gives every known section a value (its class's defaults when not given), in the order
    ``find()`` names them, before ``__post_init__`` runs; ``cfg.<key>`` reads one. An unknown
    keyword raises ``ValueError`` with a "did you mean" hint, as `config_from_dict` does.
    ``dataclasses.replace`` keeps the sections (they travel in the field)."""
    store = _sections_store(cls)
    if store is None:
        raise TypeError(f"{cls.__name__} has no field with {SECTIONS!r} metadata")
    own = {f.name for f in dataclasses.fields(cls) if f.init}
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        given = dict(kwargs.pop(store.name, None) or {})
        given.update((key, kwargs.pop(key)) for key in list(kwargs) if key not in own)
        sections = config_sections(cls)
        clash = sorted(own & sections.keys())
        if clash:
            raise ValueError(f"sections {clash} of {cls.__name__} have the names of its fields")
        for key in given:
            if key not in sections:
                raise _unknown_key_error(cls, key, "")
        kwargs[store.name] = {
            key: _coerce(given[key], section, key) if key in given else section()
            for key, section in sections.items()
        }
        init(self, *args, **kwargs)

    def __getattr__(self: Any, name: str) -> Any:
        # Only called when normal lookup fails; reads __dict__ directly, so a half-built
        # instance (unpickling, copying) raises AttributeError rather than recursing.
        sections = self.__dict__.get(store.name)
        if sections is not None and name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    cls.__init__ = __init__  # type: ignore[method-assign]
    cls.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return cls
