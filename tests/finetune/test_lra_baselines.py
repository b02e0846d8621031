"""The trivial LRA baselines (finetune/lra/baselines.py) on tiny hand-made data whose answers
are known: each baseline gets exactly what it can see, and no more."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from finetune.lra import baselines
from finetune.lra.synthetic import write_synthetic_imdb


def write_listops(folder, rows_by_split):
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in rows_by_split.items():
        lines = ["Source\tTarget"] + [f"{src}\t{tgt}" for src, tgt in rows]
        (folder / f"basic_{split}.tsv").write_text("\r\n".join(lines) + "\r\n")
    return folder


def first_op_rows(n_max, n_min, seed):
    """The label is the outer operator's (MAX -> 9, MIN -> 0); every row holds the same
    tokens (both operators, the same digits), so only their order tells the label."""
    rng = random.Random(seed)
    rows = []
    for op in ["[MAX"] * n_max + ["[MIN"] * n_min:
        inner = "[MIN" if op == "[MAX" else "[MAX"
        digits = ["3", "4", "5", "7"]
        rng.shuffle(digits)
        src = f"( ( ( {op} {digits[0]} ) ( ( ( {inner} {digits[1]} ) {digits[2]} ) ] ) ) {digits[3]} ] )"
        rows.append((src, 9 if op == "[MAX" else 0))
    rng.shuffle(rows)
    return rows


def count_rows(n, seed):
    """The label is 1 when the row has more 7s than 3s, else 2; the first token is always
    [SM: a linear function of the token counts, invisible to the first-token rule."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        sevens, threes = rng.sample(range(6), 2)
        toks = ["7"] * sevens + ["3"] * threes + ["1"] * rng.randint(0, 3)
        rng.shuffle(toks)
        rows.append(("[SM " + " ".join(toks) + " ]", 1 if sevens > threes else 2))
    return rows


def write_imdb(root, docs_by_split):
    """aclImdb/{train,test}/{pos,neg}/<i>_<rating>.txt from {split: [(text, label)]}."""
    for split, docs in docs_by_split.items():
        for label in ("pos", "neg"):
            (root / "aclImdb" / split / label).mkdir(parents=True, exist_ok=True)
        for i, (text, label) in enumerate(docs):
            name = "pos" if label else "neg"
            (root / "aclImdb" / split / name / f"{i}_{8 if label else 2}.txt").write_text(text)
    return root / "aclImdb"


def test_majority_and_first_token_rule_by_hand():
    assert baselines.majority_label([2, 1, 1, 2]) == 1  # ties: the smallest
    assert baselines.majority(np.array([1, 1, 2]), np.array([1, 2, 2, 1])) == 0.5
    rule, fallback = baselines.fit_first_token_rule([5, 5, 5, 6], [1, 1, 2, 3])
    assert rule == {5: 1, 6: 3} and fallback == 1
    # an unseen first token (7) gets the overall majority (1)
    acc = baselines.first_token_rule([5, 5, 5, 6], np.array([1, 1, 2, 3]), [5, 6, 7, 7],
                                     np.array([1, 0, 1, 2]))  # fmt: skip
    assert acc == 0.5
    with pytest.raises(ValueError):
        baselines.accuracy(np.array([1]), np.array([1, 2]))


def test_first_operator_rule_sees_order_the_bag_does_not(tmp_path):
    data = write_listops(
        tmp_path / "ops",
        {
            "train": first_op_rows(24, 16, seed=0),
            "val": first_op_rows(2, 2, seed=1),
            "test": first_op_rows(12, 8, seed=2),
        },
    )
    got = baselines.task_baselines("listops", data)
    assert set(got) == {"majority", "first_token", "bag_of_tokens"}
    assert got["majority"] == pytest.approx(0.6)  # train majority 9, 12 of 20 test rows
    assert got["first_token"] == 1.0
    # every row has the same bag: the regression can only learn the prior
    assert got["bag_of_tokens"] == pytest.approx(0.6)
    assert baselines.shortcut(got) == ("first_token", 1.0)


def test_bag_of_tokens_learns_counts_the_rule_cannot(tmp_path):
    data = write_listops(
        tmp_path / "counts",
        {"train": count_rows(300, 0), "val": count_rows(10, 1), "test": count_rows(100, 2)},
    )
    got = baselines.task_baselines("listops", data)
    assert got["first_token"] == got["majority"] < 0.7
    assert got["bag_of_tokens"] >= 0.95


def test_logistic_regression_is_deterministic_and_fits_separable_data():
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=(5, 3))
    x, xt = rng.normal(size=(300, 5)), rng.normal(size=(100, 5))
    y, yt = (x @ true_w).argmax(1), (xt @ true_w).argmax(1)  # linearly separable, 3 classes
    first = baselines.logistic_regression(x, y, xt, num_classes=3)
    again = baselines.logistic_regression(x, y, xt, num_classes=3)
    assert np.array_equal(first, again)
    assert baselines.accuracy(first, yt) >= 0.9
    # labels that are no function of the features: about chance, not above it
    noise = baselines.logistic_regression(x, rng.integers(0, 3, 300), xt, num_classes=3)
    assert baselines.accuracy(noise, yt) < 0.6
    # a constant feature (scale 0) is harmless
    with_const = np.concatenate([x, np.zeros((300, 1))], 1)
    test_const = np.concatenate([xt, np.ones((100, 1))], 1)
    assert np.array_equal(baselines.logistic_regression(with_const, y, test_const, 3), first)
    with pytest.raises(ValueError):
        baselines.logistic_regression(x, y, xt[:, :3], 3)


def test_text_bag_of_bytes_is_blind_to_order(tmp_path):
    # pos: "ab..." neg: "ba..." with the same bytes; a bag of bytes sees nothing
    def docs(n):
        # examples 2j and 2j + 1: the same bytes, opposite labels, so every function of the
        # bytes' counts is right on exactly half of them
        out = []
        for i in range(n):
            pad = "c" * ((i // 2) % 5)
            out.append((("ab " if i % 2 else "ba ") + pad, i % 2))
        return out

    root = write_imdb(tmp_path, {"train": docs(40), "test": docs(20)})
    got = baselines.task_baselines("text", root)
    assert set(got) == {"majority", "bag_of_tokens", "bag_of_words"}
    assert got["majority"] == 0.5
    assert got["bag_of_tokens"] == 0.5
    assert got["bag_of_words"] == 1.0  # "ab" and "ba" are different words
    assert baselines.shortcut(got)[0] in ("majority", "bag_of_tokens")


def test_text_bag_of_words_solves_the_synthetic_cue_task(tmp_path):
    root = write_synthetic_imdb(tmp_path, train=400, test=100, min_words=3, max_words=6)
    got = baselines.task_baselines("text", root)
    assert got["majority"] == 0.5
    assert got["bag_of_words"] >= 0.95  # the label is a linear function of cue-word counts
    assert baselines.shortcut({**got, "bag_of_words": 1.0})[0] != "bag_of_words"


def test_cli(tmp_path, capsys):
    data = write_listops(
        tmp_path / "ops",
        {
            "train": first_op_rows(6, 4, 0),
            "val": first_op_rows(1, 1, 1),
            "test": first_op_rows(3, 1, 2),
        },
    )
    assert baselines.main(["--task", "listops", "--data", str(data), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["first_token"] == 1.0 and got["majority"] == 0.75
    assert baselines.main(["--task", "listops", "--data", str(tmp_path / "missing")]) == 1


@pytest.mark.slow
def test_mirrored_cues_defeat_the_bag_of_bytes(tmp_path):
    """Text with `cue_style="mirrored"` (negative cues = positive ones spelt backwards): the
    two classes have the same byte histogram in expectation, so bag-of-bytes falls to chance."""
    from finetune.lra.baselines import task_baselines
    from finetune.lra.synthetic import cue_lists, write_synthetic_imdb

    positive, negative = cue_lists("mirrored")
    assert [sorted(w) for w in positive] == [sorted(w) for w in negative]
    with pytest.raises(ValueError, match="cue style"):
        cue_lists("nope")
    words = write_synthetic_imdb(tmp_path / "w", 600, 400, min_words=6, max_words=12)
    mirrored = write_synthetic_imdb(
        tmp_path / "m", 600, 400, min_words=6, max_words=12, cue_style="mirrored"
    )
    assert task_baselines("text", words, 150)["bag_of_tokens"] > 0.63
    assert task_baselines("text", mirrored, 150)["bag_of_tokens"] < 0.6
