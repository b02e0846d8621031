"""GLUE metrics against scikit-learn / scipy, the GLUE score, and the server's submission files."""

from __future__ import annotations

import logging
import zipfile

import numpy as np
import pytest
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from finetune.glue.metrics import compute_metrics, glue_average
from finetune.glue.submission import write_predictions, write_submission_dir
from finetune.glue.tasks import TASKS, get_task

N = 300
SERVER_FILES = [  # the GLUE server's file names
    *("CoLA.tsv", "SST-2.tsv", "MRPC.tsv", "STS-B.tsv", "QQP.tsv", "MNLI-m.tsv", "MNLI-mm.tsv"),
    *("QNLI.tsv", "RTE.tsv", "WNLI.tsv", "AX.tsv"),
]


def _random_classes(task, seed):
    rng = np.random.default_rng(seed)
    k = len(get_task(task).labels)
    return rng.integers(0, k, N), rng.integers(0, k, N)


@pytest.mark.parametrize("task", ["cola", "sst2", "mrpc", "qqp", "mnli", "qnli", "rte", "wnli"])
def test_classification_metrics_equal_sklearn(task):
    pred, gold = _random_classes(task, seed=len(task))
    result = compute_metrics(task, pred, gold)
    sklearn_fn = {"mcc": matthews_corrcoef, "accuracy": accuracy_score, "f1": f1_score}
    names = get_task(task).metrics
    reference = {name: sklearn_fn[name](gold, pred) for name in names}
    assert set(result) == {*names, "score"}
    for name in names:
        assert result[name] == pytest.approx(reference[name], abs=1e-12)
    assert result["score"] == pytest.approx(np.mean([reference[n] for n in names]))
    assert result["accuracy" if task != "cola" else "mcc"] != 0.0  # random, not degenerate


def test_stsb_metrics_equal_scipy():
    rng = np.random.default_rng(0)
    gold = rng.uniform(0, 5, N)
    pred = gold + rng.normal(0, 1.5, N)  # unclipped predictions are fine for metrics
    result = compute_metrics("stsb", pred.astype(np.float32), gold)
    assert result["pearson"] == pytest.approx(pearsonr(pred, gold).statistic, abs=1e-6)
    assert result["spearman"] == pytest.approx(spearmanr(pred, gold).statistic, abs=1e-6)
    assert result["score"] == pytest.approx((result["pearson"] + result["spearman"]) / 2)
    # (n, 1) regression-head outputs are accepted; a constant prediction scores 0, not NaN.
    assert compute_metrics("stsb", pred[:, None], gold)["pearson"] == pytest.approx(
        pearsonr(pred, gold).statistic
    )
    assert compute_metrics("stsb", np.full(N, 2.5), gold) == {
        "pearson": 0.0,
        "spearman": 0.0,
        "score": 0.0,
    }


def test_metric_errors():
    pred, gold = _random_classes("mnli", seed=1)
    with pytest.raises(
        ValueError, match=r"mnli labels hold 3, outside the task's label ids 0\.\.2"
    ):
        compute_metrics("mnli", pred, np.where(gold == 0, 3, gold))
    with pytest.raises(ValueError, match=r"rte predictions hold -1"):
        compute_metrics("rte", pred % 2 - 1, gold % 2)
    with pytest.raises(ValueError, match="take the argmax of the logits"):
        compute_metrics("mnli", np.zeros((N, 3)), gold)
    with pytest.raises(ValueError, match="integer class ids"):
        compute_metrics("sst2", np.full(N, 0.5), gold % 2)
    with pytest.raises(ValueError, match=f"{N - 1} predictions for {N} labels"):
        compute_metrics("mnli", pred[1:], gold)
    with pytest.raises(ValueError, match=r"outside the STS-B range \[0, 5\]"):
        compute_metrics("stsb", np.ones(3), np.array([1.0, 6.0, 2.0]))
    with pytest.raises(ValueError, match="only the GLUE server scores it"):
        compute_metrics("ax", pred, gold)
    with pytest.raises(ValueError, match="unknown GLUE task"):
        compute_metrics("squad", pred, gold)


# BERT-large's GLUE test results (leaderboard, in %); its published GLUE score is 80.5.
BERT_LARGE = {
    "cola": {"mcc": 60.5},
    "sst2": {"accuracy": 94.9},
    "mrpc": {"f1": 89.3, "accuracy": 85.4},
    "stsb": {"pearson": 87.6, "spearman": 86.5},
    "qqp": {"f1": 72.1, "accuracy": 89.3},
    "mnli_matched": {"accuracy": 86.7},
    "mnli_mismatched": {"accuracy": 85.9},
    "qnli": {"accuracy": 92.7},
    "rte": {"accuracy": 70.1},
    "wnli": {"accuracy": 65.1},
}


def test_glue_average_reproduces_the_leaderboard(caplog):
    # MNLI counts once (the mean of m and mm); two-metric tasks are averaged first.
    task_scores = [60.5, 94.9, 87.35, 87.05, 80.7, 86.3, 92.7, 70.1, 65.1]
    assert glue_average(BERT_LARGE) == pytest.approx(np.mean(task_scores))
    assert round(glue_average(BERT_LARGE), 1) == 80.5
    assert glue_average(BERT_LARGE, exclude_wnli=True) == pytest.approx(np.mean(task_scores[:-1]))
    with_score = {k: {**v, "score": 1.0} for k, v in BERT_LARGE.items()}  # "score" wins
    assert glue_average(with_score) == pytest.approx(1.0)
    assert glue_average(BERT_LARGE, tasks=["rte", "mnli"]) == pytest.approx((70.1 + 86.3) / 2)
    with caplog.at_level(logging.WARNING):
        assert glue_average({**BERT_LARGE, "ax": {"mcc": 39.6}}) == glue_average(BERT_LARGE)
    assert "AX is not part of the GLUE score" in caplog.text


def test_glue_average_on_compute_metrics_results():
    results = {}
    for name in ("cola", "sst2", "mrpc", "stsb", "qqp", "qnli", "rte", "wnli", "mnli"):
        task = get_task(name)
        for i, split in enumerate(task.dev_splits):
            if task.is_regression:
                rng = np.random.default_rng(i)
                gold = rng.uniform(0, 5, N)
                pred = gold + rng.normal(0, 1, N)
            else:
                pred, gold = _random_classes(name, seed=i)
            results[task.result_key(split)] = compute_metrics(task, pred, gold)
    mnli = (results["mnli_matched"]["score"] + results["mnli_mismatched"]["score"]) / 2
    others = [results[k]["score"] for k in results if not k.startswith("mnli")]
    assert glue_average(results) == pytest.approx(np.mean([*others, mnli]))


def test_glue_average_errors():
    partial = {k: v for k, v in BERT_LARGE.items() if k != "mnli_mismatched"}
    with pytest.raises(ValueError, match=r"no results for \['mnli_mismatched'\]"):
        glue_average(partial)
    with pytest.raises(ValueError, match=r"unknown result key 'mnli'.*mnli_matched"):
        glue_average({**BERT_LARGE, "mnli": {"accuracy": 1.0}})
    with pytest.raises(ValueError, match=r"neither 'score' nor \['spearman'\]"):
        glue_average({**BERT_LARGE, "stsb": {"pearson": 1.0}})
    with pytest.raises(ValueError, match="not part of the GLUE score"):
        glue_average(BERT_LARGE, tasks=["ax"])


# ----------------------------------------------------------------------------- submission


def _read_tsv(path):
    lines = path.read_text().splitlines()
    return lines[0], [line.split("\t") for line in lines[1:]]


def test_submission_files_names_columns_and_labels(tmp_path, caplog):
    rng = np.random.default_rng(0)
    predictions = {}
    for task in TASKS.values():
        for split in task.test_splits:
            n = 7
            indices = rng.permutation(n)  # any order in, index order out
            preds = (
                rng.uniform(-1, 6, n) if task.is_regression else rng.integers(0, task.num_labels, n)
            )
            predictions[task.result_key(split)] = (indices, preds)
    with caplog.at_level(logging.WARNING):
        paths = write_submission_dir(predictions, tmp_path, zip_name="submission.zip")
    assert "the GLUE server expects indices 0..1062" in caplog.text  # 7 rows, not CoLA's 1063
    names = sorted(p.name for p in paths[:-1])
    assert names == sorted(SERVER_FILES)
    with zipfile.ZipFile(paths[-1]) as zf:
        assert sorted(zf.namelist()) == names  # at the archive's top level
    expected_values = {
        "CoLA.tsv": {"0", "1"},
        "SST-2.tsv": {"0", "1"},
        "MRPC.tsv": {"0", "1"},
        "QQP.tsv": {"0", "1"},
        "WNLI.tsv": {"0", "1"},
        "MNLI-m.tsv": {"entailment", "neutral", "contradiction"},
        "MNLI-mm.tsv": {"entailment", "neutral", "contradiction"},
        "AX.tsv": {"entailment", "neutral", "contradiction"},
        "QNLI.tsv": {"entailment", "not_entailment"},
        "RTE.tsv": {"entailment", "not_entailment"},
    }
    for path in paths[:-1]:
        header, rows = _read_tsv(path)
        assert header == "index\tprediction"
        assert [int(r[0]) for r in rows] == list(range(7)) and all(len(r) == 2 for r in rows)
        if path.name == "STS-B.tsv":
            values = [float(r[1]) for r in rows]
            assert all(0.0 <= v <= 5.0 for v in values)
            assert all(len(r[1].split(".")[1]) == 3 for r in rows)
        else:
            assert {r[1] for r in rows} <= expected_values[path.name]


def test_submission_values_follow_indices(tmp_path):
    path = write_predictions("mnli", [2, 0, 1], [0, 1, 2], tmp_path, split="test_mismatched")
    assert path.name == "MNLI-mm.tsv"
    _, rows = _read_tsv(path)
    # ids 0, 1, 2 are contradiction, entailment, neutral; row order follows the indices.
    assert rows == [["0", "entailment"], ["1", "neutral"], ["2", "contradiction"]]
    path = write_predictions("stsb", [0, 1, 2], [-0.2, 2.34567, 7.0], tmp_path)
    assert _read_tsv(path)[1] == [["0", "0.000"], ["1", "2.346"], ["2", "5.000"]]
    path = write_predictions("wnli", np.array([0, 1]), np.array([1, 0]), tmp_path)
    assert _read_tsv(path)[1] == [["0", "1"], ["1", "0"]]


def test_submission_errors(tmp_path):
    write_predictions("rte", [0, 1], [0, 1], tmp_path)
    with pytest.raises(FileExistsError, match=r"RTE\.tsv already exists"):
        write_predictions("rte", [0, 1], [1, 1], tmp_path)
    write_predictions("rte", [0, 1], [1, 1], tmp_path, overwrite=True)
    assert _read_tsv(tmp_path / "RTE.tsv")[1] == [["0", "not_entailment"], ["1", "not_entailment"]]
    with pytest.raises(FileExistsError, match=r"RTE\.tsv already exists"):
        write_submission_dir({"cola": ([0], [1]), "rte": ([0], [1])}, tmp_path)
    assert not (tmp_path / "CoLA.tsv").exists()  # refused before writing anything
    with pytest.raises(ValueError, match="test_matched and test_mismatched"):
        write_predictions("mnli", [0], [0], tmp_path, split="test")
    with pytest.raises(ValueError, match="not submitted to the GLUE server"):
        write_predictions("mnli", [0], [0], tmp_path, split="dev_matched")
    with pytest.raises(ValueError, match=r"prediction 2 is outside the label ids 0\.\.1"):
        write_predictions("qnli", [0, 1], [0, 2], tmp_path)
    with pytest.raises(ValueError, match="indices are not unique"):
        write_predictions("qnli", [0, 0], [0, 1], tmp_path)
    with pytest.raises(ValueError, match="1 indices for 2 predictions"):
        write_predictions("qnli", [0], [0, 1], tmp_path)
    with pytest.raises(ValueError, match="bad result key"):
        write_submission_dir({"mnli": ([0], [0])}, tmp_path)
    with pytest.raises(ValueError, match="unknown GLUE task"):
        write_predictions("squad", [0], [0], tmp_path)
