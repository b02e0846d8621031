"""Length-grouped pretraining order (`data_prep.loader.LengthGrouping`, `data.group_by_length`).

The grouped order is a bijection of each epoch's positions that depends on neither the rank
count nor the batch size; on the embedded corpus most batches carry no padding with it and
none without it; exact resume and elastic resume (2 ranks -> 1) consume exactly what an
uninterrupted run does; a state saved with another setting is refused; and with the option off
the stream and the state are those of the loader before the option existed (a digest taken
with that loader, commit de132bc).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from test_loader import assert_batches_equal, take, write_shard_dir

from data_prep.loader import (
    EpochPlan,
    FeistelPermutation,
    LengthGrouping,
    PretrainingData,
    PretrainingLoader,
)
from data_prep.shards import ShardConfig, build_shards
from data_prep.tokenizer import write_tokenizer
from pretrain.config import pretrain_config

pytestmark = pytest.mark.unit


def table_lengths(n: int, seed: int = 0, full: int = 128, short_share: float = 0.2):
    """ALBERT-like lengths: most examples full, the rest shorter (uniform in [8, full))."""
    rng = np.random.default_rng(seed)
    lengths = np.full(n, full, dtype=np.int64)
    short = rng.random(n) < short_share
    lengths[short] = rng.integers(8, full, size=int(short.sum()))
    return lengths


def grouped_plan(lengths, batch=4, rank=0, world=1, seed=3, window=64, chunk=16, **kw):
    return EpochPlan(
        len(lengths),
        batch,
        rank,
        world,
        seed,
        kw.pop("drop_last", True),
        group_by_length=LengthGrouping(window, chunk),
        lengths=lambda idx: lengths[idx],
        **kw,
    )


# ------------------------------------------------------------------------------ the order


@pytest.mark.parametrize("n", [1, 15, 16, 64, 100, 257, 1000])
def test_grouped_order_is_a_bijection(n):
    """Every window size (n below one chunk, one window, several with a ragged end): the
    grouped order of an epoch holds every example exactly once, and differs between epochs."""
    lengths = table_lengths(n)
    plan = grouped_plan(lengths, batch=1)
    orders = [plan.order(epoch, np.arange(n)) for epoch in range(3)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(n))
    if n >= 64:
        assert not np.array_equal(orders[0], orders[1])


def test_grouped_order_is_grouped_and_shuffled_by_chunks():
    """Inside a window: chunks hold examples sorted by length (longest first) when laid end to
    end in sorted order; the window's examples are the permutation's for its positions; the
    chunk holding the shortest examples is not at the same place in every window/epoch."""
    n, window, chunk = 4096, 256, 32
    lengths = table_lengths(n, seed=1)
    plan = grouped_plan(lengths, window=window, chunk=chunk)
    places = set()
    for epoch in range(3):
        perm = FeistelPermutation(n, (plan.seed, epoch))
        for w in range(n // window):
            got = plan.window_order(epoch, w)
            positions = np.arange(w * window, (w + 1) * window)
            assert sorted(got.tolist()) == sorted(perm(positions).tolist())
            chunks = lengths[got].reshape(-1, chunk)
            # each chunk is sorted (non-increasing) and the chunks, ordered by their first
            # length, are the window sorted by length
            assert (np.diff(chunks, axis=1) <= 0).all()
            ranked = chunks[np.argsort(-chunks[:, 0], kind="stable")]
            assert np.array_equal(np.sort(ranked.reshape(-1))[::-1], np.sort(lengths[got])[::-1])
            places.add(int(np.argmin(chunks[:, -1])))
    assert len(places) > 3


def test_grouped_order_is_the_same_for_any_rank_layout():
    """The position -> example map depends on (seed, epoch, window, chunk) only: the union of
    all ranks' batches of an epoch is the same prefix of the same order for 1, 2 or 4 ranks and
    any batch size, each example once."""
    lengths = table_lengths(1000, seed=2)
    reference = grouped_plan(lengths, batch=8).order(1, np.arange(1000))
    for batch, world in ((8, 1), (4, 2), (2, 4), (5, 4)):
        taken = []
        for rank in range(world):
            plan = grouped_plan(lengths, batch=batch, rank=rank, world=world)
            assert np.array_equal(plan.order(1, np.arange(1000)), reference)
            for b in range(plan.batches_per_epoch):
                taken.append(plan.batch_indices(1, b))
        taken = np.concatenate(taken)
        assert len(set(taken.tolist())) == len(taken) == plan.epoch_length
        assert set(taken.tolist()) == set(reference[: plan.epoch_length].tolist())


def test_ragged_rest_keeps_the_random_order():
    """The last window's rest (fewer than a chunk) stays in the permutation's order: the tail
    an epoch drops is a random choice, not the shortest examples."""
    n, window, chunk = 300, 128, 32  # windows 128, 128, 44 = 32 + a rest of 12
    lengths = table_lengths(n, seed=4)
    plan = grouped_plan(lengths, window=window, chunk=chunk)
    perm = FeistelPermutation(n, (plan.seed, 0))
    got = plan.order(0, np.arange(n))
    assert np.array_equal(got[-12:], perm(np.arange(n - 12, n)))


def test_validation_of_the_setting():
    with pytest.raises(ValueError, match="multiple of chunk"):
        LengthGrouping(100, 64)
    with pytest.raises(ValueError, match="chunk=0"):
        LengthGrouping(64, 0)
    with pytest.raises(ValueError, match="lengths"):
        EpochPlan(10, 2, 0, 1, 0, True, group_by_length=LengthGrouping(4, 2))
    with pytest.raises(IndexError):
        grouped_plan(table_lengths(100)).window_order(0, 2)


def test_config_fields():
    cfg = pretrain_config({"data": {"shards": "x"}})
    assert cfg.data.group_by_length is False and cfg.data.length_grouping() is None
    cfg = pretrain_config(
        {
            "data": {
                "shards": "x",
                "group_by_length": True,
                "group_by_length_window": 1024,
                "group_by_length_chunk": 128,
            }
        }
    )
    assert cfg.data.length_grouping() == LengthGrouping(1024, 128)
    with pytest.raises(ValueError, match=r"multiple of data\.group_by_length_chunk"):
        pretrain_config({"data": {"shards": "x", "group_by_length_window": 1000}})
    with pytest.raises(ValueError, match="group_by_length_chunk=0"):
        pretrain_config({"data": {"shards": "x", "group_by_length_chunk": 0}})


# ------------------------------------------------------------------------------ lengths


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    return write_shard_dir(tmp_path_factory.mktemp("shards"), examples=(40, 25, 35))


@pytest.mark.parametrize("layout", ["pair", "single"])
@pytest.mark.parametrize("seq", [8, 24, 64])
def test_built_lengths_are_the_built_examples(tmp_path, shard_dir, layout, seq):
    root = shard_dir
    if layout == "single":
        root = write_shard_dir(tmp_path / "single")
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["layout"] = "single"
        (root / "manifest.json").write_text(json.dumps(manifest))
    data = PretrainingData(root, max_seq_length=seq, seed=1)
    idx = np.random.default_rng(0).permutation(data.num_examples)
    got = data.built_lengths(idx)
    assert got.tolist() == [len(data[int(i)]["input_ids"]) for i in idx]
    assert data.built_lengths(idx.reshape(4, -1)).shape == (4, 25)
    with pytest.raises(IndexError):
        data.built_lengths([data.num_examples])


# ------------------------------------------------------------------------------ off = before

# sha256 of 15 batches of each of 2 ranks (batch 4, global batch 16, seq 48, seed 7) over
# write_shard_dir(examples=(40, 25, 35)), computed with data_prep/loader.py of commit de132bc
# (before length grouping existed) and again with this one.
STREAM_BEFORE = "427ca7a75ee1227cf343ba0f9334bdc6c38257f8214ae4ba93d28176c51ceefe"
STATE_KEYS_BEFORE = {
    "version",
    "epoch",
    "batch_in_epoch",
    "start_in_epoch",
    "samples_in_epoch",
    "seed",
    "rank",
    "world_size",
    "batch_size",
    "global_batch_size",
    "drop_last",
    "data",
}


def test_off_is_the_stream_and_state_of_before(shard_dir):
    data = PretrainingData(shard_dir, max_seq_length=48, seed=7)
    digest = hashlib.sha256()
    for rank in range(2):
        loader = PretrainingLoader(data, 4, rank=rank, world_size=2, global_batch_size=16)
        for batch in take(loader, 15):
            for key in sorted(batch):
                digest.update(key.encode())
                digest.update(batch[key].numpy().tobytes())
        state = loader.state_dict()
        assert set(state) == STATE_KEYS_BEFORE
        assert (state["epoch"], state["batch_in_epoch"], state["samples_in_epoch"]) == (1, 3, 24)
    assert digest.hexdigest() == STREAM_BEFORE


# ------------------------------------------------------------------------------ resume


def test_exact_resume_mid_epoch_gives_the_same_stream(shard_dir):
    """Grouped, 2 ranks: a loader resumed from a state saved mid-epoch (mid-window) gives the
    batches an uninterrupted loader gives, across the next epoch too."""
    data = PretrainingData(shard_dir, max_seq_length=32, seed=5)
    group = LengthGrouping(32, 8)
    for rank in range(2):
        full = take(PretrainingLoader(data, 4, rank=rank, world_size=2, group_by_length=group), 20)
        first = PretrainingLoader(data, 4, rank=rank, world_size=2, group_by_length=group)
        head = take(first, 7)
        state = json.loads(json.dumps(first.state_dict()))
        assert state["group_by_length"] == {"window": 32, "chunk": 8}
        resumed = PretrainingLoader(data, 4, rank=rank, world_size=2, group_by_length=group)
        resumed.load_state_dict(state)
        assert_batches_equal(head + take(resumed, 13), full)


def test_grouped_batches_are_the_same_with_workers(shard_dir):
    """The order is computed in the training process (the batch sampler); workers only build."""
    data = PretrainingData(shard_dir, max_seq_length=32, seed=5)
    group = LengthGrouping(32, 8)
    alone = take(PretrainingLoader(data, 4, group_by_length=group), 30)
    workers = take(PretrainingLoader(data, 4, num_workers=2, group_by_length=group), 30)
    assert_batches_equal(alone, workers)


def test_elastic_resume_2_to_1_consumes_exactly_the_rest(shard_dir):
    """2 ranks take 3 batches each (24 positions), then 1 rank resumes from rank 0's state: the
    examples of the epoch are those of an uninterrupted 1-rank run, each once, and with the same
    global batch every optimizer step holds the same examples."""
    data = PretrainingData(shard_dir, max_seq_length=32, seed=6)
    group = LengthGrouping(48, 8)
    gbs = 8

    two = [
        PretrainingLoader(
            data, 4, rank=r, world_size=2, global_batch_size=gbs, group_by_length=group
        )
        for r in range(2)
    ]
    before = []
    for lo in two:
        take(lo, 3)
        before.append([lo.plan.batch_indices(0, b) for b in range(3)])
    state = json.loads(json.dumps(two[0].state_dict()))
    one = PretrainingLoader(data, 4, global_batch_size=gbs, group_by_length=group)
    one.load_state_dict(state, elastic=True)
    assert one.start_in_epoch == 24
    after = [one.plan.batch_indices(0, b, 24) for b in range(one.plan.batches_from(24))]
    reference = PretrainingLoader(data, 4, global_batch_size=gbs, group_by_length=group)
    uninterrupted = [reference.plan.batch_indices(0, b) for b in range(reference.batches_per_epoch)]

    consumed = np.concatenate([*before[0], *before[1], *after]).tolist()
    expected = np.concatenate(uninterrupted).tolist()
    assert Counter(consumed) == Counter(expected)
    assert len(set(consumed)) == len(consumed) == 96  # 100 // 8 * 8
    # step by step: step s holds positions [8 s, 8 s + 8)
    steps_two = [sorted(np.concatenate([before[0][s], before[1][s]]).tolist()) for s in range(3)]
    steps_one = [sorted(np.concatenate(after[2 * s : 2 * s + 2]).tolist()) for s in range(9)]
    ref_steps = [
        sorted(np.concatenate(uninterrupted[2 * s : 2 * s + 2]).tolist()) for s in range(12)
    ]
    assert steps_two + steps_one == ref_steps
    # and the loader itself hands out those batches, then the next epoch from position 0
    batches = take(one, len(after) + 1)
    assert one.epoch == 1 and one.batch_in_epoch == 1
    for batch, idx in zip(batches, after):
        assert batch["input_ids"].shape[0] == len(idx)


def test_a_state_of_another_setting_is_refused(shard_dir):
    data = PretrainingData(shard_dir, max_seq_length=32, seed=5)
    plain = PretrainingLoader(data, 4)
    grouped = PretrainingLoader(data, 4, group_by_length=LengthGrouping(32, 8))
    other = PretrainingLoader(data, 4, group_by_length=LengthGrouping(64, 8))
    take(plain, 2)
    take(grouped, 2)
    with pytest.raises(ValueError, match=r"group_by_length \(saved None, now \{'window': 32"):
        PretrainingLoader(data, 4, group_by_length=LengthGrouping(32, 8)).load_state_dict(
            plain.state_dict()
        )
    with pytest.raises(ValueError, match="resume with the group_by_length setting"):
        PretrainingLoader(data, 4).load_state_dict(grouped.state_dict())
    with pytest.raises(ValueError, match="group_by_length"):
        other.load_state_dict(grouped.state_dict(), elastic=True)
    same = PretrainingLoader(data, 4, group_by_length=LengthGrouping(32, 8))
    same.load_state_dict(json.loads(json.dumps(grouped.state_dict())))
    assert same.batch_in_epoch == 2


def test_a_chunk_that_micro_steps_straddle_warns(shard_dir):
    data = PretrainingData(shard_dir, max_seq_length=32, seed=5)
    with pytest.warns(UserWarning, match="not a multiple of the micro-step"):
        PretrainingLoader(data, 4, world_size=3, group_by_length=LengthGrouping(32, 8))


# ------------------------------------------------------------------------------ real corpus


@pytest.fixture(scope="module")
def embedded_shards(tmp_path_factory) -> Path:
    """Tokenizer + seq-128 shards of the whole embedded corpus (what `python -m data_prep
    tokenizer` / `shards --max-seq-length 128 --num-shards 2` make, in this process)."""
    root = tmp_path_factory.mktemp("grouping_embedded")
    tok = write_tokenizer(root / "tok", inputs=["embedded"], vocab_size=2000)
    cfg = ShardConfig(inputs=("embedded",), num_shards=2, max_seq_length=128, seed=0)
    build_shards(cfg, tok, root / "shards", workers=1)
    return root / "shards"


def unpadded_share(loader) -> float:
    masks = [batch["attention_mask"] for batch in loader]
    return sum(bool(m.all()) for m in masks) / len(masks)


def test_most_batches_are_unpadded_on_the_embedded_corpus(embedded_shards):
    """Batches of 32 at seq 128 over 3 epochs: without grouping nearly every batch holds a short
    example; with it most batches are all full-length (or all of one short length)."""
    data = PretrainingData(embedded_shards, max_seq_length=128, seed=0)
    full = float((data.built_lengths(np.arange(data.num_examples)) == 128).mean())
    assert 0.6 < full < 0.95
    off = unpadded_share(PretrainingLoader(data, 32, num_epochs=3))
    on = unpadded_share(
        PretrainingLoader(data, 32, num_epochs=3, group_by_length=LengthGrouping(512, 32))
    )
    assert off < 0.1
    assert on > 0.6
    assert on > off + 0.5
