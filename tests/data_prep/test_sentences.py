"""Sentence boundaries (`--sentences`, data_prep/sentences.py): JSONL/Parquet/`datasets`
documents split into sentences by default, plain text and the embedded corpus keep their lines,
`lines` keeps one sentence per line for any input, the splitter's quality on the hand-checked
sample, and the shard config that records the splitter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from data_prep import format as fmt
from data_prep import sentences
from data_prep.__main__ import main
from data_prep.readers import ReadStats, iter_documents
from data_prep.shards import ShardConfig

pytest.importorskip("nupunkt")

ROOT = Path(__file__).resolve().parents[2]
PARAGRAPH = (
    "Dr. Smith moved to the U.S. in 1998. He paid $3.50 for coffee every day. "
    '"Why?" she asked. Nobody knew.'
)
WANT = [
    "Dr. Smith moved to the U.S. in 1998.",
    "He paid $3.50 for coffee every day.",
    '"Why?" she asked.',
    "Nobody knew.",
]


def read(inputs, **kw):
    stats = ReadStats()
    return list(iter_documents([str(x) for x in inputs], stats=stats, **kw)), stats


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def write_parquet(path: Path, texts: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), path)
    return path


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet])
def test_one_paragraph_records_are_split_into_sentences(tmp_path, writer):
    # The bug: a document stored as one paragraph per record was one "sentence".
    path = writer(tmp_path / ("d.jsonl" if writer is write_jsonl else "d.parquet"), [PARAGRAPH])
    docs, stats = read([path])
    assert docs == [WANT]
    assert stats.sentences == 4
    # Lines stay boundaries: a heading on its own line is a sentence of its own.
    path = writer(path, ["History\n" + PARAGRAPH + "\nA second paragraph. It has two."])
    docs, _ = read([path])
    assert docs == [["History", *WANT, "A second paragraph.", "It has two."]]


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet])
def test_lines_mode_keeps_one_sentence_per_line(tmp_path, writer):
    path = writer(tmp_path / ("d.jsonl" if writer is write_jsonl else "d.parquet"), [PARAGRAPH])
    docs, _ = read([path], sentences="lines")
    assert docs == [[PARAGRAPH]]


def test_plain_text_and_embedded_keep_their_lines_unless_asked(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(PARAGRAPH + "\nSecond line.\n\nDocument two.\n")
    assert read([path])[0] == [[PARAGRAPH, "Second line."], ["Document two."]]
    assert read([path], sentences="split")[0] == [[*WANT, "Second line."], ["Document two."]]
    embedded = read(["embedded:3"])[0]
    assert embedded == read(["embedded:3"], sentences="lines")[0]
    split = read(["embedded:3"], sentences="split")[0]
    assert sum(map(len, split)) > sum(map(len, embedded))


def test_unknown_mode_is_refused():
    with pytest.raises(
        ValueError, match=r"--sentences must be one of \['auto', 'split', 'lines'\]"
    ):
        read(["embedded:1"], sentences="words")


def test_split_is_independent_of_what_was_split_before():
    # Determinism across workers: a worker's result for a line cannot depend on the lines it
    # happened to split before.
    texts = [t for t in (" ".join(d.split()) for d in read(["embedded:20"])[0][0]) if t]
    forward = [sentences.split_line(t) for t in texts]
    backward = [sentences.split_line(t) for t in reversed(texts)][::-1]
    assert forward == backward


def test_splitter_quality_on_the_hand_checked_sample():
    from bench import bench_sentence_split as bench

    gold = bench.load_gold()
    assert sum(len(p) for p in gold) >= 80
    q = bench.quality(sentences.split_line, gold)
    # The measured quality: docs/benchmarks.md#sentence-splitting.
    assert q["precision"] >= 0.95 and q["recall"] >= 0.95, q


def test_config_records_the_splitter_only_when_text_is_split(tmp_path):
    jsonl = write_jsonl(tmp_path / "d.jsonl", [PARAGRAPH])
    plain = ShardConfig(inputs=("embedded",), num_shards=2).to_dict()
    assert "sentences" not in plain and "sentence_splitter" not in plain  # as before the option
    assert (
        "sentences"
        not in ShardConfig(inputs=(str(jsonl),), num_shards=2, sentences="lines").to_dict()
    )
    d = ShardConfig(inputs=(str(jsonl),), num_shards=2).to_dict()
    assert d["sentences"] == "auto"
    assert d["sentence_splitter"].startswith("nupunkt ")
    assert (
        ShardConfig(inputs=("embedded",), num_shards=2, sentences="split").to_dict()["sentences"]
        == "split"
    )
    assert "streaming" not in ShardConfig(inputs=("x",), num_shards=2, streaming=True).to_dict()


def test_a_directory_of_line_sentences_is_not_mixed_with_split_ones(tmp_path, capsys):
    jsonl = write_jsonl(tmp_path / "d.jsonl", [PARAGRAPH * 3] * 6)
    tok = tmp_path / "tok"
    assert main(["tokenizer", "--input", str(jsonl), "--out", str(tok), "--vocab-size", "80"]) == 0
    args = ["shards", "--input", str(jsonl), "--tokenizer", str(tok / fmt.TOKENIZER)]
    args += ["--out", str(tmp_path / "s"), "--num-shards", "2", "--max-seq-length", "32"]
    assert main([*args, "--sentences", "lines"]) == 0
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "different config" in err and "sentences: None there vs 'auto' now" in err


def test_missing_splitter_names_the_fix(monkeypatch):
    sentences._tokenizer.cache_clear()
    monkeypatch.setitem(sys.modules, "nupunkt", None)
    try:
        with pytest.raises(
            ValueError, match=r"needs the sentence splitter nupunkt.*--sentences lines"
        ):
            sentences.split_line("One. Two.")
    finally:
        sentences._tokenizer.cache_clear()
