"""The Long Range Arena tasks: one frozen `LraTask` each, and the one vocabulary they share.

Vocabulary (every task; ids are what the model's embedding sees):

    0            PAD   padding only: never a data value, so a black pixel or byte 0 is never masked
    1            CLS   prepended to every sequence (each document of a Retrieval pair) by default
    2            SEP   reserved (no LRA task needs a separator)
    3            MASK  reserved for masked-language-model self-pretraining on the task's inputs
    4 + v        data value v (OFFSET = 4):
                   Text, Retrieval  v = a byte of the UTF-8 text, 0..255
                   Image, Pathfinder, Path-X  v = a grey level, 0..255 (0 is black)
                   ListOps  v = the token's position in LISTOPS_VOCAB, 0..14

so `vocab_size` is OFFSET + 256 for bytes and pixels and OFFSET + 15 for ListOps. The official
pipelines use id 0 for padding AND for the black pixel (Image, Pathfinder take the grey level
as the id), which masks black pixels; here every data value is shifted past the specials.

ListOps tokens are the whitespace tokens of the official `Source` without its parentheses
(`data_prep.listops.model_tokens`): digits 0-9, `[MIN`, `[MAX`, `[MED`, `[SM` and the closing
`]`. The brackets are kept (the official `tfds` tokenizer drops `[`/`]` and so loses where an
operator ends); the parentheses carry no further information and are dropped, so a sequence's
length is the generator's official `length` (< 2000).

Lengths: `LraTask.max_length` counts data tokens per document, the official LRA length (the
official models add their CLS inside the model). With CLS a sequence is at most
`max_length + 1` tokens (`LraTask.sequence_length`), which is what position embeddings must
cover.

Splits are "train", "val", "test" for every task; `LraTask.official` names the files each comes
from (data.py documents how val is made where the release has no validation set).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data_prep.listops import END, OPERATORS, model_tokens

PAD_ID = 0
CLS_ID = 1
SEP_ID = 2
MASK_ID = 3
SPECIAL_TOKENS = ("<pad>", "[CLS]", "[SEP]", "[MASK]")
OFFSET = len(SPECIAL_TOKENS)
"""Data value v has id v + OFFSET."""

LISTOPS_VOCAB: tuple[str, ...] = (*(str(d) for d in range(10)), *OPERATORS, END)
"""ListOps data values: '0'..'9', '[MIN', '[MAX', '[MED', '[SM', ']' (values 0..14)."""
_LISTOPS_CODES = {tok: code for code, tok in enumerate(LISTOPS_VOCAB)}

SPLITS = ("train", "val", "test")

# Input kinds (how a document's data values are made).
LISTOPS = "listops"
BYTES = "bytes"
PIXELS = "pixels"

PATHFINDER_DIFFICULTIES = {
    "easy": "curv_baseline",
    "intermediate": "curv_contour_length_9",
    "hard": "curv_contour_length_14",
}
"""The official tfds split names of the three Pathfinder difficulty folders."""


@dataclass(frozen=True)
class LraTask:
    """One Long Range Arena task."""

    name: str
    num_labels: int
    max_length: int
    """Default data tokens per document (the official length); CLS not counted."""
    input_kind: str
    """LISTOPS, BYTES or PIXELS."""
    official: tuple[tuple[str, str], ...]
    """(split, the official file or folder it is read from), for messages and docs."""
    data_subdirs: tuple[str, ...] = ()
    """Folders of an `lra_release` tree (or of a download) that hold the task's files; the
    loaders look in `data_dir` and in each `data_dir/<subdir>`."""
    pair: bool = False
    """Two documents per example (Retrieval: a dual encoder)."""
    image_side: int | None = None
    """Image tasks: the side of the square grey image (max_length = side * side)."""
    length_options: tuple[int, ...] = ()
    """Other max_length values of the literature (Text: 4000 in the LRA paper)."""

    @property
    def num_values(self) -> int:
        return len(LISTOPS_VOCAB) if self.input_kind == LISTOPS else 256

    @property
    def vocab_size(self) -> int:
        return OFFSET + self.num_values

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def is_image(self) -> bool:
        return self.image_side is not None

    def sequence_length(self, max_length: int | None = None, cls: bool = True) -> int:
        """The longest sequence (one document) a model sees: max_length data tokens, + 1 with
        CLS."""
        return self.resolve_max_length(max_length) + int(cls)

    def resolve_max_length(self, max_length: int | None) -> int:
        """`max_length` checked (None: the default). Image tasks take the whole image only."""
        if max_length is None:
            return self.max_length
        if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)):
            raise ValueError(f"{self.name}: max_length must be an int, got {max_length!r}")
        if max_length < 1:
            raise ValueError(f"{self.name}: max_length={max_length} is invalid; valid: >= 1")
        if self.is_image and max_length != self.max_length:
            raise ValueError(
                f"{self.name}: max_length={max_length} would cut the {self.image_side}x"
                f"{self.image_side} image; the only valid value is {self.max_length}"
            )
        return int(max_length)

    def check_split(self, split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"LRA {self.name}: unknown split {split!r}; valid: {list(SPLITS)}")

    def official_source(self, split: str) -> str:
        self.check_split(split)
        return dict(self.official)[split]


TASKS: dict[str, LraTask] = {
    task.name: task
    for task in (
        LraTask(
            name="listops",
            num_labels=10,
            max_length=2000,
            input_kind=LISTOPS,
            official=(
                ("train", "basic_train.tsv"),
                ("val", "basic_val.tsv"),
                ("test", "basic_test.tsv"),
            ),
            data_subdirs=("listops-1000",),
        ),
        LraTask(
            name="text",
            num_labels=2,
            max_length=1000,
            input_kind=BYTES,
            official=(
                ("train", "aclImdb/train"),
                ("val", "aclImdb/test"),
                ("test", "aclImdb/test"),
            ),
            length_options=(4000,),
        ),
        LraTask(
            name="retrieval",
            num_labels=2,
            max_length=4000,
            input_kind=BYTES,
            official=(
                ("train", "new_aan_pairs.train.tsv"),
                ("val", "new_aan_pairs.eval.tsv"),
                ("test", "new_aan_pairs.test.tsv"),
            ),
            data_subdirs=("tsv_data",),
            pair=True,
        ),
        LraTask(
            name="image",
            num_labels=10,
            max_length=32 * 32,
            input_kind=PIXELS,
            official=(
                ("train", "cifar-10-batches-py/data_batch_1..5 [:45000]"),
                ("val", "cifar-10-batches-py/data_batch_1..5 [45000:]"),
                ("test", "cifar-10-batches-py/test_batch"),
            ),
            data_subdirs=("cifar-10-batches-py",),
            image_side=32,
        ),
        LraTask(
            name="pathfinder",
            num_labels=2,
            max_length=32 * 32,
            input_kind=PIXELS,
            official=(
                ("train", "pathfinder32/<difficulty>/metadata/*.npy 80%"),
                ("val", "pathfinder32/<difficulty>/metadata/*.npy 10%"),
                ("test", "pathfinder32/<difficulty>/metadata/*.npy 10%"),
            ),
            data_subdirs=("pathfinder32",),
            image_side=32,
        ),
        LraTask(
            name="pathx",
            num_labels=2,
            max_length=128 * 128,
            input_kind=PIXELS,
            official=(
                ("train", "pathfinder128/<difficulty>/metadata/*.npy 80%"),
                ("val", "pathfinder128/<difficulty>/metadata/*.npy 10%"),
                ("test", "pathfinder128/<difficulty>/metadata/*.npy 10%"),
            ),
            data_subdirs=("pathfinder128",),
            image_side=128,
        ),
    )
}


def get_task(task: str | LraTask) -> LraTask:
    """The task called `task` (or `task` itself); ValueError naming the valid ones."""
    if isinstance(task, LraTask):
        return task
    if task not in TASKS:
        raise ValueError(f"unknown LRA task {task!r}; valid: {list(TASKS)}")
    return TASKS[task]


# ----------------------------------------------------------------------------- data values


def listops_codes(source: str) -> np.ndarray:
    """(L,) uint8 data values of a ListOps Source: its whitespace tokens without the
    parentheses (`model_tokens`), each token's position in LISTOPS_VOCAB.

    KeyError names the first token that is neither in LISTOPS_VOCAB nor a parenthesis."""
    try:
        return np.fromiter((_LISTOPS_CODES[tok] for tok in model_tokens(source)), dtype=np.uint8)
    except KeyError as e:
        raise KeyError(f"token {e.args[0]!r} is not in the ListOps vocabulary") from None


def listops_codes_batch(sources: Sequence[str]) -> list[np.ndarray] | None:
    """`listops_codes` of many sources at once, vectorised over their bytes (several times
    faster on official rows), or None when some source is not made of space-separated
    vocabulary tokens and parentheses only: then use `listops_codes` per source, which splits
    on any whitespace and names a bad token. Whenever it returns codes, they equal
    `listops_codes`'s."""
    if not sources:
        return []
    data = "\n".join(sources).encode("utf-8")
    if data.translate(None, _LISTOPS_BYTES) or data.count(b"\n") != len(sources) - 1:
        return None  # a byte no token has, or a newline inside a source
    n = len(data)
    padded = np.frombuffer(data + b"    ", dtype=np.uint8)  # operator look-ahead past the end
    arr = padded[:n]
    sep = (arr == _SP) | (arr == _NL)
    word = (arr >= ord("A")) & (arr != _RB)  # '[' and the operator letters
    # Every token is one byte but the operators: no two neighbours are both token bytes unless
    # both are operator bytes.
    if (~sep[1:] & ~sep[:-1] & ~(word[1:] & word[:-1])).any():
        return None
    # Every '[' starts an exact operator followed by a separator (or the end), and there are no
    # other letters; so every run of operator bytes is exactly one operator.
    lb = np.flatnonzero(arr == _LB)
    c1, c2, c3, c4 = (padded[lb + k] for k in (1, 2, 3, 4))
    end3, end4 = (c3 == _SP) | (c3 == _NL), (c4 == _SP) | (c4 == _NL)
    long_op = (
        (c1 == ord("M"))
        & end4
        & (
            ((c2 == ord("I")) & (c3 == ord("N")))
            | ((c2 == ord("A")) & (c3 == ord("X")))
            | ((c2 == ord("E")) & (c3 == ord("D")))
        )
    )
    short_op = (c1 == ord("S")) & (c2 == ord("M")) & end3
    letters = np.count_nonzero(word) - len(lb)
    op_letters = 3 * np.count_nonzero(long_op) + 2 * np.count_nonzero(short_op)
    if not (long_op | short_op).all() or letters != op_letters:
        return None
    # Data tokens: digits, ']' and operators (their '['); an operator is known by its 3rd byte.
    at = np.flatnonzero(((arr >= ord("0")) & (arr <= ord("9"))) | (arr == _RB) | (arr == _LB))
    codes = _LISTOPS_FIRST[arr[at]]
    op = codes == _BRACKET
    codes[op] = _LISTOPS_THIRD[padded[at[op] + 2]]
    return np.split(codes, np.searchsorted(at, np.flatnonzero(arr == _NL)))


# Byte tables of `listops_codes_batch`: the code of a token's first byte (digits, ']'), or
# _BRACKET for '['; an operator's code by its third byte.
_BRACKET, _INVALID = 254, 255
_SP, _NL, _LB, _RB = ord(" "), ord("\n"), ord("["), ord("]")
_LISTOPS_BYTES = b"0123456789()[] \nMINAXEDS"
_LISTOPS_FIRST = np.full(256, _INVALID, dtype=np.uint8)
_LISTOPS_FIRST[_LB] = _BRACKET
_LISTOPS_THIRD = np.full(256, _INVALID, dtype=np.uint8)
for _tok, _code in _LISTOPS_CODES.items():
    if len(_tok) == 1:
        _LISTOPS_FIRST[ord(_tok)] = _code
    else:
        _LISTOPS_THIRD[ord(_tok[2])] = _code


def byte_codes(text: str | bytes) -> np.ndarray:
    """(L,) uint8 data values of a text: the bytes of its UTF-8 encoding."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).copy()


def to_ids(codes: np.ndarray, cls: bool = True) -> np.ndarray:
    """(L,) data values -> (L + cls,) int32 token ids: [CLS] then value + OFFSET."""
    ids = np.empty(len(codes) + int(cls), dtype=np.int32)
    if cls:
        ids[0] = CLS_ID
    ids[int(cls) :] = codes
    ids[int(cls) :] += OFFSET
    return ids


def rgb_to_grayscale(rgb: np.ndarray) -> np.ndarray:
    """(..., 3) uint8 RGB -> (...) uint8 grey, as `tf.image.rgb_to_grayscale` on uint8 input.

    TF converts to float32 in [0, 1] (`convert_image_dtype`: value * (1 / 255)), takes the
    weighted sum with [0.2989, 0.5870, 0.1140] (ITU-R 601), and converts back with
    `convert_image_dtype(..., uint8)`, which multiplies by 255.5 (`dtype.max + 0.5`) and CASTS,
    i.e. truncates: grey = trunc(255.5 * sum_c w_c * (x_c / 255)). Not rounding: pure green
    (0, 255, 0) is 149 (0.587 * 255.5 = 149.98), where rounding (and PIL's convert("L")) gives
    150. Computed in float32 like TF; the order of the three-term sum can move a value that is
    within float32 rounding of an integer by one grey level (47 of the 2^24 colours between
    the two orders measured here), so TF's exact summation order is not guaranteed to match.
    """
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8 or rgb.shape[-1:] != (3,):
        raise ValueError(f"expected (..., 3) uint8 RGB, got {rgb.dtype} {rgb.shape}")
    flt = rgb.astype(np.float32) * np.float32(1.0 / 255)
    w = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)
    grey = flt[..., 0] * w[0] + flt[..., 1] * w[1] + flt[..., 2] * w[2]
    return (grey * np.float32(255.5)).astype(np.uint8)
