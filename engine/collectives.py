"""The collectives the trainers use through the engine: barriers, host flags reduced over ranks
(through a gloo group when the default one is NCCL, so no device synchronisation) and means of
logged metrics. `Collectives` holds the `Engine`'s methods for this job."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

from albatross import compat

log = logging.getLogger("engine.engine")  # the name its messages always had


class Collectives:
    """The `Engine`'s collectives (a mixin: the state they use is set up by `Engine`)."""

    # -- collectives for the trainer -----------------------------------------------------------

    def barrier(self) -> None:
        if self._collective:
            torch_dist.barrier()

    def all_reduce_max(self, values: list[float]) -> list[float]:
        """Element-wise max of ``values`` over ranks (for flags: stop requested, budget hit).
        Host values, exchanged without touching the GPU: one process needs no exchange, and on
        NCCL they go through a gloo group made for them (an NCCL all-reduce would wait for the
        GPU to finish its queued work: a host synchronisation at every step)."""
        if not self._collective:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64)
        group = self._flags_group()
        if group is None and torch_dist.get_backend() != "gloo":
            t = t.to(self.device)
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX, group=group)
        return t.cpu().tolist()

    def _flags_group(self) -> Any:
        """Collective on first use: a gloo process group for host flags when the default group
        is not gloo (None: use the default group, on the device, when gloo is not available)."""
        if torch_dist.get_backend() == "gloo":
            return None
        if self._host_group is None:
            try:
                timeout = timedelta(minutes=self.cfg.dist_timeout_minutes)
                self._host_group = torch_dist.new_group(backend="gloo", timeout=timeout)
            except Exception as e:  # no gloo in this build: the device path, synchronising
                log.warning("no gloo group for host flags (%s); using the default group", e)
                self._host_group = False
        return self._host_group or None

    def all_gather_with_autograd(self, part: torch.Tensor) -> torch.Tensor:
        """Collective, differentiable: every rank's ``part`` (the same shape on each)
        concatenated along dim 0 in rank order, on the default group; its backward is a
        reduce-scatter that sums (what a model's step hooks are handed to share work out)."""
        return compat.all_gather_with_autograd(part, torch_dist.group.WORLD)

    def any_rank(self, flag: bool) -> bool:
        """Collective: whether ``flag`` is true on any rank."""
        return bool(self.all_reduce_max([float(flag)])[0])

    def all_reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean of a float64 CPU vector over ranks (for logged metrics)."""
        t = values.detach().to(torch.float64)
        if self._collective:
            t = t.to(self.device)
            torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
            t = t / self.world_size
        return t.cpu()
