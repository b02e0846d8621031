"""Orthogonal maps evaluated in shards over the data-parallel ranks (``engine.orthogonal_shard_maps``).

Every rank of a data-parallel job holds the same free parameters, so without this every rank
maps the same matrices (TransJect at ALBERT-base width: 121 Cayley solves of 768 x 768 per
step, more than softmax's whole step on an H100). `DataParallelMapSharding` is the
`model.orthogonal.MapSharding` the engine hands to its `OrthogonalStepCache`: a batch of
``total`` maps is split into ``world_size`` contiguous shares whose sizes differ by at most one
(rank r evaluates ``bounds(total)``), and ``gather`` all-gathers the shares with autograd
(torch's functional collectives: the backward is a reduce-scatter that sums each share's
gradient over the ranks). A batch with fewer maps than ranks is not sharded. Why the result is
the unsharded gradient: ``model/orthogonal.py``'s module docstring. Batches of small matrices
(a side under ``min_size``, ``engine.orthogonal_shard_min_size``) are not sharded either: their
maps cost less than the collectives (2 CPU ranks over gloo, the maps of a 4-layer TransJect
forward + backward: at 64 x 64 2.3 ms on every rank, 2.5 ms sharded; at 128 x 128 7.9 vs 7.4
ms; at 256 x 256 39 vs 32 ms; BENCHMARKS.md),
and on a GPU a batched solve of small matrices costs about the same for 6 of them as for 11.

The collectives run on the default process group (the data-parallel group of this project's
jobs: NCCL on GPUs, gloo on CPU), from inside the model's forward and backward. Every rank must
therefore evaluate the same groups of maps in the same order in every training micro-batch,
which holds for models whose forward uses all their orthogonal maps (all of this project's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine import compat


class DataParallelMapSharding:
    """`model.orthogonal.MapSharding` over the ``world_size`` ranks of the default group."""

    def __init__(self, rank: int, world_size: int, min_size: int = 0) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"map sharding needs rank < world_size >= 2, got {rank}/{world_size}")
        self.rank = rank
        self.world_size = world_size
        self.min_size = min_size
        """Matrices with a side shorter than this are mapped by every rank."""

    def sizes(self, total: int) -> list[int]:
        """How many of ``total`` maps each rank evaluates (the first ``total % world_size``
        ranks one more)."""
        base, extra = divmod(total, self.world_size)
        return [base + (r < extra) for r in range(self.world_size)]

    def bounds(self, total: int, shape: tuple[int, int]) -> tuple[int, int] | None:
        if total < self.world_size or min(shape) < self.min_size:
            return None
        sizes = self.sizes(total)
        lo = sum(sizes[: self.rank])
        return lo, lo + sizes[self.rank]

    def gather(self, part: torch.Tensor, total: int) -> torch.Tensor:
        sizes = self.sizes(total)
        chunk = sizes[0]  # the largest share: every rank sends this many rows
        if part.size(0) < chunk:
            part = torch.cat([part, part.new_zeros(chunk - part.size(0), *part.shape[1:])])
        full = compat.all_gather_with_autograd(part.contiguous(), dist.group.WORLD)
        if sizes[-1] == chunk:  # equal shares: no padding to drop
            return full
        return torch.cat([full[r * chunk : r * chunk + n] for r, n in enumerate(sizes)])
