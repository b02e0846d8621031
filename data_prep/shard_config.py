"""The settings that decide the bytes of a shard directory (`ShardConfig`), recorded in every
done-record and in the manifest; the format and the stage: `data_prep/shards.py`."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from data_prep import format as fmt
from data_prep import sentences as sentence_rules
from data_prep.readers import (
    DEFAULT_MAX_LINE_CHARS,
    ReadStats,
    iter_documents,
    splits_sentences,
)

log = logging.getLogger(__name__)


TRUNCATIONS = ("albert", "junction")
"""`ShardConfig.truncation` values."""


@dataclass(frozen=True)
class ShardConfig:
    """Everything besides the tokenizer that decides the bytes of the shards. Recorded in every
    done-record and in the manifest; a shard directory made with another config is refused.
    (--workers, --job-index and --num-jobs only split the work and are not part of it.)"""

    inputs: tuple[str, ...]
    """Input arguments as given: paths, globs, @list files, `embedded[:N]`."""

    num_shards: int
    """S: document d goes to shard d % S."""

    max_seq_length: int = 512
    """Length of [CLS] A [SEP] B [SEP]; A and B hold at most max_seq_length - 3 tokens."""

    short_seq_prob: float = 0.1
    """Probability that an example's target length is drawn uniformly from [2, max]."""

    seed: int = 0
    """Document d's randomness comes from random.Random(f"{seed}:{d}")."""

    text_field: str = "text"
    """JSONL field / Parquet or HF column holding a document's text."""

    max_line_chars: int = DEFAULT_MAX_LINE_CHARS
    """Longer input lines are skipped (and counted)."""

    truncation: str = "albert"
    """How a pair longer than the budget is cut. `albert`: ALBERT's truncate_seq_pair (the longer
    side loses a token at a random end, which cuts the A|B junction of most short pairs).
    `junction`: A loses tokens from its front and B from its back (the same lengths as the
    loader's truncation), so B still starts where A ends: the order signal SOP is about. On the
    embedded corpus's 32-token pairs it lets SOP be learned on more seeds
    (docs/benchmarks.md#decisions-whose-measurements-are-in-the-history)."""

    validation_fraction: float = 0.0
    """Hold out each document with this probability (by its `format.validation_key`), as the
    validation split; 0: no split. At most one of validation_fraction / validation_documents."""

    validation_documents: int = 0
    """Hold out exactly this many documents (the N smallest keys); 0: no split."""

    validation_shards: int = 1
    """V: held-out document d goes to validation shard d % V."""

    sentences: str = "auto"
    """How a document's text becomes sentences (`readers`, data_prep/sentences.py): 'auto'
    (lines of plain text and of the embedded corpus; JSONL, Parquet and `datasets` documents
    split into sentences), 'split' or 'lines'."""

    streaming: bool = False
    """Read `hf:` sources as streams. The same rows in the same order, so not part of
    `to_dict` (like --workers): a directory built streaming resumes without, and back."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if not self.inputs:
            raise ValueError("no input given")
        if self.num_shards < 1:
            raise ValueError(f"--num-shards must be >= 1, got {self.num_shards}")
        if self.max_seq_length < 5:
            raise ValueError(f"--max-seq-length must be >= 5, got {self.max_seq_length}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.max_line_chars < 1:
            raise ValueError(f"--max-line-chars must be >= 1, got {self.max_line_chars}")
        if self.truncation not in TRUNCATIONS:
            raise ValueError(
                f"--truncation must be one of {list(TRUNCATIONS)}, got {self.truncation!r}"
            )
        f = self.validation_fraction
        if not 0.0 <= f < 1.0:  # also refuses NaN
            raise ValueError(
                f"--validation-fraction must be in [0, 1), got {f}"
                + (": it would leave no training documents" if f >= 1.0 else "")
            )
        if not isinstance(self.validation_documents, int) or self.validation_documents < 0:
            raise ValueError(
                f"--validation-documents must be an int >= 0, got {self.validation_documents!r}"
            )
        if f > 0 and self.validation_documents > 0:
            raise ValueError(
                "give --validation-fraction or --validation-documents, not both (got "
                f"{f} and {self.validation_documents})"
            )
        if self.validation_shards < 1:
            raise ValueError(f"--validation-shards must be >= 1, got {self.validation_shards}")
        if self.validation_shards != 1 and not self.has_validation:
            raise ValueError(
                f"--validation-shards {self.validation_shards} needs {fmt.VALIDATION_FLAGS}"
            )
        sentence_rules.check_mode(self.sentences)

    @property
    def has_validation(self) -> bool:
        return self.validation_fraction > 0 or self.validation_documents > 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["inputs"] = list(self.inputs)
        if d["truncation"] == "albert":  # the default: manifests written before the option match
            del d["truncation"]
        # No split: the keys are left out, so such directories are byte-identical to those made
        # before the option existed. With one: only the flag in use, and V.
        if not self.validation_fraction:
            del d["validation_fraction"]
        if not self.validation_documents:
            del d["validation_documents"]
        if not self.has_validation:
            del d["validation_shards"]
        del d["streaming"]  # the same documents either way
        # Sentences: recorded (with the splitter and its version) only when some input's text
        # is split, so a directory of line-per-sentence input has the config it had before the
        # option; a directory split by another splitter version is refused, never mixed.
        del d["sentences"]
        if splits_sentences(self.inputs, self.sentences):
            d["sentences"] = self.sentences
            d["sentence_splitter"] = sentence_rules.splitter_id()
        return d

    def read(self, stats: ReadStats | None = None) -> Iterator[list[str]]:
        """`iter_documents` of this config's input, documents to split coming `Unsplit` (each
        worker splits only the documents it keeps)."""
        return iter_documents(
            list(self.inputs),
            self.text_field,
            stats,
            self.max_line_chars,
            sentences=self.sentences,
            streaming=self.streaming,
            defer_split=True,
        )
