"""Hostile input to the data pipeline: an input file changed under the same path, a vocabulary
too small for the corpus, a mostly undecodable corpus file, a corrupt token id read without
checksums. Each is a user error with a clear message (the CLI: `error: ...`, exit 2)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
from test_data_prep import run_cli
from test_loader import VOCAB, write_shard_dir

from data_prep import format as fmt
from data_prep.loader import PretrainingData, PretrainingLoader
from data_prep.readers import iter_documents


def write_corpus(path: Path, docs: int = 8, word: str = "alpha") -> Path:
    """Plain text in the BERT convention: `docs` documents of three sentences each."""
    body = "\n\n".join(
        "\n".join(f"{word} sentence {s} of document {d} with a few words" for s in range(3))
        for d in range(docs)
    )
    path.write_text(body + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    assert run_cli("tokenizer", "--input", "embedded:12", "--out", out, "--vocab-size", 300) == 0
    return out / fmt.TOKENIZER


def shards(tokenizer: Path, out: Path, *inputs: object, extra: tuple = ()) -> int:
    return run_cli(
        "shards",
        "--input",
        *inputs,
        "--tokenizer",
        tokenizer,
        "--out",
        out,
        "--num-shards",
        2,
        "--max-seq-length",
        32,
        *extra,
    )


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


# ----------------------------------------------------------------------------- changed input


def test_input_changed_under_the_same_path_is_refused(tokenizer, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt", word="alpha")
    out = tmp_path / "shards"
    assert shards(tokenizer, out, corpus) == 0
    before = dir_bytes(out)
    stat = corpus.stat()

    # Same path, same size, same mtime: only the content differs.
    write_corpus(corpus, word="gamma")
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert corpus.stat().st_size == stat.st_size
    assert shards(tokenizer, out, corpus) == 2
    line = error_line(capsys)
    assert str(corpus) in line and "changed" in line
    assert "another --out directory" in line and "delete" in line
    assert dir_bytes(out) == before  # nothing was touched

    # Following the advice (a new directory) builds shards of the new text.
    assert shards(tokenizer, tmp_path / "fresh", corpus) == 0
    assert (
        dir_bytes(tmp_path / "fresh")["shard_00000.tokens.npy"] != before["shard_00000.tokens.npy"]
    )


def test_touched_but_unchanged_input_is_still_done(tokenizer, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "shards"
    assert shards(tokenizer, out, corpus) == 0
    mtime = (out / "shard_00000.tokens.npy").stat().st_mtime_ns
    os.utime(corpus, ns=(1, 10**18))  # a copy or `touch`: the same bytes, another mtime
    assert shards(tokenizer, out, corpus) == 0
    assert (out / "shard_00000.tokens.npy").stat().st_mtime_ns == mtime  # not rebuilt


def test_a_glob_that_matches_another_file_is_refused(tokenizer, tmp_path, capsys):
    write_corpus(tmp_path / "a.txt")
    out = tmp_path / "shards"
    pattern = str(tmp_path / "*.txt")
    assert shards(tokenizer, out, pattern) == 0
    write_corpus(tmp_path / "b.txt", word="beta")
    assert shards(tokenizer, out, pattern) == 2
    line = error_line(capsys)
    assert str(tmp_path / "b.txt") in line and "added" in line


def test_input_changed_between_jobs_is_refused(tokenizer, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "shards"
    jobs = ("--num-jobs", 2, "--job-index")
    assert shards(tokenizer, out, corpus, extra=(*jobs, 0)) == 0
    write_corpus(corpus, word="delta")
    assert shards(tokenizer, out, corpus, extra=(*jobs, 1)) == 2
    assert str(corpus) in error_line(capsys)
    assert not (out / fmt.done_file(fmt.shard_name(1))).exists()


def test_input_changed_while_read_is_refused(tokenizer, tmp_path, monkeypatch):
    from data_prep import shards as shards_mod

    corpus = write_corpus(tmp_path / "corpus.txt")
    real_run = shards_mod._run

    def run_then_append(*args):  # a download or an edit still going on
        real_run(*args)
        with open(corpus, "a") as f:
            f.write("\na late document\n")

    monkeypatch.setattr(shards_mod, "_run", run_then_append)
    out = tmp_path / "shards"
    config = shards_mod.ShardConfig(inputs=(str(corpus),), num_shards=2, max_seq_length=32)
    with pytest.raises(fmt.ShardError, match=r"corpus\.txt changed while it was being read"):
        shards_mod.build_shards(config, tokenizer, out)
    assert not (out / fmt.MANIFEST).exists()


def test_fingerprints_of_embedded_and_hf_directories(tmp_path):
    from data_prep.readers import fingerprint_inputs

    a, b = fingerprint_inputs(["embedded:3", "embedded:4"])
    assert a["mtime_ns"] is None and a["sha256"] != b["sha256"] and a["size"] < b["size"]
    assert fingerprint_inputs(["embedded:3"]) == [a]
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "state.json").write_text("{}")
    (hf / "data-00000-of-00001.arrow").write_bytes(b"x" * 100)
    before = fingerprint_inputs([str(hf)])[0]
    assert before["size"] == 102
    (hf / "data-00000-of-00001.arrow").write_bytes(b"y" * 100)
    after = fingerprint_inputs([str(hf)])[0]
    assert after["size"] == 102 and after["sha256"] != before["sha256"]


def test_manifest_records_the_input_fingerprint(tokenizer, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "shards"
    assert shards(tokenizer, out, corpus) == 0
    (entry,) = fmt.read_manifest(out)["input_files"]
    assert entry == {
        "path": str(corpus),
        "size": corpus.stat().st_size,
        "mtime_ns": corpus.stat().st_mtime_ns,
        "sha256": fmt.sha256_file(corpus),
    }


# ----------------------------------------------------------------------------- vocab size


@pytest.mark.parametrize(
    ("kind", "vocab_size"),
    [
        ("unigram", 10),  # the library's own check fails (fewer ids than characters)
        ("unigram", 70),  # the library returns more entries than asked
        ("wordpiece", 10),  # the library silently returns the whole alphabet
    ],
)
def test_too_small_vocab_size_is_a_user_error(tmp_path, capsys, kind, vocab_size):
    from tokenizers import Tokenizer

    out = tmp_path / "tok"
    args = ("tokenizer", "--input", "embedded:12", "--out", out, "--kind", kind)
    assert run_cli(*args, "--vocab-size", vocab_size) == 2
    line = error_line(capsys)
    assert f"--vocab-size {vocab_size} is too small for this corpus" in line
    minimum = int(re.search(r"needs at least (\d+)", line).group(1))
    assert minimum > vocab_size
    assert not out.exists()  # nothing written
    # The minimum it names is enough, and honoured exactly; one less is refused.
    assert run_cli(*args, "--vocab-size", minimum - 1) == 2
    assert f"needs at least {minimum}" in error_line(capsys)
    assert run_cli(*args, "--vocab-size", minimum) == 0
    assert Tokenizer.from_file(str(out / fmt.TOKENIZER)).get_vocab_size() == minimum


def test_vocab_size_below_the_special_tokens_is_refused_before_reading(tmp_path, capsys):
    out = tmp_path / "tok"
    assert (
        run_cli("tokenizer", "--input", tmp_path / "missing.txt", "--out", out, "--vocab-size", 5)
        == 2
    )
    assert "--vocab-size 5 is too small" in error_line(capsys)  # before the missing input


# ----------------------------------------------------------------------------- undecodable input


def test_mostly_undecodable_input_is_warned_about(tokenizer, tmp_path, caplog):
    lines = [
        (b"caf\xe9 au lait line %d" if i % 25 < 11 else b"a clean line %d") % i for i in range(100)
    ]  # 44 of 100 lines are Latin-1, not UTF-8
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    clean = write_corpus(tmp_path / "clean.txt")
    with caplog.at_level(logging.WARNING):
        assert shards(tokenizer, tmp_path / "shards", bad, clean) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    mine = [w for w in warnings if "44 of 100 lines (44.0%)" in w]
    assert len(mine) == 1, warnings
    assert str(bad) in mine[0] and "invalid UTF-8" in mine[0]
    assert not [w for w in warnings if str(clean) in w]
    assert fmt.read_manifest(tmp_path / "shards")["input"]["replaced_characters"] == 44


def test_clean_input_is_not_warned_about(tmp_path, caplog):
    clean = write_corpus(tmp_path / "clean.txt")
    with caplog.at_level(logging.WARNING):
        docs = list(iter_documents([str(clean)]))
    assert len(docs) == 8
    assert not [r for r in caplog.records if r.name == "data_prep.readers"]


# ----------------------------------------------------------------------------- corrupt token id


def corrupt_one_id(shard_dir: Path, shard: int, position: int, value: int) -> Path:
    """Overwrites one token id in place (same file size: only a checksum would notice)."""
    path = shard_dir / fmt.tokens_file(fmt.shard_name(shard))
    size = path.stat().st_size
    tokens = np.load(path, mmap_mode="r+")
    tokens[position] = value
    tokens.flush()
    del tokens
    assert path.stat().st_size == size
    return path


def test_corrupt_token_id_without_checksums_names_the_shard(tmp_path):
    shard_dir = write_shard_dir(tmp_path / "s", examples=(10, 10))
    index = np.load(shard_dir / fmt.index_file(fmt.shard_name(1)))
    off, la, _ = index[4].tolist()  # example 4 of shard 1: global example 14
    bad = corrupt_one_id(shard_dir, 1, off + la, 60000)
    data = PretrainingData(shard_dir, 64, verify_checksums=False)
    for i in range(14):
        data[i]  # the examples before it are fine
    message = (
        rf"{bad.name}: token id 60000 at position {off + la} \(example 4 of the shard\) is >= "
        rf"the vocabulary size {len(VOCAB)}: the shard is corrupt"
    )
    with pytest.raises(fmt.ShardError, match=message) as e:
        data[14]
    assert "inspect" in str(e.value) and "--verify" in str(e.value)
    with pytest.raises(fmt.ShardError, match=message):
        data.segments(14)
    with pytest.raises(fmt.ShardError, match=bad.name):  # and through the loader
        for _ in PretrainingLoader(data, 4, num_epochs=1):
            pass
    with pytest.raises(fmt.ShardError, match="is corrupt"):  # a checksum catches it up front
        PretrainingData(shard_dir, 64, verify_checksums=True)


def test_negative_token_id_in_a_signed_shard(tmp_path):
    shard_dir = write_shard_dir(tmp_path / "s", examples=(10,))
    path = shard_dir / fmt.tokens_file(fmt.shard_name(0))
    tokens = np.load(path).astype(np.int32)
    tokens[3] = -7
    fmt.atomic_save_npy(path, tokens)
    with pytest.raises(fmt.ShardError, match=r"token id -7 at position 3 \(example 0 of the"):
        PretrainingData(shard_dir, 64)[0]
