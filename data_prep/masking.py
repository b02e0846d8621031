"""ALBERT's masked-LM and sentence-order objectives, applied to one example at training time.

ALBERT (Lan et al. 2020, arXiv 1909.11942; google-research/albert `create_pretraining_data.py`):

* **n-gram masking.** A budget of `round(mlm_probability * num_real_tokens)` (at least 1) tokens
  is predicted. Candidate start units (whole words, or single tokens) are visited in random
  order; for each one a span length `n <= max_ngram` is drawn with `P(n) ~ 1/n`
  (n=1: 6/11, n=2: 3/11, n=3: 2/11 for max_ngram=3), renormalised over the lengths that fit in
  the segment; if the span would overrun the budget shorter lengths are tried; a span that
  overlaps an already chosen one is skipped; the loop stops when the budget is reached.
* **80/10/10.** Each predicted token is replaced by `[MASK]` (80%), a random non-special token
  (10%) or left unchanged (10%).
* **SOP.** Segments A and B (consecutive text of one document) are swapped with probability 0.5;
  label 1 = swapped (done by the loader, configured here).

Decisions where ALBERT's code is silent or awkward:

* Spans never cross a special token ([SEP]): ALBERT's candidates skip [CLS]/[SEP] and so let a
  2-gram join the last word of A with the first word of B. Here a span stays in its segment.
* "Round" is round-half-up (`floor(x + 0.5)`), not Python's banker's rounding.
* With `whole_word=False` the budget is always met exactly (a 1-gram always fits). With
  `whole_word=True` a word longer than the remaining budget is skipped (ALBERT does the same),
  so an example can end a little under budget when only long words remain.
* The accepted spans follow 1/n closely only at low density: at 15% of 128 tokens, overlapping
  (more often long) spans are skipped and the last span is shortened to fit the budget, so the
  accepted lengths come out near (0.60, 0.25, 0.15) instead of (0.55, 0.27, 0.18), as in ALBERT.
* `static_masked_positions = K` caps the budget at K (ALBERT's `max_predictions_per_seq`), so
  the masked input never hides a token that has no label, and pads the position list to K.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MaskingConfig:
    """Dynamic MLM + SOP settings (ALBERT defaults)."""

    mlm_probability: float = 0.15
    """Share of real (non-special, non-pad) tokens to predict; the per-example budget is
    `max(1, round(mlm_probability * num_real_tokens))`."""

    mask_token_fraction: float = 0.8
    """Of the predicted tokens: share replaced by [MASK]."""

    random_token_fraction: float = 0.1
    """Of the predicted tokens: share replaced by a uniformly drawn non-special token."""

    keep_fraction: float = 0.1
    """Of the predicted tokens: share left unchanged. The three fractions must sum to 1."""

    max_ngram: int = 3
    """Longest masked span, in units (words with `whole_word`, else tokens); P(n) ~ 1/n."""

    whole_word: bool = True
    """Spans are made of whole words (ALBERT's `do_whole_word_mask`, default True there). A token
    starts a word if it begins with "▁" (SentencePiece) or does not begin with "##" (WordPiece);
    see `word_start_table`. False: spans are made of single tokens."""

    sop_probability: float = 0.5
    """Probability that segments A and B are swapped (SOP label 1 = swapped)."""

    static_masked_positions: int | None = None
    """For compiled models: a fixed number K of masked positions per example. The budget is
    capped at K and each example also returns `masked_positions` (K,) indices (ascending, 0 as
    padding), `masked_weights` (K,) 1.0/0.0 and `masked_labels` (K,) (-100 at padding).
    None: dynamic count, labels only."""

    def __post_init__(self) -> None:
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {self.mlm_probability}")
        fractions = (self.mask_token_fraction, self.random_token_fraction, self.keep_fraction)
        if any(not 0.0 <= f <= 1.0 for f in fractions):
            raise ValueError(f"mask/random/keep fractions must each be in [0, 1], got {fractions}")
        if abs(sum(fractions) - 1.0) > 1e-6:
            raise ValueError(
                f"mask_token_fraction + random_token_fraction + keep_fraction must be 1, "
                f"got {fractions} (sum {sum(fractions)})"
            )
        if isinstance(self.max_ngram, bool) or not isinstance(self.max_ngram, int):
            raise ValueError(f"max_ngram must be an int >= 1, got {self.max_ngram!r}")
        if self.max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {self.max_ngram}")
        if not isinstance(self.whole_word, bool):
            raise ValueError(f"whole_word must be a bool, got {self.whole_word!r}")
        if not 0.0 <= self.sop_probability <= 1.0:
            raise ValueError(f"sop_probability must be in [0, 1], got {self.sop_probability}")
        k = self.static_masked_positions
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"static_masked_positions must be None or an int >= 1, got {k!r}")

    def ngram_probabilities(self) -> np.ndarray:
        """P(n) for n = 1..max_ngram: proportional to 1/n."""
        p = 1.0 / np.arange(1, self.max_ngram + 1)
        return p / p.sum()


def _split_points(cfg: MaskingConfig) -> tuple[float, float]:
    return (cfg.mask_token_fraction, cfg.mask_token_fraction + cfg.random_token_fraction)


class MaskedExample(NamedTuple):
    """What `mask_example` returns. Arrays of length N unless noted."""

    input_ids: np.ndarray  # (N,) int64: ids after [MASK]/random/keep replacement
    labels: np.ndarray  # (N,) int64: original id where predicted, -100 elsewhere
    spans: list[tuple[int, int]]  # chosen spans as (first token position, number of units)
    masked_positions: np.ndarray | None  # (K,) int64, static mode only
    masked_weights: np.ndarray | None  # (K,) float32, static mode only
    masked_labels: np.ndarray | None  # (K,) int64, static mode only


def masking_budget(num_real_tokens: int, cfg: MaskingConfig) -> int:
    """Number of tokens to predict: round-half-up of p * n, at least 1 (0 if no real token)."""
    if num_real_tokens <= 0:
        return 0
    budget = max(1, math.floor(cfg.mlm_probability * num_real_tokens + 0.5))
    if cfg.static_masked_positions is not None:
        budget = min(budget, cfg.static_masked_positions)
    return budget


@functools.lru_cache(maxsize=16)
def _ngram_thresholds(max_ngram: int) -> tuple[tuple[float, ...], ...]:
    """Entry a (1 <= a <= max_ngram): the inner CDF points of P(n | n <= a), P(n) ~ 1/n;
    a uniform draw u gives n = 1 + #(points <= u)."""
    p = 1.0 / np.arange(1, max_ngram + 1)
    out: list[tuple[float, ...]] = [()]
    for a in range(1, max_ngram + 1):
        out.append(tuple((np.cumsum(p[:a]) / p[:a].sum())[:-1].tolist()))
    return tuple(out)


@functools.lru_cache(maxsize=16)
def _regular_ids(vocab_size: int, special_ids: tuple[int, ...]) -> np.ndarray:
    """Sorted ids of [0, vocab_size) that are not special (cached: one table per vocabulary)."""
    table = np.setdiff1d(
        np.arange(vocab_size, dtype=np.int64), np.asarray(special_ids, dtype=np.int64)
    )
    if len(table) == 0:
        raise ValueError("the vocabulary has no non-special token to draw")
    table.setflags(write=False)
    return table


def random_non_special_ids(
    rng: np.random.Generator, size: int, vocab_size: int, special_ids: Sequence[int] | np.ndarray
) -> np.ndarray:
    """`size` ids drawn uniformly from [0, vocab_size) minus `special_ids`."""
    table = _regular_ids(vocab_size, tuple(np.asarray(special_ids).tolist()))
    return table[rng.integers(0, len(table), size=size)]


def mask_example(
    ids: np.ndarray,
    special_mask: np.ndarray,
    word_start: np.ndarray | None,
    rng: np.random.Generator,
    cfg: MaskingConfig,
    vocab_size: int,
    mask_id: int,
    special_ids: Sequence[int] | np.ndarray,
) -> MaskedExample:
    """ALBERT n-gram masking of one sequence (pure: all randomness comes from `rng`).

    ids: (N,) token ids, e.g. [CLS] A [SEP] B [SEP] (padding allowed).
    special_mask: (N,) bool, True at positions never predicted ([CLS], [SEP], padding).
    word_start: (N,) bool, True where a token starts a word; needed when `cfg.whole_word`
        (ignored otherwise). The first token after a special position always starts a word.
    vocab_size, special_ids: random replacements are drawn from [0, vocab_size) minus
        `special_ids`. mask_id: the [MASK] id.
    """
    ids = np.asarray(ids, dtype=np.int64)
    special_mask = np.asarray(special_mask, dtype=bool)
    if ids.shape != special_mask.shape or ids.ndim != 1:
        raise ValueError(f"ids {ids.shape} and special_mask {special_mask.shape} must be (N,)")

    real = np.flatnonzero(~special_mask)  # token positions that can be predicted
    budget = masking_budget(len(real), cfg)
    # A unit (the thing n counts) starts at a word start, or at every token without whole_word;
    # the first real token after a special (or at position 0) always starts a unit and a segment.
    seg_start = np.empty(len(real), dtype=bool)
    seg_start[:1] = True
    np.not_equal(real[1:], real[:-1] + 1, out=seg_start[1:])
    if cfg.whole_word:
        if word_start is None:
            raise ValueError("whole_word masking needs word_start")
        first = np.flatnonzero(seg_start | np.asarray(word_start, dtype=bool)[real])
    else:
        first = np.arange(len(real))  # first[u]: index into `real` of unit u's first token
    num_units = len(first)
    bounds = [*first.tolist(), len(real)]  # unit u covers real[bounds[u]:bounds[u+1]]
    # joined[u]: units u and u + 1 are in the same segment (a span may cover both).
    joined = [*(~seg_start[first[1:]]).tolist(), False]

    order = rng.permutation(num_units).tolist()
    draws = rng.random(num_units).tolist()  # draws[u]: the n-gram length draw for unit u
    thresholds = _ngram_thresholds(cfg.max_ngram)
    max_ngram = cfg.max_ngram
    covered = bytearray(num_units)
    spans: list[tuple[int, int]] = []
    chosen: list[int] = []  # indices into `real`, span by span
    total = 0
    for u in order:
        if total >= budget:
            break
        avail = 1  # units left in the segment from u, at most max_ngram
        while avail < max_ngram and joined[u + avail - 1]:
            avail += 1
        n = 1  # n ~ P(n | n <= avail)
        for point in thresholds[avail]:
            if draws[u] < point:
                break
            n += 1
        size = bounds[u + n] - bounds[u]
        while total + size > budget and n > 1:  # ALBERT: try shorter n-grams before giving up
            n -= 1
            size = bounds[u + n] - bounds[u]
        if total + size > budget or any(covered[u : u + n]):
            continue
        covered[u : u + n] = b"\x01" * n
        spans.append((bounds[u], n))
        chosen.extend(range(bounds[u], bounds[u + n]))
        total += size

    positions = real[chosen]
    positions.sort()
    spans = [(int(real[i]), n) for i, n in spans]
    labels = np.full_like(ids, IGNORE_INDEX)
    labels[positions] = ids[positions]
    inputs = ids.copy()
    # Row 0 picks the replacement (0: [MASK], 1: random token, 2: keep), row 1 the random token.
    u = rng.random((2, len(positions)))
    kind = np.searchsorted(_split_points(cfg), u[0], side="right")
    inputs[positions[kind == 0]] = mask_id
    to_random = kind == 1
    if to_random.any():
        regular = _regular_ids(vocab_size, tuple(np.asarray(special_ids).tolist()))
        inputs[positions[to_random]] = regular[(u[1, to_random] * len(regular)).astype(np.int64)]

    masked_positions = masked_weights = masked_labels = None
    if cfg.static_masked_positions is not None:
        k = cfg.static_masked_positions
        masked_positions = np.zeros(k, dtype=np.int64)
        masked_weights = np.zeros(k, dtype=np.float32)
        masked_labels = np.full(k, IGNORE_INDEX, dtype=np.int64)
        m = len(positions)  # <= k: the budget was capped at k
        masked_positions[:m] = positions
        masked_weights[:m] = 1.0
        masked_labels[:m] = ids[positions]
    return MaskedExample(inputs, labels, spans, masked_positions, masked_weights, masked_labels)


def word_start_table(tokenizer: Any, vocab_size: int | None = None) -> np.ndarray:
    """(V,) bool over token ids: True if the token starts a word.

    WordPiece models (`tokenizers` model type WordPiece): a token starts a word unless it begins
    with the model's continuing-subword prefix ("##"). Otherwise (Unigram/BPE/WordLevel with the
    SentencePiece convention): a token starts a word if it begins with "▁" (or "Ġ" for byte-level
    BPE when no token has "▁"). Special/added tokens count as word starts. ValueError if the
    vocabulary follows neither convention.
    """
    vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
    size = max(max(vocab.values()) + 1, vocab_size or 0)
    table = np.ones(size, dtype=bool)
    model = tokenizer.model
    if type(model).__name__ == "WordPiece":
        prefix = model.continuing_subword_prefix
        for token, i in vocab.items():
            table[i] = not token.startswith(prefix)
    else:
        marker = next((m for m in ("▁", "Ġ") if any(t.startswith(m) for t in vocab)), None)
        if marker is None:
            raise ValueError(
                "cannot tell word starts in this vocabulary (no WordPiece '##' model, no '▁' or "
                "'Ġ' tokens); use whole_word=False"
            )
        for token, i in vocab.items():
            table[i] = token.startswith(marker)
    added = tokenizer.get_added_tokens_decoder()
    for i in added:
        table[i] = True
    return table
