"""LRA loaders on fixtures written here in each official format (finetune/lra/data.py)."""

from __future__ import annotations

import csv
import logging
import os
import pickle

import numpy as np
import pytest

from data_prep import listops
from finetune.lra import data as lra
from finetune.lra.tasks import (
    CLS_ID,
    LISTOPS_VOCAB,
    OFFSET,
    PAD_ID,
    TASKS,
    byte_codes,
    get_task,
    listops_codes,
    listops_codes_batch,
    rgb_to_grayscale,
    to_ids,
)

# ----------------------------------------------------------------------------- helpers


def ids_of_codes(codes, cls=True):
    return ([CLS_ID] if cls else []) + [int(c) + OFFSET for c in codes]


def ids_of_bytes(data: bytes, cls=True):
    return ids_of_codes(list(data), cls)


def write_listops_tsv(path, rows, header=("Source", "Target")):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter="\t")
        if header is not None:
            writer.writerow(header)
        writer.writerows(rows)


# ----------------------------------------------------------------------------- tasks, vocabulary


def test_task_table():
    expected = {
        "listops": (10, 2000, 4 + 15),
        "text": (2, 1000, 4 + 256),
        "retrieval": (2, 4000, 4 + 256),
        "image": (10, 1024, 4 + 256),
        "pathfinder": (2, 1024, 4 + 256),
        "pathx": (2, 16384, 4 + 256),
    }
    assert set(TASKS) == set(expected)
    for name, (labels, length, vocab) in expected.items():
        task = get_task(name)
        assert (task.num_labels, task.max_length, task.vocab_size) == (labels, length, vocab)
        assert task.pad_id == PAD_ID == 0
        assert task.pair == (name == "retrieval")
        assert task.sequence_length() == length + 1
        assert task.sequence_length(cls=False) == length
    assert get_task("text").sequence_length(4000) == 4001
    with pytest.raises(ValueError, match="unknown LRA task"):
        get_task("cifar")
    with pytest.raises(ValueError, match="would cut"):
        get_task("image").resolve_max_length(1000)
    with pytest.raises(ValueError, match=">= 1"):
        get_task("text").resolve_max_length(0)
    with pytest.raises(ValueError, match="unknown split"):
        get_task("text").check_split("dev")


def test_padding_id_is_never_a_data_id():
    # Byte 0, pixel 0 and ListOps digit 0 all become OFFSET, never PAD (nor a special).
    assert OFFSET == 4
    assert to_ids(byte_codes(b"\x00\xff"), cls=False).tolist() == [OFFSET, OFFSET + 255]
    assert to_ids(np.zeros(3, np.uint8)).tolist() == [CLS_ID, OFFSET, OFFSET, OFFSET]
    assert listops_codes("0").tolist() == [0]
    all_ids = to_ids(np.arange(256, dtype=np.uint8))
    assert PAD_ID not in all_ids[1:] and all_ids.dtype == np.int32
    assert max(all_ids) == get_task("text").vocab_size - 1


# ----------------------------------------------------------------------------- ListOps


def test_listops_official_rows(tmp_path):
    rows = [
        ("( ( ( [MAX 2 ) 9 ) ] )", "9"),
        ("( ( ( ( [SM 4 ) ( ( ( [MIN 1 ) 7 ) ] ) ) 3 ) ] )", "8"),
        ("( ( ( [MED 0 ) 5 ) ] )", "2"),
    ]
    write_listops_tsv(tmp_path / "basic_val.tsv", rows)
    examples, stats = lra.load_split("listops", tmp_path, "val")
    assert (len(examples), stats.rows, stats.examples, stats.format) == (3, 3, 3, "tsv")
    code = {tok: i for i, tok in enumerate(LISTOPS_VOCAB)}
    first = examples[0]
    # Brackets kept, parentheses dropped: [MAX 2 9 ].
    assert first["input_ids"].tolist() == ids_of_codes([code["[MAX"], 2, 9, code["]"]])
    assert first["input_ids"].dtype == np.int32
    assert first["token_type_ids"].tolist() == [0] * 5
    assert (first["label"], first["index"]) == (9, 0)
    assert [examples[i]["label"] for i in range(3)] == [9, 8, 2]
    assert examples[1]["input_ids"].tolist() == ids_of_codes(
        [code["[SM"], 4, code["[MIN"], 1, 7, code["]"], 3, code["]"]]
    )
    assert stats.longest == 8 and stats.truncated == 0
    assert stats.label_counts == {2: 1, 8: 1, 9: 1}
    # lra_release layout: <root>/listops-1000/basic_val.tsv; and truncation.
    (tmp_path / "rel" / "listops-1000").mkdir(parents=True)
    write_listops_tsv(tmp_path / "rel" / "listops-1000" / "basic_val.tsv", rows)
    cut, stats = lra.load_split("listops", tmp_path / "rel", "val", max_length=3, cls=False)
    assert cut[1]["input_ids"].tolist() == ids_of_codes([code["[SM"], 4, code["[MIN"]], False)
    assert stats.truncated == 3 and stats.longest == 8  # lengths 4, 8, 4


def test_listops_generator_output(tmp_path):
    sizes = {"train": 30, "val": 5, "test": 5}
    listops.write_splits(tmp_path, sizes, min_length=10, max_length=40, seed=3)
    for split, n in sizes.items():
        examples, stats = lra.load_split("listops", tmp_path, split)
        reference = listops.read_tsv(tmp_path / f"basic_{split}.tsv")
        assert len(examples) == n == stats.rows
        for i, (source, target) in enumerate(reference):
            ex = examples[i]
            assert ex["label"] == target and ex["index"] == i
            tokens = listops.model_tokens(source)
            assert len(ex["input_ids"]) == len(tokens) + 1 == listops.source_length(source) + 1
            assert ex["input_ids"].tolist() == [CLS_ID] + [
                LISTOPS_VOCAB.index(t) + OFFSET for t in tokens
            ]


def test_listops_batch_tokeniser_matches_reference(tmp_path):
    listops.write_splits(tmp_path, (20, 1, 1), min_length=20, max_length=200, seed=1)
    sources = [s for s, _ in listops.read_tsv(tmp_path / "basic_train.tsv")]
    fast = listops_codes_batch(sources)
    assert fast is not None
    assert all(np.array_equal(a, listops_codes(s)) for a, s in zip(fast, sources, strict=True))
    # Not in the plain space-separated form: None (the caller falls back), never wrong codes.
    for odd in ["[MIN 12 ]", "(1 [MAX 2 ]", "[M IN 3 ]", "[MINX 1", "[SM[MIN 1", "1\t2", "a"]:
        assert listops_codes_batch([sources[0], odd]) is None
    # Spacing variants that are still valid agree with the reference.
    for ok in ["  [SM  1  ]  ", "[MIN [MAX 9 ] ]", "(", ""]:
        out = listops_codes_batch([ok, sources[0]])
        assert out is not None and np.array_equal(out[0], listops_codes(ok))
    assert listops_codes_batch([]) == []


def test_listops_errors(tmp_path):
    path = tmp_path / "basic_train.tsv"
    write_listops_tsv(path, [("( [MAX 1 2 ] )", "2")], header=("Src", "Tgt"))
    with pytest.raises(ValueError, match=r"basic_train.tsv:1: header"):
        lra.load_split("listops", tmp_path, "train")
    write_listops_tsv(path, [("( [MAX 1 2 ] )", "2"), ("( [MAX 1 12 ] )", "2")])
    with pytest.raises(ValueError, match=r"basic_train.tsv:3: token '12'"):
        lra.load_split("listops", tmp_path, "train")
    write_listops_tsv(path, [("( [MAX 1 2 ] )", "10")])
    with pytest.raises(ValueError, match=r"basic_train.tsv:2: label 10 is outside"):
        lra.load_split("listops", tmp_path, "train")
    write_listops_tsv(path, [("( [MAX 1 2 ] )", "x")])
    with pytest.raises(ValueError, match=r"basic_train.tsv:2: Target 'x'"):
        lra.load_split("listops", tmp_path, "train")
    write_listops_tsv(path, [("( [MAX 1 2 ] )",)])
    with pytest.raises(ValueError, match=r"basic_train.tsv:2: expected 2 columns"):
        lra.load_split("listops", tmp_path, "train")
    write_listops_tsv(path, [])
    with pytest.raises(ValueError, match="no examples"):
        lra.load_split("listops", tmp_path, "train")
    with pytest.raises(FileNotFoundError, match=r"basic_test.tsv not found"):
        lra.load_split("listops", tmp_path, "test")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        lra.load_split("listops", tmp_path / "nowhere", "test")


# ----------------------------------------------------------------------------- Retrieval


def write_aan(path, rows):
    # The AAN files: no header, TAB-separated, no quoting ever.
    with open(path, "w", encoding="utf-8", newline="") as f:
        for row in rows:
            f.write("\t".join(row) + "\n")


def test_retrieval_pairs_and_collate_pair(tmp_path):
    huge = "word " * 40_000  # 200 000 characters: over csv's default field limit (131072)
    quoted = 'He said "no" and left "'  # a lone quote: text, not quoting
    rows = [
        ("1", "P01-1001", "W02-0301", huge, quoted),
        ("0.0", "P01-1002", "W02-0302", "short \x00 b\u00e9", "x"),
        ("1.0", "P01-1003", "W02-0303", "abc", '"quoted field"'),
    ]
    (tmp_path / "tsv_data").mkdir()
    write_aan(tmp_path / "tsv_data" / "new_aan_pairs.eval.tsv", rows)
    limit_before = csv.field_size_limit()
    examples, stats = lra.load_split("retrieval", tmp_path, "val")
    assert csv.field_size_limit() == limit_before  # restored
    assert len(examples) == 3 and examples.pair
    assert [examples[i]["label"] for i in range(3)] == [1, 0, 1]
    first = examples[0]
    assert len(first["input_ids"]) == 4000 + 1 and len(first["input_ids_b"]) == len(quoted) + 1
    assert first["input_ids"].tolist() == ids_of_bytes(huge.encode()[:4000])
    assert first["input_ids_b"].tolist() == ids_of_bytes(quoted.encode())
    second = examples[1]
    assert second["input_ids"].tolist() == ids_of_bytes("short \x00 b\u00e9".encode())
    assert OFFSET in second["input_ids"].tolist()  # byte 0 is data, not padding
    assert examples[2]["input_ids_b"].tolist() == ids_of_bytes(b'"quoted field"')
    assert stats.truncated == 1 and stats.longest == len(huge)
    assert stats.label_counts == {0: 1, 1: 2}

    batch = lra.collate_pair([examples[i] for i in range(3)], pad_id=PAD_ID)
    assert batch["input_ids"].shape == (3, 4001) and batch["input_ids_b"].shape == (3, 24)
    assert batch["labels"].tolist() == [1, 0, 1] and batch["index"].tolist() == [0, 1, 2]
    for doc, key in ((0, "input_ids"), (1, "input_ids_b")):
        lengths = [len(examples[i][key]) for i in range(3)]
        mask = batch["attention_mask" if doc == 0 else "attention_mask_b"]
        assert mask.sum(1).tolist() == lengths
        assert (batch[key][mask == 0] == PAD_ID).all() and (batch[key][mask == 1] != PAD_ID).all()
        tt = batch["token_type_ids" if doc == 0 else "token_type_ids_b"]
        assert tt.shape == batch[key].shape and not tt.any()
    assert lra.collate_pair([examples[1]], pad_id=PAD_ID, pad_to_multiple_of=8)[
        "input_ids_b"
    ].shape == (1, 8)

    # A shorter max_length applies to both documents.
    short, stats = lra.load_split("retrieval", tmp_path, "val", max_length=5)
    assert all(
        len(short[i]["input_ids"]) <= 6 and len(short[i]["input_ids_b"]) <= 6 for i in range(3)
    )
    assert stats.truncated == 4  # all but "x" and "abc"


def test_retrieval_errors(tmp_path):
    path = tmp_path / "new_aan_pairs.train.tsv"
    write_aan(path, [("1", "a", "b", "x", "y"), ("2", "a", "b", "x", "y")])
    with pytest.raises(ValueError, match=r"train.tsv:2: label 2 is outside"):
        lra.load_split("retrieval", tmp_path, "train")
    write_aan(path, [("0.5", "a", "b", "x", "y")])
    with pytest.raises(ValueError, match=r"train.tsv:1: label '0.5' is not a whole number"):
        lra.load_split("retrieval", tmp_path, "train")
    write_aan(path, [("1", "a", "b", "x\ty", "z")])
    with pytest.raises(ValueError, match=r"train.tsv:1: expected 5 columns"):
        lra.load_split("retrieval", tmp_path, "train")
    with pytest.raises(FileNotFoundError, match=r"new_aan_pairs.test.tsv not found"):
        lra.load_split("retrieval", tmp_path, "test")


# ----------------------------------------------------------------------------- Text (IMDb)

REVIEWS = {
    "train": {
        "neg": {"10_2.txt": "Bad.<br /><br />Really bad.", "3_1.txt": "  Awful \u00e9 film.\n"},
        "pos": {"0_9.txt": "Great film!", "12_10.txt": 'A "classic".'},
    },
    "test": {"neg": {"1_3.txt": "Meh."}, "pos": {"2_8.txt": "Loved it."}},
}


def write_aclimdb(root):
    for split, labels in REVIEWS.items():
        for label, files in labels.items():
            (root / split / label).mkdir(parents=True)
            for name, text in files.items():
                (root / split / label / name).write_bytes(text.encode("utf-8"))
    (root / "train" / "unsup").mkdir()
    (root / "train" / "unsup" / "5_0.txt").write_text("unlabelled")
    (root / "train" / "pos" / "notes.md").write_text("not a review")  # ignored: not .txt


def expected_reviews(split):
    out = []
    for label_name, label in (("neg", 0), ("pos", 1)):
        files = REVIEWS[split][label_name]
        for name in sorted(files, key=lambda n: int(n.split("_")[0])):
            out.append((files[name].encode("utf-8").strip(), label))
    return out


def test_text_aclimdb(tmp_path):
    write_aclimdb(tmp_path / "aclImdb")
    examples, stats = lra.load_split("text", tmp_path, "train")
    expected = expected_reviews("train")  # neg by id (3, 10), then pos (0, 12)
    assert stats.format == "aclImdb" and len(examples) == 4 == stats.rows
    for i, (text, label) in enumerate(expected):
        assert examples[i]["input_ids"].tolist() == ids_of_bytes(text)
        assert (examples[i]["label"], examples[i]["index"]) == (label, i)
    assert examples[0]["input_ids"].tolist() == ids_of_bytes("Awful \u00e9 film.".encode())
    # val is the test set, as in LRA.
    val, val_stats = lra.load_split("text", tmp_path / "aclImdb", "val")
    test, _ = lra.load_split("text", tmp_path / "aclImdb", "test")
    assert "test set" in val_stats.note and len(val) == len(test) == 2
    assert [val[i]["input_ids"].tolist() for i in range(2)] == [
        test[i]["input_ids"].tolist() for i in range(2)
    ]
    cut, stats = lra.load_split("text", tmp_path, "train", max_length=4)
    assert cut[0]["input_ids"].tolist() == ids_of_bytes(b"Awfu")
    assert stats.truncated == 4


def test_text_hf_matches_aclimdb(tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])}
    )
    splits = {}
    for split in ("train", "test"):
        rows = expected_reviews(split)
        splits[split] = datasets.Dataset.from_dict(
            {"text": [t.decode() for t, _ in rows], "label": [label for _, label in rows]},
            features=features,
        )
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "imdb_hf"))
    write_aclimdb(tmp_path / "aclImdb")
    for split in ("train", "val", "test"):
        hf, stats = lra.load_split("text", tmp_path / "imdb_hf", split)
        raw, _ = lra.load_split("text", tmp_path, split)
        assert stats.format == "hf" and len(hf) == len(raw)
        for i in range(len(hf)):
            assert hf[i]["input_ids"].tolist() == raw[i]["input_ids"].tolist()
            assert hf[i]["label"] == raw[i]["label"]


def test_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no IMDb train data"):
        lra.load_split("text", tmp_path, "train")
    write_aclimdb(tmp_path / "aclImdb")
    (tmp_path / "aclImdb" / "test" / "pos" / "review.txt").write_text("x")
    with pytest.raises(ValueError, match=r"review.txt: not an aclImdb review file name"):
        lra.load_split("text", tmp_path, "test")


# ----------------------------------------------------------------------------- Image (CIFAR-10)


def cifar_batch(rng, n, first_pixels=None):
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    if first_pixels is not None:  # (pixel, (r, g, b)) of image 0
        for p, (r, g, b) in first_pixels:
            data[0, p], data[0, 1024 + p], data[0, 2048 + p] = r, g, b
    return {
        b"batch_label": b"training batch",
        b"labels": [int(x) for x in rng.integers(0, 10, size=n)],
        b"data": data,
        b"filenames": [b"img_%d.png" % i for i in range(n)],
    }


def write_cifar(root, per_batch=4, seed=0):
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    batches = {}
    for i in range(1, 6):
        pixels = [(0, (0, 0, 0)), (1, (0, 255, 0)), (2, (200, 100, 50))] if i == 1 else None
        batches[f"data_batch_{i}"] = cifar_batch(rng, per_batch, pixels)
    batches["test_batch"] = cifar_batch(rng, 3)
    for name, batch in batches.items():
        with open(root / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)  # the released pickles are protocol 2
    return batches


def test_grayscale_hand_computed():
    # tf.image.rgb_to_grayscale on uint8: trunc(255.5 * (0.2989 r + 0.5870 g + 0.1140 b) / 255)
    pixels = np.array([[0, 255, 0], [200, 100, 50], [255, 255, 255], [0, 0, 0], [255, 0, 0]])
    # green: 0.587 * 255.5 = 149.98 -> 149 (rounding would give 150);
    # (200, 100, 50): 124.18 / 255 * 255.5 = 124.42 -> 124; white: 0.9999 * 255.5 -> 255;
    # red: 0.2989 * 255.5 = 76.37 -> 76.
    assert rgb_to_grayscale(pixels.astype(np.uint8)).tolist() == [149, 124, 255, 0, 76]
    with pytest.raises(ValueError, match="uint8"):
        rgb_to_grayscale(pixels)


def test_image_cifar(tmp_path):
    batches = write_cifar(tmp_path / "cifar-10-batches-py")
    train, stats = lra.load_split("image", tmp_path, "train")
    val, val_stats = lra.load_split("image", tmp_path / "cifar-10-batches-py", "val")
    test, _ = lra.load_split("image", tmp_path, "test")
    assert (len(train), len(val), len(test)) == (18, 2, 3)  # 20 training images: 90 % / 10 %
    assert stats.rows == 20 and "rows [18, 20)" in val_stats.note
    assert val[0]["index"] == 18 and train[17]["index"] == 17
    labels = [lbl for i in range(1, 6) for lbl in batches[f"data_batch_{i}"][b"labels"]]
    assert [train[i]["label"] for i in range(18)] + [val[i]["label"] for i in range(2)] == labels
    first = train[0]["input_ids"]
    assert len(first) == 1025 and first[0] == CLS_ID
    # Pixel 0 black -> id OFFSET (not padding); pixel 1 pure green -> 149; pixel 2 -> 124.
    assert first[1:4].tolist() == [OFFSET, 149 + OFFSET, 124 + OFFSET]
    # Every pixel: the R, G, B planes of a row, row-major.
    data = batches["data_batch_2"][b"data"]
    rgb = np.stack([data[1, :1024], data[1, 1024:2048], data[1, 2048:]], axis=-1)
    assert train[5]["input_ids"][1:].tolist() == (rgb_to_grayscale(rgb) + OFFSET).tolist()


def test_image_refuses_non_array_pickles(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    root = tmp_path / "cifar-10-batches-py"
    write_cifar(root)
    with open(root / "test_batch", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(ValueError, match="refusing to load"):
        lra.load_split("image", tmp_path, "test")
    with open(root / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1, 10]}, f)
    with pytest.raises(ValueError, match=r"label 10, outside 0\.\.9"):
        lra.load_split("image", tmp_path, "test")
    with pytest.raises(ValueError, match="would cut"):
        lra.load_split("image", tmp_path, "test", max_length=512)


# ----------------------------------------------------------------------------- Pathfinder


def png(path, pixels):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels.astype(np.uint8), mode="L").save(path)


def write_pathfinder(root, difficulty="curv_contour_length_14", side=32, batches=2, per=20):
    """`batches` metadata files of `per` images; image k has value k + 1 everywhere but a
    black pixel 0; label k % 2. One image (batch 0, sample 7) is an empty file."""
    base = root / difficulty
    (base / "metadata").mkdir(parents=True)
    k = 0
    for b in range(batches):
        lines = []
        for i in range(per):
            image = np.full((side, side), k + 1)
            image[0, 0] = 0
            path = base / "imgs" / str(b) / f"sample_{i}.png"
            if (b, i) == (0, 7):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"")
            else:
                png(path, image)
            lines.append(f"imgs/{b} sample_{i}.png {k} {k % 2} 0.75 1.5 2 1\n")
            k += 1
        (base / "metadata" / f"{b}.npy").write_text("".join(lines))
    return base


def test_pathfinder_split(tmp_path):
    write_pathfinder(tmp_path / "pathfinder32")
    splits = {s: lra.load_split("pathfinder", tmp_path, s) for s in ("train", "val", "test")}
    n = 39  # 40 lines, one empty image
    assert [len(splits[s][0]) for s in ("train", "val", "test")] == [31, 4, 4]
    indices = {s: set(splits[s][0].indices.tolist()) for s in splits}
    assert not (indices["train"] & indices["val"] or indices["train"] & indices["test"])
    assert not indices["val"] & indices["test"]
    assert set().union(*indices.values()) == set(range(40)) - {7}
    for examples, stats in splits.values():
        assert stats.rows == 40 and stats.skipped == 1
        assert stats.skipped_items == [
            str(
                tmp_path / "pathfinder32" / "curv_contour_length_14" / "imgs" / "0" / "sample_7.png"
            )
        ]
        assert f"of {n} non-empty" in stats.note
        for i in range(len(examples)):
            ex = examples[i]
            k = ex["index"]
            assert ex["label"] == k % 2
            assert ex["input_ids"][:3].tolist() == [CLS_ID, OFFSET, k + 1 + OFFSET]
            assert len(ex["input_ids"]) == 1025
        assert np.all(np.diff(examples.indices) > 0)  # metadata order within a split
    # Deterministic: the same seed gives the same split; another seed another one.
    again, _ = lra.load_split("pathfinder", tmp_path / "pathfinder32", "val")
    assert again.indices.tolist() == splits["val"][0].indices.tolist()
    other, _ = lra.load_split("pathfinder", tmp_path, "val", split_seed=1)
    assert other.indices.tolist() != splits["val"][0].indices.tolist()
    assert lra.split_indices(39, "val").tolist() == lra.split_indices(39, "val", 0).tolist()
    parts = [lra.split_indices(1000, s, 5) for s in ("train", "val", "test")]
    assert [len(p) for p in parts] == [800, 100, 100]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(1000))


def test_black_pixel_is_not_masked(tmp_path):
    write_pathfinder(tmp_path, batches=1, per=10)
    examples, _ = lra.load_split("pathfinder", tmp_path, "train", workers=2)
    batch = lra.collate([examples[0], examples[1]], pad_id=get_task("pathfinder").pad_id)
    assert batch["input_ids"][:, 1].tolist() == [OFFSET, OFFSET]  # pixel (0, 0) is black
    assert batch["attention_mask"].all()  # nothing masked: no padding in equal-size images
    short = {"input_ids": np.array([CLS_ID, OFFSET]), "token_type_ids": np.zeros(2), "label": 0}
    batch = lra.collate([examples[0], short], pad_id=PAD_ID)
    assert batch["attention_mask"][1].tolist() == [1, 1] + [0] * 1023
    assert (batch["input_ids"][1, 2:] == PAD_ID).all()


def test_pathx_and_errors(tmp_path, caplog):
    base = write_pathfinder(
        tmp_path / "pathfinder128", "curv_baseline", side=128, batches=1, per=10
    )
    examples, _ = lra.load_split("pathx", tmp_path, "test", difficulty="easy")
    assert len(examples) == 1 and len(examples[0]["input_ids"]) == 128 * 128 + 1
    with pytest.raises(FileNotFoundError, match="curv_contour_length_14 not found"):
        lra.load_split("pathx", tmp_path, "test")
    with pytest.raises(ValueError, match="unknown Pathfinder difficulty"):
        lra.load_split("pathx", tmp_path, "test", difficulty="medium")
    # A wrongly sized image is an error naming the metadata line.
    png(base / "imgs" / "0" / "sample_3.png", np.zeros((32, 32)))
    with pytest.raises(ValueError, match=r"0.npy:4: image .*sample_3.png: size \(32, 32\)"):
        for split in ("train", "val", "test"):
            lra.load_split("pathx", tmp_path, split, difficulty="curv_baseline")
    (base / "imgs" / "0" / "sample_3.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"0.npy:4: image .*sample_3.png does not exist"):
        lra.load_split("pathx", tmp_path, "train", difficulty="easy")
    with open(base / "metadata" / "0.npy", "a") as f:
        f.write("imgs/0 sample_0.png 0 2 0\n")
    with pytest.raises(ValueError, match=r"0.npy:11: label 2 is outside"):
        lra.load_split("pathx", tmp_path, "train", difficulty="easy")
    # Pathfinder options on another task warn that they are ignored.
    write_listops_tsv(tmp_path / "basic_val.tsv", [("( [MAX 1 2 ] )", "2")])
    with caplog.at_level(logging.WARNING, logger="finetune.lra.data"):
        lra.load_split("listops", tmp_path, "val", difficulty="easy")
    assert "ignoring difficulty" in caplog.text


def test_split_sequence_protocol(tmp_path):
    write_listops_tsv(tmp_path / "basic_test.tsv", [("( [MAX 1 2 ] )", "2"), ("3", "3")])
    examples, _ = lra.load_split("listops", tmp_path, "test")
    assert examples[-1]["label"] == 3 and [ex["label"] for ex in examples] == [2, 3]
    assert examples.lengths().tolist() == [5, 2]
    with pytest.raises(IndexError):
        examples[2]
    with pytest.raises(TypeError):
        examples[0:1]
    batch = lra.collate([examples[0], examples[1]], pad_id=PAD_ID)
    assert batch["input_ids"].tolist() == [
        [CLS_ID, 11 + OFFSET, 1 + OFFSET, 2 + OFFSET, 14 + OFFSET],
        [CLS_ID, 3 + OFFSET, PAD_ID, PAD_ID, PAD_ID],
    ]
    assert batch["labels"].tolist() == [2, 3]
