"""GLUE in the three layouts `--data` takes, on one fixture in the Hub's exact schema: the
original TSVs, a `DatasetDict.save_to_disk` per config, and a snapshot of the Hub's
`nyu-mll/glue` (`<config>/<split>-00000-of-00001.parquet`, written with datasets' own
`to_parquet`): ClassLabel names in HF's order, `idx`, test labels -1, MNLI's matched and
mismatched splits, AX.

* every split reads the same from each layout;
* `--task all` writes the 11 server files (AX.tsv from the MNLI run), the same in each layout,
  with the fixture's row counts and the server's label strings; the summary names the
  submission's state; results.json counts the rows read and skipped;
* AX without its data, `--task ax`, another task's data whose columns match, a single split's
  `Dataset.save_to_disk` are clear errors or warnings;
* `check_submission_dir` on files of the official sizes.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
from test_glue_data import QUOTED, SPEC, hf_dataset_dict, write_glue_tsv
from test_glue_finetune import release as release  # the tiny release fixture
from test_glue_finetune import sentence
from test_glue_finetune import tokenizer_file as tokenizer_file  # the release fixture's

from finetune.__main__ import main as finetune_main
from finetune.glue.data import load_split
from finetune.glue.submission import check_submission_dir, write_predictions
from finetune.glue.tasks import SCORED_TASKS, SERVER_FILES, TASKS, get_task

LAYOUTS = ("tsv", "hf", "parquet")
TINY = [
    "engine.micro_batch_size=4",
    "engine.precision=fp32",
    "data.max_length=32",
    "schedule.warmup_steps=0",
    "schedule.total_steps=2",
    "train.eval_every=2",
    "train.log_every=1",
    "optimizer.lr=0.001",
]


def fixture_spec() -> dict:
    """SPEC's files (headers and columns) with more rows: 8 per train split, every label,
    a different test size per task so a mix-up shows. STS-B scores are exact in float32."""
    rng = random.Random(3)
    spec = {}
    for t, (name, splits) in enumerate(SPEC.items()):
        task = get_task(name)
        spec[name] = {}
        for s, (split, (header, builder, _)) in enumerate(splits.items()):
            n = 8 if split == "train" else 4 if split.startswith("dev") else 2 + (t + s) % 4
            rows = []
            for i in range(n):
                if not task.is_labelled(split):
                    label = None
                elif task.is_regression:
                    label = f"{(i % 5) * 1.25:.3f}"
                else:
                    label = task.labels[i % len(task.labels)]
                text_a = QUOTED if i == 0 else sentence(rng, i % 2 == 0)
                text_b = sentence(rng, i % 3 == 0) if task.is_pair else None
                rows.append((text_a, text_b, label))
            spec[name][split] = (header, builder, rows)
    return spec


SPEC_BIG = fixture_spec()


def write_layout(root: Path, layout: str) -> Path:
    """SPEC_BIG under `root` in one layout; returns the `--data` directory."""
    if layout == "tsv":
        write_glue_tsv(root, SPEC_BIG)
        return root
    for name in SPEC_BIG:
        dataset_dict = hf_dataset_dict(name, SPEC_BIG)
        if layout == "hf":
            dataset_dict.save_to_disk(str(root / name))
        else:  # the Hub's files: <config>/<split>-00000-of-00001.parquet
            for hf_split, ds in dataset_dict.items():
                ds.to_parquet(str(root / name / f"{hf_split}-00000-of-00001.parquet"))
    return root


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    return {
        layout: write_layout(tmp_path_factory.mktemp(f"glue_{layout}"), layout)
        for layout in LAYOUTS
    }


@pytest.mark.parametrize("name", list(SPEC))
def test_every_split_reads_the_same_in_every_layout(layouts, name, caplog):
    task = get_task(name)
    for split in task.splits:
        read = {}
        with caplog.at_level(logging.WARNING):
            for layout, root in layouts.items():
                examples, stats = load_split(task, root, split)
                assert stats.format == layout
                read[layout] = examples
        tsv = read["tsv"]
        want = len(SPEC_BIG[name][split][2])
        assert len(tsv) == want, (name, split)
        for layout in ("hf", "parquet"):
            got = read[layout]
            assert [(e.text_a, e.text_b) for e in got] == [(e.text_a, e.text_b) for e in tsv]
            # HF's label ids mapped to ours by the ClassLabel's names (MNLI's order differs);
            # STS-B's float32 scores are exact for these values; HF's test labels -1 are None
            assert [e.label for e in got] == [e.label for e in tsv], (layout, split)
            if not task.is_labelled(split):
                assert [e.index for e in got] == [e.index for e in tsv] == list(range(want))
    # The Parquet files' features came back: a ClassLabel, not a plain int read by position.
    assert "plain int" not in caplog.text


@pytest.mark.integration
def test_task_all_writes_the_11_server_files_the_same_in_every_layout(layouts, release, tmp_path):
    hub = layouts["parquet"]  # the Hub's files and nothing else
    assert (hub / "mnli" / "validation_matched-00000-of-00001.parquet").is_file()
    assert (hub / "ax" / "test-00000-of-00001.parquet").is_file()
    assert not list(hub.rglob("*.json"))
    submissions = {}
    for layout, data in layouts.items():
        run_dir = tmp_path / layout
        args = ["glue", "--task", "all", "--data", str(data), "--init", str(release)]
        assert finetune_main([*args, *TINY, f"train.run_dir={run_dir}"]) == 0
        files = {p.name: p.read_text() for p in (run_dir / "submission").glob("*.tsv")}
        assert sorted(files) == sorted(sf.file for _, sf in SERVER_FILES)
        for task, server_file in SERVER_FILES:
            header, *lines = files[server_file.file].splitlines()
            rows = [line.split("\t") for line in lines]
            assert header == "index\tprediction"
            assert len(rows) == len(SPEC_BIG[task.name][server_file.split][2]), server_file
            assert [int(index) for index, _ in rows] == list(range(len(rows)))
            predictions = {prediction for _, prediction in rows}
            if task.is_regression:
                assert all(0.0 <= float(p) <= 5.0 for p in predictions)
            elif task.name in ("mnli", "ax"):
                assert predictions <= {"entailment", "neutral", "contradiction"}
            elif task.name in ("qnli", "rte"):
                assert predictions <= {"entailment", "not_entailment"}
            else:
                assert predictions <= {"0", "1"}
        submissions[layout] = files

        results = json.loads((run_dir / "results.json").read_text())
        report = results["submission"]
        # every file is there; only the official row counts (1063 for CoLA, ...) are not
        assert report["missing"] == [] and report["complete"] is False
        assert sorted(report["problems"]) == sorted(files)
        assert all("rows, the server expects" in p[0] for p in report["problems"].values())
        table = (run_dir / "results.md").read_text()
        assert "INCOMPLETE, 0 of 11 server files usable" in table
        n_ax, n_mm = (
            len(SPEC_BIG[t][s][2]) for t, s in (("ax", "test"), ("mnli", "test_mismatched"))
        )
        assert f"AX.tsv: {n_ax} rows, the server expects 1104" in table
        assert "missing" not in table
        rows = {r["task"]: r["rows"] for r in results["runs"]}
        assert rows["mnli"]["ax"] == {"read": n_ax, "skipped": 0}
        assert rows["mnli"]["test_mismatched"] == {"read": n_mm, "skipped": 0}
        qqp_train = {"read": 10, "skipped": 2} if layout == "tsv" else {"read": 8, "skipped": 0}
        assert rows["qqp"]["train"] == qqp_train  # the TSV's broken rows, counted
    assert submissions["hf"] == submissions["tsv"]
    assert submissions["parquet"] == submissions["tsv"]
    # The same examples and label ids in the same order: the same training, bit for bit (the
    # predictions of 2 steps vary little, the weights show any difference in the labels).
    for name in SCORED_TASKS:
        weights = {
            (
                tmp_path / layout / name / "lr_0.001" / "seed_0" / "best" / "model.safetensors"
            ).read_bytes()
            for layout in LAYOUTS
        }
        assert len(weights) == 1, name


def test_mnli_without_the_ax_data_warns_and_the_summary_says_so(layouts, release, tmp_path, caplog):
    data = layouts["tsv"] / "MNLI"  # one task's folder: no diagnostic/ under it
    run_dir = tmp_path / "runs"
    args = ["glue", "--task", "mnli", "--data", str(data), "--init", str(release)]
    with caplog.at_level(logging.WARNING):
        assert finetune_main([*args, *TINY, f"train.run_dir={run_dir}"]) == 0
    assert "no ax test data under" in caplog.text and "AX.tsv will be missing" in caplog.text
    assert "diagnostic.tsv" in caplog.text and "test-*-of-*.parquet" in caplog.text
    assert sorted(p.name for p in (run_dir / "submission").iterdir()) == [
        "MNLI-m.tsv",
        "MNLI-mm.tsv",
    ]
    table = (run_dir / "results.md").read_text()
    assert "INCOMPLETE" in table and "AX.tsv (predicted by the mnli runs when" in table
    assert "WNLI.tsv (no finished wnli run)" in table
    report = json.loads((run_dir / "results.json").read_text())["submission"]
    assert report["missing"] == [
        sf.file for _, sf in SERVER_FILES if sf.file not in ("MNLI-m.tsv", "MNLI-mm.tsv")
    ]
    assert "GLUE submission" in caplog.text  # the warning


def test_a_finished_mnli_run_is_skipped_and_still_provides_ax(layouts, release, tmp_path, caplog):
    run_dir = tmp_path / "runs"
    args = ["glue", "--task", "mnli", "--data", str(layouts["parquet"]), "--init", str(release)]
    assert finetune_main([*args, *TINY, f"train.run_dir={run_dir}"]) == 0
    first = (run_dir / "submission" / "AX.tsv").read_text()
    with caplog.at_level(logging.WARNING):
        # again: nothing to do
        assert finetune_main([*args, *TINY, f"train.run_dir={run_dir}"]) == 0
    assert "finished before; skipping it" in caplog.text
    assert (run_dir / "submission" / "AX.tsv").read_text() == first
    (row,) = json.loads((run_dir / "results.json").read_text())["runs"]
    assert row["rows"]["ax"] == {"read": len(SPEC_BIG["ax"]["test"][2]), "skipped": 0}


def test_task_ax_is_a_clear_error(layouts, release, capsys):
    args = ["glue", "--task", "ax", "--data", str(layouts["tsv"]), "--init", str(release)]
    assert finetune_main(args) == 2
    err = capsys.readouterr().err
    assert "ax.yaml" not in err
    assert "has no training or dev data" in err and "the mnli runs predict it" in err
    assert "run --task mnli (or --task all)" in err


# ----------------------------------------------------------------------------- mismatches


@pytest.mark.parametrize("layout", ["hf", "parquet"])
@pytest.mark.parametrize(
    ("task", "other", "match"),
    [
        (  # MRPC's 0/1 classes are no similarity scores
            "stsb",
            "mrpc",
            r"glue/stsb's label is a similarity score \(a float in \[0, 5\]\), but this label "
            r"column is a ClassLabel with names \['not_equivalent', 'equivalent'\]; that is the "
            r"label of HF glue/mrpc",
        ),
        (  # the same names as WNLI's, in RTE's order
            "wnli",
            "rte",
            r"the label's ClassLabel names \['entailment', 'not_entailment'\] are not "
            r"glue/wnli's: HF's \['not_entailment', 'entailment'\] \(in that order\) or GLUE's "
            r"\['0', '1'\]; that is the label of HF glue/qnli, glue/rte",
        ),
        (
            "rte",
            "wnli",
            r"ClassLabel names \['not_entailment', 'entailment'\] are not glue/rte's.*"
            r"HF glue/wnli",
        ),
        ("sst2", "cola", r"\['unacceptable', 'acceptable'\] are not glue/sst2's.*glue/cola"),
        (
            "mrpc",
            "stsb",
            r"glue/mrpc's label is a class id .* but this label column is a plain float32 "
            r"column; that is the label of HF glue/stsb",
        ),
    ],
)
def test_another_tasks_data_is_refused(layouts, layout, task, other, match):
    data = layouts[layout] / other
    with pytest.raises(ValueError, match=match) as error:
        load_split(task, data, "train")
    assert str(data) in str(error.value)


def test_another_tasks_data_exits_2_naming_task_data_and_labels(layouts, release, capsys):
    data = layouts["parquet"] / "rte"
    args = ["glue", "--task", "wnli", "--data", str(data), "--init", str(release)]
    assert finetune_main(args) == 2
    err = capsys.readouterr().err
    assert f"{data}:train" in err and "not glue/wnli's" in err and "glue/rte" in err


def test_plain_int_labels_name_the_task_ids(tmp_path):
    import datasets

    features = datasets.Features(
        {"sentence": datasets.Value("string"), "label": datasets.Value("int64")}
    )
    ds = datasets.Dataset.from_dict({"sentence": ["a", "b"], "label": [1, 2]}, features=features)
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "sst2"))
    with pytest.raises(
        ValueError,
        match=r"sst2:train row 1: label id 2 is outside glue/sst2's label ids 0\.\.1 \(the "
        r"label column is a plain int, not a ClassLabel; read in HF glue's order "
        r"\['negative', 'positive'\]\)",
    ):
        load_split("sst2", tmp_path, "train")


def test_single_split_save_to_disk_is_refused(layouts, tmp_path):
    hf_dataset_dict("rte", SPEC_BIG)["train"].save_to_disk(str(tmp_path / "rte"))
    with pytest.raises(
        ValueError,
        match=r"rte holds a single split \(a Dataset\.save_to_disk: dataset_info\.json and "
        r"state\.json, no dataset_dict\.json\), but GLUE rte needs its splits \(train, "
        r"validation, test\) by name: save the DatasetDict",
    ):
        load_split("rte", tmp_path, "train")


def test_missing_split_names_every_layout(layouts, tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_split("mnli", layouts["hf"] / "qnli", "dev_matched")
    message = str(error.value)
    assert "dev_matched.tsv (original GLUE TSVs)" in message
    assert "a HF dataset_dict.json listing 'validation_matched'" in message
    assert "validation_matched-*-of-*.parquet (a Hub snapshot of nyu-mll/glue)" in message
    assert "is a DatasetDict of ['test', 'train', 'validation']" in message


# ----------------------------------------------------------------------------- completeness


def test_check_submission_dir_official_sizes(tmp_path):
    for task, server_file in SERVER_FILES:
        n = server_file.rows
        predictions = (
            [0.5 * (i % 11) for i in range(n)]
            if task.is_regression
            else [i % len(task.labels) for i in range(n)]
        )
        write_predictions(task, list(range(n)), predictions, tmp_path, server_file.split)
    report = check_submission_dir(tmp_path)
    assert report.complete and report.missing == [] and len(report.present) == 11
    assert "complete, all 11 server files with the official row counts" in report.summary()

    (tmp_path / "AX.tsv").unlink()
    rte = tmp_path / "RTE.tsv"
    rte.write_text(rte.read_text().replace("\tnot_entailment\n", "\tmaybe\n", 1))
    write_predictions("cola", [0, 1], [0, 1], tmp_path, overwrite=True)
    report = check_submission_dir(tmp_path)
    assert not report.complete
    assert report.missing == ["AX.tsv"]
    assert report.problems == {
        "CoLA.tsv": ["2 rows, the server expects 1063"],
        "RTE.tsv": ["line 3: prediction 'maybe' is not one of ['entailment', 'not_entailment']"],
    }
    summary = report.summary()
    assert "INCOMPLETE, 8 of 11 server files usable" in summary
    assert "missing AX.tsv (predicted by the mnli runs" in summary
    assert report.to_dict()["complete"] is False


def test_ax_is_predicted_with_mnli_labels():
    assert TASKS["ax"].predicted_with == "mnli" and TASKS["ax"].labels == TASKS["mnli"].labels
    assert [sf.file for _, sf in SERVER_FILES][-1] == "AX.tsv" and len(SERVER_FILES) == 11
