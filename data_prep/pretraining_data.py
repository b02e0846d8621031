"""The pretraining examples of a shard directory as a dataset (`PretrainingData`): every example
masked on access from (seed, epoch, index), MLM and SOP, and the keyed permutation
(`FeistelPermutation`) the epochs' order is drawn from. The loader that batches them and resumes
exactly: `data_prep/loader.py`, whose docstring describes both."""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from data_prep import format as fmt
from data_prep.masking import IGNORE_INDEX, MaskingConfig, mask_example, word_start_table

_SHUFFLE_DOMAIN = 0x5348_5546  # spawn_key tag: shuffle keys never collide with example seeds
VALIDATION_DOMAIN = 0x5641_4C49  # spawn_key tag of validation examples' masks and order


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
