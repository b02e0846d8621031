"""One buffer per batch between DataLoader workers and the training process.

A DataLoader worker hands every tensor of a batch to the training process through its own
shared-memory segment (with torch's default `file_descriptor` sharing strategy: one segment
created, one file descriptor sent over a socket and one mmap on the receiving side, per tensor).
For the small tensors of a training batch that per-tensor cost, not the batch's construction, is
what the training process waits for: receiving an already built batch of 5 tensors takes about
twice as long as one tensor of the same bytes (measured on the project's 2-core machine; the
loader's data-wait share with workers is in docs/benchmarks.md#data-loading).

`PackedCollate` wraps a collate function on the worker side: the batch's tensors are copied into
one buffer (each 8-byte aligned) and travel as one `PackedBatch`; `PackedBatch.unpack()` in the
training process returns the same dict as views into that buffer, without a copy. A buffer of up
to `INLINE_BYTES` is a `bytearray`, pickled through the worker's pipe (for a small message
cheaper than a shared-memory segment); a larger one is a uint8 tensor in shared memory (for a
large one cheaper than pickled bytes). DataLoader's `pin_memory=True` pins the one buffer
(`PackedBatch.pin_memory`), so the views are pinned too. Values that are not tensors pass
through unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

INLINE_BYTES = 256 * 1024
"""Largest buffer sent inline (pickled bytes) rather than as a shared-memory tensor."""

_ALIGN = 8
"""Byte alignment of every tensor in the buffer: `view(dtype)` needs offsets that are multiples
of the element size (at most 8 for the dtypes a batch holds)."""


@dataclass(frozen=True)
class PackedBatch:
    """A batch dict as one uint8 buffer plus where each tensor lies in it."""

    buffer: torch.Tensor | bytearray
    """Every tensor's bytes, each starting at a multiple of 8: a bytearray (sent inline) or a
    uint8 tensor (sent through shared memory)."""
    layout: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    """(key, dtype, shape, byte offset) per tensor, in the dict's order."""
    others: tuple[tuple[str, Any], ...]
    """(key, value) of the values that are not tensors."""
    keys: tuple[str, ...]
    """The dict's keys in their original order."""

    def pin_memory(self) -> PackedBatch:
        """Called by DataLoader's pinning thread (`pin_memory=True`): pins the one buffer."""
        return PackedBatch(self._tensor().pin_memory(), self.layout, self.others, self.keys)

    def _tensor(self) -> torch.Tensor:
        if isinstance(self.buffer, torch.Tensor):
            return self.buffer
        if not self.buffer:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.buffer, dtype=torch.uint8)  # shares the bytearray

    def unpack(self) -> dict[str, Any]:
        """The original dict, in its order; its tensors are views into `buffer` (no copy)."""
        buffer = self._tensor()
        values: dict[str, Any] = {
            key: buffer[offset : offset + _nbytes(dtype, shape)].view(dtype).view(shape)
            for key, dtype, shape, offset in self.layout
        }
        values.update(self.others)
        return {key: values[key] for key in self.keys}


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def pack_batch(batch: Mapping[str, Any], inline_bytes: int = INLINE_BYTES) -> PackedBatch:
    """Copies the tensors of `batch` into one buffer (see the module docstring): a bytearray up
    to `inline_bytes`, else a uint8 tensor."""
    tensors: list[tuple[str, torch.Tensor]] = []
    others: list[tuple[str, Any]] = []
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            tensors.append((key, value.contiguous()))
        else:
            others.append((key, value))
    layout = []
    offset = 0
    for key, tensor in tensors:
        layout.append((key, tensor.dtype, tuple(tensor.shape), offset))
        offset += -(-_nbytes(tensor.dtype, tuple(tensor.shape)) // _ALIGN) * _ALIGN
    raw: torch.Tensor | bytearray
    if 0 < offset <= inline_bytes:
        raw = bytearray(offset)
        buffer = torch.frombuffer(raw, dtype=torch.uint8)  # writes go to the bytearray
    else:
        raw = buffer = torch.empty(offset, dtype=torch.uint8)
    for (_key, tensor), (_, _, _, start) in zip(tensors, layout):
        if tensor.numel():
            buffer[start : start + tensor.numel() * tensor.element_size()] = tensor.reshape(
                -1
            ).view(torch.uint8)
    return PackedBatch(raw, tuple(layout), tuple(others), tuple(batch.keys()))


class PackedCollate:
    """`collate` run in a DataLoader worker, its batch dict returned as one `PackedBatch`."""

    def __init__(self, collate: Callable[[list[Any]], Mapping[str, Any]]):
        self.collate = collate

    def __call__(self, examples: list[Any]) -> PackedBatch:
        return pack_batch(self.collate(examples))


def unpack_if_packed(batch: Any) -> Any:
    """`batch.unpack()` for a `PackedBatch`, anything else unchanged."""
    return batch.unpack() if isinstance(batch, PackedBatch) else batch


def loader_batches(
    dataset: Any, collate: Callable[[list[Any]], Mapping[str, Any]], num_workers: int, **loader
) -> Iterator[Any]:
    """One pass of a `DataLoader` over `dataset` (further DataLoader arguments in `loader`):
    with workers the batches travel packed and are unpacked here; without, `collate` runs as is.
    The one place the project's loaders choose the transport."""
    collate_fn = PackedCollate(collate) if num_workers else collate
    batches = DataLoader(dataset, collate_fn=collate_fn, num_workers=num_workers, **loader)
    return map(unpack_if_packed, batches)


__all__ = ["PackedBatch", "PackedCollate", "loader_batches", "pack_batch", "unpack_if_packed"]
