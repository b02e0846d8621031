"""Generates docs/config.md, the config reference, from the typed config dataclasses.

    python scripts/gen_config_docs.py            # rewrite docs/config.md
    python scripts/gen_config_docs.py --check    # exit 1 if docs/config.md is out of date

Every key, type and default comes from the dataclasses themselves, every description from the
docstring written under the field (``model.typed_config.field_docs``), so the page cannot drift
from the code (the encoder's attention-family sections come from the families registered in
``model.attention``, each family's options class described as any other section): ``tests/project/test_config_docs.py`` regenerates it and compares. A new config field
needs a docstring under it, then a run of this script.

The roots are the recipes a user writes: pretraining (``pretrain.config.PretrainConfig``), GLUE
(``finetune.glue.run.GlueConfig``) and LRA (``finetune.lra.run.LraConfig``) fine-tuning, and the
shard settings of ``python -m data_prep shards`` (``data_prep.shards.ShardConfig``). A section
whose class was already described (the optimizer of a fine-tuning recipe, say) links to that
description and lists only the defaults that differ.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the project importable
    sys.path.insert(0, str(ROOT))

from data_prep.shards import ShardConfig  # noqa: E402
from finetune.glue.run import GlueConfig  # noqa: E402
from finetune.lra.run import LraConfig  # noqa: E402
from model.attention.registry import ATTENTION_REGISTRY, options_key  # noqa: E402
from model.config import PRESETS, EncoderConfig  # noqa: E402
from model.typed_config import SECTIONS, config_sections, field_docs  # noqa: E402
from pretrain.config import PretrainConfig  # noqa: E402
from pretrain.init import INIT_KEY  # noqa: E402
from scripts.docs_page import page_main  # noqa: E402
from study.settings import Settings  # noqa: E402
from study.spec import GlueStage, LraStage, PretrainStage, StudySpec  # noqa: E402

OUTPUT = ROOT / "docs" / "config.md"
COMMAND = "python scripts/gen_config_docs.py"

MODEL_SECTIONS = {(PretrainConfig, "model"), (LraConfig, "model")}
"""Fields typed ``dict`` that hold an ``EncoderConfig`` (plus ``preset:``): described as one."""


@dataclasses.dataclass(frozen=True)
class Root:
    title: str
    prefix: str
    """Heading prefix, so anchors stay unique across recipes."""
    cls: type
    intro: str


ROOTS = (
    Root(
        "Pretraining recipe",
        "pretrain",
        PretrainConfig,
        "`python -m pretrain --config configs/pretrain/<recipe>.yaml [key=value ...]`; "
        "recipes in `configs/pretrain/`.",
    ),
    Root(
        "GLUE fine-tuning recipe",
        "glue",
        GlueConfig,
        "`python -m finetune glue --config ... [key=value ...]`; recipes in "
        "`configs/finetune/glue/`.",
    ),
    Root(
        "Long Range Arena recipe",
        "lra",
        LraConfig,
        "`python -m finetune lra --config ... [key=value ...]`; recipes in "
        "`configs/finetune/lra/`.",
    ),
    Root(
        "Study spec",
        "study",
        StudySpec,
        "`python -m study plan|run|status|report configs/studies/<name>.yaml`; specs in "
        "`configs/studies/`, the guide in [studies.md](studies.md). A study's `stages` and each "
        "variant's `stages` are mappings of a stage kind to the settings below.",
    ),
    Root(
        "Study stage: pretrain",
        "study-pretrain",
        PretrainStage,
        "A study's or a variant's `stages.pretrain`.",
    ),
    Root("Study stage: glue", "study-glue", GlueStage, "A study's or a variant's `stages.glue`."),
    Root("Study stage: lra", "study-lra", LraStage, "A study's or a variant's `stages.lra`."),
    Root(
        "User settings",
        "settings",
        Settings,
        "`~/.config/albatross/settings.yaml` (or the file `$ALBATROSS_SETTINGS` names): where "
        "your data sets are and where your Slurm jobs go; `--data NAME=PATH`, `--partition` and "
        "`--account` override it.",
    ),
    Root(
        "Shard settings",
        "shards",
        ShardConfig,
        "Set by the options of `python -m data_prep shards` (each the field's name with dashes, "
        "`--max-seq-length`; `inputs` is `--input`) and recorded in the shard directory's "
        "`manifest.json`.",
    ),
)


# ---------------------------------------------------------------------------------- rendering


def one_line(text: str) -> str:
    """A docstring as one Markdown table cell: RST ``literals`` as `code`, pipes escaped."""
    text = " ".join(text.split())
    return text.replace("``", "`").replace("|", "\\|")


def class_doc(cls: type) -> str:
    """The class docstring, unless it is the one dataclasses generates (the signature)."""
    doc = cls.__doc__ or ""
    if not doc or doc.startswith(f"{cls.__name__}("):
        return ""
    return " ".join(inspect.cleandoc(doc).split()).replace("``", "`")


def type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        parts = [type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(parts) + (" \\| null" if type(None) in args else "")
    if origin in (list, tuple):
        args = [a for a in get_args(tp) if a is not Ellipsis]
        inner = type_name(args[0]) if args else "any"
        if origin is tuple and len(args) > 1 and Ellipsis not in get_args(tp):
            return f"list of {len(args)} {inner}"
        return f"list of {inner}"
    if origin is dict or tp is dict:
        args = get_args(tp)
        if len(args) == 2 and dataclasses.is_dataclass(args[1]):
            return "mapping of name to section"
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "section"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def yaml_value(value: Any) -> str:
    """A default as it would be written in a recipe."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    if value == "":
        return '""'
    return str(value)


def default_of(field: dataclasses.Field, instance: Any | None) -> tuple[bool, Any]:
    """(has a default, the default); from ``instance`` when there is one (defaults in context)."""
    if instance is not None:
        return True, getattr(instance, field.name)
    if field.default is not dataclasses.MISSING:
        return True, field.default
    if field.default_factory is not dataclasses.MISSING:
        try:
            return True, field.default_factory()
        except (TypeError, ValueError):  # a section with required keys (e.g. data.shards)
            return False, None
    return False, None


def default_instance(cls: type) -> Any | None:
    """``cls()`` when every field has a default and the defaults are valid, else None."""
    try:
        return cls()
    except (TypeError, ValueError):
        return None


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


class Page:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.described: dict[type, tuple[str, Any | None]] = {}
        """Classes with a full table: their anchor and the instance their defaults came from."""

    def section(self, heading: str, key: str, cls: type, instance: Any | None) -> None:
        """A table of ``cls``'s fields under ``### heading``, then its nested sections."""
        self.lines += [f"### {heading}", ""]
        if cls in self.described:
            self._same_as(cls, instance)
            return
        self.described[cls] = (anchor(heading), instance)
        doc = class_doc(cls)
        if doc:
            self.lines += [doc, ""]
        nested: list[tuple[str, type, Any | None]] = []
        rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
        docs = field_docs(cls)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if SECTIONS in f.metadata:  # sections known at parse time (attention families')
                for name, sub in config_sections(cls).items():
                    value = getattr(instance, name) if instance is not None else sub()
                    nested.append((name, sub, value))
                    where = f"{key}.{name}" if key else name
                    link = f"see [`{where}`](#{anchor(self._heading(where))})"
                    text = one_line(registered_section_doc(cls, name, sub))
                    rows.append(f"| `{name}` | section | {link} | {text} |")
                continue
            tp = hints[f.name]
            has_default, value = default_of(f, instance)
            sub = section_class(cls, f.name, tp)
            if sub is not None:
                sub_instance = sub_default(sub, value)
                name = f"{f.name}.<name>" if get_origin(tp) is dict else f.name
                nested.append((name, sub, sub_instance))
                where = f"{key}.{name}" if key else name
                text = docs.get(f.name, class_doc(sub))
                link = f"see [`{where}`](#{anchor(self._heading(where))})"
                if isinstance(value, dict) and value:  # a model section given as a dict
                    link = f"`{yaml_value(value)}`; {link}"
                rows.append(f"| `{f.name}` | {type_name(tp)} | {link} | {one_line(text)} |")
                continue
            shown = f"`{yaml_value(value)}`" if has_default else "required"
            text = docs.get(f.name, "")
            rows.append(f"| `{f.name}` | {type_name(tp)} | {shown} | {one_line(text)} |")
        self.lines += [*rows, ""]
        if cls is EncoderConfig:
            self._model_keys(key)
        for name, sub, sub_instance in nested:
            where = f"{key}.{name}" if key else name
            self.section(self._heading(where), where, sub, sub_instance)

    def _heading(self, where: str) -> str:
        return f"{self.prefix}: `{where}`"

    def _same_as(self, cls: type, instance: Any | None) -> None:
        target, first = self.described[cls]
        line = f"The keys of [`{cls.__name__}`](#{target})"
        differ = []
        if instance is not None and first is not None:
            for f in dataclasses.fields(cls):
                mine, theirs = getattr(instance, f.name), getattr(first, f.name)
                if mine != theirs and not dataclasses.is_dataclass(mine):
                    differ.append(f"`{f.name}: {yaml_value(mine)}`")
        if differ:
            line += "; defaults that differ here: " + ", ".join(differ) + "."
        else:
            line += ", with the same defaults."
        self.lines += [line, ""]

    def _model_keys(self, key: str) -> None:
        presets = ", ".join(f"`{name}`" for name in sorted(PRESETS))
        self.lines += [
            f"Besides these keys a `{key}` section may hold `preset: NAME`, which starts from a "
            f"named preset ({presets}; `model/config.py`) and lets the other keys override it.",
            "",
        ]
        if self.prefix == "pretrain":
            self.lines += [
                f"`{INIT_KEY}: DIR` (pretraining only) continues from a release or a local HF "
                "ALBERT checkpoint, whose architecture it keeps (`pretrain/init.py`).",
                "",
            ]

    prefix = ""


def registered_section_doc(owner: type, name: str, sub: type) -> str:
    """The table row of a section registered at parse time: for ``EncoderConfig``, the
    families whose settings it holds (`model.attention.registry`); else its class's doc."""
    if owner is EncoderConfig:
        families = [
            f"`{family}`"
            for family in ATTENTION_REGISTRY.names()
            if options_key(ATTENTION_REGISTRY.get(family)) == name
        ]
        return f"Settings of the {', '.join(families)} family (ignored by the others)."
    return class_doc(sub)


def section_class(owner: type, name: str, tp: Any) -> type | None:
    """The dataclass a field is described by: its own type, the element of a list of
    dataclasses, or ``EncoderConfig`` for the ``model`` dicts of ``MODEL_SECTIONS``."""
    if (owner, name) in MODEL_SECTIONS:
        return EncoderConfig
    if dataclasses.is_dataclass(tp):
        return tp
    if get_origin(tp) in (typing.Union, types.UnionType):  # an optional section
        inner = [a for a in get_args(tp) if dataclasses.is_dataclass(a)]
        return inner[0] if inner else None
    if get_origin(tp) is list:
        (item,) = get_args(tp)
        if dataclasses.is_dataclass(item):
            return item
    if get_origin(tp) is dict and dataclasses.is_dataclass(get_args(tp)[1]):
        return get_args(tp)[1]  # a mapping of names to sections: described as one
    return None


def sub_default(sub: type, value: Any) -> Any | None:
    """The instance whose values are the defaults of a nested section's keys: the section's
    default when it is a dataclass; for a ``model`` dict (replaced as a whole by a recipe's
    ``model:``, not merged) the keys' own defaults."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value
    return default_instance(sub)


def render() -> str:
    """docs/config.md's text."""
    page = Page()
    page.lines += [
        "# Config reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the config dataclasses; do not edit by hand. -->",
        "",
        "Generated from the typed config dataclasses and the docstring under each of their "
        f"fields (`{COMMAND}`; `tests/project/test_config_docs.py` fails when this page and the code "
        "differ). Defaults are the dataclasses' own, shown in the recipe's context (a "
        "fine-tuning recipe's optimizer defaults are not pretraining's).",
        "",
        "A recipe is a YAML file whose top-level keys are the sections below; it may start from "
        "other recipes (`defaults: base.yaml` or a list of files) and give a section as the path "
        "of a YAML file (`model: ../model/albert-base-tisa.yaml`). On the command line, dotted "
        "overrides come last: `optimizer.lr=1e-3 engine.zero_stage=2` (YAML values: `true`, "
        '`1e-3`, `[1, 2]`, `null`). Unknown keys (with a "did you mean"), wrong types and '
        "invalid values fail at start-up, naming the key (`engine/recipe.py`, "
        "`model/typed_config.py`). A run directory keeps the resolved recipe as `config.yaml`.",
        "",
        "**Compatibility.** A key added in a later version has a default that keeps the "
        "behaviour from before it existed, so a run directory written by an earlier version "
        "resumes: a key its `config.yaml` lacks is compared at its default (`pretrain/setup.py`), "
        "and only another value is a change that refuses the resume. A key that moves is read "
        "under its old name too, with a warning naming the new one (`engine/recipe.py`, "
        "`MOVED_KEYS`). The test suite resumes a run directory and loads a release written by "
        "the previous version (`tests/fixtures/previous`).",
        "",
        "Contents: " + " · ".join(f"[{r.title}](#{anchor(r.title)})" for r in ROOTS) + ".",
        "",
    ]
    for root in ROOTS:
        page.lines += [f"## {root.title}", "", root.intro, ""]
        page.prefix = root.prefix
        page.section(f"{root.prefix}: top level", "", root.cls, default_instance(root.cls))
    return "\n".join(page.lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    return page_main(argv, __doc__.splitlines()[0], OUTPUT, lambda _page: render(), COMMAND)


if __name__ == "__main__":
    sys.exit(main())
