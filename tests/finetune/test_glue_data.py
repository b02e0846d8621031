"""GLUE data: the TSV distribution (every task, its quirks), HF save_to_disk directories, the
task table, tokenisation and batching, and the errors for bad input.

The fixtures are written here in the exact GLUE formats: CoLA's headerless train/dev, MRPC's
BOM, STS-B's 10 columns, QQP's broken rows, MNLI's 12 / 16 / 10 columns, texts with double
quotes (quoting is off in GLUE's files, so they are plain text)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from finetune.glue.data import (
    Example,
    collate,
    encode,
    load_split,
    read_hf_split,
    read_tsv_split,
)
from finetune.glue.tasks import TASKS, get_task, parse_result_key

# Texts that quoting would break: an unbalanced opening quote swallows the following lines when
# csv quoting is on; GLUE's files have such rows.
QUOTED = 'He said "hi" to me.'
UNBALANCED = '"Unbalanced quote opens this sentence'
INCHES = "He is 6' 2\" tall."
SERVER_FILES = [  # the GLUE server's file names
    *("CoLA.tsv", "SST-2.tsv", "MRPC.tsv", "STS-B.tsv", "QQP.tsv", "MNLI-m.tsv", "MNLI-mm.tsv"),
    *("QNLI.tsv", "RTE.tsv", "WNLI.tsv", "AX.tsv"),
]

# ----------------------------------------------------------------------------- the fixture

# Row builders: (i, text_a, text_b, label) -> the file's columns.


def _mnli_row(i, a, b, label, n_labels):
    cols = [str(i), str(31193 + i), f"{31193 + i}n", "fiction", f"( {a} )", f"( {b} )"]
    cols += [f"(ROOT (S {a}))", f"(ROOT (S {b}))", a, b]
    return cols + [label] * n_labels  # label1 [.. label5] gold_label; test: none


MNLI_HEAD = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
    "sentence1_parse\tsentence2_parse\tsentence1\tsentence2"
)
STSB_HEAD = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"


def _stsb_row(i, a, b, label):
    cols = [str(i), "main-captions", "MSRvid", "2012test", f"{i:04d}", "none", "none", a, b]
    return [*cols, label] if label is not None else cols


# task -> split -> (header or None, builder, [(text_a, text_b, label), ...])
SPEC = {
    "cola": {
        "train": (
            None,
            lambda i, a, b, y: ["gj04", y, "" if y == "1" else "*", a],
            [(QUOTED, None, "1"), (UNBALANCED, None, "0"), ("The book was read.", None, "1")],
        ),
        "dev": (
            None,
            lambda i, a, b, y: ["clc95", y, "" if y == "1" else "*", a],
            [("Bill left.", None, "1"), ("Left Bill the.", None, "0")],
        ),
        "test": (
            "index\tsentence",
            lambda i, a, b, y: [str(i), a],
            [(INCHES, None, None), ("Mary sang.", None, None)],
        ),
    },
    "sst2": {
        "train": (
            "sentence\tlabel",
            lambda i, a, b, y: [a, y],
            [("a gorgeous film ", None, "1"), (UNBALANCED, None, "0"), (QUOTED, None, "1")],
        ),
        "dev": ("sentence\tlabel", lambda i, a, b, y: [a, y], [("dull", None, "0")]),
        "test": (
            "index\tsentence",
            lambda i, a, b, y: [str(i), a],
            [("fun", None, None), (INCHES, None, None)],
        ),
    },
    "mrpc": {
        "train": (
            "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",  # GLUE's file has the BOM
            lambda i, a, b, y: [y, str(702876 + i), str(702977 + i), a, b],
            [(QUOTED, "He greeted me.", "1"), ("Stocks fell.", UNBALANCED, "0")],
        ),
        "dev": (
            "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
            lambda i, a, b, y: [y, str(1 + i), str(2 + i), a, b],
            [("It rained.", "Rain fell.", "1")],
        ),
        "test": (
            "index\t#1 ID\t#2 ID\t#1 String\t#2 String",
            lambda i, a, b, y: [str(i), str(1089874 + i), str(1089925 + i), a, b],
            [("A cat sat.", INCHES, None), ("Two.", "Deux.", None)],
        ),
    },
    "stsb": {
        "train": (
            STSB_HEAD + "\tscore",
            _stsb_row,
            [
                ("A plane is taking off.", "An air plane is taking off.", "5.000"),
                (QUOTED, "A man plays a flute.", "0.500"),
            ],
        ),
        "dev": (STSB_HEAD + "\tscore", _stsb_row, [("A man.", INCHES, "3.800")]),
        "test": (STSB_HEAD, _stsb_row, [("A girl sings.", "A boy sings.", None)]),
    },
    "qqp": {
        "train": (
            "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
            lambda i, a, b, y: [str(133273 + i), str(213221 + i), str(213222 + i), a, b, y],
            [
                ("How do I learn Python?", "What is the best way to learn Python?", "1"),
                (QUOTED, "Why is the sky blue?", "0"),
                ("What is 2+2?", "What is four?", "1"),
            ],
        ),
        "dev": (
            "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
            lambda i, a, b, y: [str(40 + i), str(50 + i), str(60 + i), a, b, y],
            [("Is it?", "Is it not?", "0")],
        ),
        "test": (
            "id\tquestion1\tquestion2",
            lambda i, a, b, y: [str(i), a, b],
            [("Who?", "Whom?", None), (UNBALANCED, "What?", None)],
        ),
    },
    "mnli": {
        "train": (
            MNLI_HEAD + "\tlabel1\tgold_label",
            lambda i, a, b, y: _mnli_row(i, a, b, y, 2),
            [
                ("The new rights are nice.", "Everyone likes them.", "neutral"),
                (QUOTED, "He said nothing.", "contradiction"),
                ("It is raining.", "It is wet.", "entailment"),
            ],
        ),
        "dev_matched": (
            MNLI_HEAD + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label",
            lambda i, a, b, y: _mnli_row(i, a, b, y, 6),
            [
                ("A dog runs.", "An animal moves.", "entailment"),
                ("A dog runs.", "A cat sleeps.", "neutral"),
                ("A dog runs.", "Nothing moves.", "contradiction"),
            ],
        ),
        "dev_mismatched": (
            MNLI_HEAD + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label",
            lambda i, a, b, y: _mnli_row(i, a, b, y, 6),
            [(UNBALANCED, "Something.", "neutral"), ("Yes.", "No.", "contradiction")],
        ),
        "test_matched": (
            MNLI_HEAD,
            lambda i, a, b, y: _mnli_row(i, a, b, y, 0),
            [("Hello.", "Hi.", None), (INCHES, "He is tall.", None)],
        ),
        "test_mismatched": (
            MNLI_HEAD,
            lambda i, a, b, y: _mnli_row(i, a, b, y, 0),
            [("Bye.", "Ciao.", None)],
        ),
    },
    "qnli": {
        "train": (
            "index\tquestion\tsentence\tlabel",
            lambda i, a, b, y: [str(i), a, b, y],
            [("When?", "In 1990.", "entailment"), (QUOTED, "No idea.", "not_entailment")],
        ),
        "dev": (
            "index\tquestion\tsentence\tlabel",
            lambda i, a, b, y: [str(i), a, b, y],
            [("Who?", "Bob did.", "entailment")],
        ),
        "test": (
            "index\tquestion\tsentence",
            lambda i, a, b, y: [str(i), a, b],
            [("Where?", "Here.", None)],
        ),
    },
    "rte": {
        "train": (
            "index\tsentence1\tsentence2\tlabel",
            lambda i, a, b, y: [str(i), a, b, y],
            [
                ("No weapons were found.", "Weapons were found.", "not_entailment"),
                ("A man ate.", "Someone ate.", "entailment"),
            ],
        ),
        "dev": (
            "index\tsentence1\tsentence2\tlabel",
            lambda i, a, b, y: [str(i), a, b, y],
            [(UNBALANCED, "Quote.", "entailment")],
        ),
        "test": (
            "index\tsentence1\tsentence2",
            lambda i, a, b, y: [str(i), a, b],
            [("Maybe.", "Perhaps.", None)],
        ),
    },
    "wnli": {
        "train": (
            "index\tsentence1\tsentence2\tlabel",
            lambda i, a, b, y: [str(i), a, b, y],
            [
                ("I stuck a pin through a carrot.", "The carrot had a hole.", "1"),
                ("John couldn't see the stage.", "John is tall.", "0"),
            ],
        ),
        "dev": (
            "index\tsentence1\tsentence2\tlabel",
            lambda i, a, b, y: [str(i), a, b, y],
            [("The drain is clogged.", "The hair is clogged.", "0")],
        ),
        "test": (
            "index\tsentence1\tsentence2",
            lambda i, a, b, y: [str(i), a, b],
            [("Maybe.", "Perhaps.", None), (QUOTED, "He spoke.", None)],
        ),
    },
    "ax": {
        "test": (
            "index\tsentence1\tsentence2",
            lambda i, a, b, y: [str(i), a, b],
            [("The cat sat on the mat.", "The cat did not sit on the mat.", None)],
        ),
    },
}

# QQP's train file breaks a question over two lines: both halves have too few columns.
QQP_BROKEN = "404\t505\t606\tHow can I create an\nAndroid app?\tHow do I develop one?\t0\n"


def _file_text(header, builder, rows) -> str:
    lines = [header] if header is not None else []
    lines += ["\t".join(builder(i, *row)) for i, row in enumerate(rows)]
    return "\n".join(lines) + "\n"


def write_glue_tsv(root, spec=SPEC) -> None:
    """The GLUE TSV distribution of `spec` (SPEC's form) under `root` (one folder per task;
    QQP's train file gets the broken rows)."""
    for name, splits in spec.items():
        task = get_task(name)
        folder = root / task.dir_name
        folder.mkdir(parents=True)
        for split, (header, builder, rows) in splits.items():
            text = _file_text(header, builder, rows)
            if name == "qqp" and split == "train":  # the broken rows after the first row
                first, rest = text.split("\n", 2)[:2], text.split("\n", 2)[2]
                text = "\n".join(first) + "\n" + QQP_BROKEN + rest
            (folder / task.tsv_file(split)).write_text(text, encoding="utf-8")


@pytest.fixture(scope="module")
def glue_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("glue_data")
    write_glue_tsv(root)
    return root


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from data_prep.tokenizer import load_tokenizer, write_tokenizer

    out = tmp_path_factory.mktemp("tok")
    return load_tokenizer(write_tokenizer(out, inputs=["embedded:40"], vocab_size=300))


def expected(name: str, split: str) -> list[tuple]:
    """(text_a, text_b, label id or score or None) of SPEC's rows."""
    task = get_task(name)
    out = []
    for a, b, y in SPEC[name][split][2]:
        if y is not None:
            y = float(y) if task.is_regression else task.labels.index(y)
        out.append((a, b, y))
    return out


def as_tuples(examples: list[Example]) -> list[tuple]:
    return [(ex.text_a, ex.text_b, ex.label) for ex in examples]


ALL_SPLITS = [(name, split) for name, splits in SPEC.items() for split in splits]

# ----------------------------------------------------------------------------- the task table


def test_every_task_and_split_is_in_the_fixture():
    assert {(n, s) for n, t in TASKS.items() for s in t.splits} == set(ALL_SPLITS)


def test_task_table_is_consistent():
    files = [sf.file for t in TASKS.values() for sf in t.submission]
    assert sorted(files) == sorted(SERVER_FILES)
    for task in TASKS.values():
        assert {hf_ours for _, hf_ours in task.hf_labels} == set(task.labels)
        if not task.submission_label_strings and not task.is_regression:
            assert task.labels == ("0", "1")  # the server's 0/1 is then the label text
        assert {sf.split for sf in task.submission} == set(task.test_splits)
    assert get_task("mnli").labels == ("contradiction", "entailment", "neutral")
    assert [hf for hf, _ in get_task("mnli").hf_labels] == [
        "entailment",
        "neutral",
        "contradiction",
    ]
    assert get_task("stsb").is_regression and get_task("stsb").num_labels == 1
    assert get_task("SST-2") is TASKS["sst2"] and get_task("sts-b") is TASKS["stsb"]
    assert get_task("mnli").hf_split("dev_mismatched") == "validation_mismatched"
    assert get_task("rte").hf_split("dev") == "validation"
    assert get_task("mnli").result_key("dev_matched") == "mnli_matched"
    assert get_task("mnli").result_key("test_mismatched") == "mnli_mismatched"
    assert parse_result_key("mnli_mismatched") == (TASKS["mnli"], "test_mismatched")
    assert parse_result_key("cola") == (TASKS["cola"], "test")


def test_unknown_task_and_split():
    with pytest.raises(ValueError, match=r"unknown GLUE task 'mnli-m'.*'cola'.*'wnli'"):
        get_task("mnli-m")
    with pytest.raises(ValueError, match="dev_matched and dev_mismatched"):
        get_task("mnli").check_split("dev")
    with pytest.raises(ValueError, match=r"rte has no split 'validation'.*'train', 'dev', 'test'"):
        get_task("rte").check_split("validation")
    with pytest.raises(ValueError, match="bad result key 'mnli'"):
        parse_result_key("mnli")


# ----------------------------------------------------------------------------- TSV


@pytest.mark.parametrize(("name", "split"), ALL_SPLITS)
def test_tsv_every_task_and_split(glue_root, name, split):
    examples, stats = read_tsv_split(name, glue_root, split)
    assert as_tuples(examples) == expected(name, split)
    assert stats.examples == len(examples) and stats.format == "tsv"
    assert stats.source == str(glue_root / get_task(name).dir_name / get_task(name).tsv_file(split))
    if split.startswith("test"):
        assert [ex.index for ex in examples] == list(range(len(examples)))
    # The task folder itself and the GLUE root give the same.
    again, _ = load_split(name, glue_root / get_task(name).dir_name, split)
    assert again == examples


def test_quoting_off_keeps_quotes_and_lines(glue_root):
    examples, stats = read_tsv_split("cola", glue_root, "train")
    assert examples[0].text_a == QUOTED
    assert examples[1].text_a == UNBALANCED  # quoting on would swallow the next line here
    assert examples[2].text_a == "The book was read."
    assert stats.rows == 3 and stats.skipped == 0
    test, _ = read_tsv_split("mrpc", glue_root, "test")
    assert test[0].text_b == INCHES


def test_mnli_labels_in_run_glue_order(glue_root):
    examples, _ = read_tsv_split("mnli", glue_root, "dev_matched")
    assert [ex.label for ex in examples] == [1, 2, 0]  # entailment, neutral, contradiction
    examples, _ = read_tsv_split("mnli", glue_root, "train")
    assert examples[0].text_a == "The new rights are nice." and examples[0].label == 2


def test_mrpc_bom_header(glue_root):
    raw = (glue_root / "MRPC" / "train.tsv").read_bytes()
    assert raw.startswith(b"\xef\xbb\xbfQuality\t")
    examples, _ = read_tsv_split("mrpc", glue_root, "train")
    assert [ex.label for ex in examples] == [1, 0]


def test_stsb_scores_are_floats(glue_root):
    examples, _ = read_tsv_split("stsb", glue_root, "train")
    assert [ex.label for ex in examples] == [5.0, 0.5]
    assert all(isinstance(ex.label, float) for ex in examples)


def test_qqp_malformed_rows_skipped_and_counted(glue_root, caplog):
    with caplog.at_level(logging.WARNING):
        examples, stats = read_tsv_split("qqp", glue_root, "train")
    assert len(examples) == 3
    assert stats.rows == 5 and stats.skipped == 2 and stats.skipped_lines == [3, 4]
    assert stats.to_dict()["skipped"] == 2
    # Train/dev indices are data-row numbers (HF's idx), counting the skipped rows.
    assert [ex.index for ex in examples] == [0, 3, 4]
    assert "skipped 2 malformed rows of 5" in caplog.text


def test_test_index_comes_from_the_index_column(tmp_path):
    folder = tmp_path / "RTE"
    folder.mkdir()
    (folder / "test.tsv").write_text("index\tsentence1\tsentence2\n7\ta\tb\n3\tc\td\n")
    examples, _ = read_tsv_split("rte", tmp_path, "test")
    assert [(ex.index, ex.label) for ex in examples] == [(7, None), (3, None)]
    (folder / "test.tsv").write_text("index\tsentence1\tsentence2\nseven\ta\tb\n")
    with pytest.raises(ValueError, match=r"test\.tsv:2: index 'seven' is not an integer"):
        read_tsv_split("rte", tmp_path, "test")


def test_tsv_errors(tmp_path, glue_root):
    folder = tmp_path / "SST-2"
    folder.mkdir()
    (folder / "train.tsv").write_text("sentence\tlbl\ngood\t1\n")
    with pytest.raises(
        ValueError,
        match=r"SST-2/train\.tsv: the header has no column 'label' "
        r"\(columns: \['sentence', 'lbl'\]\)",
    ):
        read_tsv_split("sst2", tmp_path, "train")
    (folder / "train.tsv").write_text("sentence\tlabel\ngood\t1\nbad\t2\n")
    with pytest.raises(
        ValueError,
        match=r"train\.tsv:3: label '2' is not one of sst2's labels "
        r"\['0', '1'\]",
    ):
        read_tsv_split("sst2", tmp_path, "train")
    with pytest.raises(FileNotFoundError, match=r"SST-2/dev\.tsv"):
        read_tsv_split("sst2", tmp_path, "dev")
    with pytest.raises(FileNotFoundError, match=r"no GLUE sst2 dev data under"):
        load_split("sst2", tmp_path, "dev")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_split("sst2", tmp_path / "nowhere", "dev")
    (folder / "dev.tsv").write_text("sentence\tlabel\n")
    with pytest.raises(ValueError, match="no examples in split 'dev'"):
        read_tsv_split("sst2", tmp_path, "dev")
    mnli = tmp_path / "MNLI"
    mnli.mkdir()
    (mnli / "dev_matched.tsv").write_text(
        (glue_root / "MNLI" / "dev_matched.tsv").read_text().replace("\tneutral\n", "\tmaybe\n")
    )
    with pytest.raises(ValueError, match=r"dev_matched\.tsv:3: label 'maybe'.*'contradiction'"):
        read_tsv_split("mnli", tmp_path, "dev_matched")
    with pytest.raises(ValueError, match="two dev sets"):
        load_split("mnli", glue_root, "dev")
    stsb = tmp_path / "STS-B"
    stsb.mkdir()
    (stsb / "dev.tsv").write_text(
        (glue_root / "STS-B" / "dev.tsv").read_text().replace("3.8", "7.8")
    )
    with pytest.raises(ValueError, match=r"STS-B/dev\.tsv:2: STS-B score '7\.800' is outside"):
        read_tsv_split("stsb", tmp_path, "dev")
    with pytest.raises(ValueError, match="unknown GLUE task"):
        load_split("squad", glue_root, "train")


# ----------------------------------------------------------------------------- HF datasets


def hf_dataset_dict(name: str, spec=SPEC):
    """`spec`'s (SPEC's form) rows of a task as the Hub's `nyu-mll/glue` config holds them: its
    columns, ClassLabel names in HF's order, `idx`, split names, -1 for test labels."""
    import datasets

    task = get_task(name)
    col_a, col_b = task.hf_columns
    features = {col_a: datasets.Value("string")}
    if col_b:
        features[col_b] = datasets.Value("string")
    hf_names = [hf for hf, _ in task.hf_labels]
    if task.is_regression:
        features["label"] = datasets.Value("float32")
    else:
        features["label"] = datasets.ClassLabel(names=hf_names)
    features["idx"] = datasets.Value("int32")
    ours_to_hf = {ours: i for i, (_, ours) in enumerate(task.hf_labels)}
    splits = {}
    for split, (_, _, rows) in spec[name].items():
        data = {col_a: [a for a, _, _ in rows], "idx": list(range(len(rows)))}
        if col_b:
            data[col_b] = [b for _, b, _ in rows]
        if task.is_regression:
            data["label"] = [float(y) if y is not None else -1.0 for _, _, y in rows]
        else:
            data["label"] = [ours_to_hf[y] if y is not None else -1 for _, _, y in rows]
        features_ = datasets.Features(features)
        splits[task.hf_split(split)] = datasets.Dataset.from_dict(data, features=features_)
    return datasets.DatasetDict(splits)


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_glue")
    for name in ("cola", "stsb", "mnli", "wnli", "qnli"):
        hf_dataset_dict(name).save_to_disk(str(root / name))
    return root


@pytest.mark.parametrize("name", ["cola", "stsb", "mnli", "wnli", "qnli"])
def test_hf_equals_tsv_with_labels_by_name(glue_root, hf_root, name):
    for split in get_task(name).splits:
        from_hf, stats = load_split(name, hf_root, split)  # finds hf_root/<name>
        from_tsv, _ = read_tsv_split(name, glue_root, split)
        if get_task(name).is_regression:  # HF stores STS-B scores as float32
            assert [ex.label for ex in from_hf] == pytest.approx([ex.label for ex in from_tsv])
            from_hf = [Example(ex.index, ex.text_a, ex.text_b, None) for ex in from_hf]
            from_tsv = [Example(ex.index, ex.text_a, ex.text_b, None) for ex in from_tsv]
        assert as_tuples(from_hf) == as_tuples(from_tsv), split
        assert stats.format == "hf" and stats.examples == len(from_hf)
        assert [ex.index for ex in from_hf] == list(range(len(from_hf)))


def test_hf_mnli_label_order_normalised(hf_root):
    import datasets

    raw = datasets.load_from_disk(str(hf_root / "mnli"))["validation_matched"]
    assert raw["label"][:3] == [0, 1, 2]  # HF: entailment, neutral, contradiction
    examples, _ = read_hf_split("mnli", hf_root / "mnli", "dev_matched")
    assert [ex.label for ex in examples] == [1, 2, 0]  # ours: contradiction, entailment, neutral
    test, _ = read_hf_split("mnli", hf_root / "mnli", "test_mismatched")
    assert [ex.label for ex in test] == [None]  # HF's -1


def test_hf_errors(tmp_path, hf_root):
    import datasets

    with pytest.raises(ValueError, match=r"no split 'validation_matched'.*'train', 'validation'"):
        read_hf_split("mnli", hf_root / "qnli", "dev_matched")
    with pytest.raises(ValueError, match=r"no column 'premise' \(columns: .*'question'"):
        read_hf_split("mnli", hf_root / "qnli", "train")
    with pytest.raises(FileNotFoundError, match="not a HF DatasetDict directory"):
        read_hf_split("cola", tmp_path, "train")
    bad_names = datasets.ClassLabel(names=["no", "yes"])
    ds = datasets.Dataset.from_dict(
        {"sentence": ["a"], "label": [1]},
        features=datasets.Features({"sentence": datasets.Value("string"), "label": bad_names}),
    )
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(
        ValueError,
        match=r"bad:train: the label's ClassLabel names \['no', 'yes'\] are not glue/sst2's: "
        r"HF's \['negative', 'positive'\] \(in that order\) or GLUE's \['0', '1'\]",
    ):
        read_hf_split("sst2", tmp_path / "bad", "train")
    unlabelled = datasets.Dataset.from_dict(
        {"sentence": ["a"], "label": [-1]},
        features=datasets.Features(
            {"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=["0", "1"])}
        ),
    )
    datasets.DatasetDict({"train": unlabelled}).save_to_disk(str(tmp_path / "unl"))
    with pytest.raises(ValueError, match=r"unl:train row 0: no label"):
        read_hf_split("sst2", tmp_path / "unl", "train")


# ----------------------------------------------------------------------------- encode / collate


def _pieces(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_encode_pair_segments_and_order(glue_root, tokenizer):
    examples, _ = read_tsv_split("mrpc", glue_root, "train")
    enc = encode(examples, tokenizer, max_length=256)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    assert len(enc) == 2 and enc.truncated == 0
    for i, ex in enumerate(examples):
        a, b = _pieces(tokenizer, ex.text_a), _pieces(tokenizer, ex.text_b)
        item = enc[i]
        assert item["input_ids"].tolist() == [cls, *a, sep, *b, sep]
        assert item["token_type_ids"].tolist() == [0] * (len(a) + 2) + [1] * (len(b) + 1)
        assert item["label"] == ex.label and item["index"] == ex.index
    assert enc.labels.dtype == np.int64
    assert tokenizer.truncation is None  # the caller's tokenizer is left alone


def test_encode_truncates_longest_first(tokenizer):
    long_a = "the quick brown fox jumps over the lazy dog " * 3
    examples = [Example(0, long_a, "a dog", 1), Example(1, "a dog", long_a, 0)]
    b = _pieces(tokenizer, "a dog")
    enc = encode(examples, tokenizer, max_length=16)
    assert enc.truncated == 2 and enc.lengths().tolist() == [16, 16]
    keep = 16 - 3 - len(b)  # the long segment gives way; the short one is whole
    first, second = enc[0], enc[1]
    assert first["input_ids"][1 : 1 + keep].tolist() == _pieces(tokenizer, long_a)[:keep]
    assert first["input_ids"][-1 - len(b) : -1].tolist() == b
    assert second["input_ids"][1 : 1 + len(b)].tolist() == b
    assert second["token_type_ids"].tolist() == [0] * (len(b) + 2) + [1] * (keep + 1)
    with pytest.raises(ValueError, match="max_length 4 leaves no room"):
        encode(examples, tokenizer, max_length=4)


def test_encode_single_sentence_regression_and_path(glue_root, tokenizer, tmp_path):
    examples, _ = read_tsv_split("cola", glue_root, "test")
    enc = encode(examples, tokenizer, max_length=8)
    assert enc.labels is None and all(enc[i]["token_type_ids"].sum() == 0 for i in range(2))
    assert max(enc.lengths()) <= 8
    (tmp_path / "tokenizer.json").write_text(tokenizer.to_str())
    stsb, _ = read_tsv_split("stsb", glue_root, "train")
    enc = encode(stsb, tmp_path, max_length=64)  # a release dir holding tokenizer.json
    assert enc.labels.dtype == np.float32 and enc.labels.tolist() == [5.0, 0.5]
    with pytest.raises(ValueError, match="encode one split at a time"):
        encode([Example(0, "a", "b", 1), Example(1, "a", None, 1)], tokenizer, 16)


def test_collate_pads_and_masks(glue_root, tokenizer):
    examples, _ = read_tsv_split("mnli", glue_root, "dev_matched")
    enc = encode(examples, tokenizer, max_length=64)
    batch = collate([enc[i] for i in range(len(enc))], enc.pad_id, pad_to_multiple_of=8)
    lengths = enc.lengths()
    width = batch["input_ids"].shape[1]
    assert width % 8 == 0 and width >= lengths.max()
    assert batch["attention_mask"].sum(1).tolist() == lengths.tolist()
    for i, n in enumerate(lengths):
        assert batch["input_ids"][i, :n].tolist() == enc[i]["input_ids"].tolist()
        assert (batch["input_ids"][i, n:] == enc.pad_id).all()
        assert (batch["token_type_ids"][i, n:] == 0).all()
    assert batch["labels"].tolist() == [1, 2, 0] and batch["labels"].dtype == torch.long
    assert batch["index"].tolist() == [0, 1, 2]
    stsb, _ = read_tsv_split("stsb", glue_root, "train")
    enc = encode(stsb, tokenizer, max_length=64)
    assert collate([enc[0], enc[1]], enc.pad_id)["labels"].dtype == torch.float32
    test, _ = read_tsv_split("stsb", glue_root, "test")
    unlabelled = encode(test, tokenizer, max_length=64)
    assert "labels" not in collate([unlabelled[0]], 0)
    with pytest.raises(ValueError, match="mixes labelled and unlabelled"):
        collate([enc[0], unlabelled[0]], 0)
