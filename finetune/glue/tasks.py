"""The GLUE tasks: one frozen `GlueTask` each, the single source of truth for every format detail.

Split names (ours, whatever the data's layout; `GlueTask.hf_split` gives HF's: dev -> validation,
dev_matched -> validation_matched, ...):

    train, dev, test                           every task but MNLI and AX
    train, dev_matched, dev_mismatched,
           test_matched, test_mismatched       MNLI ("dev" alone is refused: there are two)
    test                                       AX (the diagnostic set: no train, no dev, no labels;
                                               predicted with the MNLI model, see `predicted_with`)

Label ids are positions in `GlueTask.labels`, the label order of the original run_glue
processors (google-research/bert run_classifier.py, HF transformers
`data/processors/glue.py`): MNLI is contradiction, entailment, neutral. HF `datasets` orders
MNLI differently (entailment, neutral, contradiction) and names the 0/1 labels (CoLA
unacceptable/acceptable, ...): `hf_labels` maps HF's names to ours, so ids mean the same thing
whichever format a split came from.

Sources, checked against each other:
* TSV columns and file names: the GLUE download script (nyu-mll `download_glue_data.py`:
  MRPC's train/dev header is copied from msr_paraphrase_train.txt, UTF-8 BOM included; its
  test header is written as "index #1 ID #2 ID #1 String #2 String"; AX is
  `diagnostic/diagnostic.tsv`), the run_glue processors (text and label columns; CoLA train/dev
  have no header: source, label, original label, sentence; QQP rows that are too short are
  skipped) and HF's `glue` dataset script (reads every file with csv.QUOTE_NONE).
  MNLI headers: train has 12 columns (index promptID pairID genre sentence1_binary_parse
  sentence2_binary_parse sentence1_parse sentence2_parse sentence1 sentence2 label1
  gold_label), dev 16 (label1..label5 then gold_label), test 10 (no labels).
* HF column names and ClassLabel names: HF `datasets` `glue` script (`text_features`,
  `label_classes`), e.g. WNLI is ["not_entailment", "entailment"] for GLUE's 0 / 1.
* Submission files: the GLUE server's names (gluebenchmark.com FAQ; jiant's GLUE submission
  formatter, `formatted_pred_output_filenames`): CoLA.tsv SST-2.tsv MRPC.tsv STS-B.tsv QQP.tsv MNLI-m.tsv
  MNLI-mm.tsv QNLI.tsv RTE.tsv WNLI.tsv AX.tsv, each "index<TAB>prediction"; MNLI, AX, QNLI and
  RTE want label strings, CoLA, SST-2, MRPC, QQP and WNLI 0/1, STS-B a float in [0, 5].
  Official test sizes as in HF's `glue` splits.
* Metrics: the GLUE paper (Wang et al., 2019) table 1 and leaderboard: CoLA Matthews corr.,
  STS-B Pearson / Spearman, MRPC and QQP F1 / accuracy, accuracy elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

# Metric names (computed in metrics.py).
MCC = "mcc"
ACCURACY = "accuracy"
F1 = "f1"
PEARSON = "pearson"
SPEARMAN = "spearman"


@dataclass(frozen=True)
class TsvLayout:
    """Where one kind of GLUE TSV file keeps the fields we read.

    Columns are header names, or 0-based positions for the files without a header (CoLA train
    and dev)."""

    header: bool
    """Whether the first line is a header."""
    text_a: str | int
    """The first (or only) text: segment A."""
    text_b: str | int | None = None
    """The second text of a pair task (segment B); None for single-sentence tasks."""
    label: str | int | None = None
    """The gold label; None in test files."""
    index: str | None = None
    """Test files: the column of the example index the GLUE server matches predictions by.
    (Train and dev examples are numbered by their data row instead, as HF's `idx` is.)"""


@dataclass(frozen=True)
class ServerFile:
    """One file of a GLUE server submission."""

    split: str
    """Our test split whose predictions go in it."""
    file: str
    """The file name the server expects, e.g. "MNLI-m.tsv"."""
    rows: int
    """The number of predictions the server expects (the official test set's size)."""


@dataclass(frozen=True)
class GlueTask:
    """Everything format-specific about one GLUE task."""

    name: str
    """Our name: cola sst2 mrpc stsb qqp mnli qnli rte wnli ax (HF `glue` config names)."""
    dir_name: str
    """The task's folder in the GLUE TSV distribution, e.g. "SST-2"."""
    labels: tuple[str, ...]
    """Label strings in id order (as in the TSV files and run_glue); () for STS-B (regression)."""
    metrics: tuple[str, ...]
    """The metrics GLUE reports; the task's score is their mean. () for AX (server only)."""
    files: tuple[tuple[str, str], ...]
    """(our split, TSV file name in `dir_name`) for every split the task has."""
    labelled: TsvLayout | None
    """Layout of the train and dev files (None for AX, which has neither)."""
    test: TsvLayout
    """Layout of the test file(s)."""
    hf_columns: tuple[str, str | None]
    """The text columns of HF's `glue` config (segment A, segment B or None)."""
    hf_labels: tuple[tuple[str, str], ...]
    """(HF ClassLabel name, our label) in HF's id order; () for STS-B."""
    submission: tuple[ServerFile, ...]
    """The server file(s) the test split(s) go to."""
    submission_label_strings: bool
    """True: the server wants label strings (MNLI, AX, QNLI, RTE); False: the class id as an
    integer 0/1 (CoLA, SST-2, MRPC, QQP, WNLI; their labels are "0"/"1", so the same text) or,
    for STS-B, the score as a float clipped to [0, 5]."""
    predicted_with: str | None = None
    """AX: the task whose fine-tuned model predicts this task's test set ("mnli"); AX has no
    training or dev data, so it is never trained itself (`--task ax` is refused) and the MNLI
    runs write AX.tsv. None for the tasks that are trained."""

    # ------------------------------------------------------------------ derived facts

    @property
    def is_regression(self) -> bool:
        return not self.labels

    @property
    def num_labels(self) -> int:
        """Outputs of the model's head: 1 for STS-B, else the number of classes."""
        return 1 if self.is_regression else len(self.labels)

    @property
    def is_pair(self) -> bool:
        return self.hf_columns[1] is not None

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(split for split, _ in self.files)

    @property
    def dev_splits(self) -> tuple[str, ...]:
        """The labelled evaluation splits: ("dev",), MNLI ("dev_matched", "dev_mismatched")."""
        return tuple(s for s in self.splits if s.startswith("dev"))

    @property
    def test_splits(self) -> tuple[str, ...]:
        return tuple(s for s in self.splits if s.startswith("test"))

    def check_split(self, split: str) -> None:
        """ValueError unless `split` is one of the task's splits."""
        if split not in self.splits:
            hint = ""
            if split in ("dev", "test") and self.name == "mnli":
                hint = f"; MNLI has two {split} sets: {split}_matched and {split}_mismatched"
            raise ValueError(
                f"{self.name} has no split {split!r}; its splits are {list(self.splits)}{hint}"
            )

    def is_labelled(self, split: str) -> bool:
        """Whether the split's files carry gold labels (train and dev do, test does not)."""
        self.check_split(split)
        return not split.startswith("test")

    def tsv_file(self, split: str) -> str:
        """The TSV file name of a split, e.g. "dev_matched.tsv"."""
        self.check_split(split)
        return dict(self.files)[split]

    def layout(self, split: str) -> TsvLayout:
        """The TSV layout of a split's file."""
        if self.is_labelled(split):
            assert self.labelled is not None, self.name
            return self.labelled
        return self.test

    def hf_split(self, split: str) -> str:
        """HF's split name: dev -> validation, dev_matched -> validation_matched, else as is."""
        self.check_split(split)
        return "validation" + split[len("dev") :] if split.startswith("dev") else split

    def result_key(self, split: str) -> str:
        """The key of a split's results: the task name; MNLI "mnli_matched" / "mnli_mismatched"
        (for its dev and test splits alike). `metrics.glue_average` and
        `submission.write_submission_dir` take results keyed this way."""
        self.check_split(split)
        _, _, variant = split.partition("_")
        return f"{self.name}_{variant}" if variant else self.name

    def server_file(self, split: str) -> ServerFile:
        """The submission file a test split's predictions go to."""
        self.check_split(split)
        for server_file in self.submission:
            if server_file.split == split:
                return server_file
        raise ValueError(
            f"{self.name} split {split!r} is not submitted to the GLUE server; "
            f"test splits: {list(self.test_splits)}"
        )


# ----------------------------------------------------------------------------- the tasks

_BINARY = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
_MNLI = ("contradiction", "entailment", "neutral")  # run_glue's order
_MNLI_HF = (
    ("entailment", "entailment"),
    ("neutral", "neutral"),
    ("contradiction", "contradiction"),
)
_STD_FILES = (("train", "train.tsv"), ("dev", "dev.tsv"), ("test", "test.tsv"))
_PAIR12 = TsvLayout(True, "sentence1", "sentence2", "label")  # RTE, WNLI


def _one_file(split: str, file: str, rows: int) -> tuple[ServerFile, ...]:
    return (ServerFile(split, file, rows),)


TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        GlueTask(
            name="cola",
            dir_name="CoLA",
            labels=_BINARY,
            metrics=(MCC,),
            files=_STD_FILES,
            # No header: source, label, original label (blank or "*"), sentence.
            labelled=TsvLayout(False, text_a=3, label=1),
            test=TsvLayout(True, "sentence", index="index"),
            hf_columns=("sentence", None),
            hf_labels=(("unacceptable", "0"), ("acceptable", "1")),
            submission=_one_file("test", "CoLA.tsv", 1063),
            submission_label_strings=False,
        ),
        GlueTask(
            name="sst2",
            dir_name="SST-2",
            labels=_BINARY,
            metrics=(ACCURACY,),
            files=_STD_FILES,
            labelled=TsvLayout(True, "sentence", label="label"),
            test=TsvLayout(True, "sentence", index="index"),
            hf_columns=("sentence", None),
            hf_labels=(("negative", "0"), ("positive", "1")),
            submission=_one_file("test", "SST-2.tsv", 1821),
            submission_label_strings=False,
        ),
        GlueTask(
            name="mrpc",
            dir_name="MRPC",
            labels=_BINARY,
            metrics=(F1, ACCURACY),
            files=_STD_FILES,
            labelled=TsvLayout(True, "#1 String", "#2 String", "Quality"),
            test=TsvLayout(True, "#1 String", "#2 String", index="index"),
            hf_columns=("sentence1", "sentence2"),
            hf_labels=(("not_equivalent", "0"), ("equivalent", "1")),
            submission=_one_file("test", "MRPC.tsv", 1725),
            submission_label_strings=False,
        ),
        GlueTask(
            name="stsb",
            dir_name="STS-B",
            labels=(),
            metrics=(PEARSON, SPEARMAN),
            files=_STD_FILES,
            labelled=TsvLayout(True, "sentence1", "sentence2", "score"),
            test=TsvLayout(True, "sentence1", "sentence2", index="index"),
            hf_columns=("sentence1", "sentence2"),
            hf_labels=(),
            submission=_one_file("test", "STS-B.tsv", 1379),
            submission_label_strings=False,
        ),
        GlueTask(
            name="qqp",
            dir_name="QQP",
            labels=_BINARY,
            metrics=(F1, ACCURACY),
            files=_STD_FILES,
            labelled=TsvLayout(True, "question1", "question2", "is_duplicate"),
            test=TsvLayout(True, "question1", "question2", index="id"),
            hf_columns=("question1", "question2"),
            hf_labels=(("not_duplicate", "0"), ("duplicate", "1")),
            submission=_one_file("test", "QQP.tsv", 390965),
            submission_label_strings=False,
        ),
        GlueTask(
            name="mnli",
            dir_name="MNLI",
            labels=_MNLI,
            metrics=(ACCURACY,),
            files=(
                ("train", "train.tsv"),
                ("dev_matched", "dev_matched.tsv"),
                ("dev_mismatched", "dev_mismatched.tsv"),
                ("test_matched", "test_matched.tsv"),
                ("test_mismatched", "test_mismatched.tsv"),
            ),
            labelled=TsvLayout(True, "sentence1", "sentence2", "gold_label"),
            test=TsvLayout(True, "sentence1", "sentence2", index="index"),
            hf_columns=("premise", "hypothesis"),
            hf_labels=_MNLI_HF,
            submission=(
                ServerFile("test_matched", "MNLI-m.tsv", 9796),
                ServerFile("test_mismatched", "MNLI-mm.tsv", 9847),
            ),
            submission_label_strings=True,
        ),
        GlueTask(
            name="qnli",
            dir_name="QNLI",
            labels=_NLI2,
            metrics=(ACCURACY,),
            files=_STD_FILES,
            labelled=TsvLayout(True, "question", "sentence", "label"),
            test=TsvLayout(True, "question", "sentence", index="index"),
            hf_columns=("question", "sentence"),
            hf_labels=(("entailment", "entailment"), ("not_entailment", "not_entailment")),
            submission=_one_file("test", "QNLI.tsv", 5463),
            submission_label_strings=True,
        ),
        GlueTask(
            name="rte",
            dir_name="RTE",
            labels=_NLI2,
            metrics=(ACCURACY,),
            files=_STD_FILES,
            labelled=_PAIR12,
            test=TsvLayout(True, "sentence1", "sentence2", index="index"),
            hf_columns=("sentence1", "sentence2"),
            hf_labels=(("entailment", "entailment"), ("not_entailment", "not_entailment")),
            submission=_one_file("test", "RTE.tsv", 3000),
            submission_label_strings=True,
        ),
        GlueTask(
            name="wnli",
            dir_name="WNLI",
            labels=_BINARY,
            metrics=(ACCURACY,),
            files=_STD_FILES,
            labelled=_PAIR12,
            test=TsvLayout(True, "sentence1", "sentence2", index="index"),
            hf_columns=("sentence1", "sentence2"),
            hf_labels=(("not_entailment", "0"), ("entailment", "1")),
            submission=_one_file("test", "WNLI.tsv", 146),
            submission_label_strings=False,
        ),
        # The diagnostic set: predicted with the MNLI model, scored by the server only.
        GlueTask(
            name="ax",
            dir_name="diagnostic",
            labels=_MNLI,
            metrics=(),
            files=(("test", "diagnostic.tsv"),),
            labelled=None,
            test=TsvLayout(True, "sentence1", "sentence2", index="index"),
            hf_columns=("premise", "hypothesis"),
            hf_labels=_MNLI_HF,
            submission=_one_file("test", "AX.tsv", 1104),
            submission_label_strings=True,
            predicted_with="mnli",
        ),
    )
}

# The tasks of the GLUE score (AX is a diagnostic, not part of it): what `--task all` trains.
SCORED_TASKS: tuple[str, ...] = tuple(name for name, t in TASKS.items() if t.metrics)

# Every file of a complete GLUE server submission, in the server's order: (task, file).
SERVER_FILES: tuple[tuple[GlueTask, ServerFile], ...] = tuple(
    (task, server_file) for task in TASKS.values() for server_file in task.submission
)


def tasks_predicted_with(task: GlueTask) -> tuple[GlueTask, ...]:
    """The tasks whose test sets `task`'s model predicts besides its own: (AX,) for MNLI."""
    return tuple(t for t in TASKS.values() if t.predicted_with == task.name)


def get_task(name: str | GlueTask) -> GlueTask:
    """The task called `name` (case-insensitive; "sst-2" / "sts-b" spellings accepted); a
    GlueTask is returned as is. ValueError naming the valid tasks otherwise."""
    if isinstance(name, GlueTask):
        return name
    key = str(name).lower().replace("-", "")
    if key not in TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; choose one of {list(TASKS)}")
    return TASKS[key]


def parse_result_key(key: str) -> tuple[GlueTask, str]:
    """(task, test split) for a result key of `GlueTask.result_key` ("cola", "mnli_matched")."""
    name, _, variant = key.partition("_")
    task = get_task(name)
    split = f"test_{variant}" if variant else "test"
    if split not in task.test_splits:
        keys = [task.result_key(s) for s in task.test_splits]
        raise ValueError(f"bad result key {key!r} for {task.name}; use one of {keys}")
    return task, split
