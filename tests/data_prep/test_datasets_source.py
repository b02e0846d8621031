"""`hf:` inputs (data_prep/datasets_source.py): a `datasets` source named like a Hub dataset,
read from local files only: a folder of Parquet files and `save_to_disk` directories made here,
through the same `datasets.load_dataset` / `load_from_disk` calls as a Hub name, with and without
streaming; byte-identical shards whatever --workers, --num-jobs and --streaming; the input
fingerprint; bad input (exit 2, naming the problem)."""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

import pytest

from data_prep import datasets_source as dsrc
from data_prep import format as fmt
from data_prep.__main__ import main
from data_prep.readers import ReadStats, fingerprint_inputs, iter_documents

pytest.importorskip("nupunkt")

DOCS = 16


def corpus_texts() -> list[str]:
    """16 documents of the embedded corpus as one paragraph per line (wraps joined), the way
    Wikipedia is stored in `datasets`."""
    from data_prep.corpus import embedded_documents

    texts = []
    for doc in embedded_documents():
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc)]
        texts.append("\n".join(p for p in paragraphs if p))
        if len(texts) == DOCS:
            return texts
    raise AssertionError("the embedded corpus has too few documents")


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path_factory, monkeypatch):
    """`load_dataset`'s Arrow cache under the test's tmp directory (workers too: spawned)."""
    import datasets

    cache = str(tmp_path_factory.getbasetemp() / "hf-datasets-cache")
    monkeypatch.setenv("HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """A Parquet folder (train in 2 files + a test split), a DatasetDict and a Dataset saved
    with save_to_disk, all holding the same 16 training documents."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("sources")
    texts = corpus_texts()
    folder = root / "parquet"
    folder.mkdir()
    ids = list(range(DOCS))
    for k, (lo, hi) in enumerate(((0, 9), (9, DOCS))):
        table = pa.table({"id": ids[lo:hi], "text": texts[lo:hi]})
        pq.write_table(table, folder / f"train-0000{k}-of-00002.parquet", row_group_size=4)
    pq.write_table(
        pa.table({"id": [0], "text": ["A test split. Not read."]}), folder / "test.parquet"
    )
    ds = datasets.Dataset.from_dict({"id": ids, "text": texts})
    datasets.DatasetDict({"train": ds, "validation": ds.select([0])}).save_to_disk(
        str(root / "dict")
    )
    ds.save_to_disk(str(root / "single"))
    return {"parquet": folder, "dict": root / "dict", "single": root / "single", "root": root}


def read(inputs, **kw):
    stats = ReadStats()
    return list(iter_documents([str(x) for x in inputs], stats=stats, **kw)), stats


# ----------------------------------------------------------------------------- the spec


def test_spec_parts():
    p = dsrc.parse("hf:wikimedia/wikipedia:20231101.en:train:text")
    assert (p.path, p.config, p.split, p.column, p.revision) == (
        "wikimedia/wikipedia",
        "20231101.en",
        "train",
        "text",
        None,
    )
    p = dsrc.parse("hf:allenai/c4@abc123:en")
    assert (p.path, p.revision, p.config, p.split_name) == ("allenai/c4", "abc123", "en", "train")
    p = dsrc.parse("hf:bookcorpus/bookcorpus::train[:1%]:body")
    assert (p.config, p.split, p.base_split, p.column) == (None, "train[:1%]", "train", "body")
    for bad in ("hf:", "hf::cfg", "hf:a/b:c:train:text:extra", "hf:@rev"):
        with pytest.raises(ValueError, match="bad input"):
            dsrc.parse(bad)


# ----------------------------------------------------------------------------- reading


@pytest.mark.parametrize("streaming", [False, True])
def test_local_sources_give_the_documents_split_into_sentences(sources, streaming):
    from data_prep.sentences import split_document

    want = [split_document(t, "split") for t in corpus_texts()]
    for spec in (
        f"hf:{sources['parquet']}",
        f"hf:{sources['parquet']}::train:text",
        f"hf:{sources['dict']}",
        f"hf:{sources['single']}",
    ):
        docs, stats = read([spec], streaming=streaming)
        assert docs == want, spec
        assert stats.files == [spec] and stats.documents == DOCS
    # The test split is a split of its own; another column is named in the spec.
    assert read([f"hf:{sources['parquet']}::test"], streaming=streaming)[0] == [
        ["A test split.", "Not read."]
    ]
    docs, _ = read([f"hf:{sources['dict']}::validation"], streaming=streaming)
    assert docs == want[:1]


def test_hub_name_goes_through_the_same_datasets_calls(sources, monkeypatch):
    """`hf:acme/corpus:default:train` is loaded with load_dataset(NAME, CONFIG, split=...,
    streaming=...), the call a local folder gets: routed here to the local Parquet folder."""
    import datasets

    calls = []
    real_builder, real_load = datasets.load_dataset_builder, datasets.load_dataset

    def builder(path, name=None, **kw):
        calls.append(("builder", path, name, kw.get("revision")))
        return real_builder(str(sources["parquet"]) if path == "acme/corpus" else path, None)

    def load(path, name=None, **kw):
        calls.append(("load", path, name, kw.get("split"), kw.get("streaming")))
        return real_load(str(sources["parquet"]) if path == "acme/corpus" else path, None, **kw)

    monkeypatch.setattr(datasets, "load_dataset_builder", builder)
    monkeypatch.setattr(datasets, "load_dataset", load)
    spec = "hf:acme/corpus@v1:default:train"
    local, _ = read([f"hf:{sources['parquet']}"])
    for streaming in (False, True):
        calls.clear()
        assert read([spec], streaming=streaming)[0] == local
        assert ("load", "acme/corpus", "default", "train", streaming) in calls
        assert ("builder", "acme/corpus", "default", "v1") in calls


def test_hub_fingerprint_is_the_resolved_files_with_their_commit(monkeypatch):
    from types import SimpleNamespace

    import datasets

    files = {"train": ["hf://datasets/acme/corpus@aaa/train-0.parquet"]}
    Builder = SimpleNamespace(config=SimpleNamespace(data_files=files))

    monkeypatch.setattr(datasets, "load_dataset_builder", lambda *a, **k: Builder)
    first = fingerprint_inputs(["hf:acme/corpus"])[0]
    assert first["path"] == "hf:acme/corpus" and first["mtime_ns"] is None
    assert fingerprint_inputs(["hf:acme/corpus"])[0] == first
    Builder.config.data_files = {"train": ["hf://datasets/acme/corpus@bbb/train-0.parquet"]}
    assert fingerprint_inputs(["hf:acme/corpus"])[0]["sha256"] != first["sha256"]  # new commit
    with pytest.raises(ValueError, match=r"unknown split 'validation' \(splits: \['train'\]\)"):
        fingerprint_inputs(["hf:acme/corpus::validation"])


# ----------------------------------------------------------------------------- shards


def shards(spec: str, tok: Path, out: Path, *extra) -> int:
    return main(
        [
            "shards",
            "--input",
            spec,
            "--tokenizer",
            str(tok),
            "--out",
            str(out),
            "--num-shards",
            "3",
            "--max-seq-length",
            "64",
            *extra,
        ]
    )


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def tokenizer(sources, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    spec = f"hf:{sources['parquet']}"
    assert (
        main(
            ["tokenizer", "--input", spec, "--streaming", "--out", str(out), "--vocab-size", "300"]
        )
        == 0
    )
    return out / fmt.TOKENIZER


def test_shards_are_byte_identical_whatever_workers_jobs_and_streaming(
    sources, tokenizer, tmp_path
):
    spec = f"hf:{sources['parquet']}"
    assert shards(spec, tokenizer, tmp_path / "one") == 0
    want = dir_bytes(tmp_path / "one")
    manifest = fmt.read_manifest(tmp_path / "one")
    assert manifest["config"]["inputs"] == [spec]
    assert manifest["config"]["sentences"] == "auto"
    assert manifest["config"]["sentence_splitter"].startswith("nupunkt ")
    assert manifest["input"]["documents"] == DOCS
    # Each worker split only its own documents; the manifest counts every sentence once.
    eager, _ = read([spec])
    assert manifest["input"]["sentences"] == sum(len(d) for d in eager)
    assert shards(spec, tokenizer, tmp_path / "w2s", "--workers", "2", "--streaming") == 0
    assert dir_bytes(tmp_path / "w2s") == want
    for job in (0, 1):
        extra = ("--streaming", "--job-index", str(job), "--num-jobs", "2")
        assert shards(spec, tokenizer, tmp_path / "jobs", *extra) == 0
    assert main(["finalize", "--out", str(tmp_path / "jobs")]) == 0
    assert dir_bytes(tmp_path / "jobs") == want
    # Another form of the same rows (a save_to_disk DatasetDict) gives the same examples.
    assert shards(f"hf:{sources['dict']}", tokenizer, tmp_path / "dict", "--streaming") == 0
    got = dir_bytes(tmp_path / "dict")
    for name, data in want.items():
        if name.endswith(".npy"):
            assert got[name] == data, name
    # A directory built streaming is done for a run without it (streaming is not config).
    assert shards(spec, tokenizer, tmp_path / "w2s") == 0
    assert dir_bytes(tmp_path / "w2s") == want


def test_changed_source_is_refused_touched_is_not(sources, tokenizer, tmp_path, capsys):
    import shutil

    folder = tmp_path / "parquet"
    shutil.copytree(sources["parquet"], folder)
    spec = f"hf:{folder}"
    assert shards(spec, tokenizer, tmp_path / "s") == 0
    part = folder / "train-00001-of-00002.parquet"
    os.utime(part, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: same bytes
    assert shards(spec, tokenizer, tmp_path / "s") == 0
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(part)
    texts = table.column("text").to_pylist()
    texts[0] = texts[0].replace("a", "e", 1)
    pq.write_table(table.set_column(1, "text", pa.array(texts)), part)
    capsys.readouterr()
    assert shards(spec, tokenizer, tmp_path / "s") == 2
    err = capsys.readouterr().err
    assert f"input file {spec} has changed" in err and "use another --out" in err
    # The same for a save_to_disk directory.
    saved = tmp_path / "single"
    shutil.copytree(sources["single"], saved)
    assert shards(f"hf:{saved}", tokenizer, tmp_path / "d") == 0
    import datasets

    ds = datasets.load_from_disk(str(saved))
    ds.map(lambda r: {"text": r["text"] + " Changed."}).save_to_disk(str(tmp_path / "single2"))
    shutil.rmtree(saved)
    shutil.move(str(tmp_path / "single2"), str(saved))
    capsys.readouterr()
    assert shards(f"hf:{saved}", tokenizer, tmp_path / "d") == 2
    assert f"input file hf:{saved} has changed" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def empty_sources(tmp_path_factory) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("empty")
    (root / "parquet").mkdir()
    pq.write_table(
        pa.table({"text": pa.array([], pa.string())}), root / "parquet" / "train.parquet"
    )
    features = datasets.Features({"text": datasets.Value("string")})
    datasets.Dataset.from_dict({"text": []}, features=features).save_to_disk(str(root / "disk"))
    return {"parquet": root / "parquet", "disk": root / "disk"}


@pytest.mark.parametrize("streaming", [False, True])
def test_bad_sources_exit_2_naming_the_problem(sources, empty_sources, tmp_path, capsys, streaming):
    cases = {
        f"hf:{sources['parquet']}::validation": r"unknown split 'validation' \(splits: \['test', 'train'\]\)",
        f"hf:{sources['dict']}::test": r"unknown split 'test' \(splits: \['train', 'validation'\]\)",
        f"hf:{sources['parquet']}:::body": r"no column 'body' \(columns: \['id', 'text'\]\)",
        f"hf:{sources['single']}:::body": r"no column 'body' \(columns: \['id', 'text'\]\)",
        f"hf:{empty_sources['parquet']}": r"split 'train' is empty \(no rows\)",
        f"hf:{empty_sources['disk']}": r"is empty \(no rows\)",
        f"hf:{tmp_path / 'nothere'}": r"directory .*nothere' does not exist",
        "hf:acme/no-such-corpus": r"cannot reach dataset 'acme/no-such-corpus' \(HF_HUB_OFFLINE is set",
        f"hf:{sources['dict']}:en": r"save_to_disk directory, which has no configs",
        "hf:a/b:c:train:text:extra": r"bad input",
    }
    flags = ["--streaming"] if streaming else []
    for spec, message in cases.items():
        out = tmp_path / hashlib.sha256(spec.encode()).hexdigest()[:8]
        assert main(["tokenizer", "--input", spec, "--out", str(out), *flags]) == 2, spec
        err = capsys.readouterr().err
        assert err.startswith("error: ") and re.search(message, err), (spec, err)
    if streaming:  # a slice cannot be streamed
        spec = f"hf:{sources['parquet']}::train[:2]"
        assert main(["tokenizer", "--input", spec, "--out", str(tmp_path / "x"), *flags]) == 2
        assert "cannot be streamed" in capsys.readouterr().err
    else:  # but it can be read
        assert len(read([f"hf:{sources['parquet']}::train[:2]"])[0]) == 2


def test_a_worker_splits_only_the_documents_it_keeps(sources, tokenizer, tmp_path, monkeypatch):
    from data_prep import sentences

    split_lines = []
    real = sentences.split_line

    def counting(line: str) -> list[str]:
        split_lines.append(line)
        return real(line)

    monkeypatch.setattr(sentences, "split_line", counting)
    spec = f"hf:{sources['parquet']}"
    extra = ("--job-index", "0", "--num-jobs", "3")  # shard 0 of 3: documents 0, 3, 6, ...
    assert shards(spec, tokenizer, tmp_path / "job0", *extra) == 0
    kept = [t for d, t in enumerate(corpus_texts()) if d % 3 == 0]
    assert sorted(split_lines) == sorted(ln for t in kept for ln in t.split("\n") if ln.strip())
