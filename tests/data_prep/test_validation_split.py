"""The held-out validation split (`data_prep shards --validation-fraction F` /
`--validation-documents N`) and its loader side (`PretrainingData(split="validation")`,
`validation_batches`): held out by document, deterministic for any --workers and job split,
reported and checksummed in the manifest; the default output unchanged byte for byte."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep import format as fmt
from data_prep.__main__ import main
from data_prep.loader import (
    PretrainingData,
    PretrainingLoader,
    validation_batches,
    validation_indices,
)
from data_prep.masking import MaskingConfig
from data_prep.readers import iter_documents
from data_prep.shards import ShardConfig, build_examples, choose_validation, document_rng

CORPUS = "embedded:30"
DOCS = 30
MAX_SEQ = 64
SHARDS = 3
FRACTION = 0.3


def run_cli(*argv: object) -> int:
    return main([str(a) for a in argv])


def shards_cmd(tokenizer: Path, out: Path, *extra: object, corpus: str = CORPUS) -> int:
    return run_cli(
        "shards",
        "--input",
        corpus,
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


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def examples_of(shard_dir: Path, name: str) -> list[tuple[list[int], list[int]]]:
    tokens, index = fmt.open_shard(shard_dir, name)
    return [
        (tokens[o : o + a].tolist(), tokens[o + a : o + a + b].tolist())
        for o, a, b in index.tolist()
    ]


def key(seed: int, d: int) -> int:
    """format.py's documented rule, written out again."""
    h = hashlib.blake2b(f"{seed}:{d}".encode(), digest_size=8, person=b"validation")
    return int.from_bytes(h.digest(), "big")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    assert run_cli("tokenizer", "--input", "embedded:12", "--out", out, "--vocab-size", 400) == 0
    return out / fmt.TOKENIZER


@pytest.fixture(scope="module")
def split_dir(tokenizer, tmp_path_factory) -> Path:
    """Fraction split, V = 2 validation shards, one job, one worker: the reference bytes."""
    out = tmp_path_factory.mktemp("split") / "ref"
    assert (
        shards_cmd(tokenizer, out, "--validation-fraction", FRACTION, "--validation-shards", 2) == 0
    )
    return out


@pytest.fixture(scope="module")
def no_split_dir(tokenizer, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nosplit") / "ref"
    assert shards_cmd(tokenizer, out) == 0
    return out


# ----------------------------------------------------------------------------- the default


def fixed_tokenizer(path: Path) -> Path:
    """A word-level tokenizer built, not trained (training is not byte-deterministic): the same
    tokenizer.json bytes every time for one `tokenizers` version."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    docs = list(iter_documents(["embedded:12"]))[:6]
    words = sorted({w for doc in docs for s in doc for w in s.lower().split()})
    vocab = {t: i for i, t in enumerate([*fmt.ALBERT_SPECIAL_TOKENS, *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(fmt.ALBERT_SPECIAL_TOKENS))
    tok.save(str(path))
    return path


# sha256 of every file `shards --input embedded:12 --num-shards 3 --max-seq-length 64 [EXTRA]`
# wrote with the code before the validation split existed (commit 5d17286's data_prep), with
# `fixed_tokenizer` (tokenizers 0.23.3, numpy 2.4.6).
BEFORE_TOKENIZER = "f2bcf8e6b37d4bdfeeeaa643186d3f1f83010eff733a1a58c374cf8672eead5a"
BEFORE = {
    "": {
        "manifest.json": "b674e30ab97da9ead60017af39abe48235640a2180c58b7a2d15fdd7a9bf1112",
        "shard_00000.done.json": "13fb2968f050cdd607fa2187f362f78c6173f7fbd0d8e7c324196f5f366c9ee2",
        "shard_00000.index.npy": "dc74fe6ea798c5a3492c1804c6c04f9a685036a65f823045a3edfc8ed7266d27",
        "shard_00000.tokens.npy": "91a65fb47782be8ae405fe6318c926de279e9b623df869e1d421b727a87e30da",
        "shard_00001.done.json": "d62eec3b8e2a4be188e5220b0cba1f6ff2f71dc7b3568baa97af06e497695c29",
        "shard_00001.index.npy": "4b02ca45180826ac34cc0b3f9a3fb1d2d63ce832652ba34344903ebf857f9783",
        "shard_00001.tokens.npy": "c05ee65993fbeaa3b7296075888f39a27057f8e3bbd76a7a4062d0027fc72252",
        "shard_00002.done.json": "4cf6d74f3d70f0356853c8889840ac41586ecc88f330b0ede6075278bb30dc98",
        "shard_00002.index.npy": "e45efbc5dde0cd05d6dfb5b35229c68ae0b15043f19d31c30311577f81b5726a",
        "shard_00002.tokens.npy": "9b57e0dea45ec34c04fc40652b5e2127936bf20612c02ba796611e8022309996",
        "tokenizer.json": BEFORE_TOKENIZER,
    },
    "--truncation junction --seed 2 --short-seq-prob 0.3": {
        "manifest.json": "d8a714ef2356f4e17be3135d877c8037491bc412b5003f1fc920811fc29aa29f",
        "shard_00000.done.json": "b9657999fd4d4f8277f99a354bb6d5c8a95c8505d655d11a65e17150c9dd4841",
        "shard_00000.index.npy": "4ceaa4e19e2af0134272f024bccc2fc7512515a5e90a6f740f0a443d702b5e90",
        "shard_00000.tokens.npy": "04cdb08ddb55cb3cfae82e8b9df8af550a7f1707c0fe0bcca519acfd78f25eed",
        "shard_00001.done.json": "da8d27ae874ab4f92514ea6127b056f44cab125d5b15082f395c4e59990905f9",
        "shard_00001.index.npy": "726de6385fc384b1f8bde34f5cfbcd1e20ec9b7cd3c813c51afb8a555fdc6726",
        "shard_00001.tokens.npy": "86825707c48edc2092b667ae37b116b3fd8a60b121c9007b1db0673d49d601c8",
        "shard_00002.done.json": "23414460ea7a544dcafecf890fb82fc53451f908982d068d0b5e82258aae65c4",
        "shard_00002.index.npy": "600a9613bab55310b8176335d47bb4c62a3e4c92bef49ab371205643d669799d",
        "shard_00002.tokens.npy": "712bf59e881e888de4646bab17fd93e7f00ca68dc03f4751e2280416b5d8b7b2",
        "tokenizer.json": BEFORE_TOKENIZER,
    },
}


def test_default_output_is_byte_identical_to_before(tmp_path):
    tokenizer = fixed_tokenizer(tmp_path / "tokenizer.json")
    if fmt.sha256_file(tokenizer) != BEFORE_TOKENIZER:
        pytest.skip("another tokenizers version serialises the tokenizer otherwise: no reference")
    for k, (extra, want) in enumerate(BEFORE.items()):
        for flags in ((), ("--validation-fraction", 0), ("--validation-documents", 0)):
            out = tmp_path / f"{k}{len(flags)}{flags[:1]}"
            assert shards_cmd(tokenizer, out, *extra.split(), *flags, corpus="embedded:12") == 0
            got = {n: hashlib.sha256(b).hexdigest() for n, b in dir_bytes(out).items()}
            assert got == want, (extra, flags)
        assert run_cli("inspect", out, "--verify", "--samples", 0) == 0


def test_no_flag_config_and_manifest_have_no_validation_keys(no_split_dir):
    manifest = fmt.read_manifest(no_split_dir)
    assert fmt.VALIDATION_KEY not in manifest
    assert not any(k.startswith("validation") for k in manifest["config"])
    assert not list(no_split_dir.glob("valid_*"))
    cfg = ShardConfig(inputs=("x",), num_shards=2)
    assert (
        cfg.to_dict() == ShardConfig(inputs=("x",), num_shards=2, validation_fraction=0).to_dict()
    )


# ----------------------------------------------------------------------------- the split


def oracle(tokenizer: Path, seed: int = 0) -> dict[int, list]:
    """Each document's examples, built as the shards stage builds them (by document index)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    out = {}
    for d, doc in enumerate(iter_documents([CORPUS])):
        ids = [e.ids for e in tok.encode_batch(doc, add_special_tokens=False)]
        out[d], _ = build_examples(ids, MAX_SEQ - 3, 0.1, document_rng(seed, d))
    return out


def test_split_is_by_document_and_training_documents_are_unchanged(
    split_dir, no_split_dir, tokenizer
):
    held = {d for d in range(DOCS) if key(0, d) < int(FRACTION * 2**64)}
    assert 0 < len(held) < DOCS
    per_doc = oracle(tokenizer)
    # The oracle is the shards stage: without a split it gives the no-split shards exactly.
    for s in range(SHARDS):
        want = [ex for d in range(s, DOCS, SHARDS) for ex in per_doc[d]]
        assert examples_of(no_split_dir, fmt.shard_name(s)) == want
    # With the split: training shard s = its documents minus the held-out ones, each with the
    # same examples as without a split; validation shard v = the held-out documents d % 2 == v.
    for s in range(SHARDS):
        want = [ex for d in range(s, DOCS, SHARDS) if d not in held for ex in per_doc[d]]
        assert examples_of(split_dir, fmt.shard_name(s)) == want
    for v in range(2):
        want = [ex for d in sorted(held) if d % 2 == v for ex in per_doc[d]]
        assert examples_of(split_dir, fmt.valid_name(v)) == want

    manifest = fmt.read_manifest(split_dir)
    section = manifest["validation"]
    assert section["selection"] == {
        "rule": "fraction",
        "fraction": FRACTION,
        "threshold": int(FRACTION * 2**64),
    }
    assert section["seed"] == 0 and section["num_shards"] == 2
    assert [s["name"] for s in section["shards"]] == ["valid_00000", "valid_00001"]
    assert "blake2b" in section["how"]
    held_examples = [ex for d in held for ex in per_doc[d]]
    assert section["totals"]["documents"] == len(held)
    assert section["totals"]["examples"] == len(held_examples)
    assert section["totals"]["tokens"] == sum(len(a) + len(b) for a, b in held_examples)
    assert manifest["totals"]["documents"] == DOCS - len(held)
    assert manifest["totals"]["documents"] + section["totals"]["documents"] == DOCS
    assert manifest["input"]["documents"] == DOCS
    for entry in section["shards"]:
        assert set(entry["sha256"]) == {
            fmt.tokens_file(entry["name"]),
            fmt.index_file(entry["name"]),
        }
        for fname, digest in entry["sha256"].items():
            assert fmt.sha256_file(split_dir / fname) == digest
    assert manifest["config"]["validation_fraction"] == FRACTION
    assert manifest["config"]["validation_shards"] == 2
    assert "validation_documents" not in manifest["config"]


def test_same_bytes_for_any_workers_and_job_split(split_dir, tokenizer, tmp_path, capsys):
    flags = ("--validation-fraction", FRACTION, "--validation-shards", 2)
    assert shards_cmd(tokenizer, tmp_path / "w2", *flags, "--workers", 2) == 0
    assert dir_bytes(tmp_path / "w2") == dir_bytes(split_dir)

    out = tmp_path / "jobs"
    assert shards_cmd(tokenizer, out, *flags, "--job-index", 1, "--num-jobs", 2) == 0
    assert sorted(p.name for p in out.glob("*.done.json")) == [
        "shard_00001.done.json",
        "valid_00001.done.json",
    ]
    assert run_cli("finalize", "--out", out) == 2
    err = capsys.readouterr().err
    assert "(shard_00000, shard_00002, valid_00000)" in err and "validation shard v" in err
    assert shards_cmd(tokenizer, out, *flags, "--job-index", 0, "--num-jobs", 2) == 0
    assert run_cli("finalize", "--out", out) == 0
    assert dir_bytes(out) == dir_bytes(split_dir)


def test_documents_mode_exact_count_deterministic_and_nested(tokenizer, tmp_path):
    n = 7
    assert shards_cmd(tokenizer, tmp_path / "one", "--validation-documents", n) == 0
    manifest = fmt.read_manifest(tmp_path / "one")
    section = manifest["validation"]
    assert section["totals"]["documents"] == n
    assert manifest["totals"]["documents"] == DOCS - n
    smallest = sorted((key(0, d), d) for d in range(DOCS))[:n]
    assert section["selection"] == {
        "rule": "documents",
        "documents": n,
        "threshold": list(smallest[-1]),
    }

    flags = ("--validation-documents", n)
    assert shards_cmd(tokenizer, tmp_path / "w2", *flags, "--workers", 2) == 0
    out = tmp_path / "jobs"
    for job in (0, 1):
        assert shards_cmd(tokenizer, out, *flags, "--job-index", job, "--num-jobs", 2) == 0
    assert run_cli("finalize", "--out", out) == 0
    assert dir_bytes(tmp_path / "w2") == dir_bytes(tmp_path / "one") == dir_bytes(out)

    def held(**kw) -> set[int]:
        split = choose_validation(ShardConfig(inputs=(CORPUS,), num_shards=3, **kw))
        return {d for d in range(DOCS) if split.held_out(d)}

    assert held(validation_documents=n) == {d for _, d in smallest}
    assert held(validation_documents=3) < held(validation_documents=n)
    assert held(validation_fraction=0.1) <= held(validation_fraction=0.3)
    assert held(validation_documents=n) != held(validation_documents=n, seed=1)
    assert len(held(validation_documents=n, seed=1)) == n


def test_resume_rebuilds_only_a_missing_validation_shard(split_dir, tokenizer, tmp_path):
    out = tmp_path / "resume"
    shutil.copytree(split_dir, out)
    (out / "valid_00001.done.json").unlink()
    (out / "valid_00001.tokens.npy").unlink()
    (out / fmt.MANIFEST).unlink()
    mtime = (out / "shard_00001.tokens.npy").stat().st_mtime_ns
    flags = ("--validation-fraction", FRACTION, "--validation-shards", 2)
    assert shards_cmd(tokenizer, out, *flags) == 0
    assert (out / "shard_00001.tokens.npy").stat().st_mtime_ns == mtime
    assert dir_bytes(out) == dir_bytes(split_dir)


# ----------------------------------------------------------------------------- errors


def test_bad_validation_sizes_are_user_errors_naming_the_flag(tokenizer, tmp_path, capsys):
    out = tmp_path / "o"
    never = next(f for f in (1e-6, 1e-7, 1e-8) if all(key(0, d) >= f * 2**64 for d in range(DOCS)))
    cases = (
        (("--validation-fraction", 1), "--validation-fraction must be in [0, 1), got 1.0: it "),
        (("--validation-fraction", -0.1), "--validation-fraction must be in [0, 1)"),
        (("--validation-documents", DOCS), f"--validation-documents {DOCS} leaves no training"),
        (("--validation-documents", 1000), "the input has 30 document(s)"),
        (("--validation-documents", -1), "--validation-documents must be an int >= 0"),
        (("--validation-fraction", never), "held out none of the 30 document(s)"),
        (("--validation-shards", 2), "--validation-shards 2 needs --validation-fraction"),
        (("--validation-fraction", 0.1, "--validation-shards", 0), "--validation-shards must"),
    )
    for flags, message in cases:
        assert shards_cmd(tokenizer, out, *flags) == 2, flags
        err = capsys.readouterr().err
        assert "error:" in err and message in err, (flags, err)
        assert not (out / fmt.MANIFEST).exists()
        assert not list(out.glob("*.done.json")), flags  # nothing half-made is left as done

    # A fraction that happens to hold out every document of a tiny input.
    all_out = next(
        f for f in (0.9, 0.95, 0.99, 0.999) if all(key(0, d) < f * 2**64 for d in range(2))
    )
    assert shards_cmd(tokenizer, out, "--validation-fraction", all_out, corpus="embedded:2") == 2
    assert "leaving no training documents" in capsys.readouterr().err
    assert not list(out.glob("*.done.json"))

    with pytest.raises(SystemExit) as e:  # argparse: the two flags exclude each other
        run_cli("shards", "--input", CORPUS, "--tokenizer", tokenizer, "--out", out,
                "--num-shards", 2, "--validation-fraction", 0.1, "--validation-documents", 3)  # fmt: skip
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_split_cannot_be_added_to_a_directory_made_without(
    no_split_dir, tokenizer, tmp_path, capsys
):
    out = tmp_path / "d"
    shutil.copytree(no_split_dir, out)
    before = dir_bytes(out)
    assert shards_cmd(tokenizer, out, "--validation-fraction", FRACTION) == 2
    err = capsys.readouterr().err
    assert "different config" in err and "validation_fraction: None there vs 0.3 now" in err
    assert dir_bytes(out) == before


def test_inspect_and_checksums_cover_the_validation_files(split_dir, tmp_path, capsys):
    assert run_cli("inspect", split_dir, "--verify", "--samples", 0) == 0
    out = capsys.readouterr().out
    assert "validation: 2 shard(s)" in out and "verify: OK" in out

    bad = tmp_path / "bad"
    shutil.copytree(split_dir, bad)
    path = bad / "valid_00001.tokens.npy"
    path.write_bytes(path.read_bytes()[:-8])
    assert run_cli("inspect", bad, "--verify") == 2
    assert "valid_00001.tokens.npy is corrupt or truncated" in capsys.readouterr().err
    with pytest.raises(fmt.ShardError, match=r"valid_00001\.tokens\.npy is corrupt"):
        PretrainingData(bad, MAX_SEQ, split="validation", verify_checksums=True)
    with pytest.raises(fmt.ShardError, match=r"valid_00001\.tokens\.npy is corrupt"):
        fmt.verify_shards(bad)
    # The training split's own check reads the training files only.
    PretrainingData(bad, MAX_SEQ, verify_checksums=True)


# ----------------------------------------------------------------------------- the loader


def batches_equal(xs: list[dict], ys: list[dict]) -> bool:
    return len(xs) == len(ys) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(xs, ys)
    )


def test_validation_data_reads_the_held_out_examples(split_dir):
    valid = PretrainingData(split_dir, MAX_SEQ, seed=3, split="validation", verify_checksums=True)
    train = PretrainingData(split_dir, MAX_SEQ, seed=3, verify_checksums=True)
    manifest = fmt.read_manifest(split_dir)
    assert len(valid) == manifest["validation"]["totals"]["examples"]
    assert len(train) == manifest["totals"]["examples"]
    raw = [ex for v in range(2) for ex in examples_of(split_dir, fmt.valid_name(v))]
    assert [tuple(x.tolist() for x in valid.segments(i)) for i in range(len(valid))] == raw
    assert valid.fingerprint()["split"] == "validation"
    assert "split" not in train.fingerprint()  # training loader states are as before
    # The training loader over a split directory still works as before.
    batch = next(iter(PretrainingLoader(train, batch_size=4)))
    assert batch["input_ids"].shape[0] == 4


def test_validation_batches_are_fixed_and_shared_out_across_ranks(split_dir):
    data = PretrainingData(split_dir, MAX_SEQ, seed=5, split="validation")
    n = len(data)
    first = validation_batches(data, batch_size=4)
    data.epoch = 7  # the training epoch counter plays no part
    again = validation_batches(data, batch_size=4)
    other = validation_batches(PretrainingData(split_dir, MAX_SEQ, seed=5, split="validation"), 4)
    assert batches_equal(first, again) and batches_equal(first, other)
    assert sum(b["input_ids"].shape[0] for b in first) == n

    # Masks are epoch-0 ones of their own key space: not the training key space's.
    i = int(validation_indices(n, 4, None, 0, 1, 5)[0][0])
    a, b = data._segments(i)
    train_rng = np.random.default_rng(np.random.SeedSequence([5, 0, i]))
    assert not np.array_equal(data.build(a, b, train_rng)["labels"], data[(0, i)]["labels"])

    for world, max_batches in ((3, None), (4, None), (2, 2), (3, 1), (n + 2, None)):
        per_rank = [validation_indices(n, 4, max_batches, r, world, 5) for r in range(world)]
        flat = [int(i) for rank in per_rank for idx in rank for i in idx]
        chosen = n if max_batches is None else min(n, max_batches * 4 * world)
        assert len(flat) == len(set(flat)) == chosen  # disjoint, none lost
        assert set(flat) <= set(range(n))
        counts = [len(r) for r in per_rank]
        assert max(counts) - min(counts) <= 1
        if max_batches is not None:
            assert max(counts) <= max_batches
    # The batches are those indices' examples: every rank's tensors built from data[(0, i)].
    ranks = [validation_batches(data, 4, None, r, 3) for r in range(3)]
    assert sum(b["input_ids"].shape[0] for rank in ranks for b in rank) == n
    for r, batches in enumerate(ranks):
        for idx, batch in zip(validation_indices(n, 4, None, r, 3, 5), batches):
            ex = data[(0, int(idx[0]))]
            k = len(ex["input_ids"])
            assert torch.equal(batch["input_ids"][0, :k], torch.from_numpy(ex["input_ids"]))
            assert torch.equal(batch["mlm_labels"][0, :k], torch.from_numpy(ex["labels"]))
    # A cap samples across the permutation, and static shapes pad to max_seq_length.
    capped = validation_batches(data, 4, max_batches=1, rank=1, world_size=2, static_shapes=True)
    assert len(capped) == 1 and capped[0]["input_ids"].shape == (4, MAX_SEQ)
    static = PretrainingData(
        split_dir, MAX_SEQ, MaskingConfig(static_masked_positions=8), split="validation"
    )
    assert validation_batches(static, 2, 1)[0]["masked_positions"].shape == (2, 8)


def test_validation_without_a_split_is_a_clear_error(no_split_dir, split_dir):
    with pytest.raises(fmt.ShardError) as e:
        PretrainingData(no_split_dir, MAX_SEQ, split="validation")
    assert str(no_split_dir) in str(e.value) and "--validation-fraction" in str(e.value)
    assert "--validation-documents" in str(e.value)
    with pytest.raises(ValueError, match="split must be one of"):
        PretrainingData(split_dir, MAX_SEQ, split="valid")
    with pytest.raises(ValueError, match="split='validation'"):
        validation_batches(PretrainingData(split_dir, MAX_SEQ), 4)
    data = PretrainingData(split_dir, MAX_SEQ, split="validation")
    for kwargs, message in (
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2, "max_batches": 0}, "max_batches"),
        ({"batch_size": 2, "rank": 2, "world_size": 2}, "rank"),
    ):
        with pytest.raises(ValueError, match=message):
            validation_batches(data, **kwargs)
