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

import dataclasses
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from data_prep.masking import IGNORE_INDEX
from data_prep.pretraining_data import VALIDATION_DOMAIN, FeistelPermutation, PretrainingData
from data_prep.transport import loader_batches

STATE_VERSION = 2  # 2: start_in_epoch, samples_in_epoch, global_batch_size (1 still loads)
_GROUP_DOMAIN = 0x4752_4F55  # spawn_key tag of the chunk shuffle of length-grouped windows


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
