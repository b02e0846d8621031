"""A byte-level, IMDb-shaped sentiment task generated offline, in the `aclImdb` folder layout.

The CPU mini-LRA needs a second task that needs no download. This one has Text's shape (byte
ids, binary labels, read by the official `aclImdb` loader, `read_aclimdb`) and a rule that
must be found from bytes and aggregated over the whole document:

    a review = neutral words (drawn from the embedded corpus, CPython's documentation) with
    `num_cues` sentiment words (an odd number) at random places, each from a positive or a
    negative list; label = positive iff most of the cue words are positive.

So a model must spell the cue words out of bytes (no tokenizer) and count them wherever they
are. Written as aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt with ratings 7-10 (pos) and
1-4 (neg), as in the real data set; balanced labels; seeded, so the same arguments give the
same bytes. As in LRA, val is the test set: the mini-LRA evaluates once, at the last step, so
nothing is selected on it.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

from albatross.files import staged_directory
from data_prep.corpus import embedded_documents

POSITIVE = ("good", "great", "excellent", "wonderful", "superb", "brilliant", "lovely", "fine")
NEGATIVE = ("bad", "awful", "terrible", "boring", "dreadful", "poor", "horrible", "dull")
CUE_STYLES = ("words", "mirrored")
"""`words`: the two lists above. `mirrored`: the positive words and the same words spelt
backwards as the negative cues ("good" / "doog"), so the two classes have the same letters and
a bag of bytes cannot tell them apart: the order of the bytes inside a word decides."""


def cue_lists(style: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(positive, negative) cue words for a `CUE_STYLES` entry."""
    if style == "words":
        return POSITIVE, NEGATIVE
    if style == "mirrored":
        return POSITIVE, tuple(w[::-1] for w in POSITIVE)
    raise ValueError(f"cue style {style!r} is not one of {list(CUE_STYLES)}")


def neutral_words() -> list[str]:
    """Lower-case alphabetic words of 3-9 letters from the embedded corpus, sorted, without
    the cue words."""
    cues = set(POSITIVE) | set(NEGATIVE) | set(cue_lists("mirrored")[1])
    words: set[str] = set()
    for doc in embedded_documents():
        words.update(w.lower() for w in re.findall(r"\b[A-Za-z]{3,9}\b", doc))
    return sorted(words - cues)


def make_review(
    rng: random.Random, vocab: list[str], num_words: int, num_cues: int, cue_style: str = "words"
) -> tuple[str, int]:
    """(text, label): `num_words` neutral words with `num_cues` cue words inserted."""
    positive, negative = cue_lists(cue_style)
    positives = rng.randint(0, num_cues)
    cues = [rng.choice(positive) for _ in range(positives)]
    cues += [rng.choice(negative) for _ in range(num_cues - positives)]
    words = [rng.choice(vocab) for _ in range(num_words)]
    for cue in cues:
        words.insert(rng.randint(0, len(words)), cue)
    text = " ".join(words)
    return text[0].upper() + text[1:] + ".", int(2 * positives > num_cues)


def write_synthetic_imdb(
    out: str | os.PathLike,
    train: int = 2000,
    test: int = 500,
    *,
    min_words: int = 15,
    max_words: int = 30,
    num_cues: int = 3,
    seed: int = 0,
    cue_style: str = "words",
) -> Path:
    """Writes `out`/aclImdb (see the module docstring); returns that folder. Refuses to write
    into an existing aclImdb folder."""
    cue_lists(cue_style)  # validates the style
    if num_cues < 1 or num_cues % 2 == 0:
        raise ValueError(f"num_cues must be odd and >= 1 (no ties), got {num_cues}")
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words, got {min_words}, {max_words}")
    root = Path(out) / "aclImdb"
    if root.exists():
        raise FileExistsError(f"{root} exists; choose another --out or delete it")
    vocab = neutral_words()
    rng = random.Random(f"synthetic-imdb:{seed}")
    with staged_directory(root, "the synthetic IMDb corpus") as tmp:
        for split, count in (("train", train), ("test", test)):
            made = {0: 0, 1: 0}
            for label in (0, 1):
                (tmp / split / ("pos" if label else "neg")).mkdir(parents=True, exist_ok=True)
            while made[0] + made[1] < count:
                num_words = rng.randint(min_words, max_words)
                text, label = make_review(rng, vocab, num_words, num_cues, cue_style)
                if made[label] >= (count + 1 - label) // 2:  # balanced: neg gets the odd one
                    continue
                rating = rng.randint(7, 10) if label else rng.randint(1, 4)
                name = f"{made[label]}_{rating}.txt"
                (tmp / split / ("pos" if label else "neg") / name).write_text(
                    text, encoding="utf-8"
                )
                made[label] += 1
    return root
