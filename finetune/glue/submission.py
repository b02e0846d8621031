"""Test-set predictions as the GLUE server (gluebenchmark.com) wants them.

One file per test set, named as the server expects (CoLA.tsv SST-2.tsv MRPC.tsv STS-B.tsv QQP.tsv
MNLI-m.tsv MNLI-mm.tsv QNLI.tsv RTE.tsv WNLI.tsv AX.tsv), tab-separated with the header
`index<TAB>prediction` and one row per test example in index order. The prediction is the label
string for MNLI, AX (entailment / neutral / contradiction), QNLI and RTE (entailment /
not_entailment); 0 or 1 for CoLA, SST-2, MRPC, QQP and WNLI; for STS-B the score clipped to
[0, 5], written with 3 decimals (as jiant does). The server takes a zip of these files at its
top level (`write_submission_dir(..., zip_name=...)`); it rejects a file whose row count differs
from the official test set's, which is warned about here (tests use tiny fixtures).

`check_submission_dir` tells whether a directory holds a complete submission: all 11 files,
each with the header, the official number of rows, the indices 0..n-1 and predictions the
server takes (the summary of a GLUE run dir reports it).
"""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from albatross.files import atomic_file
from data_prep.format import atomic_write_text
from finetune.glue.tasks import SERVER_FILES, GlueTask, ServerFile, get_task, parse_result_key

log = logging.getLogger(__name__)

HEADER = ("index", "prediction")
HEADER_LINE = "\t".join(HEADER)
STSB_DECIMALS = 3


def _indices(indices: Any, n: int, where: str) -> np.ndarray:
    array = np.asarray(indices)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{where}: indices must be integers of shape (n,), got {array.dtype}")
    if len(array) != n:
        raise ValueError(f"{where}: {len(array)} indices for {n} predictions")
    if len(np.unique(array)) != len(array):
        raise ValueError(f"{where}: indices are not unique")
    return array


def _prediction_strings(task: GlueTask, predictions: Any, where: str) -> list[str]:
    if task.is_regression:
        scores = np.asarray(predictions, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(scores)):
            raise ValueError(f"{where}: STS-B predictions hold NaN or infinite values")
        return [f"{x:.{STSB_DECIMALS}f}" for x in np.clip(scores, 0.0, 5.0)]
    ids = np.asarray(predictions)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(
            f"{where}: predictions must be integer class ids of shape (n,), got "
            f"{ids.dtype} {ids.shape}"
        )
    bad = (ids < 0) | (ids >= len(task.labels))
    if bad.any():
        raise ValueError(
            f"{where}: prediction {ids[bad][0]} is outside the label ids "
            f"0..{len(task.labels) - 1} ({list(task.labels)})"
        )
    if task.submission_label_strings:
        return [task.labels[i] for i in ids]
    return [str(int(i)) for i in ids]  # 0/1 tasks: their labels are "0" and "1"


def write_predictions(
    task: str | GlueTask,
    indices: Sequence[int] | np.ndarray,
    predictions: Sequence[Any] | np.ndarray,
    out_dir: str | os.PathLike,
    split: str = "test",
    *,
    overwrite: bool = False,
) -> Path:
    """Writes `out_dir/<server file>` for a test split and returns its path.

    `indices` are the examples' GLUE indices (`Example.index`), `predictions` class ids into
    `task.labels` (STS-B: scores). MNLI's split is "test_matched" (MNLI-m.tsv) or
    "test_mismatched" (MNLI-mm.tsv); AX (the MNLI model's predictions on the diagnostic set)
    is task "ax", split "test". FileExistsError if the file exists, unless `overwrite`."""
    task = get_task(task)
    server_file = task.server_file(split)
    path = Path(out_dir) / server_file.file
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; pass overwrite=True to replace it")
    where = f"{task.name} {split}"
    strings = _prediction_strings(task, predictions, where)
    idx = _indices(indices, len(strings), where)
    order = np.argsort(idx, kind="stable")
    if len(idx) != server_file.rows or not np.array_equal(idx[order], np.arange(len(idx))):
        log.warning(
            "%s: %d predictions with indices %s..%s; the GLUE server expects indices 0..%d",
            path,
            len(idx),
            idx.min() if len(idx) else "-",
            idx.max() if len(idx) else "-",
            server_file.rows - 1,
        )
    lines = [HEADER_LINE] + [f"{idx[i]}\t{strings[i]}" for i in order]
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def write_submission_dir(
    predictions: Mapping[str, tuple[Any, Any]],
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    zip_name: str | None = None,
) -> list[Path]:
    """Writes the server files of several test sets; returns their paths (and the zip's, last).

    `predictions` maps result keys (`GlueTask.result_key`: "cola", ..., "mnli_matched",
    "mnli_mismatched", "ax") to (indices, predictions). With `zip_name` the files are also
    zipped at the archive's top level into `out_dir/zip_name`, the upload the server takes.
    The server wants all 11 files: the missing ones are warned about."""
    targets = {key: parse_result_key(key) for key in predictions}
    if not overwrite:  # refuse before writing anything
        for task, split in targets.values():
            path = Path(out_dir) / task.server_file(split).file
            if path.exists():
                raise FileExistsError(f"{path} already exists; pass overwrite=True to replace it")
    paths = []
    for key, (indices, preds) in predictions.items():
        task, split = targets[key]
        paths.append(write_predictions(task, indices, preds, out_dir, split, overwrite=overwrite))
    written = {p.name for p in paths}
    missing = [sf.file for _, sf in SERVER_FILES if sf.file not in written]
    if missing:
        log.warning("the GLUE server wants every test file; missing: %s", missing)
    if zip_name is not None:
        paths.append(_zip(paths, Path(out_dir) / zip_name, overwrite))
    return paths


def _zip(files: list[Path], target: Path, overwrite: bool) -> Path:
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass overwrite=True to replace it")
    with (
        atomic_file(target, "the GLUE submission archive") as tmp,
        zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf,
    ):
        for path in files:
            zf.write(path, arcname=path.name)
    return target


# ----------------------------------------------------------------------------- checking


def _prediction_problem(task: GlueTask, text: str) -> str | None:
    """Why the server would refuse `text` as a prediction of `task`; None if it takes it."""
    if task.is_regression:
        try:
            score = float(text)
        except ValueError:
            return f"{text!r} is not a number"
        return None if 0.0 <= score <= 5.0 else f"{text!r} is outside [0, 5]"
    # label strings (MNLI, AX, QNLI, RTE) or the class id 0/1, which is then the label's text
    return None if text in task.labels else f"{text!r} is not one of {list(task.labels)}"


def _row_problem(task: GlueTask, row: list[str]) -> str | None:
    """Why the server would refuse a data row (its fields); None if it takes it."""
    if len(row) != 2 or not row[0].isdigit():
        return "not index<TAB>prediction"
    problem = _prediction_problem(task, row[1])
    return problem and f"prediction {problem}"


def check_server_file(task: GlueTask, server_file: ServerFile, path: Path) -> list[str]:
    """What keeps the GLUE server from taking `path` as `server_file` ([] if nothing): the
    header, the number of rows (the official test set's), each row (index<TAB>prediction, the
    prediction one of the task's label strings, 0/1, or an STS-B score in [0, 5]; the first
    bad row is named) and the indices (0..n-1, each once)."""
    header, *lines = path.read_text(encoding="utf-8").splitlines() or [""]
    rows = [line.split("\t") for line in lines]
    problems = []
    if header != HEADER_LINE:
        problems.append(f"the header is {header!r}, not {HEADER_LINE!r}")
    if len(rows) != server_file.rows:
        problems.append(f"{len(rows)} rows, the server expects {server_file.rows}")
    for line_number, row in enumerate(rows, start=2):
        problem = _row_problem(task, row)
        if problem:
            problems.append(f"line {line_number}: {problem}")
            return problems  # the indices cannot be checked
    if sorted(int(index) for index, _ in rows) != list(range(len(rows))):
        problems.append(f"the indices are not 0..{len(rows) - 1}, each once")
    return problems


@dataclass
class SubmissionReport:
    """Whether a directory holds a complete GLUE server submission (`check_submission_dir`)."""

    directory: str
    present: list[str]
    """The server files found, in the server's order."""
    missing: list[str]
    """The server files not found."""
    problems: dict[str, list[str]]
    """Server file -> why the server would refuse it (`check_server_file`); only files with
    problems."""

    @property
    def complete(self) -> bool:
        """All 11 files, none with a problem: ready to zip and upload."""
        return not self.missing and not self.problems

    def summary(self) -> str:
        """One line for results.md and the log."""
        total = len(SERVER_FILES)
        if self.complete:
            return (
                f"GLUE submission {self.directory}: complete, all {total} server files with "
                "the official row counts"
            )
        parts = []
        if self.missing:
            parts.append(f"missing {', '.join(_missing_hint(f) for f in self.missing)}")
        for file, problems in self.problems.items():
            parts.append(f"{file}: {'; '.join(problems)}")
        usable = len(self.present) - len(self.problems)
        return (
            f"GLUE submission {self.directory}: INCOMPLETE, {usable} of {total} server files "
            f"usable, the server would refuse it: {' | '.join(parts)}"
        )

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "complete": self.complete}


def _missing_hint(file: str) -> str:
    """A missing file's name with where it comes from, e.g. "AX.tsv (predicted by the best mnli
    run when the AX data is under --data)"."""
    task = next(task for task, sf in SERVER_FILES if sf.file == file)
    if task.predicted_with:
        return (
            f"{file} (predicted by the {task.predicted_with} runs when the {task.name} test data "
            f"is under --data: {task.dir_name}/{task.tsv_file('test')}, or HF's "
            f"{task.name} config)"
        )
    return f"{file} (no finished {task.name} run)"


def check_submission_dir(directory: str | os.PathLike) -> SubmissionReport:
    """Checks every file of a GLUE server submission in `directory` (`check_server_file`)."""
    directory = Path(directory)
    present, missing, problems = [], [], {}
    for task, server_file in SERVER_FILES:
        path = directory / server_file.file
        if not path.is_file():
            missing.append(server_file.file)
            continue
        present.append(server_file.file)
        found = check_server_file(task, server_file, path)
        if found:
            problems[server_file.file] = found
    return SubmissionReport(str(directory), present, missing, problems)
