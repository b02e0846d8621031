"""The study spec: a paper's table (or a comparison of our own) as data. A YAML file under
``configs/studies/`` names the paper and table, the model variants, the stages each variant
runs (pretraining from a recipe, GLUE and/or LRA fine-tuning suites), the paper's numbers, and
the scales it runs at (``tiny`` on a CPU in seconds, ``full`` at the paper's protocol), each with
its data and Slurm resources per stage. The reference of every key: docs/studies.md (generated
from the dataclasses below).

    name: transject-lra
    paper: {citation: ..., table: Table 2, aggregate: mean, runs: 3,
            results: {transformer: {listops: 38.4, ...}, ...}}
    stages:                      # every variant's stage settings ...
      lra: {protocol: skyformer, tasks: [listops, text], seeds: [0, 1, 2]}
    variants:
      transformer: {label: Transformer, family: softmax, stages: {lra: {}}}
      rezero: {label: Transformer+ReZero, stages: {lra: {overrides: [model.residual=rezero]}}}
    scales:                      # ... and what each scale changes
      tiny: {device: cpu, data: {lra: {generate: lra}}, stages: {lra: {overrides: [...]}}}
      full: {data: {lra: {setting: lra}}, stages: {lra: {resources: {time: "12:00:00"}}}}

``load_spec`` checks everything a user can get wrong before anything runs and raises
``SpecError`` naming the file and the place (``variants.rezero.stages.lra.tasks[1]``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from model.typed_config import config_from_dict

REPO = Path(__file__).resolve().parents[1]
STAGE_KINDS = ("pretrain", "glue", "lra")
"""The stages a variant may run, in this order."""
GENERATORS = ("embedded", "glue", "lra", "listops", "hf-albert")
"""Data a scale can make itself (``study/tiny_data.py``, ``data_prep``): see ``DataSource``."""
METRICS = ("accuracy", "mcc", "f1", "pearson", "spearman", "score")
"""Metrics a paper column can name (``score``: GLUE's task score, the mean of its metrics)."""
GLUE_DEFAULT_TASKS = ["sst2", "mnli", "qqp", "stsb", "cola", "mrpc", "qnli", "rte"]


class SpecError(ValueError):
    """A mistake in a study spec: printed with the file and the place, exit code 2, nothing
    run or submitted."""


@dataclass
class Paper:
    """What is reproduced, and the paper's own numbers."""

    citation: str = ""
    """The paper, as a reference list cites it."""
    url: str = ""
    """Where to read it (arXiv)."""
    table: str = ""
    """The table reproduced, e.g. ``Table 3 (a)``."""
    protocol: str = ""
    """How the paper's numbers were obtained (data split, model selection), in a sentence."""
    aggregate: Literal["mean", "median"] = "mean"
    """How the paper aggregates its runs; ours are aggregated the same way."""
    runs: int = 1
    """Runs (seeds) behind each of the paper's numbers."""
    spread: float = 0.0
    """The paper's reported spread of a number (± points) where it gives one; 0: none
    reported. The verdict counts a difference within our interval widened by this."""
    metrics: dict[str, str] = field(default_factory=dict)
    """Task -> the metric of the paper's column (``accuracy``, ``mcc``, ``f1``, ``pearson``,
    ``spearman``); unnamed tasks: ``accuracy``."""
    results: dict[str, dict[str, float | None]] = field(default_factory=dict)
    """Variant -> task -> the paper's number (x 100, as printed); null: not reported."""
    notes: str = ""
    """Anything a reader needs to compare the numbers (what was not recoverable, assumptions)."""


@dataclass
class Resources:
    """What one job of a stage asks Slurm for (``--executor slurm``); partition and account
    come from the user's settings, never from a spec."""

    nodes: int = 1
    """Nodes per job."""
    gpus_per_node: int = 1
    """GPUs per node; 0 for a CPU job."""
    tasks_per_node: int | None = None
    """Processes per node; None: one per GPU (1 on a CPU job). Locally, a stage runs this many
    processes (``torchrun``)."""
    cpus_per_task: int = 8
    """CPU cores per process."""
    time: str = "04:00:00"
    """Time limit per job (Slurm syntax: ``HH:MM:SS``, ``D-HH:MM:SS``); a preempted or timed-out
    job is requeued and resumes from its checkpoint."""

    def tasks(self) -> int:
        return self.tasks_per_node or max(self.gpus_per_node, 1)


@dataclass
class PretrainStage:
    """Pretraining of a variant (``python -m pretrain``), one run for all its phases."""

    recipe: str = ""
    """A pretraining recipe, relative to the repository (``configs/pretrain/albert-base.yaml``);
    ``{family}`` is replaced by the variant's family."""
    overrides: list[str] = field(default_factory=list)
    """Dotted overrides of the recipe (``model.tisa.num_kernels=3``)."""
    data: dict[str, str] = field(default_factory=dict)
    """Recipe key -> data source of the scale (``data.shards: corpus``, ``phases.1.shards:
    corpus-512``; list items by index)."""
    init: str = "scratch"
    """Where the weights start: ``scratch``; ``source:NAME``, a data source holding a release
    or a Hugging Face ALBERT directory (continued pretraining); ``variant:NAME``, the end of
    another variant's pretraining."""
    export: bool = False
    """Also export the last checkpoint (``python -m pretrain.export``) to ``release/`` and
    check it against the run's own release."""
    check_loss: bool = False
    """The report fails (``study report`` exits 1) when the MLM loss did not decrease from the
    first logged value to the last: a smoke check for short runs that must learn."""


@dataclass
class GlueStage:
    """GLUE fine-tuning of a variant (``python -m finetune glue``): tasks x lrs x seeds."""

    tasks: list[str] = field(default_factory=lambda: list(GLUE_DEFAULT_TASKS))
    """GLUE tasks (the recipe of each: ``recipe`` with ``{task}``)."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """One run per seed (per learning rate)."""
    lrs: list[float] | None = None
    """A learning-rate grid; the best by median dev score over seeds is reported (None: each
    task recipe's own)."""
    recipe: str = "configs/finetune/glue/{task}.yaml"
    """The fine-tuning recipe, ``{task}`` replaced by each task."""
    overrides: list[str] = field(default_factory=list)
    """Dotted overrides of every task's recipe."""
    task_overrides: dict[str, list[str]] = field(default_factory=dict)
    """Task -> dotted overrides of that task's recipe alone (after ``overrides``)."""
    data: str = "glue"
    """The data source holding GLUE."""
    init: str = "pretrained"
    """``pretrained``: this variant's pretraining; ``source:NAME``: a data source holding a
    release or a Hugging Face ALBERT directory (``model.attention`` switches its family)."""


@dataclass
class LraStage:
    """Long Range Arena of a variant (``python -m finetune lra``): tasks x seeds."""

    tasks: list[str] = field(default_factory=list)
    """LRA tasks: listops, text, retrieval, image, pathfinder, pathx."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """One run per seed."""
    protocol: str = "skyformer"
    """A shipped recipe set, ``configs/finetune/lra/<protocol>/<task>[-<family>].yaml``
    (``lra``, ``skyformer``); unused when ``recipe`` is given."""
    recipe: str = ""
    """A recipe instead of the protocol's (``{task}`` and ``{family}`` replaced)."""
    overrides: list[str] = field(default_factory=list)
    """Dotted overrides of every task's recipe."""
    task_overrides: dict[str, list[str]] = field(default_factory=dict)
    """Task -> dotted overrides of that task's recipe alone (after ``overrides``)."""
    data: str = "lra"
    """The data source holding the LRA release (every task's files below it)."""
    init: Literal["scratch", "self-pretrained"] = "scratch"
    """``scratch``, or ``self-pretrained``: masked-LM pretraining on the task's own training
    inputs first (Amos et al. 2023; ``python -m finetune lra-shards`` + ``python -m
    pretrain``), then fine-tuning from that release."""
    pretrain_recipe: str = "configs/pretrain/lra/{task}.yaml"
    """The self-pretraining recipe (``{task}``, ``{family}`` replaced)."""
    pretrain_overrides: list[str] = field(default_factory=list)
    """Dotted overrides of the self-pretraining recipe."""


STAGE_CLASSES: dict[str, type] = {"pretrain": PretrainStage, "glue": GlueStage, "lra": LraStage}


@dataclass
class Variant:
    """One model of the table."""

    label: str = ""
    """Its name in the paper's table (default: the key)."""
    family: str = "softmax"
    """The attention family (fills ``{family}`` in recipes; the estimates' throughput row)."""
    description: str = ""
    """What it is, in a line."""
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The stages it runs (``pretrain``, ``glue``, ``lra``), each a mapping that changes the
    study's settings of that stage (``{}``: the study's as they are). Lists of overrides are
    appended to the study's, other keys replace."""
    reported_as: str = ""
    """Another variant whose paper numbers this one is compared with (an alternative protocol
    of the same model); default: its own."""


@dataclass
class DataSource:
    """Where one data set of a scale comes from: a user's setting, or made by the study."""

    setting: str = ""
    """The name of a path in the user's settings (``--data NAME=PATH`` or the settings file's
    ``data.NAME``)."""
    generate: str = ""
    """Made by the study, in the official format: ``embedded`` (a tokenizer and pretraining
    shards from the embedded corpus), ``glue`` (tiny GLUE TSVs), ``lra`` (tiny LRA tasks),
    ``listops`` (generated ListOps), ``hf-albert`` (a tiny Hugging Face ALBERT directory)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The generator's options (sizes, seed; ``hf-albert``: ``tokenizer: SOURCE``)."""


@dataclass
class ScaleStage:
    """What a scale changes in every stage of one kind."""

    overrides: list[str] = field(default_factory=list)
    """Dotted overrides after the stage's own (steps, sizes, device)."""
    task_overrides: dict[str, list[str]] = field(default_factory=dict)
    """Task -> dotted overrides of that task's runs alone, last (e.g. its ``data.max_length``)."""
    seeds: list[int] | None = None
    """Replaces every suite's seeds at this scale (None: the stage's)."""
    lrs: list[float] | None = None
    """Replaces every GLUE suite's learning-rate grid (None: the stage's)."""
    resources: Resources = field(default_factory=Resources)
    """Per job of this stage on Slurm."""
    tokens_per_s: float | None = None
    """Training throughput per GPU for the estimate where no benchmark measured this stage's
    model (None: the benchmark tables, or no estimate)."""


@dataclass
class Scale:
    """One size of the study."""

    description: str = ""
    """What this scale is for and what it costs."""
    device: Literal["cpu", "cuda"] = "cuda"
    """``cpu``: no GPU-hour estimate (the ``tiny`` scale)."""
    variants: list[str] | None = None
    """The variants run at this scale (None: all of them)."""
    data: dict[str, DataSource] = field(default_factory=dict)
    """Every data source the stages name, by name."""
    stages: dict[str, ScaleStage] = field(default_factory=dict)
    """Every stage kind the variants run (``pretrain``, ``glue``, ``lra``; ``lra-pretrain``
    for self-pretraining) -> what this scale changes in it."""


@dataclass
class StudySpec:
    """A study: ``configs/studies/<name>.yaml``."""

    name: str = ""
    """The study's name (its run directory: ``runs/studies/<name>/<scale>``)."""
    title: str = ""
    """A line for the report's title."""
    description: str = ""
    """What the study shows and how, in a few sentences."""
    paper: Paper | None = None
    """The paper and table reproduced; None for a comparison of our own."""
    reference: str = ""
    """The variant every other is compared with (default: the first)."""
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every variant's settings of a stage kind (``pretrain``, ``glue``, ``lra``), changed per
    variant by its ``stages``."""
    variants: dict[str, Variant] = field(default_factory=dict)
    """The models, by key (``[a-z0-9-]``)."""
    scales: dict[str, Scale] = field(default_factory=dict)
    """The sizes it runs at, by name (``tiny``, ``full``, ...)."""
    source: str = field(default="", init=False)
    """The file it was read from (set by ``load_spec``)."""

    def variant_stage(self, variant: str, kind: str) -> Any:
        """The typed settings of ``variant``'s stage ``kind`` (study settings + the variant's)."""
        merged = _merge_stage(self.stages.get(kind, {}), self.variants[variant].stages[kind])
        return config_from_dict(
            STAGE_CLASSES[kind], merged, prefix=f"variants.{variant}.stages.{kind}"
        )

    def stage_kinds(self) -> list[str]:
        """The scale stage kinds the variants need (``lra-pretrain`` for self-pretraining)."""
        kinds: set[str] = set()
        for name, variant in self.variants.items():
            kinds.update(variant.stages)
            if (
                "lra" in variant.stages
                and self.variant_stage(name, "lra").init == "self-pretrained"
            ):
                kinds.add("lra-pretrain")
        return [k for k in (*STAGE_KINDS, "lra-pretrain") if k in kinds]


def _merge_stage(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """A variant's stage settings over the study's: override lists appended, the rest replaced."""
    merged = {**base, **{k: v for k, v in change.items() if not k.endswith("overrides")}}
    for key, value in change.items():
        if key.endswith("overrides"):
            merged[key] = [*base.get(key, []), *(value or [])]
    return merged


def load_spec(path: str | Path) -> StudySpec:
    """The spec at ``path``, checked; ``SpecError`` (file and place) on any mistake."""
    path = Path(path)
    if not path.is_file():
        shipped = sorted(p.stem for p in (REPO / "configs" / "studies").glob("*.yaml"))
        raise SpecError(f"{path}: no such study spec (shipped: {', '.join(shipped)})")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a study spec is a mapping (name, paper, variants, scales)")
    try:
        spec = config_from_dict(StudySpec, raw)
        spec.source = str(path)
        check_spec(spec)
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from e
    except ValueError as e:
        raise SpecError(f"{path}: {e}") from e
    return spec


def _fail(where: str, message: str) -> SpecError:
    return SpecError(f"{where}: {message}")


def check_spec(spec: StudySpec) -> None:
    """Everything that can be checked without data: names, stage settings, families, tasks,
    paper rows, references between variants (no cycles), scales covering every stage and
    every data source. Recipes are checked when the graph is built (``study.graph``)."""
    from finetune.glue.tasks import get_task as glue_task
    from finetune.lra.tasks import get_task as lra_task
    from model import ATTENTION_REGISTRY

    if not spec.name:
        raise _fail("name", "missing (the study's name)")
    if not spec.variants:
        raise _fail("variants", "a study needs at least one variant")
    if not spec.scales:
        raise _fail("scales", "a study needs at least one scale (e.g. tiny and full)")
    for kind in spec.stages:
        if kind not in STAGE_KINDS:
            raise _fail(f"stages.{kind}", f"unknown stage kind; valid: {list(STAGE_KINDS)}")
    for name, variant in spec.variants.items():
        where = f"variants.{name}"
        if not name.replace("-", "").isalnum() or name != name.lower():
            raise _fail(where, "a variant's key is lower-case letters, digits and '-'")
        if variant.family not in ATTENTION_REGISTRY:
            raise _fail(
                f"{where}.family",
                f"unknown attention family {variant.family!r}; valid: {ATTENTION_REGISTRY.names()}",
            )
        if not variant.stages:
            raise _fail(f"{where}.stages", "a variant runs at least one stage")
        for kind, change in variant.stages.items():
            if kind not in STAGE_KINDS:
                raise _fail(f"{where}.stages.{kind}", f"unknown stage; valid: {list(STAGE_KINDS)}")
            if not isinstance(change, dict):
                raise _fail(f"{where}.stages.{kind}", "must be a mapping ({} for the defaults)")
            stage = spec.variant_stage(name, kind)  # unknown keys, wrong types: ValueError
            _check_stage(spec, name, kind, stage, glue_task, lra_task)
        if variant.reported_as and variant.reported_as not in spec.variants:
            raise _fail(f"{where}.reported_as", f"no variant {variant.reported_as!r}")
    _check_no_cycle(spec)
    if spec.reference and spec.reference not in spec.variants:
        raise _fail("reference", f"no variant {spec.reference!r}; valid: {list(spec.variants)}")
    if spec.paper is not None:
        _check_paper(spec, glue_task, lra_task)
    needed = spec.stage_kinds()
    sources = _data_sources(spec)
    for scale_name, scale in spec.scales.items():
        where = f"scales.{scale_name}"
        for kind in needed:
            if kind not in scale.stages:
                raise _fail(
                    f"{where}.stages",
                    f"no {kind!r} entry: every scale says what it changes in every stage the "
                    f"variants run ({needed}; {{}} to change nothing)",
                )
        for variant in scale.variants or []:
            if variant not in spec.variants:
                raise _fail(f"{where}.variants", f"no variant {variant!r}")
        for kind in scale.stages:
            if kind not in (*STAGE_KINDS, "lra-pretrain"):
                raise _fail(f"{where}.stages.{kind}", "unknown stage kind")
        for source, users in sources.items():
            if source not in scale.data:
                raise _fail(f"{where}.data", f"no data source {source!r} (used by {users[0]})")
        for source_name, source in scale.data.items():
            _check_source(f"{where}.data.{source_name}", source, scale)


def _check_stage(spec, variant, kind, stage, glue_task, lra_task) -> None:
    where = f"variants.{variant}.stages.{kind}"
    try:
        if kind == "glue":
            for task in stage.tasks:
                glue_task(task)
            if not stage.tasks or not stage.seeds:
                raise ValueError("tasks and seeds must not be empty")
        elif kind == "lra":
            for task in stage.tasks:
                lra_task(task)
            if not stage.tasks or not stage.seeds:
                raise ValueError("tasks and seeds must not be empty")
    except ValueError as e:
        raise _fail(where, str(e)) from None
    init = getattr(stage, "init", "scratch")
    if init.startswith("variant:"):
        other = init.split(":", 1)[1]
        if other not in spec.variants or "pretrain" not in spec.variants[other].stages:
            raise _fail(f"{where}.init", f"{init}: no variant {other!r} with a pretrain stage")
    elif kind == "glue" and init == "pretrained":
        if "pretrain" not in spec.variants[variant].stages:
            raise _fail(
                f"{where}.init",
                "pretrained, but the variant has no pretrain stage (give init: source:NAME)",
            )
    elif init not in ("scratch", "pretrained", "self-pretrained") and not init.startswith(
        "source:"
    ):
        raise _fail(f"{where}.init", f"{init!r}: valid: scratch, source:NAME, variant:NAME")


def _check_no_cycle(spec: StudySpec) -> None:
    """``init: variant:X`` chains end (a cycle would wait for itself forever)."""
    for start in spec.variants:
        seen, name = [start], start
        while "pretrain" in spec.variants[name].stages:
            init = spec.variant_stage(name, "pretrain").init
            if not init.startswith("variant:"):
                break
            name = init.split(":", 1)[1]
            if name in seen:
                chain = " -> ".join([*seen, name])
                raise _fail(f"variants.{start}.stages.pretrain.init", f"a cycle: {chain}")
            seen.append(name)


def _check_paper(spec: StudySpec, glue_task, lra_task) -> None:
    paper = spec.paper
    for variant, row in paper.results.items():
        if variant not in spec.variants:
            raise _fail(
                f"paper.results.{variant}",
                f"a paper row names variant {variant!r}, which the study does not have "
                f"(variants: {list(spec.variants)})",
            )
        tasks = set()
        for kind in ("glue", "lra"):
            if kind in spec.variants[variant].stages:
                tasks.update(spec.variant_stage(variant, kind).tasks)
        for task in row:
            if task not in tasks:
                raise _fail(
                    f"paper.results.{variant}.{task}",
                    f"the variant runs no task {task!r} (its tasks: {sorted(tasks)})",
                )
    for task, metric in paper.metrics.items():
        if metric not in METRICS:
            raise _fail(f"paper.metrics.{task}", f"unknown metric {metric!r}; valid: {METRICS}")


def _data_sources(spec: StudySpec) -> dict[str, list[str]]:
    """Data source name -> the places that use it."""
    used: dict[str, list[str]] = {}
    for name, variant in spec.variants.items():
        for kind in variant.stages:
            stage = spec.variant_stage(name, kind)
            where = f"variants.{name}.stages.{kind}"
            if kind == "pretrain":
                for key, source in stage.data.items():
                    used.setdefault(source, []).append(f"{where}.data.{key}")
            else:
                used.setdefault(stage.data, []).append(f"{where}.data")
            init = getattr(stage, "init", "")
            if init.startswith("source:"):
                used.setdefault(init.split(":", 1)[1], []).append(f"{where}.init")
    return used


def _check_source(where: str, source: DataSource, scale: Scale) -> None:
    if bool(source.setting) == bool(source.generate):
        raise _fail(where, "give exactly one of setting (a user's path) or generate")
    if source.generate and source.generate not in GENERATORS:
        raise _fail(f"{where}.generate", f"unknown generator; valid: {list(GENERATORS)}")
    tokenizer = source.options.get("tokenizer")
    if tokenizer is not None and tokenizer not in scale.data:
        raise _fail(f"{where}.options.tokenizer", f"no data source {tokenizer!r} in this scale")


def spec_dict(spec: StudySpec) -> dict[str, Any]:
    """The spec as plain data (the report's record of what ran)."""
    return dataclasses.asdict(spec)
