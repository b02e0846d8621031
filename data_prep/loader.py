"""The training-time loader: shard directory -> per-rank, resumable batches of masked examples.

    data = PretrainingData("shards/", max_seq_length=512, masking=MaskingConfig(), seed=1)
    loader = PretrainingLoader(data, batch_size=64, rank=rank, world_size=world, num_workers=2)
    for batch in loader:             # dict of tensors, see `PretrainingCollator`
        ...
        ckpt["loader"] = loader.state_dict()
    loader.load_state_dict(ckpt["loader"])   # the next batch is the one an uninterrupted run
                                              # would have produced next

Determinism. Everything random about an example (SOP swap, masking) comes from a numpy
Generator seeded by `SeedSequence([seed, epoch, global_index])` only, and the order of examples
from a keyed permutation of (seed, epoch). So batches do not depend on the number of workers,
on when a run was interrupted, or on the rank count (beyond which rank gets which example).

Shuffle scheme (memory O(1) in the corpus size). Each epoch's order is a keyed Feistel network:
a 6-round balanced Feistel cipher over [0, 2^(2h)) (2^(2h) >= N, the smallest even bit width),
round function splitmix64(right ^ round_key) truncated to h bits, round keys from
`SeedSequence([seed, epoch])`; values >= N are re-encrypted until they fall in [0, N) ("cycle
walking"), which keeps it a bijection of [0, N) (expected < 4 encryptions since 2^(2h) < 4N).
Position p of the epoch maps to example `perm(p)`, computed per batch (vectorised over the
batch): nothing of size N is ever built, and resuming at batch b costs nothing (the skipped
batches are not decoded). Rank r of W takes positions r, r+W, r+2W, ... of the first
W * (N // W) positions (the ragged tail is dropped so every rank has the same batch count).
With `global_batch_size` G (micro-batch x accumulation x ranks) an epoch ends after the first
floor(N / G) * G positions instead, so that optimizer steps never straddle two epochs and the
positions of step s of an epoch are [s G, (s + 1) G) on any number of ranks.

Another number of ranks (elastic resume). After k batches of b on W ranks, the ranks have
together consumed positions [0, k b W) of the epoch's order (interleaved); the state records
that global offset (`samples_in_epoch`). `load_state_dict(state, elastic=True)` on W' ranks
continues from that position: rank r takes positions o + r, o + r + W', ... (o the offset) to
the epoch's end, and the next epoch starts at 0 on W' ranks. So the positions consumed in every
epoch are a prefix of its order, each exactly once, however often the rank count changed; with
`global_batch_size` (the same G before and after) the prefix, hence the multiset of examples of
the whole run, is the one an uninterrupted run consumes, and each optimizer step gets the same
examples. Without it an epoch's length follows the micro-step b W of the layout that finishes
it (the dropped tail, under one micro-step, may differ).

Length grouping (opt-in: `PretrainingLoader(..., group_by_length=LengthGrouping(window,
chunk))`). ALBERT shards hold mostly full-length examples and a share (short_seq_prob,
document ends) of shorter ones, so nearly every random batch holds one and is padded. With
grouping, the epoch's order is cut into windows of `window` consecutive positions (the last
one may be shorter); the examples of a window (`perm(p)` for its positions) are sorted by their
built length, longest first (stable, so equal lengths keep their random order), cut into
chunks of `chunk` positions, and the chunks are shuffled by a generator seeded from
(seed, epoch, window). An epoch's last window may end in a ragged rest of fewer than `chunk`
positions: it keeps its plain random order, last, so the tail an epoch drops (drop_last,
`global_batch_size`) is still a random choice of examples, not the shortest ones.
Position p of window w then holds the example at offset p - w * window of that arrangement.
This is a bijection of [0, N) that depends on (seed, epoch, window, chunk, the lengths)
only, never on the rank count, the batch size or `global_batch_size`, so everything above
holds unchanged: rank r still takes positions r, r + W, ..., exact and elastic resume continue
at the same position of the same order, and the positions consumed before an elastic resume
are the same examples under any number of ranks. A micro-step (batch_size x W consecutive
positions) that lies inside a chunk of full-length examples has no padding on any rank; chunks
of short examples hold examples of similar lengths (their dynamic width is small). Best when
`chunk` is a multiple of batch_size x W: micro-steps then never straddle two chunks (one that
straddles two chunks of full-length examples has no padding either; the loader warns when it
is not). Lengths come from the shard index (`PretrainingData.built_lengths`), no example is
built; a window is arranged once, when its first batch is drawn (O(window log window), about
1.5 ms for 16384 examples, cached), so the cost per batch stays O(batch) amortised.
Trade-off: the examples of one optimizer step are no longer a uniform sample of the corpus.
As in any length grouping (HF group_by_length), a step (or micro-step) holds either
full-length examples or short ones of similar lengths, so a step of short examples has fewer
tokens, and a window's short examples come in runs of `chunk` positions at a random place of
the window (different in every window and epoch) instead of spread over all steps. Smaller
chunks spread them more finely (keep them a multiple of the micro-step); smaller windows move
an example less far (under `window` positions) from its random position.

Shards are memory-mapped (format.open_shard) on first use in each process and kept in a small
LRU (`max_open_shards`), so neither memory nor open file descriptors grow with the corpus.

Validation (a directory made with `data_prep shards --validation-fraction F` or
`--validation-documents N`: held-out documents, see format.py):

    valid = PretrainingData("shards/", max_seq_length=512, masking=MaskingConfig(), seed=1,
                            split="validation")
    batches = validation_batches(valid, batch_size=64, max_batches=50, rank=rank,
                                 world_size=world)   # the same list on every call
    # sum loss * count over `batches`, all-reduce the sums once, divide

Validation examples are masked by the same code, from `SeedSequence([seed, 0, index],
spawn_key=(VALIDATION_DOMAIN,))`: epoch fixed at 0, a key space of its own (never a training
example's masks). `validation_batches` takes the first max_batches * batch_size * world_size
positions of a keyed permutation of (seed, VALIDATION_DOMAIN) (so a cap samples across
documents, not the first few) and gives position p to rank p % world_size: ranks' examples
are disjoint and together exactly those positions (all examples when max_batches is None).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from data_prep import format as fmt
from data_prep.masking import IGNORE_INDEX, MaskingConfig, mask_example, word_start_table
from data_prep.transport import loader_batches

STATE_VERSION = 2  # 2: start_in_epoch, samples_in_epoch, global_batch_size (1 still loads)
_SHUFFLE_DOMAIN = 0x5348_5546  # spawn_key tag: shuffle keys never collide with example seeds
VALIDATION_DOMAIN = 0x5641_4C49  # spawn_key tag of validation examples' masks and order
_GROUP_DOMAIN = 0x4752_4F55  # spawn_key tag of the chunk shuffle of length-grouped windows


# --------------------------------------------------------------------------------------------
# Keyed permutation
# --------------------------------------------------------------------------------------------

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    z = x + _M1
    z = (z ^ (z >> np.uint64(30))) * _M2
    z = (z ^ (z >> np.uint64(27))) * _M3
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """A keyed pseudo-random bijection of [0, n), evaluated pointwise in O(1) memory.

    Balanced Feistel network on 2h bits (2^(2h) >= n) with cycle walking; see the module
    docstring. `key` is any sequence of non-negative ints (e.g. (seed, epoch)).
    """

    def __init__(self, n: int, key: Sequence[int], rounds: int = 6):
        if n < 1:
            raise ValueError(f"cannot permute {n} elements")
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.n = n
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        seq = np.random.SeedSequence(list(key), spawn_key=(_SHUFFLE_DOMAIN,))
        self.round_keys = seq.generate_state(rounds, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.round_keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Maps positions (ints in [0, n)) to their elements; int64 array of the same shape."""
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"positions must be in [0, {self.n})")
        y = self._encrypt(x.astype(np.uint64))
        out = y >= np.uint64(self.n)
        while out.any():  # cycle walking
            y[out] = self._encrypt(y[out])
            out = y >= np.uint64(self.n)
        return y.astype(np.int64)


# --------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------


class PretrainingData(Dataset):
    """Map-style dataset over a shard directory (see `data_prep/format.py`).

    `data[i]` (epoch `self.epoch`) or `data[(epoch, i)]` is one masked ALBERT example as a dict
    of numpy arrays: input_ids, token_type_ids, labels (-100 where not predicted), sop_label
    (1 = A and B swapped; -100 when a segment is empty: never swapped, SOP ignores it), and in
    static mode masked_positions, masked_weights, masked_labels (see `MaskingConfig`).

    The sequence is `[CLS] A [SEP] B [SEP]` (token types 0 up to the first [SEP], 1 after). If it
    is longer than `max_seq_length`, the longer segment is trimmed first (ALBERT's
    truncate_seq_pair order), A from its front and B from its back, so the A|B junction that
    SOP is about stays intact (ALBERT trims a random end; that would need the RNG for nothing).
    Truncation happens before the swap.

    verify_checksums: sha256 of every shard file against the manifest (reads the whole corpus).
        Without it, every example's token ids are still checked against the vocabulary size as
        it is read (one vectorised max), so a corrupt id is a ShardError naming the shard file,
        the position and the id, not an IndexError in the model.
    tokenizer_path: the tokenizer training will use; ShardError if it is not the shards' one.
    split: "train" (the training shards) or "validation" (the held-out documents' shards of a
        directory made with --validation-fraction / --validation-documents; ShardError naming
        the directory and the flags if it has none). Validation examples draw their SOP swap
        and masks from `SeedSequence([seed, epoch, index], spawn_key=(VALIDATION_DOMAIN,))`;
        use `validation_batches` for a fixed evaluation set. verify_checksums checks the
        files of this split.
    Bad input raises `format.ShardError` naming the file and the reason.
    """

    def __init__(
        self,
        shard_dir: str | os.PathLike,
        max_seq_length: int = 512,
        masking: MaskingConfig | None = None,
        seed: int = 0,
        *,
        verify_checksums: bool = False,
        tokenizer_path: str | os.PathLike | None = None,
        max_open_shards: int = 64,
        split: str = "train",
    ):
        if split not in fmt.SPLITS:
            raise ValueError(f"split must be one of {list(fmt.SPLITS)}, got {split!r}")
        self.split = split
        # Training examples keep the default key space (their masks are as before splits existed).
        self._spawn_key: tuple[int, ...] = (VALIDATION_DOMAIN,) if split == "validation" else ()
        self.shard_dir = Path(shard_dir)
        self.masking = masking if masking is not None else MaskingConfig()
        if max_seq_length < 5:
            raise ValueError(
                f"max_seq_length must be >= 5 ([CLS] A [SEP] B [SEP]), got {max_seq_length}"
            )
        k = self.masking.static_masked_positions
        if k is not None and k > max_seq_length - 3:
            raise ValueError(
                f"static_masked_positions={k} exceeds the {max_seq_length - 3} maskable tokens "
                f"of max_seq_length={max_seq_length}"
            )
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        self.max_seq_length = max_seq_length
        self.seed = seed
        self.max_open_shards = max_open_shards
        self.epoch = 0

        manifest = fmt.read_manifest(self.shard_dir)
        self._check_manifest(manifest)
        self.manifest = manifest
        entries = fmt.split_shards(manifest, split, self.shard_dir)
        if tokenizer_path is not None:
            if not Path(tokenizer_path).is_file():
                raise fmt.ShardError(f"tokenizer {tokenizer_path} not found")
            fmt.verify_tokenizer(self.shard_dir, tokenizer_path)
        if verify_checksums:
            fmt.verify_shards(self.shard_dir, manifest, split)

        self.shard_names = [s["name"] for s in entries]
        self.shard_examples = [int(s["examples"]) for s in entries]
        for name, count in zip(self.shard_names, self.shard_examples):
            for fname in (fmt.tokens_file(name), fmt.index_file(name)):
                if count and not (self.shard_dir / fname).is_file():
                    raise fmt.ShardError(
                        f"{self.shard_dir / fname} is missing (listed in "
                        f"{self.shard_dir / fmt.MANIFEST})"
                    )
        # (S + 1,) cumulative example counts: global index -> (shard, local) by binary search.
        self.cumulative = np.concatenate([[0], np.cumsum(self.shard_examples, dtype=np.int64)])
        self._cumulative = self.cumulative.tolist()
        self.num_examples = int(self.cumulative[-1])

        roles = manifest["special_tokens"]
        self.special = fmt.SpecialTokens(
            **{r: None if roles[r] is None else int(roles[r]) for r in fmt.SPECIAL_TOKEN_NAMES}
        )
        self.layout = manifest.get("layout", "pair")
        self.vocab_size = int(manifest["vocab_size"])
        specials = {i for i in self.special.to_dict().values() if i is not None}
        self.word_start: np.ndarray | None = None
        # The tokenizer is needed for whole-word masking; otherwise it is only consulted (when
        # present) for special tokens beyond the five roles.
        if self.masking.whole_word or (self.shard_dir / fmt.TOKENIZER).is_file():
            tokenizer = self._load_tokenizer()
            added = tokenizer.get_added_tokens_decoder()
            specials |= {i for i, token in added.items() if token.special}
            if self.masking.whole_word:
                self.word_start = word_start_table(tokenizer, self.vocab_size)
        # Random replacements never draw these (the 5 roles + the tokenizer's special tokens).
        self.special_ids = np.array(
            sorted(i for i in specials if i < self.vocab_size), dtype=np.int64
        )
        self._open: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    # -- validation ---------------------------------------------------------------------------

    def _check_manifest(self, manifest: dict[str, Any]) -> None:
        path = self.shard_dir / fmt.MANIFEST

        def bad(reason: str) -> fmt.ShardError:
            return fmt.ShardError(f"{path}: {reason}")

        for key in ("shards", "vocab_size", "special_tokens", "tokenizer_sha256"):
            if key not in manifest:
                raise bad(f"missing key {key!r}")
        if not isinstance(manifest["shards"], list) or not manifest["shards"]:
            raise bad("'shards' must be a non-empty list")
        roles = manifest["special_tokens"]
        missing = [
            r
            for r in fmt.SPECIAL_TOKEN_NAMES
            if roles.get(r) is None and r not in fmt.OPTIONAL_SPECIAL_TOKENS
        ]
        if missing:
            raise bad(f"special_tokens lacks {missing}")
        if manifest.get("layout", "pair") not in fmt.LAYOUTS:
            raise bad(f"unknown layout {manifest['layout']!r}; valid: {list(fmt.LAYOUTS)}")
        entries = fmt.split_shards(manifest, self.split, self.shard_dir)
        where, totals = "shards", manifest.get("totals", {})
        if self.split == "validation":
            where, totals = "validation.shards", manifest[fmt.VALIDATION_KEY].get("totals", {})
        for i, shard in enumerate(entries):
            if not isinstance(shard, dict) or "name" not in shard or "examples" not in shard:
                raise bad(f"{where}[{i}] needs 'name' and 'examples'")
            if not isinstance(shard["examples"], int) or shard["examples"] < 0:
                raise bad(
                    f"{where}[{i}] ({shard['name']}): bad example count {shard['examples']!r}"
                )
        total = sum(s["examples"] for s in entries)
        if total == 0:
            raise bad(f"the {where} hold no examples")
        declared = totals.get("examples")
        if declared is not None and declared != total:
            raise bad(f"{where}: totals.examples is {declared} but the shards add up to {total}")

    def _load_tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        path = self.shard_dir / fmt.TOKENIZER
        if not path.is_file():
            raise fmt.ShardError(f"{path} not found (whole-word masking needs the tokenizer)")
        fmt.verify_tokenizer(self.shard_dir, path)
        try:
            return Tokenizer.from_file(str(path))
        except Exception as e:
            raise fmt.ShardError(f"{path} cannot be loaded as a tokenizer: {e}") from e

    def _shard(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, index) of shard s, memory-mapped; opened on first use, LRU-bounded."""
        if s in self._open:
            self._open.move_to_end(s)
            return self._open[s]
        name = self.shard_names[s]
        try:
            tokens, index = fmt.open_shard(self.shard_dir, name)
        except fmt.ShardError:
            raise
        except (OSError, ValueError) as e:
            raise fmt.ShardError(f"{self.shard_dir}/{name}.*.npy cannot be opened: {e}") from e
        where = self.shard_dir / fmt.index_file(name)
        if index.shape[0] != self.shard_examples[s]:
            raise fmt.ShardError(
                f"{where}: {index.shape[0]} rows but the manifest says {self.shard_examples[s]} examples"
            )
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui" or index.dtype.kind not in "ui":
            raise fmt.ShardError(
                f"{self.shard_dir / fmt.tokens_file(name)}: expected 1-D integer tokens and integer "
                f"index, got {tokens.dtype}{tokens.shape} / {index.dtype}{index.shape}"
            )
        off, la, lb = (int(v) for v in index[-1])  # rows are in order: the last one ends last
        if off < 0 or la < 0 or lb < 0 or off + la + lb > tokens.shape[0]:
            raise fmt.ShardError(
                f"{where}: last example [{off}, {la}, {lb}] runs past the {tokens.shape[0]} tokens "
                f"of {fmt.tokens_file(name)} (truncated shard?)"
            )
        # Plain ndarray views of the maps (they keep the maps alive): cheaper to index than np.memmap.
        self._open[s] = (tokens.view(np.ndarray), index.view(np.ndarray))
        if len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)
        return self._open[s]

    def __getstate__(self) -> dict[str, Any]:
        # Workers started with spawn re-open shards themselves: never pickle the memmaps.
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state

    # -- examples -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_examples

    def segments(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The raw segments (A, B) of example `index`, as int64 arrays (no truncation)."""
        a, b = self._segments(index)
        return a.astype(np.int64), b.astype(np.int64)

    def _segments(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(A, B) as views into the token map (its dtype)."""
        if not 0 <= index < self.num_examples:
            raise IndexError(f"example {index} out of range [0, {self.num_examples})")
        s = bisect.bisect_right(self._cumulative, index) - 1
        tokens, rows = self._shard(s)
        local = index - self._cumulative[s]
        off, la, lb = rows[local].tolist()
        ids = tokens[off : off + la + lb]
        self._check_ids(ids, s, off, local)
        return ids[:la], ids[la:]

    def built_lengths(self, indices: np.ndarray | Sequence[int]) -> np.ndarray:
        """Tokens of each example as `build` makes it ([CLS] A [SEP] B [SEP] after truncation to
        max_seq_length; `[CLS] A` in the "single" layout), from the shard index alone: no token
        is read and nothing is built. int64 array of the shape of `indices`."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_examples):
            raise IndexError(f"example indices must be in [0, {self.num_examples})")
        flat = idx.reshape(-1)
        shard = np.searchsorted(self.cumulative, flat, side="right") - 1
        order = np.argsort(shard, kind="stable")
        bounds = np.searchsorted(shard[order], np.arange(len(self.shard_names) + 1))
        la = np.empty(flat.shape, dtype=np.int64)
        lb = np.empty(flat.shape, dtype=np.int64)
        for s in np.flatnonzero(np.diff(bounds)).tolist():
            take = order[bounds[s] : bounds[s + 1]]
            rows = self._shard(s)[1][flat[take] - self.cumulative[s]]
            la[take], lb[take] = rows[:, 1], rows[:, 2]
        if self.layout == "single":
            out = np.minimum(la, self.max_seq_length - 1) + 1
        else:  # truncated_pair_lengths keeps min(la + lb, budget) tokens
            out = np.minimum(la + lb, self.max_seq_length - 3) + 3
        return out.reshape(idx.shape)

    def _check_ids(self, ids: np.ndarray, s: int, off: int, local: int) -> None:
        """ShardError naming the shard, position and id if a token id of example `local` of
        shard `s` (its tokens `ids`, from position `off`) is outside [0, vocab_size).

        Without checksums (verify_checksums=False, or on ranks > 0 in pretraining) a corrupt
        id would otherwise surface far away, as an IndexError in the embedding that names no
        file. The cost is one vectorised max over the example's tokens (and a min for a signed
        dtype): about 1 us per example, 1-3% of building it (measured on the embedded corpus at
        sequence lengths 128 and 512)."""
        if not ids.size:
            return
        signed = ids.dtype.kind == "i"
        if int(ids.max()) < self.vocab_size and not (signed and int(ids.min()) < 0):
            return
        pos = int(np.flatnonzero((ids >= self.vocab_size) | (ids < 0))[0])
        bad = int(ids[pos])
        problem = "negative" if bad < 0 else f">= the vocabulary size {self.vocab_size}"
        raise fmt.ShardError(
            f"{self.shard_dir / fmt.tokens_file(self.shard_names[s])}: token id {bad} at position "
            f"{off + pos} (example {local} of the shard) is {problem}: the shard is corrupt "
            f"(check the directory with `python -m data_prep inspect {self.shard_dir} --verify`; "
            "re-running `python -m data_prep shards` with the same arguments rebuilds a shard "
            "whose checksum no longer matches)"
        )

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Any]:
        epoch, index = key if isinstance(key, tuple) else (self.epoch, key)
        index = int(index)
        a, b = self._segments(index)
        rng = np.random.default_rng(
            np.random.SeedSequence([self.seed, int(epoch), index], spawn_key=self._spawn_key)
        )
        return self.build(a, b, rng)

    def build(self, a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
        """Truncate, SOP-swap and mask one (A, B) pair (layout "single": `[CLS] A`)."""
        if self.layout == "single":
            return self._build_single(a, rng)
        la, lb = fmt.truncated_pair_lengths(len(a), len(b), self.max_seq_length - 3)
        a, b = a[len(a) - la :], b[:lb]  # A loses its front, B its back
        draw = rng.random()  # drawn even when unused: the stream stays aligned
        has_pair = la > 0 and lb > 0
        swap = has_pair and draw < self.masking.sop_probability
        sop_label = int(swap) if has_pair else IGNORE_INDEX
        if swap:
            a, b = b, a
        sp = self.special
        n, sep1 = la + lb + 3, len(a) + 1
        ids = np.empty(n, dtype=np.int64)
        ids[0], ids[sep1], ids[n - 1] = sp.cls, sp.sep, sp.sep
        ids[1:sep1], ids[sep1 + 1 : n - 1] = a, b
        token_types = np.zeros(n, dtype=np.int64)
        token_types[sep1 + 1 :] = 1
        special_mask = np.zeros(n, dtype=bool)
        special_mask[0] = special_mask[sep1] = special_mask[n - 1] = True
        return self._mask(ids, special_mask, token_types, sop_label, rng)

    def _build_single(self, a: np.ndarray, rng: np.random.Generator) -> dict[str, Any]:
        """`[CLS] A` (A cut at the back to max_seq_length - 1 tokens, as a fine-tuning loader
        cuts a document), masked; token types 0; no sentence-order label (-100)."""
        a = a[: self.max_seq_length - 1]
        rng.random()  # the SOP draw of the pair layout: the streams stay alike
        ids = np.empty(len(a) + 1, dtype=np.int64)
        ids[0], ids[1:] = self.special.cls, a
        special_mask = np.zeros(len(ids), dtype=bool)
        special_mask[0] = True
        token_types = np.zeros(len(ids), dtype=np.int64)
        return self._mask(ids, special_mask, token_types, IGNORE_INDEX, rng)

    def _mask(
        self,
        ids: np.ndarray,
        special_mask: np.ndarray,
        token_types: np.ndarray,
        sop_label: int,
        rng: np.random.Generator,
    ) -> dict[str, Any]:
        """The example dict of a built sequence, masked (see `mask_example`)."""
        word_start = None if self.word_start is None else self.word_start[ids]
        m = mask_example(
            ids,
            special_mask,
            word_start,
            rng,
            self.masking,
            self.vocab_size,
            self.special.mask,
            self.special_ids,
        )
        out = {
            "input_ids": m.input_ids,
            "token_type_ids": token_types,
            "labels": m.labels,
            "sop_label": sop_label,
        }
        if m.masked_positions is not None:
            out["masked_positions"] = m.masked_positions
            out["masked_weights"] = m.masked_weights
            out["masked_labels"] = m.masked_labels
        return out

    def fingerprint(self) -> dict[str, Any]:
        """What a saved loader state must agree with to resume exactly."""
        out = {
            "tokenizer_sha256": self.manifest["tokenizer_sha256"],
            "num_examples": self.num_examples,
            "shards": [[n, c] for n, c in zip(self.shard_names, self.shard_examples)],
            "max_seq_length": self.max_seq_length,
            "masking": dataclasses.asdict(self.masking),
        }
        if self.split != "train":  # training fingerprints stay as saved states have them
            out["split"] = self.split
        return out


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


class PretrainingCollator:
    """Pads a list of examples into a batch dict of tensors.

    input_ids (B, L) long, pad id at padding; attention_mask (B, L) long, 1 at real tokens;
    token_type_ids (B, L) long; mlm_labels (B, L) long, -100 where not predicted; sop_labels (B,)
    long (-100: no SOP target); static mode adds masked_positions (B, K) long, masked_weights
    (B, K) float32, masked_labels (B, K) long. L is the longest example of the batch, or
    `pad_to` (static shapes).
    """

    def __init__(self, pad_id: int, pad_to: int | None = None):
        self.pad_id = pad_id
        self.pad_to = pad_to

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        lengths = [len(e["input_ids"]) for e in examples]
        width = self.pad_to if self.pad_to is not None else max(lengths)
        bsz = len(examples)
        input_ids = np.full((bsz, width), self.pad_id, dtype=np.int64)
        attention = np.zeros((bsz, width), dtype=np.int64)
        types = np.zeros((bsz, width), dtype=np.int64)
        labels = np.full((bsz, width), IGNORE_INDEX, dtype=np.int64)
        for i, (e, n) in enumerate(zip(examples, lengths)):
            input_ids[i, :n] = e["input_ids"]
            attention[i, :n] = 1
            types[i, :n] = e["token_type_ids"]
            labels[i, :n] = e["labels"]
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention,
            "token_type_ids": types,
            "mlm_labels": labels,
            "sop_labels": np.array([e["sop_label"] for e in examples], dtype=np.int64),
        }
        if "masked_positions" in examples[0]:
            for key in ("masked_positions", "masked_weights", "masked_labels"):
                batch[key] = np.stack([e[key] for e in examples])
        return {k: torch.from_numpy(v) for k, v in batch.items()}


DEFAULT_GROUP_WINDOW = 16384
"""Positions of the epoch's order per length-grouping window (`LengthGrouping.window`)."""
DEFAULT_GROUP_CHUNK = 512
"""Positions per shuffled chunk of a length-grouped window (`LengthGrouping.chunk`)."""


@dataclasses.dataclass(frozen=True)
class LengthGrouping:
    """Length-grouped order (see the module docstring, "Length grouping"): windows of `window`
    consecutive positions of an epoch's order, each sorted by example length (longest first)
    and cut into chunks of `chunk` positions that are shuffled (seeded by seed, epoch and
    window). Both are counts of examples, independent of ranks and batch sizes; `window` must
    be a multiple of `chunk`. For batches without padding, make `chunk` a multiple of
    batch_size x world_size."""

    window: int = DEFAULT_GROUP_WINDOW
    chunk: int = DEFAULT_GROUP_CHUNK

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"length grouping {name}={value!r} is invalid; valid: >= 1")
        if self.window % self.chunk:
            raise ValueError(
                f"length grouping window={self.window} is invalid; valid: a multiple of "
                f"chunk={self.chunk}"
            )

    def state(self) -> dict[str, int]:
        """What a saved loader state records of it (the order depends on both)."""
        return {"window": self.window, "chunk": self.chunk}


class EpochPlan:
    """Which examples make batch b of epoch e on this rank: pure index arithmetic, O(batch).

    An epoch consumes the first `epoch_length` positions of its order: with drop_last
    floor(N / q) * q, q = `global_batch_size` or, when None, one micro-step of all ranks
    (batch_size * world_size); without drop_last world_size * (N // world_size) (each rank's
    last batch may be partial). From a global position `start` of the epoch (0 unless the epoch
    was begun on another number of ranks), batch b of rank r holds positions
    start + r + world_size * j, j in [b * batch_size, (b + 1) * batch_size), up to the epoch's
    end (a remainder under world_size positions is dropped so every rank has the same count).

    group_by_length: a `LengthGrouping` rearranges each epoch's order by length within windows
    (module docstring, "Length grouping"); `lengths` then maps example indices to their built
    lengths (`PretrainingData.built_lengths`). None: the keyed permutation alone.
    """

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        drop_last: bool,
        global_batch_size: int | None = None,
        *,
        group_by_length: LengthGrouping | None = None,
        lengths: Callable[[np.ndarray], np.ndarray] | None = None,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}"
            )
        if group_by_length is not None and lengths is None:
            raise ValueError("group_by_length needs the examples' lengths (lengths=...)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if global_batch_size is not None:
            if not drop_last:
                raise ValueError("global_batch_size needs drop_last=True")
            step = batch_size * world_size
            if (
                isinstance(global_batch_size, bool)
                or not isinstance(global_batch_size, int)
                or global_batch_size < step
                or global_batch_size % step
            ):
                raise ValueError(
                    f"global_batch_size={global_batch_size!r} is invalid; valid: a multiple of "
                    f"batch_size x world_size = {step}"
                )
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.drop_last = drop_last
        self.global_batch_size = global_batch_size
        self.per_rank = num_examples // world_size  # the ragged tail is dropped on every rank
        if drop_last:
            quantum = global_batch_size or batch_size * world_size
            self.epoch_length = num_examples // quantum * quantum
        else:
            self.epoch_length = world_size * self.per_rank
        self.batches_per_epoch = self.batches_from(0)
        if self.batches_per_epoch == 0:
            what = f" (global batch {global_batch_size})" if global_batch_size else ""
            raise ValueError(
                f"{num_examples} examples over {world_size} rank(s) give no full batch of "
                f"{batch_size}{what}"
            )
        self._perm: tuple[int, FeistelPermutation] | None = None
        self.group_by_length = group_by_length
        self._lengths = lengths
        # (epoch, window) -> the window's examples in grouped order; a batch spans <= 2 windows.
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def rank_positions(self, start: int = 0) -> int:
        """Positions this rank takes from global position `start` to the epoch's end."""
        return max(0, self.epoch_length - start) // self.world_size

    def batches_from(self, start: int = 0) -> int:
        """This rank's batches from global position `start` to the epoch's end."""
        n = self.rank_positions(start)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def permutation(self, epoch: int) -> FeistelPermutation:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, FeistelPermutation(self.num_examples, (self.seed, epoch)))
        return self._perm[1]

    def order(self, epoch: int, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """The examples at `positions` (ints in [0, num_examples)) of `epoch`'s order: the keyed
        permutation, arranged by length within windows with `group_by_length`."""
        if self.group_by_length is None:
            return self.permutation(epoch)(positions)
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.num_examples):
            raise IndexError(f"positions must be in [0, {self.num_examples})")
        size = self.group_by_length.window
        windows = x // size
        out = np.empty_like(x)
        for w in np.unique(windows).tolist():
            sel = windows == w
            out[sel] = self.window_order(epoch, w)[x[sel] - w * size]
        return out

    def window_order(self, epoch: int, window: int) -> np.ndarray:
        """The examples of window `window` of `epoch` (positions [window x size, ...)) in their
        length-grouped order; computed once per window (the last two are cached)."""
        key = (epoch, window)
        if key in self._windows:
            self._windows.move_to_end(key)
            return self._windows[key]
        group = self.group_by_length
        assert group is not None and self._lengths is not None
        first = window * group.window
        if not 0 <= first < self.num_examples:
            raise IndexError(f"window {window} is outside the {self.num_examples} positions")
        size = min(group.window, self.num_examples - first)
        examples = self.permutation(epoch)(np.arange(first, first + size, dtype=np.int64))
        # Whole chunks only: the ragged rest of an epoch's last window (< chunk examples) keeps
        # its random order at the end, where the epoch's dropped tail comes from, so the
        # examples an epoch drops stay a random choice (not the shortest ones).
        whole = size - size % group.chunk
        grouped = examples[:whole]
        lengths = np.asarray(self._lengths(grouped), dtype=np.int64)
        # Longest first, stable: the full-length examples keep their random order.
        grouped = grouped[np.argsort(-lengths, kind="stable")]
        seq = np.random.SeedSequence([self.seed, epoch, window], spawn_key=(_GROUP_DOMAIN,))
        shuffle = np.random.default_rng(seq).permutation(whole // group.chunk)
        chunks = grouped.reshape(-1, group.chunk)[shuffle].reshape(-1)
        arranged = np.concatenate([chunks, examples[whole:]])
        self._windows[key] = arranged
        if len(self._windows) > 2:
            self._windows.popitem(last=False)
        return arranged

    def batch_indices(self, epoch: int, batch: int, start: int = 0) -> np.ndarray:
        """Global example indices of batch `batch` (counted from `start`) of `epoch` for this
        rank."""
        first = batch * self.batch_size
        end = min(first + self.batch_size, self.rank_positions(start))
        j = np.arange(first, end, dtype=np.int64)
        return self.order(epoch, start + j * self.world_size + self.rank)


class _BatchSampler:
    """Yields [(epoch, index), ...] lists from (epoch, batch) on (batch counted from the global
    position `start` of that epoch), across epochs (later epochs start at position 0)."""

    def __init__(
        self, plan: EpochPlan, epoch: int, batch: int, num_epochs: int | None, start: int = 0
    ):
        self.plan, self.epoch, self.batch, self.num_epochs = plan, epoch, batch, num_epochs
        self.start = start

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, batch, start = self.epoch, self.batch, self.start
        while self.num_epochs is None or epoch < self.num_epochs:
            while batch < self.plan.batches_from(start):
                yield [(epoch, i) for i in self.plan.batch_indices(epoch, batch, start).tolist()]
                batch += 1
            epoch, batch, start = epoch + 1, 0, 0


class PretrainingLoader:
    """Per-rank, resumable, endlessly reshuffled batches of a `PretrainingData`.

    Every epoch is a fresh keyed permutation (see the module docstring); rank r takes every
    W-th position. Iterating yields `PretrainingCollator` dicts and goes on across epochs until
    `num_epochs` (None: forever); iterating again continues where the last iteration stopped
    (keep one live iterator at a time: they share the position counters).

    num_workers: DataLoader worker processes (0: in the main process); batches are identical
        for any value.
    drop_last: drop the last partial batch of each epoch (same count on every rank either way).
    static_shapes: pad every batch to max_seq_length (compiled models). None: on when the
        masking config has static_masked_positions.
    global_batch_size: examples per optimizer step over all ranks (batch_size x gradient
        accumulation x world_size; drop_last only). Epochs then end on a step boundary, the
        same on any number of ranks, which makes an elastic resume (`load_state_dict(...,
        elastic=True)`) consume exactly what an uninterrupted run does. None: epochs end on a
        micro-step boundary (batch_size x world_size), as before this option existed; the same
        thing when there is no gradient accumulation.
    group_by_length: a `LengthGrouping`: each epoch's order is arranged by example length
        within windows of a fixed number of positions (module docstring, "Length grouping"),
        so most batches hold examples of one length and need no padding. It is recorded in
        the state (a state saved with another setting, or without it, is refused: the order
        differs). None (the default): the plain keyed permutation; the stream and the state
        are those of a loader without this option.
    """

    def __init__(
        self,
        data: PretrainingData,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        num_epochs: int | None = None,
        drop_last: bool = True,
        static_shapes: bool | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        global_batch_size: int | None = None,
        group_by_length: LengthGrouping | None = None,
    ):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be None or >= 1, got {num_epochs}")
        if prefetch_factor is not None and num_workers == 0:
            raise ValueError("prefetch_factor needs num_workers > 0")
        self.data = data
        self.plan = EpochPlan(
            data.num_examples,
            batch_size,
            rank,
            world_size,
            data.seed,
            drop_last,
            global_batch_size,
            group_by_length=group_by_length,
            lengths=None if group_by_length is None else data.built_lengths,
        )
        step = batch_size * world_size
        if group_by_length is not None and group_by_length.chunk % step:
            warnings.warn(
                f"length grouping chunk={group_by_length.chunk} is not a multiple of the "
                f"micro-step batch_size x world_size = {step}: micro-steps straddle chunks, so "
                "fewer batches are free of padding (choose a chunk that is a multiple of it)",
                stacklevel=2,
            )
        self.num_workers = num_workers
        self.num_epochs = num_epochs
        self.drop_last = drop_last
        if static_shapes is None:
            static_shapes = data.masking.static_masked_positions is not None
        self.static_shapes = static_shapes
        self.collate = PretrainingCollator(
            data.special.pad, data.max_seq_length if static_shapes else None
        )
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.epoch = 0
        self.batch_in_epoch = 0  # batches of `epoch` handed out (since `start_in_epoch`)
        self.start_in_epoch = 0  # positions of `epoch` consumed under an earlier rank count

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    @property
    def batches_per_epoch(self) -> int:
        return self.plan.batches_per_epoch

    @property
    def samples_in_epoch(self) -> int:
        """Positions of the current epoch's order consumed by all ranks together (the global
        offset an elastic resume continues from)."""
        plan = self.plan
        return self.start_in_epoch + self.batch_in_epoch * plan.batch_size * plan.world_size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            return
        sampler = _BatchSampler(
            self.plan, self.epoch, self.batch_in_epoch, self.num_epochs, self.start_in_epoch
        )
        extra = {} if self.prefetch_factor is None else {"prefetch_factor": self.prefetch_factor}
        batches = loader_batches(
            self.data,
            self.collate,
            self.num_workers,
            batch_sampler=sampler,
            pin_memory=self.pin_memory,
            # Its own generator: creating the iterator must not draw from the global torch RNG
            # (that would shift dropout after a resume). Examples draw from (seed, epoch, index).
            generator=torch.Generator().manual_seed(self.data.seed),
            **extra,
        )
        for batch in batches:
            # Counted when handed out: a state saved after this batch resumes at the next one.
            self.batch_in_epoch += 1
            if self.batch_in_epoch == self.plan.batches_from(self.start_in_epoch):
                self.epoch, self.batch_in_epoch, self.start_in_epoch = self.epoch + 1, 0, 0
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The position (``epoch``; ``batch_in_epoch`` batches of this rank since
        ``start_in_epoch``; ``samples_in_epoch``, the same position as a count of the epoch's
        positions consumed by all ranks) and what it is valid for (with length grouping also
        ``group_by_length``: its window and chunk; without it the state has no such key, as
        before the option existed)."""
        state = {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "start_in_epoch": self.start_in_epoch,
            "samples_in_epoch": self.samples_in_epoch,
            "seed": self.data.seed,
            "rank": self.plan.rank,
            "world_size": self.plan.world_size,
            "batch_size": self.plan.batch_size,
            "global_batch_size": self.plan.global_batch_size,
            "drop_last": self.drop_last,
            "data": self.data.fingerprint(),
        }
        if self.plan.group_by_length is not None:
            state["group_by_length"] = self.plan.group_by_length.state()
        return state

    def load_state_dict(self, state: dict[str, Any], *, elastic: bool = False) -> None:
        """Resumes at the saved position (ValueError if the state is from a different setup:
        another seed, rank layout, batch size, data or length grouping, where exact resume is
        impossible).

        elastic: also accept a state saved by another number of ranks (any of its ranks' states:
        they hold the same global position), with the same seed, data, batch size, drop_last
        and length grouping. This loader then continues at the state's ``samples_in_epoch``:
        the first position of the epoch that no rank consumed, interleaved over this loader's
        ranks (see the module docstring). With the same number of ranks it is the exact resume
        above. A state whose epoch is already complete under this loader's epoch length
        (possible when ``global_batch_size`` is not given and the micro-step changes) continues
        at the next epoch."""
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise ValueError(f"loader state version {version!r}, expected 1 or {STATE_VERSION}")
        mine = self.state_dict()
        same_world = _jsonish(state.get("world_size")) == mine["world_size"]
        keys = ["seed", "batch_size", "drop_last", "data", "group_by_length"]
        if not (elastic and not same_world):
            keys[1:1] = ["rank", "world_size"]
        diff = [k for k in keys if _jsonish(state.get(k)) != _jsonish(mine.get(k))]
        if diff:
            hint = ""
            if diff == ["world_size"] or diff == ["rank", "world_size"]:
                hint = "; a state of another number of ranks loads with elastic=True"
            elif "group_by_length" in diff:  # None: saved without it / loading without it
                hint = (
                    "; length grouping changes the order of the examples: resume with the "
                    "group_by_length setting the state was saved with"
                )
            raise ValueError(
                "loader state does not match this loader in "
                + ", ".join(f"{k} (saved {state.get(k)!r}, now {mine.get(k)!r})" for k in diff)
                + hint
            )
        epoch, batch = int(state["epoch"]), int(state["batch_in_epoch"])
        start = int(state.get("start_in_epoch", 0))
        saved_world, saved_batch = int(state["world_size"]), int(state["batch_size"])
        if epoch < 0 or batch < 0 or start < 0:
            raise ValueError(
                f"loader state position epoch={epoch} batch={batch} start={start} is out of range"
            )
        samples = start + batch * saved_batch * saved_world
        recorded = int(state.get("samples_in_epoch", samples))
        if recorded != samples and not same_world:  # the position an elastic resume uses
            raise ValueError(
                f"loader state is inconsistent: samples_in_epoch={state['samples_in_epoch']} "
                f"but start_in_epoch + batch_in_epoch x batch_size x world_size = {samples}"
            )
        # Another global batch (e.g. a state saved before it was given) changes the epoch's
        # length, and the position may lie beyond the new end: the epoch is then over.
        same_length = _jsonish(state.get("global_batch_size")) == mine["global_batch_size"]
        if same_world and batch < self.plan.batches_from(start):
            self.epoch, self.batch_in_epoch, self.start_in_epoch = epoch, batch, start
        elif same_world and same_length:
            raise ValueError(f"loader state position epoch={epoch} batch={batch} is out of range")
        elif self.plan.batches_from(samples) == 0:  # the epoch is over at this epoch length
            self.epoch, self.batch_in_epoch, self.start_in_epoch = epoch + 1, 0, 0
        else:
            self.epoch, self.batch_in_epoch, self.start_in_epoch = epoch, 0, samples


def _jsonish(x: Any) -> Any:
    """Tuples and lists compare equal (a state may have gone through JSON/YAML)."""
    if isinstance(x, dict):
        return {k: _jsonish(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonish(v) for v in x]
    return x


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def validation_indices(
    num_examples: int,
    batch_size: int,
    max_batches: int | None,
    rank: int,
    world_size: int,
    seed: int,
) -> list[np.ndarray]:
    """The example indices of each of this rank's validation batches (see `validation_batches`)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be None or >= 1, got {max_batches}")
    total = num_examples
    if max_batches is not None:
        total = min(total, max_batches * batch_size * world_size)
    positions = np.arange(rank, total, world_size, dtype=np.int64)
    if not positions.size:
        return []
    order = FeistelPermutation(num_examples, (seed, VALIDATION_DOMAIN))(positions)
    return [order[i : i + batch_size] for i in range(0, order.size, batch_size)]


def validation_batches(
    data: PretrainingData,
    batch_size: int,
    max_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    *,
    static_shapes: bool | None = None,
) -> list[dict[str, torch.Tensor]]:
    """This rank's share of a fixed validation set: a list of `PretrainingCollator` batches.

    `data` must be a `PretrainingData(..., split="validation")`. The examples are the first
    min(len(data), max_batches * batch_size * world_size) positions (all, with max_batches None)
    of a keyed permutation of (data.seed, VALIDATION_DOMAIN); position p goes to rank
    p % world_size, in order, cut into batches of batch_size (the last may be smaller).
    Masks and SOP swaps are the examples' epoch-0 ones (`data[(0, i)]`, a key space of their
    own). So every call, in any process, returns the same tensors; ranks' examples are disjoint
    and together exactly the chosen positions, each rank getting at most max_batches batches.
    Ranks' batch counts differ by at most one when the chosen count is not a multiple of
    batch_size * world_size: sum the losses and counts per rank and all-reduce them once after
    the loop (a collective per batch would hang). An empty list is possible on a rank when
    there are fewer validation examples than ranks.

    static_shapes: pad to max_seq_length (None: when the masking has static_masked_positions),
    as `PretrainingLoader` does. Examples are built in this process (about 50 us each)."""
    if getattr(data, "split", "train") != "validation":
        raise ValueError(
            "validation_batches needs PretrainingData(..., split='validation') (the held-out "
            f"documents of {data.shard_dir}), got split={getattr(data, 'split', 'train')!r}"
        )
    if static_shapes is None:
        static_shapes = data.masking.static_masked_positions is not None
    collate = PretrainingCollator(data.special.pad, data.max_seq_length if static_shapes else None)
    batches = validation_indices(
        data.num_examples, batch_size, max_batches, rank, world_size, data.seed
    )
    return [collate([data[(0, int(i))] for i in idx]) for idx in batches]
