"""The shard directory format: the contract between `data_prep shards` and the training loader.

A shard directory holds:

    manifest.json                 written last (by a single-job run or `finalize`); see below
    tokenizer.json                the tokenizer the ids come from (copied in)
    shard_00000.tokens.npy        1-D uint16 (vocab <= 65536) or uint32: all token ids of the
                                  shard's examples, segment A then segment B, example after example
    shard_00000.index.npy         int64 (num_examples, 3): [offset into tokens, len_a, len_b];
                                  rows in order and contiguous (offset[i+1] = offset[i] + len_a
                                  + len_b), both lengths >= 1 (layout "pair"), or len_b = 0
                                  (layout "single")
    shard_00000.done.json         per-shard completion record, written atomically after both
                                  arrays: {"examples", "tokens", "sha256": {file: digest}, ...}
    ...
    valid_00000.tokens.npy        the held-out validation split (only with `data_prep shards
    valid_00000.index.npy         --validation-fraction F` or `--validation-documents N`): the
    valid_00000.done.json         same three files per validation shard, the same array layout,
    ...                           named valid_NNNNN (`valid_name`); never in "shards"

Validation split (held out by document). Document d (0-based, input order) is held out or not
as a whole: all of its examples go to validation shard d % V, none to a training shard (a
training document still goes to shard d % S, with the same examples as without a split). Which
documents: the key `validation_key(seed, d)`, a uniform 64-bit number, the 8 bytes (read
big-endian) of blake2b(f"{seed}:{d}".encode(), digest_size=8, person=b"validation"):
    fraction F:   d is held out iff key < floor(F * 2**64) (about F * D documents, streamed);
    documents N:  d is held out iff (key, d) is among the N smallest of all D documents (exactly
                  N; costs one extra read of the input to find them, no tokenizing).
Nothing depends on --workers, --job-index or --num-jobs. Splits are nested: a smaller fraction
or N holds out a subset of what a larger one holds out (same seed).

An example is one ALBERT pretraining instance before masking: two consecutive segments A and B
of one document, without special tokens. The loader adds [CLS] A [SEP] B [SEP], swaps A and B
with probability 0.5 for sentence-order prediction and masks dynamically. Both arrays are read
with `np.load(..., mmap_mode="r")`, so a reader's memory does not grow with the corpus.

Layouts (manifest key "layout", absent = "pair"):
    pair      ALBERT instances as above (`data_prep shards`).
    single    one segment per example, no B (len_b = 0): the loader builds `[CLS] A`, with no
              [SEP] and no sentence-order label: masked-LM on a task's own inputs, e.g. the
              LRA self-pretraining shards of `python -m finetune lra-shards`.

manifest.json:
    {"format_version": 1,
     "tokenizer_sha256": "<sha256 of tokenizer.json bytes>",
     "tokenizer_kind": "unigram" | "wordpiece" | "bpe" | ...,
     "special_tokens": {"pad": id, "unk": id, "cls": id, "sep": id, "mask": id},
                       ("unk" may be null: a closed vocabulary, e.g. LRA's, has no unknown token)
     "layout": "pair" | "single"   (optional; absent = "pair")
     "vocab_size": V,
     "config": {... the ShardConfig used ...},
     "num_shards": S,
     "shards": [{"name": "shard_00000", "examples": n, "tokens": t,
                 "sha256": {"shard_00000.tokens.npy": ..., "shard_00000.index.npy": ...}}, ...],
     "totals": {"examples": ..., "tokens": ..., "documents": ...},   (the training shards)
     "validation": {               (only in directories made with a validation split)
         "selection": {"rule": "fraction", "fraction": F, "threshold": T}
                    | {"rule": "documents", "documents": N, "threshold": [key, d]},
         "how": "<the rule above, in words>",
         "seed": seed,
         "num_shards": V,
         "shards": [{"name": "valid_00000", "examples", "tokens", "documents", "sha256"}, ...],
         "totals": {"examples", "tokens", "documents", "dropped_tokens"}},
                      (totals.documents + validation.totals.documents == input.documents)
     "input": {"files": [...], "documents": ..., "replaced_characters": ..., "skipped": {...}},
     "input_files": [{"path": ..., "size": bytes, "mtime_ns": ..., "sha256": ...}, ...]}
                      (what each input was when read, `readers.fingerprint_inputs`; absent in
                      directories made before it was recorded. Done-records hold it too: a
                      re-run of `data_prep shards` whose input differs in content is refused.)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from albatross.files import atomic_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"

# Special-token spellings, ALBERT/SentencePiece first, then BERT/WordPiece.
SPECIAL_TOKEN_NAMES: dict[str, tuple[str, ...]] = {
    "pad": ("<pad>", "[PAD]"),
    "unk": ("<unk>", "[UNK]"),
    "cls": ("[CLS]", "<cls>"),
    "sep": ("[SEP]", "<sep>"),
    "mask": ("[MASK]", "<mask>"),
}
OPTIONAL_SPECIAL_TOKENS = ("unk",)
"""Roles a closed vocabulary may lack (nothing in training uses [UNK])."""
LAYOUTS = ("pair", "single")
"""Example layouts of a shard directory (see the module docstring)."""
# The order a trained tokenizer gets them in (ALBERT's ids: <pad>=0 <unk>=1 [CLS]=2 [SEP]=3 [MASK]=4).
ALBERT_SPECIAL_TOKENS = ("<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]")


SPLITS = ("train", "validation")
"""The example sets of a shard directory: "shards" and "validation" in the manifest."""
VALIDATION_KEY = "validation"
"""The manifest key of the validation split (absent: the directory has none)."""
VALIDATION_FLAGS = "--validation-fraction F or --validation-documents N"


def shard_name(index: int) -> str:
    return f"shard_{index:05d}"


def valid_name(index: int) -> str:
    """The name of validation shard `index` (files valid_NNNNN.tokens.npy, ...)."""
    return f"valid_{index:05d}"


def validation_key(seed: int, document_index: int) -> int:
    """The 64-bit key that decides whether document d is held out (see the module docstring)."""
    digest = hashlib.blake2b(
        f"{seed}:{document_index}".encode(), digest_size=8, person=b"validation"
    ).digest()
    return int.from_bytes(digest, "big")


def split_shards(
    manifest: dict[str, Any], split: str, shard_dir: str | os.PathLike = "."
) -> list[dict[str, Any]]:
    """The shard entries of `split` ("train": manifest["shards"]; "validation": those of
    manifest["validation"]). ShardError naming the directory and the flags to add if the
    directory has no validation split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if split == "train":
        return manifest["shards"]
    section = manifest.get(VALIDATION_KEY)
    if section is None:
        raise ShardError(
            f"{shard_dir} has no validation split (its {MANIFEST} has no {VALIDATION_KEY!r} "
            f"section): make the shards with `python -m data_prep shards ... "
            f"{VALIDATION_FLAGS}` (into a new --out directory: the training shards change too)"
        )
    if not isinstance(section, dict) or not isinstance(section.get("shards"), list):
        raise ShardError(f"{Path(shard_dir) / MANIFEST}: {VALIDATION_KEY!r} has no 'shards' list")
    return section["shards"]


def tokens_file(name: str) -> str:
    return f"{name}.tokens.npy"


def index_file(name: str) -> str:
    return f"{name}.index.npy"


def done_file(name: str) -> str:
    return f"{name}.done.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Writes via a temp file in the same directory and os.replace: never a half-written file."""
    with atomic_file(path, Path(path).name, unique=True) as tmp:
        tmp.write_text(text)


def atomic_save_npy(path: str | os.PathLike, array: np.ndarray) -> None:
    with atomic_file(path, Path(path).name, unique=True) as tmp, open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)


@dataclass(frozen=True)
class SpecialTokens:
    pad: int
    unk: int | None
    cls: int
    sep: int
    mask: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> SpecialTokens:
        """Finds the ids in a `tokenizers.Tokenizer`; ValueError naming what is missing."""
        found, missing = {}, []
        for role, spellings in SPECIAL_TOKEN_NAMES.items():
            ids = [tokenizer.token_to_id(s) for s in spellings]
            ids = [i for i in ids if i is not None]
            if ids:
                found[role] = ids[0]
            elif role in OPTIONAL_SPECIAL_TOKENS:
                found[role] = None
            else:
                missing.append(f"{role} ({' or '.join(spellings)})")
        if missing:
            raise ValueError(f"tokenizer lacks special tokens needed for pretraining: {missing}")
        return cls(**found)

    def to_dict(self) -> dict[str, int | None]:
        return {
            "pad": self.pad,
            "unk": self.unk,
            "cls": self.cls,
            "sep": self.sep,
            "mask": self.mask,
        }


class ShardError(ValueError):
    """A shard directory that cannot be used: names the file and the reason."""


def read_manifest(shard_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise ShardError(
            f"{path} not found: not a finished shard directory (run `python -m data_prep shards`, "
            "or `finalize` after a multi-job run)"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ShardError(f"{path} is not valid JSON: {e}") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ShardError(
            f"{path}: format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    return manifest


def verify_shards(
    shard_dir: str | os.PathLike,
    manifest: dict[str, Any] | None = None,
    split: str | None = None,
) -> None:
    """Checks every shard file exists and matches its sha256 in the manifest (ShardError if not).
    split: "train" or "validation" checks that split's files only; None: every file listed
    (the validation split's too, where the directory has one)."""
    shard_dir = Path(shard_dir)
    manifest = manifest or read_manifest(shard_dir)
    if split is None:
        splits = [s for s in SPLITS if s == "train" or VALIDATION_KEY in manifest]
    else:
        splits = [split]
    for shard in (e for s in splits for e in split_shards(manifest, s, shard_dir)):
        for fname, digest in shard["sha256"].items():
            path = shard_dir / fname
            if not path.is_file():
                raise ShardError(f"{path} is missing (listed in {shard_dir / MANIFEST})")
            actual = sha256_file(path)
            if actual != digest:
                raise ShardError(
                    f"{path} is corrupt or truncated: sha256 {actual[:12]}... does not match the "
                    f"manifest's {digest[:12]}..."
                )


def verify_tokenizer(shard_dir: str | os.PathLike, tokenizer_path: str | os.PathLike) -> None:
    """ShardError if `tokenizer_path` is not the tokenizer the shards were made with."""
    manifest = read_manifest(shard_dir)
    actual = sha256_file(tokenizer_path)
    if actual != manifest["tokenizer_sha256"]:
        raise ShardError(
            f"tokenizer {tokenizer_path} (sha256 {actual[:12]}...) does not match the tokenizer of "
            f"the shards in {shard_dir} (sha256 {manifest['tokenizer_sha256'][:12]}...)"
        )


def open_shard(shard_dir: str | os.PathLike, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, index) of one shard, memory-mapped read-only."""
    shard_dir = Path(shard_dir)
    tokens = np.load(shard_dir / tokens_file(name), mmap_mode="r", allow_pickle=False)
    index = np.load(shard_dir / index_file(name), mmap_mode="r", allow_pickle=False)
    if index.ndim != 2 or index.shape[1] != 3:
        raise ShardError(
            f"{shard_dir / index_file(name)}: expected shape (n, 3), got {index.shape}"
        )
    return tokens, index


def truncated_pair_lengths(la: int, lb: int, budget: int) -> tuple[int, int]:
    """ALBERT's truncate_seq_pair lengths (used by the loader and by the shard builder's
    `junction` truncation): pop one token from the longer segment (B on ties)
    until la + lb <= budget, in closed form."""
    excess = la + lb - budget
    if excess <= 0:
        return la, lb
    if la > lb:  # trim the longer one alone until both are equal
        d = min(excess, la - lb)
        la, excess = la - d, excess - d
    elif lb > la:
        d = min(excess, lb - la)
        lb, excess = lb - d, excess - d
    # Now equal: B, A, B, A, ...
    lb -= (excess + 1) // 2
    la -= excess // 2
    return la, lb
