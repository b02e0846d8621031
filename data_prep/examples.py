"""ALBERT sentence-pair examples from tokenized documents (`build_examples`: target lengths,
segments A and B, sentence-order swaps, one seeded stream per document) and the held-out
validation split of the documents (`choose_validation`). The rules against ALBERT's
`create_pretraining_data.py`: docs/methods.md, "ALBERT backbone"."""

from __future__ import annotations

import heapq
import logging
import math
import random
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from data_prep import format as fmt
from data_prep.shard_config import ShardConfig

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- examples


def build_examples(
    sentences: Sequence[Sequence[int]],
    max_num_tokens: int,
    short_seq_prob: float,
    rng: random.Random,
    truncation: str = "albert",
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """ALBERT SOP examples (A, B) of one tokenized document, and the number of tokens dropped
    (truncation, one-token leftovers). See the module docstring for the rules."""

    def draw_target() -> int:
        if rng.random() < short_seq_prob:
            return rng.randint(2, max_num_tokens)
        return max_num_tokens

    queue = deque(list(s) for s in sentences if len(s))
    examples: list[tuple[list[int], list[int]]] = []
    dropped = 0
    chunk: list[list[int]] = []
    length = 0
    target = draw_target()
    while queue:
        segment = queue.popleft()
        if len(segment) > target:
            # Cut a too-long sentence so the open chunk ends exactly at the target.
            cut = target - length
            queue.appendleft(segment[cut:])
            segment = segment[:cut]
        chunk.append(segment)
        length += len(segment)
        if not queue or length >= target:
            pair, lost = _split_chunk(chunk, max_num_tokens, rng, truncation)
            dropped += lost
            if pair is not None:
                examples.append(pair)
            chunk, length = [], 0
            target = draw_target()
    return examples, dropped


def _split_chunk(
    chunk: list[list[int]], max_num_tokens: int, rng: random.Random, truncation: str = "albert"
) -> tuple[tuple[list[int], list[int]] | None, int]:
    if len(chunk) >= 2:
        a_end = rng.randint(1, len(chunk) - 1)
        a = [t for seg in chunk[:a_end] for t in seg]
        b = [t for seg in chunk[a_end:] for t in seg]
    else:
        (tokens,) = chunk
        if len(tokens) < 2:
            return None, len(tokens)
        cut = rng.randint(1, len(tokens) - 1)
        a, b = tokens[:cut], tokens[cut:]
    if truncation == "junction":
        # The lengths of truncate_seq_pair, taken from A's front and B's back: the junction stays.
        la, lb = fmt.truncated_pair_lengths(len(a), len(b), max_num_tokens)
        lost = len(a) + len(b) - la - lb
        return (a[len(a) - la :], b[:lb]), lost
    # ALBERT's truncate_seq_pair: drop from the longer side, front or back at random.
    a0, a1, b0, b1 = 0, len(a), 0, len(b)
    while (a1 - a0) + (b1 - b0) > max_num_tokens:
        if a1 - a0 > b1 - b0:
            if rng.random() < 0.5:
                a0 += 1
            else:
                a1 -= 1
        elif rng.random() < 0.5:
            b0 += 1
        else:
            b1 -= 1
    lost = len(a) + len(b) - (a1 - a0) - (b1 - b0)
    return (a[a0:a1], b[b0:b1]), lost


def document_rng(seed: int, document_index: int) -> random.Random:
    """The RNG of one document: depends on (seed, d) only."""
    return random.Random(f"{seed}:{document_index}")


# ----------------------------------------------------------------------------- validation split


@dataclass(frozen=True)
class ValidationSplit:
    """Which documents are held out for validation (the rule: format.py's docstring).

    rule "fraction": d is held out iff key(d) < threshold (an int, floor(F * 2**64)).
    rule "documents": d is held out iff (key(d), d) <= threshold (the N-th smallest (key, d)
    of the input, found by `choose_validation`'s read of the input)."""

    seed: int
    rule: str
    threshold: int | tuple[int, int]
    requested: float | int
    """The fraction F or the count N asked for."""

    def held_out(self, document_index: int) -> bool:
        key = fmt.validation_key(self.seed, document_index)
        if isinstance(self.threshold, int):  # rule "fraction"
            return key < self.threshold
        return (key, document_index) <= self.threshold

    def selection(self) -> dict[str, Any]:
        """What the manifest and the done-records report under validation.selection."""
        if isinstance(self.threshold, int):
            return {"rule": "fraction", "fraction": self.requested, "threshold": self.threshold}
        return {
            "rule": "documents",
            "documents": self.requested,
            "threshold": list(self.threshold),
        }

    def describe(self, num_shards: int) -> str:
        """The rule in words, with this split's numbers (the manifest's validation.how)."""
        key = (
            f"key(d) = the first 8 bytes, big-endian, of blake2b(f'{self.seed}:{{d}}'.encode(), "
            "digest_size=8, person=b'validation')"
        )
        if isinstance(self.threshold, int):
            which = f"key(d) < {self.threshold} (floor({self.requested} * 2**64))"
        else:
            which = (
                f"(key(d), d) is among the {self.requested} smallest of the input, i.e. "
                f"<= {list(self.threshold)}"
            )
        return (
            f"document d (0-based, input order) is held out iff {which}, where {key}; a held-out "
            f"document's examples are in valid_{{d % {num_shards}}}, never in a training shard"
        )


def choose_validation(config: ShardConfig) -> ValidationSplit | None:
    """The validation split of `config` (None without one). --validation-documents N reads the
    input once (no tokenizing) to find the N documents with the smallest keys; ValueError if
    the input has no more than N documents (nothing would be left to train on)."""
    if config.validation_fraction > 0:
        threshold = math.floor(Fraction(config.validation_fraction) * 2**64)
        return ValidationSplit(config.seed, "fraction", threshold, config.validation_fraction)
    if not config.validation_documents:
        return None
    n = config.validation_documents
    start = time.perf_counter()
    readers_log = logging.getLogger("data_prep.readers")
    level = readers_log.level
    readers_log.setLevel(logging.ERROR)  # the build's own read warns about bad input
    try:
        docs = config.read()
        count = 0

        def keys() -> Iterator[tuple[int, int]]:
            nonlocal count
            for d, _ in enumerate(docs):
                count = d + 1
                yield fmt.validation_key(config.seed, d), d

        smallest = heapq.nsmallest(n, keys())
    finally:
        readers_log.setLevel(level)
    if n >= count:
        raise ValueError(
            f"--validation-documents {n} leaves no training documents: the input has "
            f"{count} document(s); use a smaller N (at most {count - 1}) or --validation-fraction"
        )
    log.info(
        "validation split: %d of %d documents held out (chosen in %.1f s, one read of the input)",
        n,
        count,
        time.perf_counter() - start,
    )
    return ValidationSplit(config.seed, "documents", smallest[-1], n)
