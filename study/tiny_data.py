"""Tiny seeded data sets in the official on-disk formats, for the study runner's `tiny` scale.

The whole paper-reproduction pipeline (LRA, GLUE, an imported HF ALBERT) runs on a CPU in
seconds on these, with nothing downloaded, because the project's own readers take them exactly
as they take the real files:

    write_lra(root)    lra_release layout: listops-1000/basic_{train,val,test}.tsv, aclImdb/,
                       tsv_data/new_aan_pairs.{train,eval,test}.tsv, cifar-10-batches-py/,
                       pathfinder32/curv_contour_length_14/{metadata,imgs}/
                       (`finetune.lra.data.load_split`, `python -m finetune lra --data root`)
    write_glue(root)   glue_data layout: CoLA/ SST-2/ MRPC/ STS-B/ QQP/ MNLI/ QNLI/ RTE/ WNLI/
                       diagnostic/ (`finetune.glue.data.load_split`, `--data root`)
    write_hf_albert(out, tokenizer_file)   a random tiny `AlbertForPreTraining` (`--init out`)

Every task carries a simple learnable signal (documented per writer) with balanced labels.
The same arguments give byte-identical files. Writers refuse a non-empty target directory and
build into a temporary sibling renamed into place at the end, so a killed run never leaves a
complete-looking half data set.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from albatross.files import staged_directory

LRA_TASKS = ("listops", "text", "retrieval", "image", "pathfinder")
GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli", "ax")
HF_SIZES: dict[str, Any] = dict(
    embedding_size=16,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=128,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
"""`write_hf_albert`'s default AlbertConfig sizes (any AlbertConfig field may be overridden)."""

# Plain words for GLUE sentences and LRA Retrieval documents (a fixed list: the bytes do not
# depend on the Python version, as pydoc's topics would).
_WORD_TEXT = (
    "cat dog house tree river car book music film story day night city road garden window "
    "table letter friend teacher market village ocean mountain bridge field summer winter "
    "morning paper song chair door lamp bird horse boat island forest kitchen"
)
WORDS = tuple(_WORD_TEXT.split())
MARKERS = ("alpha", "omega", "delta", "sigma", "kappa", "gamma")
"""Retrieval: a pair is related (label 1) iff both documents carry the same marker."""
GLUE_CUES = {"cola": ("seldom", "gladly"), "sst2": ("terrible", "wonderful")}
"""Single-sentence GLUE tasks: the cue word of each label id."""
PATHFINDER_DIR = "pathfinder32/curv_contour_length_14"
PATHFINDER_PER_FILE = 100  # metadata lines (and images) per batch folder


# ----------------------------------------------------------------------------- helpers


@contextmanager
def _staged(root: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary sibling of `root`, renamed to `root` when the block succeeds (removed
    when it fails). ValueError if `root` exists and is not an empty directory."""
    root = Path(root)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(f"{root} exists and is not an empty directory; tiny data go to a new one")
    root.parent.mkdir(parents=True, exist_ok=True)
    with staged_directory(root, "tiny data") as tmp:  # replaces an empty directory
        yield tmp


def _np_rng(name: str, seed: int) -> np.random.Generator:
    digest = hashlib.sha256(f"tiny-{name}:{seed}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _balanced(rng: random.Random, n: int, k: int) -> list[int]:
    """n labels 0..k-1, as equal in number as n allows, in random order."""
    labels = [i % k for i in range(n)]
    rng.shuffle(labels)
    return labels


def _write_lines(path: Path, lines: Sequence[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("".join(line + "\n" for line in lines))


# ----------------------------------------------------------------------------- LRA


def lra_split_sizes(
    task: str, n_train: int = 64, n_val: int = 32, n_test: int = 32
) -> dict[str, int]:
    """{split: rows} that `load_split` returns for `write_lra`'s sizes. Text: val is the test
    set (the reader's rule). Image: data_batch_1..5 hold n = max(n_train + n_val, 10 * n_val)
    images, of which the reader keeps the last tenth as val. Pathfinder: n = max(n_train + n_val
    + n_test, 10 * max(n_val, n_test)) images, which the reader splits 80/10/10. So val (and
    Pathfinder's test) have the asked sizes while train is small (the defaults: Image 288 / 32 /
    32, Pathfinder 256 / 32 / 32). ValueError if a split would be empty."""
    if task in ("listops", "retrieval"):
        sizes = {"train": n_train, "val": n_val, "test": n_test}
    elif task == "text":
        sizes = {"train": n_train, "val": n_test, "test": n_test}
    elif task == "image":
        n = max(n_train + n_val, 10 * n_val)
        sizes = {"train": n - n // 10, "val": n // 10, "test": n_test}
    elif task == "pathfinder":
        n = max(n_train + n_val + n_test, 10 * max(n_val, n_test))
        sizes = {"train": n * 8 // 10, "val": n * 9 // 10 - n * 8 // 10, "test": n - n * 9 // 10}
    else:
        raise ValueError(f"unknown tiny LRA task {task!r}; valid: {list(LRA_TASKS)}")
    if min(sizes.values()) < 1:
        raise ValueError(f"LRA {task}: sizes {n_train}/{n_val}/{n_test} leave a split empty")
    return sizes


def _listops(out: Path, seed: int, n_train: int, n_val: int, n_test: int) -> None:
    """The project's ListOps generator at mini-LRA's tiny shape (10 < length < 40, depth <= 3,
    2-5 arguments): the label is the tree's value."""
    from data_prep.listops import write_splits

    sizes = (n_train, n_val, n_test)
    write_splits(out / "listops-1000", sizes, 10, 40, max_depth=3, max_args=5, seed=seed)


def _text(out: Path, seed: int, n_train: int, n_val: int, n_test: int) -> None:
    """`finetune.lra.synthetic`'s aclImdb-layout reviews of 6-12 neutral words and 3 cue words
    (label: most cues positive), at most ~150 bytes. val is the test set (n_val unused)."""
    from finetune.lra.synthetic import write_synthetic_imdb

    write_synthetic_imdb(out, n_train, n_test, min_words=6, max_words=12, seed=seed)


def _retrieval(out: Path, seed: int, n_train: int, n_val: int, n_test: int) -> None:
    """AAN pair TSVs (no header, TAB, `label id1 id2 text1 text2`): 6-14 plain words with a
    marker word each; label 1 iff the two markers are the same. Under 200 bytes a document."""
    rng = random.Random(f"tiny-retrieval:{seed}")
    for split, n in (("train", n_train), ("eval", n_val), ("test", n_test)):
        lines = []
        for i, label in enumerate(_balanced(rng, n, 2)):
            a = rng.choice(MARKERS)
            b = a if label else rng.choice([m for m in MARKERS if m != a])
            docs = []
            for marker in (a, b):
                words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
                words.insert(rng.randint(0, len(words)), marker)
                docs.append(" ".join(words))
            lines.append(f"{label}\tT{i:04d}-{split}a\tT{i:04d}-{split}b\t{docs[0]}\t{docs[1]}")
        _write_lines(out / "tsv_data" / f"new_aan_pairs.{split}.tsv", lines)


def _image(out: Path, seed: int, n_train: int, n_val: int, n_test: int) -> None:
    """CIFAR-10 python pickles (protocol 2, as released): the class is the image's brightness,
    grey level about 16 + 24 * label with +-12 noise per pixel and channel. Labels balanced
    within train, val (the last tenth of data_batch_1..5) and test."""
    sizes = lra_split_sizes("image", n_train, n_val, n_test)
    rng, np_rng = random.Random(f"tiny-image:{seed}"), _np_rng("image", seed)

    def batch(labels: list[int], name: str, first: int) -> dict:
        level = 16 + 24 * np.asarray(labels, dtype=np.int64)[:, None]
        noise = np_rng.integers(-12, 13, size=(len(labels), 3 * 1024))
        files = [b"tiny_%05d.png" % (first + k) for k in range(len(labels))]
        data = np.clip(level + noise, 0, 255).astype(np.uint8)
        return {
            b"batch_label": name.encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": files,
        }

    folder = out / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train = _balanced(rng, sizes["train"], 10) + _balanced(rng, sizes["val"], 10)
    parts = np.array_split(np.arange(len(train)), 5)
    batches = {
        f"data_batch_{b + 1}": batch([train[k] for k in part], f"training batch {b + 1} of 5", 0)
        for b, part in enumerate(parts)
    }
    batches["test_batch"] = batch(_balanced(rng, n_test, 10), "testing batch 1 of 1", len(train))
    for name, content in batches.items():
        with open(folder / name, "wb") as f:
            pickle.dump(content, f, protocol=2)


def _l_path(a: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of an L-shaped line: along a's row to end's column, then to end."""
    (y0, x0), (y1, x1) = a, end
    rows = np.r_[np.full(abs(x1 - x0) + 1, y0), np.arange(min(y0, y1), max(y0, y1) + 1)]
    cols = np.r_[np.arange(min(x0, x1), max(x0, x1) + 1), np.full(abs(y1 - y0) + 1, x1)]
    return rows, cols


def _path_image(rng: np.random.Generator, connected: bool) -> np.ndarray:
    """A 32x32 grey image: two bright dots and an L-shaped line from the first, ending on the
    second iff `connected` (else at a point away from it), on dim noise."""
    img = rng.integers(0, 40, size=(32, 32))
    while True:
        a, b, c = (rng.integers(2, 30, size=2) for _ in range(3))
        if np.abs(a - b).sum() < 10:
            continue
        rows, cols = _l_path(a, b if connected else c)
        far = np.maximum(np.abs(rows - b[0]), np.abs(cols - b[1])).min() > 2
        if connected or (far and np.abs(a - c).sum() >= 10):
            break
    img[rows, cols] = 200
    for y, x in (a, b):
        img[y - 1 : y + 2, x - 1 : x + 2] = 255
    return img.astype(np.uint8)


def _pathfinder(out: Path, seed: int, n_train: int, n_val: int, n_test: int) -> None:
    """Pathfinder-32 at the hard difficulty: metadata/<b>.npy text lines
    `imgs/<b> sample_<i>.png <k> <label> ...` and 8-bit grey PNGs (`_path_image`; label 1 iff
    the line connects the two dots). The reader splits the rows 80/10/10 by a seeded
    permutation (`lra_split_sizes`); labels are balanced within each of its splits."""
    from PIL import Image

    from finetune.lra.data import PATHFINDER_SPLIT_SEED, split_indices

    n = sum(lra_split_sizes("pathfinder", n_train, n_val, n_test).values())
    rng, np_rng = random.Random(f"tiny-pathfinder:{seed}"), _np_rng("pathfinder", seed)
    labels = np.zeros(n, dtype=np.int64)
    for split in ("train", "val", "test"):
        where = split_indices(n, split, PATHFINDER_SPLIT_SEED)
        labels[where] = _balanced(rng, len(where), 2)
    base = out / PATHFINDER_DIR
    lines: dict[int, list[str]] = {}
    for k, label in enumerate(labels.tolist()):
        b, i = divmod(k, PATHFINDER_PER_FILE)
        path = base / "imgs" / str(b) / f"sample_{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(_path_image(np_rng, bool(label))).save(path, format="PNG")
        lines.setdefault(b, []).append(f"imgs/{b} sample_{i}.png {k} {label} 0.75 1.5 2 1")
    for b, batch in lines.items():
        _write_lines(base / "metadata" / f"{b}.npy", batch)


_LRA_WRITERS: dict[str, Callable[..., None]] = {
    "listops": _listops,
    "text": _text,
    "retrieval": _retrieval,
    "image": _image,
    "pathfinder": _pathfinder,
}


def write_lra(
    root: str | os.PathLike,
    tasks: Sequence[str] = LRA_TASKS,
    seed: int = 0,
    *,
    n_train: int = 64,
    n_val: int = 32,
    n_test: int = 32,
) -> Path:
    """Writes the asked LRA tasks under one `lra_release`-style root; returns it (the `--data`
    of `python -m finetune lra`). `lra_split_sizes` gives the rows each split will have."""
    unknown = [t for t in tasks if t not in _LRA_WRITERS]
    if unknown or not tasks:
        raise ValueError(f"unknown tiny LRA tasks {unknown or tasks}; valid: {list(LRA_TASKS)}")
    for task in tasks:
        lra_split_sizes(task, n_train, n_val, n_test)
    with _staged(root) as tmp:
        for task in dict.fromkeys(tasks):
            _LRA_WRITERS[task](tmp, seed, n_train, n_val, n_test)
    return Path(root)


# ----------------------------------------------------------------------------- GLUE

_RELATION = {
    "0": "other",
    "1": "same",
    "entailment": "same",
    "not_entailment": "other",
    "neutral": "other",
    "contradiction": "negated",
}
"""Pair tasks: how segment B is made for each label (see `_pair`)."""
_MNLI_TEXT = (
    "index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
    "sentence2_parse sentence1 sentence2"
)
_STSB_TEXT = "index genre filename year old_index source1 source2 sentence1 sentence2"
_MNLI_HEAD, _STSB_HEAD = _MNLI_TEXT.split(), _STSB_TEXT.split()
_GENRES = {"dev_mismatched": "letters", "test_mismatched": "letters"}
Row = Callable[[int, str, str, str], list[str]]


def _pair(rng: random.Random, relation: str) -> tuple[str, str]:
    """(A, B) of 5-8 words: B is A's words shuffled less one ("same"), that with "not"
    ("negated"), or words A does not have ("other")."""
    a = rng.sample(WORDS, rng.randint(5, 8))
    if relation == "other":
        b = rng.sample([w for w in WORDS if w not in a], rng.randint(4, 7))
    else:
        b = rng.sample(a, len(a) - 1)
        if relation == "negated":
            b.insert(rng.randint(0, len(b)), "not")
    return " ".join(a), " ".join(b)


def _stsb_pair(rng: random.Random, shared: int) -> tuple[str, str]:
    """(A, B) of 5 words each with `shared` words in common (the score)."""
    a = rng.sample(WORDS, 5)
    b = rng.sample(a, shared) + rng.sample([w for w in WORDS if w not in a], 5 - shared)
    rng.shuffle(b)
    return " ".join(a), " ".join(b)


def _glue_layout(name: str, split: str) -> tuple[list[str] | None, Row]:
    """(header or None, row builder (i, A, B, label) -> columns) of a split's original TSV."""
    test = split.startswith("test") or name == "ax"
    end = [] if test else ["label"]
    if name == "cola":
        if test:
            return ["index", "sentence"], lambda i, a, b, y: [str(i), a]
        return None, lambda i, a, b, y: ["tiny", y, "" if y == "1" else "*", a]
    if name == "sst2":
        if test:
            return ["index", "sentence"], lambda i, a, b, y: [str(i), a]
        return ["sentence", "label"], lambda i, a, b, y: [a, y]
    if name == "mrpc":
        head = ["index" if test else "\ufeffQuality", "#1 ID", "#2 ID", "#1 String", "#2 String"]
        return head, lambda i, a, b, y: [str(i) if test else y, str(1000 + i), str(5000 + i), a, b]
    if name == "stsb":

        def stsb(i: int, a: str, b: str, y: str) -> list[str]:
            cols = [str(i), "main-captions", "MSRvid", "2012test", f"{i:04d}", "none", "none", a, b]
            return cols if test else [*cols, y]

        return (_STSB_HEAD if test else [*_STSB_HEAD, "score"]), stsb
    if name == "qqp":
        if test:
            return ["id", "question1", "question2"], lambda i, a, b, y: [str(i), a, b]
        head = ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"]
        return head, lambda i, a, b, y: [str(i), str(2 * i + 1), str(2 * i + 2), a, b, y]
    if name == "mnli":
        n = 0 if test else 1 if split == "train" else 5
        head = [*_MNLI_HEAD, *(f"label{k}" for k in range(1, n + 1)), *(["gold_label"] * (n > 0))]
        genre = _GENRES.get(split, "fiction")

        def mnli(i: int, a: str, b: str, y: str) -> list[str]:
            cols = [str(i), str(31000 + i), f"{31000 + i}n", genre, f"( {a} )", f"( {b} )"]
            return [*cols, f"(ROOT (S {a}))", f"(ROOT (S {b}))", a, b, *[y] * (n + (n > 0))]

        return head, mnli
    names = ["question", "sentence"] if name == "qnli" else ["sentence1", "sentence2"]
    return ["index", *names, *end], lambda i, a, b, y: [str(i), a, b, *([] if test else [y])]


def _glue_task(folder: Path, name: str, seed: int, sizes: dict[str, int]) -> None:
    """Every split of one task: labels balanced per split (test files too, unlabelled)."""
    from finetune.glue.tasks import get_task

    task = get_task(name)
    rng = random.Random(f"tiny-glue:{name}:{seed}")
    for split in task.splits:
        n = sizes[split.split("_")[0]]
        header, row = _glue_layout(name, split)
        lines = [] if header is None else ["\t".join(header)]
        for i, y in enumerate(_balanced(rng, n, 6 if task.is_regression else len(task.labels))):
            if task.is_regression:
                (a, b), label = _stsb_pair(rng, y), f"{y:.3f}"  # score = shared words
            elif name in GLUE_CUES:
                words = rng.sample(WORDS, rng.randint(5, 8))
                words.insert(rng.randint(0, len(words)), GLUE_CUES[name][y])
                a, b, label = " ".join(words), "", task.labels[y]
            else:
                label = task.labels[y]
                a, b = _pair(rng, _RELATION[label])
            if name in ("qqp", "qnli"):
                a += "?"
            lines.append("\t".join(row(i, a, b, label)))
        _write_lines(folder / task.dir_name / task.tsv_file(split), lines)


def write_glue(
    root: str | os.PathLike,
    tasks: Sequence[str] | None = None,
    seed: int = 0,
    *,
    n_train: int = 64,
    n_dev: int = 32,
    n_test: int = 16,
) -> Path:
    """Writes the original GLUE TSV layout of `tasks` (default: the 9 scored tasks and AX)
    under `root`; returns it (the `--data` of `python -m finetune glue`). Each dev split (MNLI:
    both) has n_dev rows, each test split n_test. Signals: CoLA, SST-2 a cue word per label;
    pair tasks B = A's words (paraphrase, duplicate, entailment), those with "not"
    (contradiction) or other words; STS-B the number of shared words (of 5) as the score."""
    tasks = GLUE_TASKS if tasks is None else tuple(tasks)
    unknown = [t for t in tasks if t not in GLUE_TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown tiny GLUE tasks {unknown or tasks}; valid: {list(GLUE_TASKS)}")
    if min(n_train, n_dev, n_test) < 1:
        raise ValueError(f"GLUE sizes must be >= 1, got {n_train}/{n_dev}/{n_test}")
    sizes = {"train": n_train, "dev": n_dev, "test": n_test}
    with _staged(root) as tmp:
        for name in dict.fromkeys(tasks):
            _glue_task(tmp, name, seed, sizes)
    return Path(root)


# ----------------------------------------------------------------------------- HF ALBERT


def write_hf_albert(
    out: str | os.PathLike, tokenizer_file: str | os.PathLike, seed: int = 0, **sizes: Any
) -> Path:
    """A randomly initialised tiny `AlbertForPreTraining` saved as `transformers` does
    (config.json, model.safetensors) with `tokenizer_file` as out/tokenizer.json: the `--init`
    of `python -m finetune glue --attention tisa` and of `model.hub.hf_import`. `sizes` override
    `HF_SIZES` (any AlbertConfig field); vocab_size and pad_token_id are the tokenizer's."""
    import torch

    try:
        import transformers
    except ImportError as e:
        raise ValueError(f'write_hf_albert needs transformers: pip install -e ".[hf]" ({e})') from e
    from data_prep.tokenizer import load_tokenizer
    from finetune.glue.data import pad_token_id

    tok = load_tokenizer(tokenizer_file)
    fixed = {"vocab_size": tok.get_vocab_size(), "pad_token_id": pad_token_id(tok)}
    config = transformers.AlbertConfig(**{**HF_SIZES, **sizes, **fixed})
    with _staged(out) as tmp, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AlbertForPreTraining(config).eval()
        model.save_pretrained(tmp, safe_serialization=True)
        shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
    return Path(out)


__all__ = ["lra_split_sizes", "write_glue", "write_hf_albert", "write_lra"]
