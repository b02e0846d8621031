"""A study at one scale as a graph of stages (``Node``): the data it makes, each variant's
pretraining, export, self-pretraining and fine-tuning, every one the project's own command line
(``python -m pretrain``, ``python -m finetune glue|lra``, ...) run in its own directory.

Identity. A node's directory is ``<out>/nodes/<id>-<identity>``, where the identity is a hash of
everything that decides its result: the resolved recipe it runs (written beside it as
``stage.yaml``), its command and the identities of the nodes it reads (their directories are in
its arguments). A finished node is skipped; a changed spec, recipe or upstream result gives the
affected nodes new identities, so nothing stale is reused and nothing finished is overwritten.

Done. A node is done when its ``done/`` markers exist, one per element (a fine-tuning grid's
learning rate x seed; one ``all`` element otherwise), written by the executor after the stage
succeeded (pretraining: ``status.json`` says ``completed``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.checkpoint import write_atomically
from engine.recipe import build_config, load_recipe
from study.settings import Settings
from study.spec import REPO, LraStage, Resources, SpecError, StudySpec

DATA_RESOURCES = Resources(nodes=1, gpus_per_node=0, cpus_per_task=2, time="02:00:00")
"""Data making, export and baselines: one CPU process."""
STAGE_FILE = "stage.yaml"


@dataclass
class Element:
    """One independent run of a node (an array element on Slurm)."""

    key: str
    """``all``, ``seed_0`` or ``lr_2e-05.seed_0``."""
    args: list[str]
    """The stage's arguments that run this element alone."""


@dataclass
class Node:
    """One stage of the study: a command in its own directory."""

    id: str
    """``<variant>.<kind>[.<task>]``, ``data.<source>``, ``lra-shards.<task>``, ..."""
    kind: str
    """data, pretrain, export, lra-shards, lra-pretrain, glue, lra, baselines."""
    stage: str
    """The scale stage whose resources it uses (``pretrain``, ``glue``, ``lra``,
    ``lra-pretrain``) or ``data``."""
    module: str
    """``python -m <module>``."""
    args: list[str]
    """Every element at once (the local executor's one process)."""
    deps: list[str]
    dir: Path
    identity: str
    resources: Resources
    elements: list[Element]
    variant: str | None = None
    task: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    """What the estimate and the report need (family, tokens per phase, the encoder)."""

    @property
    def run_dir(self) -> Path:
        """The stage's own run directory (``train.run_dir``, ``--out``)."""
        return self.dir / "run"

    def done_file(self, element: str) -> Path:
        return self.dir / "done" / f"{element}.json"

    def is_done(self, element: str | None = None) -> bool:
        keys = [element] if element else [e.key for e in self.elements]
        return all(_marker_matches(self.done_file(k), self.identity) for k in keys)

    def missing(self) -> list[Element]:
        return [e for e in self.elements if not self.is_done(e.key)]

    def command(self) -> list[str]:
        return ["python", "-m", self.module, *self.args]


def _marker_matches(path: Path, identity: str) -> bool:
    try:
        return json.loads(path.read_text()).get("identity") == identity
    except (OSError, ValueError):
        return False


def write_done(node: Node, element: str, extra: dict[str, Any] | None = None) -> None:
    """The element's marker, atomically (a crash leaves none, never half a file)."""
    from engine.checkpoint import write_json_atomically

    path = node.done_file(element)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, {"identity": node.identity, "id": node.id, **(extra or {})})


@dataclass
class Graph:
    """The nodes of a study at one scale, in an order where every node follows its deps."""

    spec: StudySpec
    scale: str
    out: Path
    nodes: dict[str, Node]
    data: dict[str, Path]
    """Data source -> the path the stages read."""

    def order(self) -> list[Node]:
        return list(self.nodes.values())

    def dependents(self, node_id: str) -> set[str]:
        """Every node that needs ``node_id``, directly or not."""
        out: set[str] = set()
        for node in self.nodes.values():
            if node_id in node.deps or out & set(node.deps):
                out.add(node.id)
        return out


def _identity(payload: dict[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _set_dotted(data: dict[str, Any], key: str, value: Any, where: str) -> None:
    """``data[key] = value`` for a dotted key whose parts may index lists (``phases.1.shards``)."""
    *parents, last = key.split(".")
    node: Any = data
    for part in parents:
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise SpecError(f"{where}: {key}: no item {part} in the recipe's list")
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise SpecError(f"{where}: {key}: no item {last} in the recipe's list")
        node[int(last)] = value
    else:
        node[last] = value


def _recipe(template: str, where: str, **fields: str) -> Path:
    path = REPO / template.format(**fields)
    if not path.is_file():
        raise SpecError(f"{where}: recipe {path.relative_to(REPO)} not found")
    return path


def _load(path: Path, overrides: list[str], where: str) -> dict[str, Any]:
    try:
        return load_recipe(path, overrides)
    except ValueError as e:
        raise SpecError(f"{where}: {e}") from None


class _Builder:
    def __init__(self, spec: StudySpec, scale: str, out: Path, settings: Settings):
        if scale not in spec.scales:
            raise SpecError(f"--scale {scale}: the study has {list(spec.scales)}")
        self.spec, self.scale_name, self.scale = spec, scale, spec.scales[scale]
        self.out, self.settings = out, settings
        self.nodes: dict[str, Node] = {}
        self.data: dict[str, Path] = {}

    # -- nodes ------------------------------------------------------------------------------

    def add(self, id: str, kind: str, stage: str, module: str, args: list[str], deps: list[str],
            config: dict[str, Any] | None = None, elements: list[Element] | None = None,
            **extra: Any) -> Node:  # fmt: skip
        """A node whose arguments may hold ``{self}`` (its own directory, known once its
        identity is)."""
        payload = {"kind": kind, "module": module, "args": args, "config": config,
                   "deps": {d: self.nodes[d].identity for d in deps}}  # fmt: skip
        identity = _identity(
            json.loads(json.dumps(payload, default=str).replace(str(self.out), "<out>"))
        )
        node_dir = self.out / "nodes" / f"{id}-{identity}"

        def fill(items: list[str]) -> list[str]:
            return [a.replace("{self}", str(node_dir)) for a in items]

        if config is not None:
            config = json.loads(json.dumps(config).replace("{self}", str(node_dir)))
        elements = elements or [Element("all", args)]
        resources = (
            self.scale.stages[stage].resources if stage in self.scale.stages else DATA_RESOURCES
        )
        node = Node(id, kind, stage, module, fill(args), deps, node_dir, identity, resources,
                    [Element(e.key, fill(e.args)) for e in elements], **extra)  # fmt: skip
        node.info["config"] = config
        if id in self.nodes:
            raise SpecError(f"two stages named {id!r}")
        self.nodes[id] = node
        return node

    def data_source(self, name: str) -> str | None:
        """The node id that makes source ``name`` (None: the user's own path)."""
        source = self.scale.data[name]
        if source.setting:
            path = self.settings.data.get(source.setting)
            if path is None:
                path = f"<setting {source.setting}>"
            self.data[name] = Path(path)
            return None
        node_id = f"data.{name}"
        if node_id in self.nodes:
            return node_id
        deps, options = [], dict(source.options)
        if "tokenizer" in options:
            tok_source = options.pop("tokenizer")
            dep = self.data_source(tok_source)
            deps += [dep] if dep else []
            tok = self.tokenizer_of(tok_source)
            options["tokenizer_file"] = str(tok)
        args = [source.generate, "--out", "{self}/run", "--options",
                json.dumps(options, sort_keys=True)]  # fmt: skip
        node = self.add(node_id, "data", "data", "study.make_data", args, deps)
        self.data[name] = node.run_dir / ("shards" if source.generate == "embedded" else "")
        return node_id

    def tokenizer_of(self, source: str) -> Path:
        """The tokenizer.json of a data source (an ``embedded`` corpus, a release, an HF dir)."""
        path = self.data[source]
        if self.scale.data[source].generate == "embedded":
            return path.parent / "tokenizer" / "tokenizer.json"
        return path / "tokenizer.json"

    def _source_path(self, name: str, where: str) -> tuple[str, list[str]]:
        if name not in self.scale.data:
            raise SpecError(f"{where}: no data source {name!r} in scale {self.scale_name}")
        dep = self.data_source(name)
        return str(self.data[name]), [dep] if dep else []

    def _init(self, init: str, where: str) -> tuple[str | None, list[str]]:
        """(the directory a stage starts from, its deps) for ``init``."""
        if init.startswith("source:"):
            return self._source_path(init.split(":", 1)[1], where)
        if init.startswith("variant:"):
            node = self.pretrain(init.split(":", 1)[1])
            return str(node.run_dir / "release"), [node.id]
        return None, []

    # -- stages -----------------------------------------------------------------------------

    def pretrain(self, variant: str) -> Node:
        node_id = f"{variant}.pretrain"
        if node_id in self.nodes:
            return self.nodes[node_id]
        spec_variant = self.spec.variants[variant]
        stage = self.spec.variant_stage(variant, "pretrain")
        where = f"variants.{variant}.stages.pretrain"
        recipe = _recipe(stage.recipe, f"{where}.recipe", family=spec_variant.family)
        overrides = [*stage.overrides, *self.scale.stages["pretrain"].overrides]
        data = _load(recipe, overrides, where)
        deps: list[str] = []
        for key, source in stage.data.items():
            path, dep = self._source_path(source, f"{where}.data.{key}")
            _set_dotted(data, key, path, f"{where}.data")
            deps += dep
        init, dep = self._init(stage.init, f"{where}.init")
        if init is not None:
            data.setdefault("model", {})["init_from"] = init
            deps += dep
        data.setdefault("train", {})["run_dir"] = "{self}/run"
        data["train"].setdefault("progress", False)
        cfg = self._check_pretrain(data, where)
        info = {"family": spec_variant.family, "phases": [
            {"steps": min(p.end, cfg.train.steps) - p.start, "seq": p.max_seq_length,
             "micro_batch": p.micro_batch_size}
            for p in cfg.resolved_phases() if p.start < cfg.train.steps], "accumulation": cfg.engine.gradient_accumulation_steps,
            "model": data.get("model", {}), "check_loss": stage.check_loss}  # fmt: skip
        node = self.add(node_id, "pretrain", "pretrain", "pretrain",
                        ["--config", f"{{self}}/{STAGE_FILE}"], deps, config=data,
                        variant=variant, info=info)  # fmt: skip
        if stage.export:
            args = [str(node.run_dir), "--out", "{self}/run/release"]
            self.add(f"{variant}.export", "export", "data", "pretrain.export", args, [node.id],
                     variant=variant)  # fmt: skip
        return node

    @staticmethod
    def _check_pretrain(data: dict[str, Any], where: str):
        from pretrain.config import pretrain_config

        try:
            return pretrain_config(json.loads(json.dumps(data)))
        except ValueError as e:
            raise SpecError(f"{where}: {e}") from None

    def glue(self, variant: str) -> None:
        from finetune.glue.run import GlueConfig

        stage = self.spec.variant_stage(variant, "glue")
        scale = self.scale.stages["glue"]
        where = f"variants.{variant}.stages.glue"
        data_path, data_deps = self._source_path(stage.data, f"{where}.data")
        if stage.init == "pretrained":
            source = self.pretrain(variant)
            init, init_deps = str(source.run_dir / "release"), [source.id]
        else:
            init, init_deps = self._init(stage.init, f"{where}.init")
        seeds = scale.seeds or stage.seeds
        lrs = scale.lrs or stage.lrs
        for task in stage.tasks:
            recipe = _recipe(stage.recipe, f"{where}.recipe", task=task,
                             family=self.spec.variants[variant].family)  # fmt: skip
            overrides = [f"task={task}", *stage.overrides, *stage.task_overrides.get(task, []),
                         *scale.overrides, *scale.task_overrides.get(task, [])]  # fmt: skip
            data = _load(recipe, overrides, f"{where} ({task})")
            data.setdefault("train", {})["run_dir"] = "{self}/run"
            data["seeds"] = list(seeds)
            if lrs:
                data["lrs"] = list(lrs)
            try:
                cfg = build_config(GlueConfig, json.loads(json.dumps(data)))
            except ValueError as e:
                raise SpecError(f"{where} ({task}): {e}") from None
            base = ["glue", "--task", task, "--data", data_path, "--init", str(init),
                    "--config", f"{{self}}/{STAGE_FILE}", "--no-summary"]  # fmt: skip
            grid = cfg.lrs or [cfg.optimizer.lr]
            elements = [Element(f"lr_{lr:g}.seed_{s}", [*base, "--lrs", str(lr), "--seeds", str(s)])
                        for lr in grid for s in cfg.seeds]  # fmt: skip
            info = {"family": self.spec.variants[variant].family, "seeds": list(cfg.seeds),
                    "lrs": list(grid), "steps": cfg.schedule.total_steps,
                    "batch": cfg.engine.micro_batch_size * cfg.engine.gradient_accumulation_steps,
                    "seq": cfg.data.max_length}  # fmt: skip
            self.add(f"{variant}.glue.{task}", "glue", "glue", "finetune", base,
                     [*data_deps, *init_deps], config=data, elements=elements, variant=variant,
                     task=task, info=info)  # fmt: skip

    def lra(self, variant: str) -> None:
        from finetune.lra.run import LraConfig, recipe_path
        from finetune.lra.tasks import get_task

        stage: LraStage = self.spec.variant_stage(variant, "lra")
        scale = self.scale.stages["lra"]
        family = self.spec.variants[variant].family
        where = f"variants.{variant}.stages.lra"
        data_path, data_deps = self._source_path(stage.data, f"{where}.data")
        seeds = scale.seeds or stage.seeds
        for task in stage.tasks:
            if stage.recipe:
                recipe = _recipe(stage.recipe, f"{where}.recipe", task=task, family=family)
            else:
                try:
                    recipe = recipe_path(task, stage.protocol, family)
                except ValueError as e:
                    raise SpecError(f"{where}: {e}") from None
            overrides = [f"task={task}", *stage.overrides, *stage.task_overrides.get(task, []),
                         *scale.overrides, *scale.task_overrides.get(task, [])]  # fmt: skip
            data = _load(recipe, overrides, f"{where} ({task})")
            data.setdefault("train", {})["run_dir"] = "{self}/run"
            data["seeds"] = list(seeds)
            try:
                cfg = build_config(LraConfig, json.loads(json.dumps(data)))
                _check_lra_model(cfg, task)
            except ValueError as e:
                raise SpecError(f"{where} ({task}): {e}") from None
            deps = list(data_deps)
            base = ["lra", "--task", task, "--data", data_path,
                    "--config", f"{{self}}/{STAGE_FILE}", "--no-summary"]  # fmt: skip
            if stage.init == "self-pretrained":
                length = get_task(task).resolve_max_length(cfg.data.max_length)
                release = self.lra_pretrain(variant, stage, task, data_path, data_deps, length)
                base += ["--init", str(release.run_dir / "release")]
                deps.append(release.id)
            elements = [Element(f"seed_{s}", [*base, "--seeds", str(s)]) for s in cfg.seeds]

            info = {"family": family, "seeds": list(cfg.seeds), "steps": cfg.schedule.total_steps,
                    "batch": cfg.engine.micro_batch_size * cfg.engine.gradient_accumulation_steps,
                    "seq": get_task(task).sequence_length(cfg.data.max_length),
                    "documents": 2 if get_task(task).pair else 1,
                    "model": cfg.model, "init": stage.init}  # fmt: skip
            self.add(f"{variant}.lra.{task}", "lra", "lra", "finetune", base, deps, config=data,
                     elements=elements, variant=variant, task=task, info=info)  # fmt: skip
            self.baselines(stage.data, task, data_path, data_deps)

    def lra_pretrain(self, variant: str, stage: LraStage, task: str, data_path: str,
                     data_deps: list[str], length: int) -> Node:  # fmt: skip
        shards_id = f"lra-shards.{task}-{length}"
        if shards_id not in self.nodes:
            args = ["lra-shards", "--task", task, "--data", data_path, "--out", "{self}/run",
                    "--max-length", str(length)]  # fmt: skip
            self.add(shards_id, "lra-shards", "data", "finetune", args, list(data_deps), task=task)
        shards = self.nodes[shards_id]
        family = self.spec.variants[variant].family
        where = f"variants.{variant}.stages.lra.pretrain_recipe"
        recipe = _recipe(stage.pretrain_recipe, where, task=task, family=family)
        scale = self.scale.stages["lra-pretrain"]
        overrides = [*stage.pretrain_overrides, *scale.overrides,
                     *scale.task_overrides.get(task, [])]  # fmt: skip
        data = _load(recipe, overrides, where)
        data.setdefault("data", {})["shards"] = str(shards.run_dir)
        data.setdefault("train", {})["run_dir"] = "{self}/run"
        data["train"].setdefault("progress", False)
        cfg = self._check_pretrain(data, where)
        info = {"family": family, "phases": [
            {"steps": min(p.end, cfg.train.steps) - p.start, "seq": p.max_seq_length,
             "micro_batch": p.micro_batch_size}
            for p in cfg.resolved_phases() if p.start < cfg.train.steps], "accumulation": cfg.engine.gradient_accumulation_steps,
            "model": data.get("model", {})}  # fmt: skip
        return self.add(f"{variant}.lra-pretrain.{task}", "lra-pretrain", "lra-pretrain",
                        "pretrain", ["--config", f"{{self}}/{STAGE_FILE}"], [shards.id],
                        config=data, variant=variant, task=task, info=info)  # fmt: skip

    def baselines(self, source: str, task: str, data_path: str, data_deps: list[str]) -> None:
        from finetune.lra.baselines import TASKS as BASELINE_TASKS

        node_id = f"baselines.{task}"
        if task not in BASELINE_TASKS or node_id in self.nodes:
            return
        args = ["--task", task, "--data", data_path, "--out", "{self}/run/baselines.json"]
        self.add(node_id, "baselines", "data", "finetune.lra.baselines", args, list(data_deps),
                 task=task)  # fmt: skip


def _check_lra_model(cfg, task: str) -> None:
    """The recipe's model section builds an encoder config (a typo in a model key fails here)."""
    from finetune.lra.tasks import PAD_ID, get_task
    from model.config import EncoderConfig

    lra_task = get_task(task)
    seq = lra_task.sequence_length(cfg.data.max_length)
    EncoderConfig.from_dict({**cfg.model, "vocab_size": lra_task.vocab_size, "pad_token_id": PAD_ID,
                             "max_position_embeddings": max(seq, cfg.model.get(
                                 "max_position_embeddings", 0))})  # fmt: skip


def build_graph(spec: StudySpec, scale: str, out: Path, settings: Settings) -> Graph:
    """Every node of ``spec`` at ``scale`` under ``out``; ``SpecError`` on a recipe or key that
    does not exist (nothing has run). Data from the user's settings is not looked at here
    (``missing_data`` says what is absent)."""
    try:
        return _build(spec, scale, Path(out).absolute(), settings)
    except SpecError as e:
        raise SpecError(f"{spec.source or spec.name}: {e}") from None


def _build(spec: StudySpec, scale: str, out: Path, settings: Settings) -> Graph:
    builder = _Builder(spec, scale, out, settings)
    chosen = spec.scales[scale].variants if scale in spec.scales else None
    variants = {k: v for k, v in spec.variants.items() if chosen is None or k in chosen}
    for name, variant in variants.items():
        if "pretrain" in variant.stages:
            builder.pretrain(name)
    for name, variant in variants.items():
        if "glue" in variant.stages:
            builder.glue(name)
        if "lra" in variant.stages:
            builder.lra(name)
    return Graph(spec, scale, out, builder.nodes, builder.data)


def missing_data(graph: Graph) -> list[str]:
    """The user's data the graph needs and does not have: each with the way to give it."""
    problems = []
    scale = graph.spec.scales[graph.scale]
    for name, path in sorted(graph.data.items()):
        setting = scale.data[name].setting
        if not setting:
            continue
        if str(path).startswith("<setting"):
            problems.append(f"data source {name!r} needs setting {setting!r}: give --data "
                            f"{setting}=PATH or add it under data: in your settings file")  # fmt: skip
        elif not path.exists():
            problems.append(f"data source {name!r}: {path} (setting {setting!r}) does not exist")
    return problems


def write_stage_files(graph: Graph, nodes: list[Node]) -> None:
    """Each node's resolved recipe (``stage.yaml``), which its command reads."""
    for node in nodes:
        config = node.info.get("config")
        if config is None:
            continue
        path = node.dir / STAGE_FILE
        node.dir.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(config, sort_keys=False)
        if not path.is_file() or path.read_text() != text:
            data = text.encode()
            write_atomically(path, lambda f, data=data: f.write(data))
