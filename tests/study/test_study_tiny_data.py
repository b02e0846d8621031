"""study.tiny_data: every tiny LRA and GLUE split loads through the project's own readers with
the expected rows and labels, the files are deterministic in the seed, a used directory is
refused, a failed write leaves nothing behind, and the tiny HF ALBERT imports with TISA."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from finetune.glue import data as glue_data
from finetune.glue.tasks import get_task as glue_task
from finetune.lra import data as lra_data
from study import tiny_data
from study.tiny_data import lra_split_sizes, write_glue, write_hf_albert, write_lra

LRA_SPLITS = [(t, s) for t in tiny_data.LRA_TASKS for s in ("train", "val", "test")]
GLUE_SPLITS = [(t, s) for t in tiny_data.GLUE_TASKS for s in glue_task(t).splits]
GLUE_SIZES = {"train": 64, "dev": 32, "test": 16}  # write_glue's defaults
PF = "curv_contour_length_14"


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root: relative path -> bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def lra_root(tmp_path_factory) -> Path:
    return write_lra(tmp_path_factory.mktemp("tiny") / "lra_release")


@pytest.fixture(scope="module")
def glue_root(tmp_path_factory) -> Path:
    return write_glue(tmp_path_factory.mktemp("tiny") / "glue_data")


@pytest.mark.parametrize(("task", "split"), LRA_SPLITS)
def test_every_lra_split_loads_with_its_rows_and_labels(lra_root, task, split):
    examples, stats = lra_data.load_split(task, lra_root, split)
    assert len(examples) == lra_split_sizes(task)[split] and stats.skipped == 0
    labels = set(stats.label_counts)
    assert len(labels) >= (3 if task == "listops" else 2), stats.label_counts
    if task in ("text", "retrieval", "pathfinder"):  # balanced binary labels
        assert max(stats.label_counts.values()) - min(stats.label_counts.values()) <= 1
    if task in ("text", "retrieval"):
        assert stats.longest <= 200 and stats.truncated == 0
    if task == "listops":
        assert 10 < stats.longest < 40
    if task == "image" and split != "train":
        assert labels == set(range(10))  # 32 rows: every class


def test_lra_layout_and_sizes(lra_root):
    assert sorted(p.name for p in lra_root.iterdir()) == [
        "aclImdb",
        "cifar-10-batches-py",
        "listops-1000",
        "pathfinder32",
        "tsv_data",
    ]
    assert sorted(p.name for p in (lra_root / "cifar-10-batches-py").iterdir()) == [
        *(f"data_batch_{i}" for i in range(1, 6)),
        "test_batch",
    ]
    assert lra_split_sizes("image") == {"train": 288, "val": 32, "test": 32}
    assert lra_split_sizes("pathfinder") == {"train": 256, "val": 32, "test": 32}
    assert lra_split_sizes("text", 10, 5, 7) == {"train": 10, "val": 7, "test": 7}
    with pytest.raises(ValueError, match="empty"):
        lra_split_sizes("listops", 8, 0, 4)


def test_image_label_is_brightness(lra_root):
    grey, labels = lra_data.read_cifar_batch(lra_root / "cifar-10-batches-py" / "test_batch")
    by_brightness = labels[np.argsort(grey.mean(1))]
    assert (np.diff(by_brightness) >= 0).all()  # brighter images never have a smaller label


@pytest.mark.parametrize(("task", "split"), GLUE_SPLITS)
def test_every_glue_split_loads_with_its_rows_and_labels(glue_root, task, split):
    t = glue_task(task)
    examples, stats = glue_data.load_split(t, glue_root, split)
    n = GLUE_SIZES[split.split("_")[0]]
    assert stats.format == "tsv" and stats.counts() == {"read": n, "skipped": 0}
    assert len(examples) == n
    for ex in examples:
        assert ex.text_a and (ex.text_b is None) == (not t.is_pair)
        assert not any(c in ex.text_a + (ex.text_b or "") for c in '\t\n\r"')
    if not t.is_labelled(split):
        assert [ex.label for ex in examples] == [None] * n
        assert [ex.index for ex in examples] == list(range(n))
    elif t.is_regression:
        scores = [ex.label for ex in examples]
        assert min(scores) == 0.0 and max(scores) == 5.0
    else:
        counts = np.bincount([ex.label for ex in examples], minlength=t.num_labels)
        assert counts.min() >= n // t.num_labels and counts.max() <= -(-n // t.num_labels)


def test_glue_layout(glue_root):
    folders = sorted(p.name for p in glue_root.iterdir())
    assert folders == sorted(glue_task(t).dir_name for t in tiny_data.GLUE_TASKS)
    assert (glue_root / "diagnostic" / "diagnostic.tsv").is_file()
    cola = (glue_root / "CoLA" / "train.tsv").read_text().splitlines()[0].split("\t")
    assert len(cola) == 4 and cola[1] in ("0", "1")  # no header
    head = {
        f: (glue_root / "MNLI" / f).read_text().splitlines()[0].count("\t") + 1
        for f in ("train.tsv", "dev_matched.tsv", "test_mismatched.tsv")
    }
    assert head == {"train.tsv": 12, "dev_matched.tsv": 16, "test_mismatched.tsv": 10}
    assert (glue_root / "MRPC" / "train.tsv").read_bytes().startswith(b"\xef\xbb\xbfQuality\t")
    assert (glue_root / "STS-B" / "dev.tsv").read_text().splitlines()[1].count("\t") == 9


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    sizes = dict(n_train=8, n_val=4, n_test=4)
    a = tree(write_lra(tmp_path / "a", seed=3, **sizes))
    assert a == tree(write_lra(tmp_path / "b", seed=3, **sizes))
    other = tree(write_lra(tmp_path / "c", seed=4, **sizes))
    for name in ("listops-1000/basic_train.tsv", "tsv_data/new_aan_pairs.test.tsv"):
        assert other[name] != a[name]
    for name in ("cifar-10-batches-py/test_batch", "pathfinder32/" + PF + "/imgs/0/sample_0.png"):
        assert other[name] != a[name]
    assert {k: v for k, v in other.items() if "aclImdb" in k} != {
        k: v for k, v in a.items() if "aclImdb" in k
    }
    g = tree(write_glue(tmp_path / "g1", seed=3, n_train=6, n_dev=4, n_test=3))
    assert g == tree(write_glue(tmp_path / "g2", seed=3, n_train=6, n_dev=4, n_test=3))
    h = tree(write_glue(tmp_path / "g3", seed=4, n_train=6, n_dev=4, n_test=3))
    assert h.keys() == g.keys() and all(h[k] != g[k] for k in g)
    # a subset of tasks gets the same files as in the full set
    part = tree(write_lra(tmp_path / "d", tasks=("retrieval",), seed=3, **sizes))
    assert part == {k: v for k, v in a.items() if k.startswith("tsv_data/")}


def test_a_used_directory_is_refused_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("x")
    for write in (write_lra, write_glue):
        with pytest.raises(ValueError, match=re.escape(str(used))):
            write(used)
    assert [p.name for p in used.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_glue(empty, tasks=["rte"]) == empty and (empty / "RTE" / "dev.tsv").is_file()
    with pytest.raises(ValueError, match="unknown tiny LRA tasks"):
        write_lra(tmp_path / "x", tasks=("pathx",))

    def broken(out, *args):
        (out / "half.tsv").write_text("half")
        raise RuntimeError("killed")

    monkeypatch.setitem(tiny_data._LRA_WRITERS, "image", broken)
    with pytest.raises(RuntimeError, match="killed"):
        write_lra(tmp_path / "lra", tasks=("retrieval", "image"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "used"]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    from data_prep.tokenizer import write_tokenizer

    out = tmp_path_factory.mktemp("tok")
    return write_tokenizer(out, inputs=["embedded:40"], vocab_size=300)


def test_hf_albert_imports_with_tisa(tmp_path, tokenizer_file):
    pytest.importorskip("transformers")
    from data_prep.tokenizer import load_tokenizer
    from model.hub.hf_import import import_hf_albert, read_hf_config

    out = write_hf_albert(tmp_path / "hf", tokenizer_file, seed=1)
    assert (out / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    assert (out / "model.safetensors").is_file()
    tok = load_tokenizer(tokenizer_file)
    config = read_hf_config(out)
    assert config["vocab_size"] == tok.get_vocab_size() and config["hidden_size"] == 32
    assert config["pad_token_id"] == glue_data.pad_token_id(tok)
    model = import_hf_albert(out, attention="tisa")
    assert model.config.attention == "tisa"
    ids = torch.tensor(tok.encode("the cat sat on the mat").ids)[None]
    with torch.no_grad():
        logits = model(ids, torch.ones_like(ids), torch.zeros_like(ids)).logits
    assert logits.shape == (1, ids.shape[1], tok.get_vocab_size())
    assert torch.isfinite(logits).all()
    again = write_hf_albert(tmp_path / "hf2", tokenizer_file, seed=1)
    assert tree(again) == tree(out)
    with pytest.raises(ValueError, match="not an empty directory"):
        write_hf_albert(out, tokenizer_file)


def test_hf_albert_without_transformers_names_the_extra(tmp_path, tokenizer_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError, match=r'pip install -e "\.\[hf\]"'):
        write_hf_albert(tmp_path / "hf", tokenizer_file)
    assert not (tmp_path / "hf").exists()
