"""Tokenizer training, ALBERT example building, sharding (determinism, multi-job + finalize,
resume, refusing another config), manifest and inspect, all through `python -m data_prep`."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_prep import format as fmt
from data_prep.__main__ import main
from data_prep.readers import iter_documents
from data_prep.shards import build_examples

CORPUS = "embedded:12"  # a small slice of the embedded corpus keeps every test fast
MAX_SEQ = 64
SHARDS = 3


def run_cli(*argv: str) -> int:
    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    assert run_cli("tokenizer", "--input", CORPUS, "--out", out, "--vocab-size", 400) == 0
    return out / fmt.TOKENIZER


def shards_cmd(tokenizer: Path, out: Path, *extra) -> int:
    return run_cli(
        "shards",
        "--input",
        CORPUS,
        "--tokenizer",
        tokenizer,
        "--out",
        out,
        "--num-shards",
        SHARDS,
        "--max-seq-length",
        MAX_SEQ,
        *extra,
    )


@pytest.fixture(scope="module")
def built(tokenizer, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "single"
    assert shards_cmd(tokenizer, out) == 0
    return out


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def examples_of(shard_dir: Path, name: str) -> list[tuple[list[int], list[int]]]:
    tokens, index = fmt.open_shard(shard_dir, name)
    return [
        (tokens[o : o + a].tolist(), tokens[o + a : o + a + b].tolist())
        for o, a, b in index.tolist()
    ]


# ----------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("kind", ["unigram", "wordpiece"])
def test_trained_tokenizer_special_ids_template_and_round_trip(tmp_path, kind):
    from tokenizers import Tokenizer

    assert (
        run_cli(
            "tokenizer", "--input", CORPUS, "--out", tmp_path, "--kind", kind, "--vocab-size", 300
        )
        == 0
    )
    tok = Tokenizer.from_file(str(tmp_path / fmt.TOKENIZER))
    for i, token in enumerate(fmt.ALBERT_SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i
    assert fmt.SpecialTokens.from_tokenizer(tok) == fmt.SpecialTokens(0, 1, 2, 3, 4)
    assert tok.get_vocab_size() == 300
    assert json.loads((tmp_path / fmt.TOKENIZER).read_text())["model"]["type"].lower() == kind

    text = "The assert statement is a convenient way to insert debugging assertions"
    enc = tok.encode(text, add_special_tokens=False)
    assert "".join(tok.decode(enc.ids).split()) == "".join(text.lower().split())
    assert tok.token_to_id("<unk>") not in enc.ids
    pair = tok.encode("first part", "second part")
    assert pair.ids[0] == 2 and pair.ids[-1] == 3 and pair.ids.count(3) == 2
    sep = pair.ids.index(3)
    assert pair.type_ids == [0] * (sep + 1) + [1] * (len(pair.ids) - sep - 1)


def test_tokenizer_refuses_to_overwrite(tmp_path, capsys):
    args = ["tokenizer", "--input", "embedded:3", "--out", tmp_path, "--vocab-size", 200]
    assert run_cli(*args) == 0
    before = (tmp_path / fmt.TOKENIZER).read_bytes()
    assert run_cli(*args[:-1], 250) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / fmt.TOKENIZER).read_bytes() == before
    assert run_cli(*args[:-1], 250, "--overwrite") == 0
    assert (tmp_path / fmt.TOKENIZER).read_bytes() != before


def test_from_tokenizer_copies_and_validates(tmp_path, tokenizer, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert run_cli("tokenizer", "--from-tokenizer", tokenizer, "--out", tmp_path / "ok") == 0
    assert (tmp_path / "ok" / fmt.TOKENIZER).read_bytes() == tokenizer.read_bytes()

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "hello": 4, "world": 5}
    no_mask = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    no_mask.pre_tokenizer = pre_tokenizers.Whitespace()
    no_mask.save(str(tmp_path / "nomask.json"))
    assert (
        run_cli(
            "tokenizer", "--from-tokenizer", tmp_path / "nomask.json", "--out", tmp_path / "bad"
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "error:" in err and "nomask.json" in err and "mask ([MASK] or <mask>)" in err
    assert not (tmp_path / "bad" / fmt.TOKENIZER).exists()


def test_max_sentences_limits_training_input():
    from data_prep.tokenizer import _sentences

    batches = list(_sentences(iter([["a", "b"], ["c", "d", "e"], ["f"]]), 4))
    assert batches == [["a", "b"], ["c", "d"]]


# ----------------------------------------------------------------------------- examples


def test_build_examples_respects_max_length_and_keeps_order():
    rng = random.Random(0)
    sentences = [list(range(i * 100, i * 100 + rng.randint(1, 30))) for i in range(300)]
    stream = [t for s in sentences for t in s]
    examples, dropped = build_examples(sentences, 61, 0.1, random.Random(1))
    assert len(examples) > 50
    pos = 0
    for a, b in examples:
        assert a and b and len(a) + len(b) <= 61
        # A then B: contiguous runs of the document, in order, B after A (a gap = truncation).
        i = stream.index(a[0], pos)
        assert stream[i : i + len(a)] == a
        j = stream.index(b[0], i + len(a))
        assert stream[j : j + len(b)] == b
        pos = j + len(b)
    kept = sum(len(a) + len(b) for a, b in examples)
    assert kept + dropped == len(stream)


def test_long_sentence_is_cut_and_loses_nothing():
    sentence = list(range(1000))  # one JSONL line much longer than the target
    examples, dropped = build_examples([sentence], 61, 0.0, random.Random(0))
    assert dropped == 0
    assert [t for a, b in examples for t in a + b] == sentence
    assert all(len(a) + len(b) == 61 for a, b in examples[:-1])
    # Before it, a shorter sentence: the long one first fills the open chunk to the target.
    examples, dropped = build_examples(
        [list(range(5000, 5020)), sentence], 61, 0.0, random.Random(0)
    )
    assert dropped == 0 and sum(len(a) + len(b) for a, b in examples) == 1020


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_short_seq_probability_roughly_respected(p):
    sentences = [[7] * 5 for _ in range(4000)]
    examples, _ = build_examples(sentences, 61, p, random.Random(123))
    lengths = np.array([len(a) + len(b) for a, b in examples])
    short = float(np.mean(lengths < 56))  # a target <= 51 always gives < 56 tokens
    if p == 0.0:
        assert (lengths[:-1] == 61).all()
    elif p == 1.0:
        assert short > 0.75
    else:  # expected between 0.82 p (targets <= 51) and 0.9 p
        assert 0.82 * p - 0.07 < short < 0.9 * p + 0.07, short


def test_one_token_chunk_is_dropped_and_counted():
    examples, dropped = build_examples([[5]], 61, 0.0, random.Random(0))
    assert examples == [] and dropped == 1


# ----------------------------------------------------------------------------- shards


def test_shards_content_and_manifest(built, tokenizer):
    from tokenizers import Tokenizer

    manifest = fmt.read_manifest(built)
    fmt.verify_shards(built, manifest)
    fmt.verify_tokenizer(built, tokenizer)
    assert manifest["tokenizer_sha256"] == fmt.sha256_file(tokenizer)
    assert manifest["tokenizer_kind"] == "unigram"
    assert manifest["special_tokens"] == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert manifest["vocab_size"] == 400
    assert manifest["num_shards"] == SHARDS and len(manifest["shards"]) == SHARDS
    assert manifest["config"]["max_seq_length"] == MAX_SEQ
    assert manifest["config"]["inputs"] == [CORPUS]
    assert manifest["input"]["documents"] == 12 == manifest["totals"]["documents"]
    assert manifest["input"]["files"] == [CORPUS]

    tok = Tokenizer.from_file(str(tokenizer))
    docs = list(iter_documents([CORPUS]))
    total_examples = total_tokens = 0
    for s, shard in enumerate(manifest["shards"]):
        tokens, index = fmt.open_shard(built, shard["name"])
        assert tokens.dtype == np.uint16 and index.dtype == np.int64
        assert index.shape == (shard["examples"], 3) and tokens.size == shard["tokens"]
        total_examples += shard["examples"]
        total_tokens += shard["tokens"]
        # Oracle: this shard's documents (d % S == s), tokenized sentence by sentence.
        streams, texts = [], []
        for doc in docs[s::SHARDS]:
            ids = [i for enc in tok.encode_batch(doc, add_special_tokens=False) for i in enc.ids]
            streams.append("," + ",".join(map(str, ids)) + ",")
            texts.append("".join(tok.normalizer.normalize_str(" ".join(doc)).split()))
        examples = examples_of(built, shard["name"])
        assert examples
        for k, (a, b) in enumerate(examples):
            assert a and b and len(a) + len(b) <= MAX_SEQ - 3
            a_s, b_s = "," + ",".join(map(str, a)) + ",", "," + ",".join(map(str, b)) + ","
            assert any(_a_then_b(stream, a_s, b_s) for stream in streams), (s, k)
            if k % 10 == 0:  # decoded text is text of one of the shard's documents
                decoded = "".join((tok.decode(a) + tok.decode(b)).split())
                assert any("".join(tok.decode(a).split()) in t for t in texts)
                assert decoded
    assert manifest["totals"]["examples"] == total_examples
    assert manifest["totals"]["tokens"] == total_tokens


def _a_then_b(stream: str, a: str, b: str) -> bool:
    """B occurs after some occurrence of A in the comma-joined id stream."""
    start = stream.find(a)
    while start != -1:
        if stream.find(b, start + len(a) - 1) != -1:
            return True
        start = stream.find(a, start + 1)
    return False


def test_workers_do_not_change_bytes(built, tokenizer, tmp_path):
    assert shards_cmd(tokenizer, tmp_path / "w2", "--workers", 2) == 0
    assert dir_bytes(tmp_path / "w2") == dir_bytes(built)


def test_two_jobs_then_finalize_equals_single_run(built, tokenizer, tmp_path, capsys):
    out = tmp_path / "jobs"
    assert shards_cmd(tokenizer, out, "--job-index", 1, "--num-jobs", 2) == 0
    assert not (out / fmt.MANIFEST).exists()
    assert sorted(p.name for p in out.glob("*.done.json")) == ["shard_00001.done.json"]
    assert run_cli("finalize", "--out", out) == 2
    assert "2 of 3 shards are not done (shard_00000, shard_00002)" in capsys.readouterr().err
    assert shards_cmd(tokenizer, out, "--job-index", 0, "--num-jobs", 2) == 0
    assert not (out / fmt.MANIFEST).exists()
    assert run_cli("finalize", "--out", out) == 0
    assert (out / fmt.MANIFEST).read_bytes() == (built / fmt.MANIFEST).read_bytes()
    assert dir_bytes(out) == dir_bytes(built)


def test_resume_rebuilds_only_the_crashed_shard(built, tokenizer, tmp_path):
    import shutil

    out = tmp_path / "resume"
    shutil.copytree(built, out)
    # Simulated crash in shard 1: arrays written (one of them), no done-record yet.
    (out / "shard_00001.done.json").unlink()
    (out / "shard_00001.tokens.npy").unlink()
    (out / fmt.MANIFEST).unlink()
    others = [p for p in out.iterdir() if not p.name.startswith("shard_00001")]
    mtimes = {p.name: p.stat().st_mtime_ns for p in others}
    assert shards_cmd(tokenizer, out) == 0
    for p in others:
        if p.name != fmt.MANIFEST:
            assert p.stat().st_mtime_ns == mtimes[p.name], f"{p.name} was rewritten"
    assert dir_bytes(out) == dir_bytes(built)
    # Nothing left to do: a re-run rewrites no shard.
    mtime = (out / "shard_00001.index.npy").stat().st_mtime_ns
    assert shards_cmd(tokenizer, out) == 0
    assert (out / "shard_00001.index.npy").stat().st_mtime_ns == mtime


def test_corrupt_done_shard_is_rebuilt(built, tokenizer, tmp_path, caplog):
    import shutil

    out = tmp_path / "corrupt"
    shutil.copytree(built, out)
    path = out / "shard_00002.tokens.npy"
    path.write_bytes(path.read_bytes()[:-10])
    assert shards_cmd(tokenizer, out) == 0
    assert "does not match shard_00002.done.json: rebuilding" in caplog.text
    assert dir_bytes(out) == dir_bytes(built)


def test_refuses_a_directory_made_with_another_config_or_tokenizer(
    built, tokenizer, tmp_path, capsys
):
    import shutil

    out = tmp_path / "other"
    shutil.copytree(built, out)
    before = dir_bytes(out)
    assert shards_cmd(tokenizer, out, "--seed", 1) == 2
    err = capsys.readouterr().err
    assert "different config" in err and "seed: 0 there vs 1 now" in err
    assert shards_cmd(tokenizer, out, "--num-shards", 4) == 2  # the last --num-shards wins
    assert "num_shards: 3 there vs 4 now" in capsys.readouterr().err

    other_tok = tmp_path / "tok2"
    assert run_cli("tokenizer", "--input", CORPUS, "--out", other_tok, "--vocab-size", 350) == 0
    assert shards_cmd(other_tok / fmt.TOKENIZER, out) == 2
    assert "different tokenizer" in capsys.readouterr().err
    assert dir_bytes(out) == before  # nothing was touched


def test_input_problems_are_reported(tokenizer, tmp_path, capsys):
    assert (
        run_cli(
            "shards",
            "--input",
            tmp_path / "missing.txt",
            "--tokenizer",
            tokenizer,
            "--out",
            tmp_path / "o",
            "--num-shards",
            2,
        )
        == 2
    )
    assert "error: input file" in capsys.readouterr().err

    text = tmp_path / "corpus.txt"
    body = "\n\n".join(
        " ".join(["a sentence of text"] * 3) + "\nand a second line" for _ in range(6)
    )
    text.write_bytes(b"bad \xff byte here\n" + ("x" * 80).encode() + b"\n" + body.encode())
    assert (
        run_cli(
            "shards",
            "--input",
            text,
            "--tokenizer",
            tokenizer,
            "--out",
            tmp_path / "o",
            "--num-shards",
            2,
            "--max-line-chars",
            60,
        )
        == 0
    )
    manifest = fmt.read_manifest(tmp_path / "o")
    assert manifest["input"]["replaced_characters"] == 1
    assert manifest["input"]["skipped"]["long_lines"] == 1
    assert manifest["input"]["documents"] == 6


def test_bad_settings_are_user_errors(tokenizer, tmp_path, capsys):
    for flags, message in (
        (("--max-seq-length", 4), "--max-seq-length must be >= 5"),
        (("--short-seq-prob", 1.5), "--short-seq-prob must be in [0, 1]"),
        (("--job-index", 2, "--num-jobs", 2), "need 0 <= --job-index < --num-jobs"),
        (("--workers", 0), "--workers must be >= 1"),
    ):
        assert shards_cmd(tokenizer, tmp_path / "o", *flags) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o" / fmt.MANIFEST).exists()


def test_inspect_and_verify(built, tmp_path, capsys):
    import shutil

    assert run_cli("inspect", built, "--verify", "--samples", 2) == 0
    out = capsys.readouterr().out
    assert "verify: OK" in out and "example length" in out
    assert out.count("  A: ") == 2 and out.count("  B: ") == 2
    assert f"{SHARDS} shards" in out

    bad = tmp_path / "bad"
    shutil.copytree(built, bad)
    path = bad / "shard_00001.tokens.npy"
    path.write_bytes(path.read_bytes()[:-64])  # truncated
    assert run_cli("inspect", bad, "--verify") == 2
    err = capsys.readouterr().err
    assert "shard_00001.tokens.npy is corrupt or truncated" in err
    assert run_cli("inspect", bad) == 2  # even without --verify: a clear error, no traceback
    assert "shard_00001.tokens.npy" in capsys.readouterr().err


def test_every_subcommand_has_help(capsys):
    for cmd in ("tokenizer", "shards", "finalize", "inspect", "listops"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert "usage: python -m data_prep " + cmd in capsys.readouterr().out
    res = subprocess.run(
        [sys.executable, "-m", "data_prep", "--help"], capture_output=True, text=True
    )
    assert res.returncode == 0 and "shards" in res.stdout
