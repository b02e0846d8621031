"""Corpus readers: every input kind, globs and @lists, the embedded corpus, bad input."""

from __future__ import annotations

import gzip
import json
import logging

import pytest

from data_prep.corpus import embedded_documents
from data_prep.readers import ReadStats, expand_inputs, input_kind, iter_documents

DOCS = [
    ["The first sentence.", "The second sentence of document one."],
    ["Document two has one sentence."],
    ["Third document, line one.", "Line two.", "Line three."],
]


def as_bert_text(docs) -> str:
    return "\n\n".join("\n".join(d) for d in docs) + "\n"


def as_jsonl(docs, field="text") -> str:
    return "".join(json.dumps({"id": i, field: "\n".join(d)}) + "\n" for i, d in enumerate(docs))


def read(inputs, **kw):
    stats = ReadStats()
    docs = list(iter_documents([str(x) for x in inputs], stats=stats, **kw))
    return docs, stats


def test_plain_text_bert_convention(tmp_path):
    # Several blank lines, whitespace-only lines and CRLF all separate documents correctly.
    text = "The first sentence.\r\n  The second sentence of document one.  \r\n\r\n \n\n"
    text += "Document two has one sentence.\n\n\nThird document, line one.\nLine two.\nLine three."
    path = tmp_path / "a.txt"
    path.write_text(text, encoding="utf-8", newline="")
    docs, stats = read([path])
    assert docs == DOCS
    assert stats.documents == 3 and stats.sentences == 6
    assert stats.files == [str(path)]
    assert stats.replaced_characters == 0


def test_file_boundary_ends_a_document(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo")  # no trailing blank line
    (tmp_path / "b.txt").write_text("three\n")
    docs, _ = read([tmp_path / "a.txt", tmp_path / "b.txt"])
    assert docs == [["one", "two"], ["three"]]


def test_jsonl_text_field_and_newline_sentences(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(as_jsonl(DOCS, field="body"))
    docs, stats = read([path], text_field="body")
    assert docs == DOCS
    assert stats.documents == 3
    with pytest.raises(ValueError, match=r"c\.jsonl:1: record has no field 'text'.*--text-field"):
        read([path])


def test_jsonl_bad_line_skipped_and_counted(tmp_path, caplog):
    lines = as_jsonl(DOCS).splitlines()
    lines.insert(1, '{"text": "truncated')
    lines.append('{"text": null}')
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        docs, stats = read([path])
    assert docs == DOCS
    assert stats.skipped["bad_json_lines"] == 1
    assert stats.skipped["null_text"] == 1
    assert "bad.jsonl:2: not valid JSON" in caplog.text


def test_jsonl_non_string_text_is_an_error(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match=r"n\.jsonl:1: field 'text' is a int"):
        read([path])


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    texts = ["\n".join(d) for d in DOCS] + [None]
    pq.write_table(pa.table({"content": texts, "n": list(range(4))}), path, row_group_size=2)
    docs, stats = read([path], text_field="content")
    assert docs == DOCS
    assert stats.skipped["null_text"] == 1
    with pytest.raises(ValueError, match=r"no column 'text' \(columns: \['content', 'n'\]\)"):
        read([path])


def test_hf_datasets_directory(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["\n".join(d) for d in DOCS], "i": [0, 1, 2]})
    ds.save_to_disk(str(tmp_path / "hf"))
    assert input_kind(str(tmp_path / "hf")) == "hf"
    docs, _ = read([tmp_path / "hf"])
    assert docs == DOCS
    datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train', 'validation'\]"):
        read([tmp_path / "dd"])
    docs, _ = read([tmp_path / "dd" / "train"])
    assert docs == DOCS


def test_gzip_and_zstd(tmp_path):
    import zstandard

    gz = tmp_path / "a.txt.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(as_bert_text(DOCS))
    zst = tmp_path / "b.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(as_jsonl(DOCS).encode()))
    assert (input_kind(str(gz)), input_kind(str(zst))) == ("text", "jsonl")
    docs, stats = read([gz, zst])
    assert docs == DOCS + DOCS
    assert stats.documents == 6


def test_corrupt_compressed_input_names_the_file(tmp_path):
    import zstandard

    data = ("a line of text\n" * 20000).encode()
    gz = tmp_path / "bad.txt.gz"
    gz.write_bytes(gzip.compress(data)[:-200])  # truncated
    with pytest.raises(ValueError, match=r"bad\.txt\.gz: read error after line \d+ \(corrupt"):
        read([gz])
    zst = tmp_path / "bad.txt.zst"
    blob = bytearray(zstandard.ZstdCompressor().compress(data))
    blob[len(blob) // 2 :] = b"\x00" * (len(blob) - len(blob) // 2)  # garbage second half
    zst.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=r"bad\.txt\.zst: read error after line \d+"):
        read([zst])


def test_globs_sorted_and_list_files_keep_their_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, docs in (("b.txt", DOCS[1:2]), ("a.txt", DOCS[:1]), ("c.txt", DOCS[2:])):
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "data" / name).write_text(as_bert_text(docs))
    docs, stats = read(["data/*.txt"])
    assert docs == DOCS  # a, b, c
    assert stats.files == ["data/a.txt", "data/b.txt", "data/c.txt"]
    (tmp_path / "list.txt").write_text("# comment\ndata/c.txt\n\ndata/a.txt\n")
    docs, stats = read(["@list.txt", "data/b.txt"])
    assert docs == [DOCS[2], DOCS[0], DOCS[1]]
    assert expand_inputs(["data/**/*.txt"]) == ["data/a.txt", "data/b.txt", "data/c.txt"]


def test_missing_inputs_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"input file 'nope\.txt' does not exist"):
        read(["nope.txt"])
    with pytest.raises(FileNotFoundError, match=r"input pattern 'data/\*\.jsonl' matches no file"):
        read(["data/*.jsonl"])
    with pytest.raises(FileNotFoundError, match=r"input list file 'l\.txt' does not exist"):
        read(["@l.txt"])
    (tmp_path / "l.txt").write_text("gone.txt\n")
    with pytest.raises(FileNotFoundError, match=r"'gone\.txt' \(listed in l\.txt\)"):
        read(["@l.txt"])
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match=r"'d' is a directory but not a HF datasets directory"):
        read(["d"])


def test_empty_input_is_an_error(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n\n   \n")
    with pytest.raises(ValueError, match=r"no documents found .*empty\.txt"):
        read([path])


def test_undecodable_bytes_replaced_and_counted(tmp_path):
    path = tmp_path / "latin1.txt"
    # Two invalid bytes, plus a genuine U+FFFD in the input that must not be counted.
    path.write_bytes("ok line\ncaf\xe9 and na\xefve\n".encode("latin-1") + "real \ufffd\n".encode())
    docs, stats = read([path])
    assert docs == [["ok line", "caf\ufffd and na\ufffdve", "real \ufffd"]]
    assert stats.replaced_characters == 2


@pytest.mark.parametrize("suffix", [".txt", ".txt.gz"])
def test_long_lines_skipped_and_counted(tmp_path, caplog, suffix):
    text = "short one\n" + "x" * 60 + "\n" + "y" * 1000 + "\nlast line\n\nnext doc\n"
    path = tmp_path / f"long{suffix}"
    if suffix.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    with caplog.at_level(logging.WARNING):
        docs, stats = read([path], max_line_chars=50)
    # The 60-char line is caught after decoding; the 1000-char one while reading (never whole).
    assert docs == [["short one", "last line"], ["next doc"]]
    assert stats.skipped["long_lines"] == 2
    assert "line of 60 characters skipped" in caplog.text
    assert "line longer than 50 characters skipped" in caplog.text


def test_jsonl_long_sentence_skipped_long_record_skipped(tmp_path):
    # A record may be much longer than max_line_chars (a whole book); its lines may not.
    book = "\n".join(f"sentence number {i}" for i in range(40))  # ~800 chars, short lines
    records = [{"text": book}, {"text": "keep me\n" + "z" * 40 + "\nand me"}]
    records.append({"text": "w" * (64 * 30 + 10)})  # longer than 64 x max_line_chars
    path = tmp_path / "j.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    docs, stats = read([path], max_line_chars=30)
    assert docs == [book.split("\n"), ["keep me", "and me"]]
    assert stats.skipped["long_lines"] == 1
    assert stats.skipped["long_records"] == 1


def test_embedded_corpus():
    expected = [
        [ln.strip() for ln in text.split("\n") if ln.strip()] for text in embedded_documents()
    ]
    docs, stats = read(["embedded"])
    assert docs == expected and len(docs) > 50
    assert stats.files == ["embedded"]
    assert stats.documents == len(expected)
    head, _ = read(["embedded:3"])
    assert head == expected[:3]
    with pytest.raises(ValueError, match="embedded:N"):
        read(["embedded:zero"])
