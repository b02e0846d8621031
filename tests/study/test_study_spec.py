"""Study specs in-process: every shipped spec builds its graph at every scale; each kind of bad
spec is refused with exit 2 naming the file and the place, before anything runs; identities
change exactly where a spec change reaches; the estimate's arithmetic; the verdict; the user's
settings; one ``study run`` per study directory."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from study.cli import main as study_main
from study.graph import build_graph, missing_data
from study.ledger import StudyBusy, study_lock
from study.settings import load_settings
from study.spec import REPO, load_spec

SHIPPED = sorted((REPO / "configs" / "studies").glob("*.yaml"))

BASE = {
    "name": "t",
    "paper": {"citation": "A. Author (2023)", "table": "Table 1", "runs": 1,
              "results": {"a": {"listops": 40.0}, "b": {"listops": 42.0}}},
    "stages": {"lra": {"recipe": "configs/finetune/lra/debug-{task}.yaml", "tasks": ["listops"],
                       "data": "lo"}},
    "variants": {"a": {"stages": {"lra": {}}},
                 "b": {"family": "tisa", "stages": {"lra": {"overrides": ["optimizer.lr=0.002"]}}}},
    "scales": {"tiny": {"device": "cpu", "data": {"lo": {"setting": "lo"}},
                        "stages": {"lra": {"overrides": ["schedule.total_steps=4",
                                                          "schedule.warmup_steps=1"]}}}},
}  # fmt: skip


def write(tmp_path: Path, spec: dict, name: str = "t.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return path


def graph_of(path: Path, tmp_path: Path, scale: str = "tiny"):
    return build_graph(load_spec(path), scale, tmp_path / "out", load_settings(["lo=/data/lo"]))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_study_builds_at_every_scale(path, tmp_path, monkeypatch):
    monkeypatch.setenv("ALBATROSS_SETTINGS", str(tmp_path / "none.yaml"))
    (tmp_path / "none.yaml").write_text("{}\n")
    spec = load_spec(path)
    assert spec.name == path.stem and {"tiny"} <= set(spec.scales)
    for scale in spec.scales:
        graph = build_graph(spec, scale, tmp_path / scale, load_settings())
        assert graph.nodes and all(n.elements for n in graph.order())
        seen: set[str] = set()
        for node in graph.order():  # every node after the nodes it reads
            assert set(node.deps) <= seen, node.id
            seen.add(node.id)
        if spec.paper is not None:  # every paper number has a stage that produces it
            produced = {(n.variant, n.task) for n in graph.order() if n.kind in ("glue", "lra")}
            for variant, row in spec.paper.results.items():
                chosen = spec.scales[scale].variants
                if chosen is None or variant in chosen:
                    assert {(variant, t) for t in row} <= produced


def bad(mutate):
    spec = copy.deepcopy(BASE)
    mutate(spec)
    return spec


BAD_SPECS = {
    "unknown recipe": (
        bad(lambda s: s["stages"]["lra"].update(recipe="configs/finetune/lra/nope-{task}.yaml")),
        "variants.a.stages.lra.recipe: recipe configs/finetune/lra/nope-listops.yaml not found",
    ),
    "unknown key": (
        bad(lambda s: s["variants"]["a"]["stages"]["lra"].update(seeeds=[0])),
        "variants.a.stages.lra.seeeds",
    ),
    "unknown recipe key": (
        bad(lambda s: s["variants"]["a"]["stages"]["lra"].update(overrides=["optimiser.lr=1"])),
        "optimiser",
    ),
    "unknown model key": (
        bad(lambda s: s["variants"]["a"]["stages"]["lra"].update(overrides=["model.resdual=x"])),
        "resdual",
    ),
    "unknown task": (
        bad(lambda s: s["stages"]["lra"].update(tasks=["listopz"])),
        "variants.a.stages.lra: unknown LRA task",
    ),
    "unknown family": (
        bad(lambda s: s["variants"]["a"].update(family="sofmax")),
        "variants.a.family: unknown attention family 'sofmax'",
    ),
    "a cycle": (
        bad(
            lambda s: s["variants"].update(
                c={
                    "stages": {
                        "pretrain": {"recipe": "configs/pretrain/debug.yaml", "init": "variant:d"}
                    }
                },
                d={
                    "stages": {
                        "pretrain": {"recipe": "configs/pretrain/debug.yaml", "init": "variant:c"}
                    }
                },
            )
        ),
        "variants.c.stages.pretrain.init: a cycle: c -> d -> c",
    ),
    "a paper row naming a missing variant": (
        bad(lambda s: s["paper"]["results"].update(z={"listops": 1.0})),
        "paper.results.z: a paper row names variant 'z', which the study does not have",
    ),
    "a paper row naming a task the variant does not run": (
        bad(lambda s: s["paper"]["results"]["a"].update(text=1.0)),
        "paper.results.a.text: the variant runs no task 'text'",
    ),
    "a scale missing a stage": (
        bad(lambda s: s["scales"]["tiny"].update(stages={})),
        "scales.tiny.stages: no 'lra' entry",
    ),
    "a scale missing a data source": (
        bad(lambda s: s["scales"]["tiny"].update(data={})),
        "scales.tiny.data: no data source 'lo'",
    ),
    "an unknown init": (
        bad(lambda s: s["variants"]["a"]["stages"]["lra"].update(init="pretrained")),
        "variants.a.stages.lra.init",
    ),
    "an unknown generator": (
        bad(lambda s: s["scales"]["tiny"]["data"].update(lo={"generate": "wikipedia"})),
        "scales.tiny.data.lo.generate: unknown generator",
    ),
    "no variants": (bad(lambda s: s.update(variants={})), "variants: a study needs"),
}


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_spec_exits_2_naming_the_file_and_the_place(case, tmp_path, capsys):
    spec, message = BAD_SPECS[case]
    path = write(tmp_path, spec)
    out = tmp_path / "out"
    for command in ("plan", "run"):
        assert study_main([command, str(path), "--data", "lo=/x", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and message in err, err
    assert not out.exists()  # nothing was run or written


def test_missing_spec_file_and_bad_yaml(tmp_path, capsys):
    assert study_main(["plan", str(tmp_path / "nope.yaml")]) == 2
    assert "no such study spec" in capsys.readouterr().err
    (tmp_path / "x.yaml").write_text("name: [unclosed\n")
    assert study_main(["plan", str(tmp_path / "x.yaml")]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_run_refuses_missing_data_naming_the_setting(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ALBATROSS_SETTINGS", str(tmp_path / "settings.yaml"))
    (tmp_path / "settings.yaml").write_text("{}\n")
    path = write(tmp_path, BASE)
    assert study_main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "data source 'lo' needs setting 'lo': give --data lo=PATH" in err
    assert study_main(["run", str(path), "--data", f"lo={tmp_path / 'absent'}"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_identities_change_exactly_where_a_change_reaches(tmp_path):
    before = graph_of(write(tmp_path, BASE), tmp_path)
    changed = copy.deepcopy(BASE)
    changed["variants"]["b"]["stages"]["lra"]["overrides"] = ["optimizer.lr=0.003"]
    after = graph_of(write(tmp_path, changed, "u.yaml"), tmp_path)
    same = {n for n in before.nodes if before.nodes[n].identity == after.nodes[n].identity}
    assert same == set(before.nodes) - {"b.lra.listops"}
    # a scale change reaches every fine-tuning stage, not the baselines of the data
    changed["scales"]["tiny"]["stages"]["lra"]["overrides"] = [
        "schedule.total_steps=5",
        "schedule.warmup_steps=1",
    ]
    again = graph_of(write(tmp_path, changed, "v.yaml"), tmp_path)
    moved = {n for n in before.nodes if before.nodes[n].identity != again.nodes[n].identity}
    assert moved == {"a.lra.listops", "b.lra.listops"}
    # upstream changes propagate: a pretraining override changes its fine-tuning stages
    spec = load_spec(REPO / "configs" / "studies" / "main.yaml")
    settings = load_settings()
    g1 = build_graph(spec, "tiny", tmp_path / "m", settings)
    spec.variants["lra-self-pretrained"].stages["lra"]["pretrain_overrides"] = ["optimizer.lr=0.01"]
    g2 = build_graph(spec, "tiny", tmp_path / "m", settings)
    moved = {n for n in g1.nodes if g1.nodes[n].identity != g2.nodes[n].identity}
    assert moved == {"lra-self-pretrained.lra-pretrain.listops", "lra-self-pretrained.lra.listops"}


def test_node_directories_hold_the_identity_and_the_resolved_recipe(tmp_path):
    graph = graph_of(write(tmp_path, BASE), tmp_path)
    node = graph.nodes["b.lra.listops"]
    assert node.dir.name == f"b.lra.listops-{node.identity}"
    assert node.info["config"]["optimizer"]["lr"] == 0.002
    assert node.info["config"]["train"]["run_dir"] == str(node.run_dir)
    assert node.info["config"]["schedule"]["total_steps"] == 4  # the scale's, after the stage's
    assert node.args[node.args.index("--data") + 1] == "/data/lo"
    assert not missing_data(graph) or "does not exist" in missing_data(graph)[0]


def test_estimate_from_a_throughput_table(tmp_path):
    from study.estimate import estimate

    rows = [{"family": f, "hidden": 768, "layers": 12, "seq": s, "tokens_per_s": t}
            for f in ("softmax", "tisa") for s, t in ((128, 100_000.0), (512, 50_000.0))]  # fmt: skip
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"meta": {"device_name": "GPU X"}, "rows": rows}))
    spec = load_spec(REPO / "configs" / "studies" / "tisa-glue.yaml")
    graph = build_graph(spec, "full", tmp_path / "o", load_settings())
    by_name = {r.what: r for r in estimate(graph, table)}
    pre = by_name["pos-baseline pretrain"]
    seq128, seq512 = 112500 * 4096 * 128, 12500 * 4096 * 512  # steps x global batch x tokens
    assert pre.tokens == seq128 + seq512
    assert pre.gpu_hours == pytest.approx((seq128 / 100_000 + seq512 / 50_000) / 3600)
    glue = by_name["pos-baseline glue"]
    assert glue.gpu_hours == pytest.approx(glue.tokens / 50_000 / 3600)  # max_length 512
    total = by_name["total"]
    assert total.gpu_hours == pytest.approx(sum(r.gpu_hours for n, r in by_name.items()
                                                if n != "total"))  # fmt: skip
    assert pre.source == "measured"
    from study.estimate import format_estimate

    assert "Measured throughput: GPU X" in format_estimate(list(by_name.values()), table)


def test_verdict():
    from finetune.compare import Interval
    from study.report import verdict
    from study.results import TaskResult

    result = TaskResult("a", "t", "accuracy", "test", [40.0], 40.0, 0.0,
                        interval=Interval(0.40, 0.37, 0.43, 0.95))  # fmt: skip
    assert verdict(result, 41.0, 0.0)[0] == "consistent"
    assert verdict(result, 45.0, 0.0)[0] == "below the paper"
    assert verdict(result, 45.0, 2.5)[0] == "consistent"  # within the paper's spread
    assert verdict(result, 30.0, 0.0)[0] == "above the paper"
    assert verdict(None, 30.0, 0.0)[0] == "not run"


def test_settings_file_and_flags(tmp_path, monkeypatch):
    path = tmp_path / "s.yaml"
    path.write_text("data: {glue: /g}\nslurm: {partition: gpu, sbatch: {qos: high}}\n")
    monkeypatch.setenv("ALBATROSS_SETTINGS", str(path))
    s = load_settings(["lra=/l"], account="acct")
    assert s.data == {"glue": "/g", "lra": "/l"}
    assert (s.slurm.partition, s.slurm.account, s.slurm.sbatch) == ("gpu", "acct", {"qos": "high"})
    path.write_text("slurm: {partiton: gpu}\n")
    with pytest.raises(ValueError, match=r"settings file .*partiton"):
        load_settings()
    path.write_text("{}\n")
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        load_settings(["glue"])


def test_one_study_run_per_directory(tmp_path):
    with (
        study_lock(tmp_path),
        pytest.raises(StudyBusy, match=r"written by another `study run` .*pid"),
        study_lock(tmp_path),
    ):
        pass
    with study_lock(tmp_path):  # released with its holder
        pass


def test_local_executor_gives_each_gpu_stage_its_own_gpus(tmp_path, monkeypatch):
    """Four one-GPU stages on a machine with two GPUs: two at a time, each alone on its GPU;
    a CPU stage sees none."""
    from study.graph import Element, Graph, Node
    from study.local import LocalExecutor
    from study.spec import Resources

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))  # the probe's folder
    spec = load_spec(write(tmp_path, BASE))
    nodes = {}
    for i in range(5):
        gpu = Resources(gpus_per_node=0 if i == 4 else 1)
        out = tmp_path / f"probe{i}.json"
        nodes[f"p{i}"] = Node(f"p{i}", "data", "data", "study_probe", [str(out)], [],
                              tmp_path / f"n{i}", "x", gpu, [Element("all", [])])  # fmt: skip
    graph = Graph(spec, "tiny", tmp_path, nodes, {})
    outcome = LocalExecutor(graph, jobs=4, echo=False, gpus=["0", "1"]).run(list(nodes.values()))
    assert set(outcome.values()) == {"done"}
    runs = [json.loads((tmp_path / f"probe{i}.json").read_text()) for i in range(5)]
    assert [r["gpus"] for r in runs[:4]].count("0") == 2 and runs[4]["gpus"] == ""
    for a in runs[:4]:
        for b in runs[:4]:
            if a is not b and a["gpus"] == b["gpus"]:  # the same GPU never twice at once
                assert a["end"] <= b["start"] or b["end"] <= a["start"]
