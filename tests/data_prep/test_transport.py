"""data_prep.transport: a batch dict as one buffer between DataLoader workers and the trainer."""

from __future__ import annotations

import functools
import math
import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from data_prep.transport import PackedBatch, PackedCollate, pack_batch, unpack_if_packed
from finetune.batching import collate


def sample_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 30000, (4, 7), generator=g),
        "note": "not a tensor",
        "masked_weights": torch.rand(4, 3, generator=g),  # float32
        "attention_mask": torch.rand(4, 7, generator=g) > 0.3,  # bool, odd byte count
        "sop_labels": torch.tensor([0, 1, -100, 1]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),  # 0-d
        "empty": torch.zeros(4, 0, dtype=torch.long),
        "strided": torch.arange(40).reshape(5, 8)[:, ::2],  # not contiguous
    }


@pytest.mark.parametrize("inline_bytes", [1 << 20, 0])  # bytearray, shared-memory tensor
def test_pack_unpack_roundtrip(inline_bytes):
    batch = sample_batch()
    packed = pack_batch(batch, inline_bytes=inline_bytes)
    assert isinstance(packed.buffer, bytearray if inline_bytes else torch.Tensor)
    out = pickle.loads(pickle.dumps(packed)).unpack()  # what crossing the process boundary does
    assert list(out) == list(batch)  # the dict's order, non-tensors in place
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(out[key], value, rtol=0, atol=0, msg=key)
        else:
            assert out[key] == value


def test_unpacked_tensors_are_views_of_one_buffer():
    packed = pack_batch(sample_batch(), inline_bytes=0)
    out = packed.unpack()
    start = packed.buffer.data_ptr()
    end = start + packed.buffer.numel()
    for key, dtype, shape, offset in packed.layout:
        if math.prod(shape) * dtype.itemsize:
            assert out[key].data_ptr() == start + offset and offset % 8 == 0, key
            assert start <= out[key].data_ptr() < end
    out["input_ids"][0, 0] = -1  # a view: writes land in the buffer, nothing else moves
    assert packed.unpack()["input_ids"][0, 0] == -1
    assert (packed.unpack()["sop_labels"] == torch.tensor([0, 1, -100, 1])).all()


def test_through_dataloader_workers_equals_collate():
    """Real worker processes: the unpacked batches equal the plain collate's, for the
    fine-tuning collate (int64 ids, float32 regression labels)."""
    examples = [
        {
            "input_ids": list(range(1, 3 + i % 9)),
            "token_type_ids": [0] * (2 + i % 9),
            "label": i / 7,
        }
        for i in range(24)
    ]
    plain = functools.partial(collate, pad_id=0)
    loader = DataLoader(examples, batch_size=8, num_workers=2, collate_fn=PackedCollate(plain))
    got = list(loader)
    assert all(isinstance(b, PackedBatch) for b in got)
    for i, batch in enumerate(map(unpack_if_packed, got)):
        ref = plain(examples[8 * i : 8 * i + 8])
        assert list(batch) == list(ref)
        for key in ref:
            torch.testing.assert_close(batch[key], ref[key], rtol=0, atol=0, msg=key)
    assert unpack_if_packed({"a": 1}) == {"a": 1}
