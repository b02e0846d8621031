"""The training loader (data_prep/loader.py): exact resume, rank split, determinism, memory,
SOP, and refusal of bad shard directories. Shard directories are written here with format.py."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep import format as fmt
from data_prep.format import truncated_pair_lengths
from data_prep.loader import (
    EpochPlan,
    FeistelPermutation,
    PretrainingData,
    PretrainingLoader,
)
from data_prep.masking import IGNORE_INDEX, MaskingConfig

SPECIALS = list(fmt.ALBERT_SPECIAL_TOKENS)  # <pad> <unk> [CLS] [SEP] [MASK] = 0..4
WORDS = [f"▁w{i}" for i in range(40)]  # word starts (SentencePiece convention)
PIECES = [f"p{i}" for i in range(15)]  # word continuations
VOCAB = SPECIALS + WORDS + PIECES
PAD, UNK, CLS, SEP, MASK = range(5)
FIRST_PIECE = len(SPECIALS) + len(WORDS)


def write_tokenizer(path: Path, vocab: list[str] = VOCAB) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path))


def random_segment(rng: np.random.Generator, length: int) -> np.ndarray:
    """Words of 1-3 tokens: a '▁w' token then 0-2 continuation pieces, cut to `length`."""
    out: list[int] = []
    while len(out) < length:
        out.append(int(rng.integers(len(SPECIALS), FIRST_PIECE)))
        out.extend(rng.integers(FIRST_PIECE, len(VOCAB), size=int(rng.integers(0, 3))).tolist())
    return np.array(out[:length], dtype=np.int64)


def write_shard_dir(
    root: Path, examples: tuple[int, ...] = (40, 25, 35), seed: int = 0, max_len: int = 40
) -> Path:
    """A finished shard directory (format.py layout): tokenizer, arrays, done records, manifest."""
    root.mkdir(parents=True, exist_ok=True)
    write_tokenizer(root / fmt.TOKENIZER)
    rng = np.random.default_rng(seed)
    shards, total_tokens = [], 0
    for s, n in enumerate(examples):
        name = fmt.shard_name(s)
        rows, parts, off = [], [], 0
        for _ in range(n):
            a = random_segment(rng, int(rng.integers(1, max_len)))
            b = random_segment(rng, int(rng.integers(1, max_len)))
            rows.append([off, len(a), len(b)])
            parts += [a, b]
            off += len(a) + len(b)
        tokens = np.concatenate(parts).astype(fmt.token_dtype(len(VOCAB)))
        fmt.atomic_save_npy(root / fmt.tokens_file(name), tokens)
        fmt.atomic_save_npy(root / fmt.index_file(name), np.array(rows, dtype=np.int64))
        digests = {
            f: fmt.sha256_file(root / f) for f in (fmt.tokens_file(name), fmt.index_file(name))
        }
        record = {"examples": n, "tokens": int(off), "sha256": digests}
        fmt.atomic_write_text(root / fmt.done_file(name), json.dumps(record))
        shards.append({"name": name, **record})
        total_tokens += off
    manifest = {
        "format_version": fmt.FORMAT_VERSION,
        "tokenizer_sha256": fmt.sha256_file(root / fmt.TOKENIZER),
        "tokenizer_kind": "wordlevel",
        "special_tokens": {"pad": PAD, "unk": UNK, "cls": CLS, "sep": SEP, "mask": MASK},
        "vocab_size": len(VOCAB),
        "config": {"test": True},
        "num_shards": len(examples),
        "shards": shards,
        "totals": {"examples": sum(examples), "tokens": total_tokens, "documents": sum(examples)},
        "input": {"files": [], "documents": sum(examples)},
    }
    fmt.atomic_write_text(root / fmt.MANIFEST, json.dumps(manifest, indent=1))
    return root


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    return write_shard_dir(tmp_path_factory.mktemp("shards"))


def take(loader: PretrainingLoader, k: int) -> list[dict[str, torch.Tensor]]:
    """The next k batches, then the iterator (and its workers) is closed."""
    it = iter(loader)
    out = [next(it) for _ in range(k)]
    it.close()
    return out


def assert_batches_equal(xs, ys) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for key in x:
            torch.testing.assert_close(x[key], y[key], rtol=0, atol=0, msg=key)


# -- permutation ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4099])
def test_feistel_is_a_bijection(n):
    perm = FeistelPermutation(n, (3, 0))(np.arange(n))
    np.testing.assert_array_equal(np.sort(perm), np.arange(n))


def test_feistel_depends_on_key_and_shuffles():
    n = 5000
    a = FeistelPermutation(n, (0, 0))(np.arange(n))
    b = FeistelPermutation(n, (0, 1))(np.arange(n))
    c = FeistelPermutation(n, (1, 0))(np.arange(n))
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.05  # no trace of the identity order
    assert (a == np.arange(n)).sum() < 20  # about one fixed point expected
    np.testing.assert_array_equal(FeistelPermutation(n, (0, 0))(np.arange(n)), a)  # keyed only
    with pytest.raises(IndexError):
        FeistelPermutation(n, (0, 0))([n])


def test_truncation_matches_albert_pop_loop():
    def albert(la, lb, budget):
        while la + lb > budget:
            if la > lb:
                la -= 1
            else:
                lb -= 1
        return la, lb

    for la in range(0, 12):
        for lb in range(0, 12):
            for budget in range(2, 20):
                assert truncated_pair_lengths(la, lb, budget) == albert(la, lb, budget)


# -- examples ---------------------------------------------------------------------------------


def test_examples_structure_sop_and_truncation(shard_dir):
    """Decoding every example: [CLS] X [SEP] Y [SEP], types 0/1, X|Y = truncated A|B or B|A with
    label 1 iff swapped; specials never masked; SOP balanced over examples and epochs."""
    data = PretrainingData(shard_dir, max_seq_length=48, seed=5)
    swaps, truncated = [], 0
    for epoch in range(8):
        for i in range(len(data)):
            ex = data[(epoch, i)]
            ids, labels = ex["input_ids"], ex["labels"]
            assert len(ids) <= 48
            original = np.where(labels != IGNORE_INDEX, labels, ids)
            sep = np.flatnonzero(original == SEP)
            assert original[0] == CLS and len(sep) == 2 and sep[1] == len(ids) - 1
            x, y = original[1 : sep[0]], original[sep[0] + 1 : sep[1]]
            np.testing.assert_array_equal(
                ex["token_type_ids"], [0] * (sep[0] + 1) + [1] * len(y) + [1]
            )
            for p in (0, *sep):
                assert labels[p] == IGNORE_INDEX and ids[p] in (CLS, SEP)
            a, b = data.segments(i)
            la, lb = truncated_pair_lengths(len(a), len(b), 45)
            truncated += la + lb < len(a) + len(b)
            a, b = a[len(a) - la :], b[:lb]  # A keeps its end, B its start
            if ex["sop_label"] == 1:
                np.testing.assert_array_equal(x, b)
                np.testing.assert_array_equal(y, a)
            else:
                assert ex["sop_label"] == 0
                np.testing.assert_array_equal(x, a)
                np.testing.assert_array_equal(y, b)
            assert not np.array_equal(a, b)  # so the check above tells swapped from not
            swaps.append(ex["sop_label"])
    assert truncated > 50  # the truncation path was exercised
    assert abs(np.mean(swaps) - 0.5) < 0.05  # 800 draws: sd 0.018


def test_example_rng_depends_only_on_seed_epoch_index(shard_dir):
    d1 = PretrainingData(shard_dir, max_seq_length=64, seed=1)
    d2 = PretrainingData(shard_dir, max_seq_length=64, seed=1)
    for _ in range(3):
        d2[(0, 17)]  # history does not matter
    a, b = d1[(0, 17)], d2[(0, 17)]
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    np.testing.assert_array_equal(a["labels"], b["labels"])
    c = d1[(1, 17)]  # another epoch: masked afresh
    assert not np.array_equal(a["labels"], c["labels"])
    assert not np.array_equal(
        PretrainingData(shard_dir, 64, seed=2)[(0, 17)]["labels"], a["labels"]
    )


def test_whole_word_masking_in_the_loader(shard_dir):
    """Masked tokens come as whole words of the tokenizer's vocabulary ('▁' starts a word)."""
    data = PretrainingData(shard_dir, max_seq_length=64, masking=MaskingConfig(whole_word=True))
    for i in range(len(data)):
        ex = data[i]
        picked = ex["labels"] != IGNORE_INDEX
        original = np.where(picked, ex["labels"], ex["input_ids"])
        starts = (original < FIRST_PIECE) | np.r_[True, np.isin(original[:-1], [CLS, SEP])]
        for p in np.flatnonzero(picked):  # a masked continuation follows a masked token
            assert starts[p] or picked[p - 1]
            if p + 1 < len(original) and not starts[p + 1]:
                assert picked[p + 1]  # the rest of a masked word is masked too


# -- loader: determinism, resume, ranks ---------------------------------------------------------


def test_batches_identical_with_0_and_2_workers_across_epochs(shard_dir):
    data = PretrainingData(shard_dir, max_seq_length=64, seed=3)
    ref = take(PretrainingLoader(data, batch_size=8, num_workers=0), 30)  # 12 per epoch
    got = take(PretrainingLoader(data, batch_size=8, num_workers=2), 30)
    assert_batches_equal(ref, got)
    b = ref[0]
    assert b["input_ids"].dtype == torch.long and b["input_ids"].shape[0] == 8
    assert b["input_ids"].shape == b["attention_mask"].shape == b["mlm_labels"].shape
    assert b["sop_labels"].shape == (8,)
    width = b["input_ids"].shape[1]
    assert width == int(b["attention_mask"].sum(1).max())  # padded to the longest
    assert (b["input_ids"][b["attention_mask"] == 0] == PAD).all()
    assert (b["mlm_labels"][b["attention_mask"] == 0] == IGNORE_INDEX).all()


@pytest.mark.parametrize(
    ("k", "workers"),
    [(5, 0), (12, 0), (17, 0), (7, 2), (11, 2)],  # 12 batches per epoch: mid, boundary, next epoch
)
def test_exact_resume(shard_dir, k, workers):
    data = PretrainingData(shard_dir, max_seq_length=64, seed=9)
    ref = take(PretrainingLoader(data, batch_size=8), k + 8)

    first = PretrainingLoader(data, batch_size=8, num_workers=workers)
    assert_batches_equal(take(first, k), ref[:k])
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
    assert (state["epoch"], state["batch_in_epoch"]) == divmod(k, 12)

    resumed = PretrainingLoader(
        PretrainingData(shard_dir, max_seq_length=64, seed=9), batch_size=8, num_workers=workers
    )
    resumed.load_state_dict(state)
    assert_batches_equal(take(resumed, 8), ref[k:])
    # Continuing the first loader (a second `for` loop) also picks up where it stopped.
    assert_batches_equal(take(first, 8), ref[k:])


def test_resume_skips_at_index_level(shard_dir):
    """Resuming deep into a run decodes only the batches it yields."""

    class Counting(PretrainingData):
        calls = 0

        def __getitem__(self, key):
            Counting.calls += 1
            return super().__getitem__(key)

    data = Counting(shard_dir, max_seq_length=64)
    loader = PretrainingLoader(data, batch_size=8)
    state = loader.state_dict()
    state.update(epoch=1000, batch_in_epoch=7)
    loader.load_state_dict(state)
    take(loader, 2)
    assert Counting.calls == 16
    assert (loader.epoch, loader.batch_in_epoch) == (1000, 9)


def test_num_epochs_stops_and_reshuffles(shard_dir):
    data = PretrainingData(shard_dir, max_seq_length=64)
    loader = PretrainingLoader(data, batch_size=10, num_epochs=2)
    batches = list(loader)
    assert len(batches) == 2 * loader.batches_per_epoch == 20
    assert list(loader) == []  # finished
    plan = loader.plan
    e0 = np.concatenate([plan.batch_indices(0, b) for b in range(10)])
    e1 = np.concatenate([plan.batch_indices(1, b) for b in range(10)])
    np.testing.assert_array_equal(np.sort(e0), np.arange(100))
    np.testing.assert_array_equal(np.sort(e1), np.arange(100))
    assert not np.array_equal(e0, e1)


@pytest.mark.parametrize(("n", "world"), [(101, 2), (100, 3), (57, 4)])
def test_ranks_are_disjoint_and_cover_the_epoch(n, world):
    per_rank = n // world
    seen = []
    for rank in range(world):
        plan = EpochPlan(n, per_rank, rank, world, seed=4, drop_last=True)
        assert plan.batches_per_epoch == 1
        seen.append(plan.batch_indices(epoch=2, batch=0))
    allseen = np.concatenate(seen)
    assert len(allseen) == world * per_rank == len(set(allseen.tolist()))  # disjoint, equal shares
    assert n - len(allseen) < world  # only the ragged tail is dropped


def test_two_rank_loaders_see_disjoint_examples(shard_dir):
    """Through the real loaders: each rank's batches are its plan's examples, disjoint."""
    data = PretrainingData(shard_dir, max_seq_length=64, seed=6)
    loaders = [PretrainingLoader(data, 10, rank=r, world_size=2, num_epochs=1) for r in (0, 1)]
    assert all(lo.batches_per_epoch == 5 for lo in loaders)
    indices = []
    for lo in loaders:
        batches = list(lo)
        assert len(batches) == 5
        for b, batch in enumerate(batches):
            idx = lo.plan.batch_indices(0, b)
            expected = lo.collate([data[(0, int(i))] for i in idx])
            assert_batches_equal([batch], [expected])
            indices += idx.tolist()
    assert sorted(indices) == list(range(100))


def test_static_shapes_and_positions(shard_dir):
    cfg = MaskingConfig(static_masked_positions=6)
    data = PretrainingData(shard_dir, max_seq_length=64, masking=cfg)
    for batch in take(PretrainingLoader(data, batch_size=8, num_workers=0), 4):
        assert batch["input_ids"].shape == (8, 64)
        assert batch["masked_positions"].shape == batch["masked_weights"].shape == (8, 6)
        assert batch["masked_weights"].dtype == torch.float32
        labels = batch["mlm_labels"]
        assert ((labels != IGNORE_INDEX).sum(1) == batch["masked_weights"].sum(1)).all()
        gathered = labels.gather(1, batch["masked_positions"])
        real = batch["masked_weights"] > 0
        assert (gathered[real] == batch["masked_labels"][real]).all()
        assert (gathered[real] != IGNORE_INDEX).all()


def test_load_state_dict_refuses_other_setups(shard_dir):
    data = PretrainingData(shard_dir, max_seq_length=64, seed=1)
    state = PretrainingLoader(data, batch_size=8).state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        PretrainingLoader(data, batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PretrainingLoader(PretrainingData(shard_dir, 64, seed=2), 8).load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):
        PretrainingLoader(data, 8, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="data"):
        PretrainingLoader(PretrainingData(shard_dir, 32, seed=1), 8).load_state_dict(state)


# -- memory -------------------------------------------------------------------------------------


def test_memory_does_not_grow_with_corpus(tmp_path):
    """A 10M-example corpus (sparse index file): building the loader and drawing batches
    allocates far less than one int64 per example (an 80 MB permutation), and takes no time
    proportional to N. (The constant ~4 MiB peak is format.sha256_file's read buffer.)"""
    n = 10_000_000
    root = tmp_path / "big"
    root.mkdir()
    write_tokenizer(root / fmt.TOKENIZER)
    name = fmt.shard_name(0)
    fmt.atomic_save_npy(root / fmt.tokens_file(name), np.arange(5, 45, dtype=np.uint16))
    index = np.lib.format.open_memmap(root / fmt.index_file(name), "w+", np.int64, (n, 3))
    index[:1000] = [[i % 20, 10, 10] for i in range(1000)]  # the rest: sparse zeros (empty)
    index.flush()
    del index
    manifest = {
        "format_version": fmt.FORMAT_VERSION,
        "tokenizer_sha256": fmt.sha256_file(root / fmt.TOKENIZER),
        "special_tokens": {"pad": PAD, "unk": UNK, "cls": CLS, "sep": SEP, "mask": MASK},
        "vocab_size": len(VOCAB),
        "shards": [{"name": name, "examples": n, "tokens": 40, "sha256": {}}],
    }
    (root / fmt.MANIFEST).write_text(json.dumps(manifest))

    # The probe can fail: a materialised permutation of N would show up.
    tracemalloc.start()
    np.random.default_rng(0).permutation(n)
    big_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert big_peak >= 8 * n

    tracemalloc.start()
    t0 = time.perf_counter()
    data = PretrainingData(root, max_seq_length=128, seed=0)
    loader = PretrainingLoader(data, batch_size=32, rank=1, world_size=4)
    state = loader.state_dict()
    state.update(epoch=3, batch_in_epoch=loader.batches_per_epoch - 1)  # across the boundary
    loader.load_state_dict(state)
    batches = take(loader, 3)
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20, f"peak {peak / 2**20:.1f} MiB"
    assert elapsed < 5.0
    assert loader.batches_per_epoch == n // 4 // 32
    assert all(b["input_ids"].shape[0] == 32 for b in batches)


# -- bad input ----------------------------------------------------------------------------------


@pytest.fixture
def fresh_dir(tmp_path) -> Path:
    return write_shard_dir(tmp_path / "s", examples=(10, 10))


def test_missing_manifest(fresh_dir):
    (fresh_dir / fmt.MANIFEST).unlink()
    with pytest.raises(fmt.ShardError, match=r"manifest\.json not found"):
        PretrainingData(fresh_dir)


def test_corrupt_manifest(fresh_dir):
    (fresh_dir / fmt.MANIFEST).write_text('{"format_version": 1, "shards": [')
    with pytest.raises(fmt.ShardError, match=r"manifest\.json is not valid JSON"):
        PretrainingData(fresh_dir)


def test_manifest_missing_keys_and_bad_totals(fresh_dir):
    manifest = json.loads((fresh_dir / fmt.MANIFEST).read_text())
    broken = {k: v for k, v in manifest.items() if k != "special_tokens"}
    (fresh_dir / fmt.MANIFEST).write_text(json.dumps(broken))
    with pytest.raises(fmt.ShardError, match=r"manifest\.json: missing key .special_tokens."):
        PretrainingData(fresh_dir)
    manifest["totals"]["examples"] = 21
    (fresh_dir / fmt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(fmt.ShardError, match=r"totals\.examples is 21"):
        PretrainingData(fresh_dir)


def test_checksum_mismatch(fresh_dir):
    path = fresh_dir / fmt.tokens_file(fmt.shard_name(1))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    PretrainingData(fresh_dir)  # not checked unless asked (it reads the whole corpus)
    with pytest.raises(fmt.ShardError, match=r"shard_00001\.tokens\.npy is corrupt"):
        PretrainingData(fresh_dir, verify_checksums=True)


def test_missing_shard_file(fresh_dir):
    (fresh_dir / fmt.index_file(fmt.shard_name(0))).unlink()
    with pytest.raises(fmt.ShardError, match=r"shard_00000\.index\.npy is missing"):
        PretrainingData(fresh_dir)


def test_tokenizer_mismatch(fresh_dir, tmp_path):
    other = tmp_path / "other_tokenizer.json"
    write_tokenizer(other, [*VOCAB, "▁extra"])
    PretrainingData(fresh_dir, tokenizer_path=fresh_dir / fmt.TOKENIZER)  # the right one passes
    with pytest.raises(fmt.ShardError, match=r"other_tokenizer\.json .* does not match"):
        PretrainingData(fresh_dir, tokenizer_path=other)
    # The copy in the shard dir itself is checked before whole-word masking relies on it.
    (fresh_dir / fmt.TOKENIZER).write_bytes(other.read_bytes())
    with pytest.raises(fmt.ShardError, match="does not match"):
        PretrainingData(fresh_dir, masking=MaskingConfig(whole_word=True))


def test_shard_that_disagrees_with_manifest(fresh_dir):
    name = fmt.shard_name(1)
    index = np.load(fresh_dir / fmt.index_file(name))
    fmt.atomic_save_npy(fresh_dir / fmt.index_file(name), index[:7])
    data = PretrainingData(fresh_dir)
    data[3]  # shard 0 is fine
    with pytest.raises(
        fmt.ShardError, match=r"shard_00001\.index\.npy: 7 rows but the manifest says 10"
    ):
        data[15]
    fmt.atomic_save_npy(fresh_dir / fmt.index_file(name), index)
    tokens = np.load(fresh_dir / fmt.tokens_file(name))
    fmt.atomic_save_npy(fresh_dir / fmt.tokens_file(name), tokens[:-3])
    with pytest.raises(fmt.ShardError, match="runs past"):
        PretrainingData(fresh_dir)[15]


def test_bad_arguments(shard_dir):
    with pytest.raises(ValueError, match="max_seq_length"):
        PretrainingData(shard_dir, max_seq_length=4)
    with pytest.raises(ValueError, match="static_masked_positions"):
        PretrainingData(shard_dir, 16, masking=MaskingConfig(static_masked_positions=14))
    data = PretrainingData(shard_dir, 64)
    with pytest.raises(ValueError, match="rank"):
        PretrainingLoader(data, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="no full batch"):
        PretrainingLoader(data, 64, world_size=2)


def test_tokenizer_special_tokens_are_never_random_replacements(fresh_dir):
    """Special tokens the tokenizer adds beyond the five roles are excluded from random draws."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(fresh_dir / fmt.TOKENIZER))
    tok.add_special_tokens(["<extra>"])  # gets id len(VOCAB)
    tok.save(str(fresh_dir / fmt.TOKENIZER))
    manifest = json.loads((fresh_dir / fmt.MANIFEST).read_text())
    manifest["tokenizer_sha256"] = fmt.sha256_file(fresh_dir / fmt.TOKENIZER)
    manifest["vocab_size"] = len(VOCAB) + 1
    (fresh_dir / fmt.MANIFEST).write_text(json.dumps(manifest))
    for whole_word in (True, False):
        data = PretrainingData(fresh_dir, 64, masking=MaskingConfig(whole_word=whole_word))
        assert data.special_ids.tolist() == [PAD, UNK, CLS, SEP, MASK, len(VOCAB)]


def test_empty_segment_has_no_sop_target(shard_dir):
    data = PretrainingData(shard_dir, 64, masking=MaskingConfig(sop_probability=1.0))
    a = np.array([5, 45, 6, 7], dtype=np.int64)
    ex = data.build(a, a[:0], np.random.default_rng(0))
    assert ex["sop_label"] == IGNORE_INDEX
    original = np.where(ex["labels"] != IGNORE_INDEX, ex["labels"], ex["input_ids"])
    assert original.tolist() == [CLS, *a, SEP, SEP]  # not swapped
    ex = data.build(a[:2], a[2:], np.random.default_rng(0))
    assert ex["sop_label"] == 1  # always swapped at sop_probability 1
