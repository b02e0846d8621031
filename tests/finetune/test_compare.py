"""Confidence intervals for comparisons (finetune/compare.py): the paired bootstrap against
scipy's, its coverage on simulated test sets, what pairing and seeds do to the interval, and
the predictions file a fine-tuning run leaves."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from finetune import compare


def answers(rng, labels, p_right, num_classes=10):
    """Predictions right with probability p_right (independently per example), else wrong."""
    right = rng.random(len(labels)) < p_right
    return np.where(right, labels, (labels + 1 + rng.integers(0, num_classes - 1, len(labels)))
                    % num_classes)  # fmt: skip


def test_one_seed_each_is_scipys_paired_bootstrap():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 10, 1500)
    a, b = answers(rng, labels, 0.45), answers(rng, labels, 0.40)
    ours = compare.bootstrap_difference(labels, a, b, resamples=4000)
    hits_a, hits_b = (a == labels).astype(float), (b == labels).astype(float)
    theirs = stats.bootstrap(
        (hits_a, hits_b), lambda x, y, axis=-1: x.mean(axis) - y.mean(axis), paired=True,
        method="percentile", n_resamples=4000, random_state=0,
    ).confidence_interval  # fmt: skip
    assert ours.estimate == pytest.approx(hits_a.mean() - hits_b.mean(), abs=1e-12)
    # two Monte Carlo estimates of the same interval: equal to about a tenth of its width
    width = theirs.high - theirs.low
    assert abs(ours.low - theirs.low) < 0.1 * width and abs(ours.high - theirs.high) < 0.1 * width
    # and both close to the normal approximation of a paired difference
    d = hits_a - hits_b
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d))
    assert ours.half_width == pytest.approx(half, rel=0.1)


def test_coverage_on_simulated_test_sets():
    """Two models of the same true accuracy on 200 fresh test sets: the 95 % interval of their
    difference holds 0 about 95 % of the time; a true 10-point gap is told apart as often as
    the normal approximation predicts (its power)."""
    rng = np.random.default_rng(7)
    held, apart = 0, 0
    trials = 200
    for trial in range(trials):
        labels = rng.integers(0, 10, 400)
        a, b = answers(rng, labels, 0.5), answers(rng, labels, 0.5)
        held += not compare.bootstrap_difference(
            labels, a, b, resamples=400, seed=trial
        ).excludes_zero
        c = answers(rng, labels, 0.6)
        apart += compare.bootstrap_difference(labels, c, b, resamples=400, seed=trial).excludes_zero
    assert 0.90 <= held / trials <= 0.99
    se = np.sqrt((0.5 * 0.5 + 0.6 * 0.4) / 400)  # independent errors: the variances add
    power = stats.norm.cdf(0.1 / se - 1.96)  # about 0.82
    assert abs(apart / trials - power) < 0.1


def test_pairing_makes_shared_errors_cancel():
    """B answers like A except on 30 of 2000 examples, where A is right: the paired interval is
    about the 1.5-point gap, far narrower than each model's own interval."""
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 10, 2000)
    a = answers(rng, labels, 0.6)
    b = a.copy()
    changed = np.flatnonzero(a == labels)[:30]
    b[changed] = (labels[changed] + 1) % 10
    diff = compare.bootstrap_difference(labels, a, b)
    alone = compare.bootstrap_difference(labels, a)
    assert diff.estimate == pytest.approx(30 / 2000)
    assert diff.excludes_zero and diff.low > 0.008
    assert diff.half_width < 0.3 * alone.half_width


def test_seed_spread_widens_the_interval():
    """Two models with the same mean accuracy over 3 seeds on the same examples: the one whose
    seeds disagree (35 / 45 / 55 %) gets a wider interval than the steady one (45 % each)."""
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 10, 2000)
    steady = np.stack([answers(rng, labels, 0.45) for _ in range(3)])
    erratic = np.stack([answers(rng, labels, p) for p in (0.35, 0.45, 0.55)])
    a = compare.bootstrap_difference(labels, steady)
    b = compare.bootstrap_difference(labels, erratic)
    assert a.estimate == pytest.approx(b.estimate, abs=0.02)
    assert b.half_width > 2 * a.half_width


def test_any_metric_and_the_accuracy_fast_path_agree():
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 3, 300)
    a = np.stack([answers(rng, labels, p, 3) for p in (0.5, 0.6)])
    b = answers(rng, labels, 0.5, 3)
    fast = compare.bootstrap_difference(labels, a, b, resamples=200, seed=5)
    slow = compare.bootstrap_difference(
        labels, a, b, metric=lambda p, y: float(np.mean(p == y)), resamples=200, seed=5
    )
    assert fast.to_dict() == pytest.approx(slow.to_dict(), abs=1e-12)


def test_bad_input_is_named():
    labels = np.array([0, 1, 1])
    with pytest.raises(ValueError, match="the same test set"):
        compare.bootstrap_difference(labels, np.array([0, 1]))
    with pytest.raises(ValueError, match="level"):
        compare.bootstrap_difference(labels, labels, level=95)
    with pytest.raises(ValueError, match="another test set"):
        compare.stack_seeds([(labels, labels), (labels, np.array([1, 1, 1]))])


def test_predictions_file_round_trip(tmp_path):
    best = {"dev": np.array([1, 0, 2]), "test": np.array([3, 3])}
    last = {"dev": np.array([1, 1, 2]), "test": np.array([0, 3])}
    path = compare.save_predictions(tmp_path, best, last, {"dev": np.array([1, 0, 0])})
    assert path == tmp_path / compare.PREDICTIONS_FILE
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary, then renamed
    pred, labels = compare.load_predictions(tmp_path, "dev")
    assert pred.tolist() == [1, 0, 2] and labels.tolist() == [1, 0, 0]
    assert compare.load_predictions(tmp_path, "dev", "last")[0].tolist() == [1, 1, 2]
    with pytest.raises(ValueError, match=r"labelled sets: \['dev'\]"):
        compare.load_predictions(tmp_path, "test")  # no labels: nothing to score
    with pytest.raises(FileNotFoundError, match="no predictions"):
        compare.load_predictions(tmp_path / "elsewhere", "dev")
    with pytest.raises(ValueError, match="which="):
        compare.load_predictions(tmp_path, "dev", "first")


def test_format_interval():
    iv = compare.Interval(0.024, -0.003, 0.051, 0.95)
    assert compare.format_interval(iv) == "+2.4 [-0.3, +5.1]"
    apart = compare.Interval(0.024, 0.003, 0.051, 0.95)
    assert compare.format_interval(apart) == "+2.4 [+0.3, +5.1] *"
    assert compare.format_interval(apart, signed=False) == "2.4 [0.3, 5.1]"


def test_compare_dirs_names_models_that_do_not_match(tmp_path):
    dev = np.array([0, 1, 1, 0])
    for model, seeds in (("a", 2), ("b", 1)):
        for seed in range(seeds):
            run = tmp_path / model / f"seed_{seed}"
            run.mkdir(parents=True)
            compare.save_predictions(run, {"dev": dev}, {"dev": dev}, {"dev": dev})
    rows, md = compare.compare_dirs([tmp_path / "a", tmp_path / "b"], "dev", resamples=50)
    assert [r["seeds"] for r in rows] == [2, 1] and rows[1]["difference"]["estimate"] == 0
    assert f"| {tmp_path / 'b'} | 1 | 100.0 [100.0, 100.0] | +0.0 [+0.0, +0.0] |" in md
    other = tmp_path / "c" / "seed_0"
    other.mkdir(parents=True)
    compare.save_predictions(other, {"dev": dev}, {"dev": dev}, {"dev": 1 - dev})
    with pytest.raises(ValueError, match="other dev examples"):
        compare.compare_dirs([tmp_path / "a", tmp_path / "c"], "dev", resamples=50)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no predictions\.npz at or below it"):
        compare.model_runs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        compare.model_runs(tmp_path / "missing")
    with pytest.raises(ValueError, match="--metric 'auc'"):
        compare.compare_dirs([tmp_path / "a"], "dev", metric="auc")


def test_a_model_is_one_configuration_over_seeds(tmp_path):
    """Runs below a directory that differ in more than their seed (two learning rates) are not
    taken as one model's seeds."""
    import json

    dev = np.array([0, 1, 1, 0])
    for lr, seed in (("1e-3", 0), ("1e-3", 1), ("3e-3", 0)):
        run = tmp_path / "rte" / f"lr_{lr}" / f"seed_{seed}"
        run.mkdir(parents=True)
        identity = {"task": "rte", "lr": float(lr), "seed": seed, "train": {"seed": seed}}
        (run / "run.json").write_text(json.dumps(identity))
        compare.save_predictions(run, {"dev": dev}, {"dev": dev}, {"dev": dev})
    rows, _ = compare.compare_dirs([tmp_path / "rte" / "lr_1e-3"], "dev", resamples=20)
    assert rows[0]["seeds"] == 2  # the seeds of one lr: fine
    with pytest.raises(ValueError, match=r"differ in more than the seed \(lr\)"):
        compare.compare_dirs([tmp_path / "rte"], "dev", resamples=20)


@pytest.mark.parametrize("task", ["cola", "mrpc", "mnli", "stsb"])
def test_glue_score_metric_is_compute_metrics_score(task):
    """The bootstrap's form of each GLUE task's score (confusion counts for classification)
    equals the summary's `compute_metrics` on the same predictions."""
    from finetune.glue.metrics import compute_metrics, score_metric
    from finetune.glue.tasks import get_task

    rng = np.random.default_rng(0)
    classes = len(get_task(task).labels)
    if task == "stsb":
        labels = rng.uniform(0, 5, 300)
        pred = labels + rng.normal(0, 1, 300)
    else:
        labels = rng.integers(0, classes, 300)
        pred = answers(rng, labels, 0.7, classes)
    assert score_metric(task)(pred, labels) == pytest.approx(
        compute_metrics(task, pred, labels)["score"], abs=1e-12
    )


def test_confusion_fast_path_equals_the_plain_metric():
    from sklearn.metrics import matthews_corrcoef

    rng = np.random.default_rng(8)
    labels = rng.integers(0, 3, 400)
    a = np.stack([answers(rng, labels, p, 3) for p in (0.6, 0.7)])
    b = answers(rng, labels, 0.6, 3)
    fast = compare.bootstrap_difference(
        labels, a, b, compare.ConfusionMetric(3, compare.confusion_mcc), resamples=200, seed=1
    )
    slow = compare.bootstrap_difference(
        labels, a, b, lambda p, y: matthews_corrcoef(y, p), resamples=200, seed=1
    )
    assert fast.to_dict() == pytest.approx(slow.to_dict(), abs=1e-12)
