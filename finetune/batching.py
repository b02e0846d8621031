"""Batching for fine-tuning: padding examples into tensors (`collate`) and the length-grouped
batch sampler (`LengthGroupedBatchSampler`, HF's ``group_by_length``). Shared by the fine-tuning
loop and the GLUE and LRA example sets, which import nothing else of the trainer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def collate(
    batch: Sequence[Mapping[str, Any]], pad_id: int, pad_to_multiple_of: int | None = None
) -> dict[str, torch.Tensor]:
    """Pads examples to the batch's longest (rounded up to ``pad_to_multiple_of``).

    Returns torch tensors: input_ids, attention_mask (1 real, 0 padding), token_type_ids (0 on
    padding), all (B, N) int64; index (B,) int64 when the examples carry one; and labels (B,)
    (int64 class ids or float32 scores) when they carry labels. The model takes the first three.
    """
    if not batch:
        raise ValueError("empty batch")
    width = max(len(item["input_ids"]) for item in batch)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    type_ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, item in enumerate(batch):
        n = len(item["input_ids"])
        input_ids[i, :n] = torch.as_tensor(np.asarray(item["input_ids"], dtype=np.int64))
        type_ids[i, :n] = torch.as_tensor(np.asarray(item["token_type_ids"], dtype=np.int64))
        mask[i, :n] = 1
    out = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": type_ids}
    if all("index" in item for item in batch):
        out["index"] = torch.tensor([item["index"] for item in batch], dtype=torch.long)
    labels = [item.get("label") for item in batch]
    if any(label is not None for label in labels):
        if any(label is None for label in labels):
            raise ValueError("a batch mixes labelled and unlabelled examples")
        regression = any(isinstance(label, (float, np.floating)) for label in labels)
        out["labels"] = torch.tensor(labels, dtype=torch.float32 if regression else torch.long)
    return out


MEGABATCH_BATCHES = 50
"""Global batches per megabatch of the length-grouped sampler (HF's mega_batch_mult)."""


def example_lengths(examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """(n,) int64 token counts: the set's ``lengths`` (an array, or a method returning one) if it
    has one, else ``len(input_ids)`` plus ``len(input_ids_b)`` for two-document examples."""
    given = getattr(examples, "lengths", None)
    if callable(given):  # the GLUE and LRA example sets compute it
        given = given()
    if given is not None:
        return np.asarray(given, dtype=np.int64)
    out = np.empty(len(examples), dtype=np.int64)
    for i in range(len(examples)):
        item = examples[i]
        out[i] = len(item["input_ids"]) + (len(item["input_ids_b"]) if "input_ids_b" in item else 0)
    return out


class LengthGroupedBatchSampler:
    """This rank's batches of indices, grouped by length; the same count on every rank.

    Epoch e: a permutation seeded by (seed, e); cut into megabatches of ``MEGABATCH_BATCHES``
    global batches (``batch_size x world_size`` examples); each megabatch sorted by length
    (longest first, stable) and cut into global batches; the ragged tail dropped; the global
    batches shuffled (seeded); rank r takes examples [r*batch_size, (r+1)*batch_size) of
    each. Sorting inside megabatches keeps batches random while their members have similar
    lengths; shuffling the batches avoids a long-to-short sweep within every megabatch.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        megabatch_batches: int = MEGABATCH_BATCHES,
    ):
        if batch_size < 1 or megabatch_batches < 1:
            raise ValueError("batch_size and megabatch_batches must be >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {rank}, {world_size}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.megabatch_batches = seed, megabatch_batches
        self.epoch = 0
        if len(self) == 0:
            raise ValueError(
                f"{len(self.lengths)} training examples give no full global batch of "
                f"{batch_size} x {world_size} ranks"
            )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths) // (self.batch_size * self.world_size)

    def global_batches(self) -> np.ndarray:
        """(num_batches, batch_size x world_size) example indices of this epoch, all ranks."""
        rng = np.random.default_rng([self.seed, self.epoch])
        perm = rng.permutation(len(self.lengths))
        global_batch = self.batch_size * self.world_size
        mega = global_batch * self.megabatch_batches
        chunks = []
        for start in range(0, len(perm), mega):
            chunk = perm[start : start + mega]
            chunks.append(chunk[np.argsort(-self.lengths[chunk], kind="stable")])
        order = np.concatenate(chunks)[: len(self) * global_batch]
        batches = order.reshape(len(self), global_batch)
        return batches[rng.permutation(len(batches))]

    def __iter__(self):
        lo = self.rank * self.batch_size
        for batch in self.global_batches():
            yield batch[lo : lo + self.batch_size].tolist()


__all__ = ["MEGABATCH_BATCHES", "LengthGroupedBatchSampler", "collate", "example_lengths"]
