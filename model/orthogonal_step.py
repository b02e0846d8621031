"""The orthogonal maps (`model.orthogonal`) in a training step: evaluated once per optimizer
step across the micro-batches of gradient accumulation (`OrthogonalStepCache`), shared out over
the data-parallel ranks (`DataParallelMapSharding`), and evaluated eagerly before a compiled
encoder; all of it driven by the training engine through the model's step hooks
(`OrthogonalMapHooks`, one of `model.step_hooks`). Settings: `EncoderConfig`'s
``orthogonal_step_cache``, ``orthogonal_shard_maps`` and ``orthogonal_shard_min_size``
(``model.*`` in a recipe).

Once per optimizer step. Across the micro-batches of one optimizer step the free parameters do
not change, so each map is evaluated once per step, forward and backward, through an
`OrthogonalStepCache` active around every training forward (`OrthogonalStepCache.micro_batch`).
The maps are evaluated with their graph at the first micro-batch (Q = map(X)); the
micro-batches before the last use a detached leaf Q' = Q.detach().requires_grad_(), on whose
`.grad` their backward passes sum dL_i/dQ; the last micro-batch uses Q through an identity whose
backward adds Q'.grad to its own dL_k/dQ, so the whole step's gradient goes through the map's
backward once, inside the LAST micro-batch's own backward (where DDP and DeepSpeed ZeRO 1-2
reduce gradients). Exact: the map's backward is linear in its incoming gradient,
J^T (sum_i g_i) = sum_i J^T g_i, up to fp32 summation order; the loss scaling of every
micro-batch is already in g_i. Not with ZeRO-3, whose partitioned parameters are gathered only
around each module's own forward. With `torch.compile` the step's maps are evaluated eagerly
into the forward's cache before the compiled encoder runs, whose graph then takes them as
inputs (it skips maps already in the active cache) and returns their gradient to the eager maps.

Shared out over the ranks. With several data-parallel ranks every rank would map the same
matrices from the same free parameters (TransJect at ALBERT-base width: 121 Cayley solves of
768 x 768 per step, more than softmax's whole step on an H100). With a `MapSharding` the step
cache maps each batch of matrices of one kind and shape in shards instead: a batch of ``total``
maps is split into ``world_size`` contiguous shares whose sizes differ by at most one, rank r
evaluates its share, an all-gather (the engine's, `HookContext.gather`) hands every rank the
whole batch, and the all-gather's backward (a reduce-scatter, summing) gives each owner
sum_r dL_r/dQ of its share, whose map backward yields the gradient of its free parameters; the
other ranks' gradient for them is zero. The data-parallel reduction (an average over ranks)
then gives J^T (mean_r dL_r/dQ) = mean_r J^T dL_r/dQ, the gradient of the unsharded evaluation,
up to fp32 summation order. A batch with fewer maps than ranks is not sharded, nor are batches
of small matrices (a side under ``orthogonal_shard_min_size``): their maps cost less than the
collectives (measured on 2 CPU ranks: docs/benchmarks.md#transjects-orthogonal-maps), and on a
GPU a batched solve of a few small matrices costs about the same as of a dozen. The collectives
run from inside the model's forward and backward, so every
rank must evaluate the same groups of maps in the same order in every training micro-batch,
which holds for models whose forward uses all their orthogonal maps (all of this project's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from model.config import EncoderConfig
from model.hooks import HookContext, StepHooks
from model.orthogonal import (
    FP32Orthogonal,
    MapSharding,
    evaluate_grouped,
    evaluate_orthogonal_maps,
    forward_cache_key,
    orthogonal_cache,
    orthogonal_modules,
    step_cache_active,
)


class OrthogonalStepCache:
    """Each orthogonal map evaluated once per optimizer step, forward and backward (module
    docstring); driven by `OrthogonalMapHooks`, not state (never saved).

    `micro_batch(index, last)` is entered around the forward of micro-batch `index` (0-based)
    of a step, `last` for the step's last one; `finish()` follows the last micro-batch's
    backward and `reset()` comes at the step (and whenever the parameters may have changed,
    e.g. a checkpoint load). Inside the block `evaluate_orthogonal_maps` and each map's own
    forward take the step's matrices from here.
    """

    def __init__(self, sharding: MapSharding | None = None) -> None:
        self.sharding = sharding
        """Spreads the step's maps over data-parallel ranks (module docstring), or None."""
        self.evaluations = 0
        """Matrices mapped so far by this rank (an (E, n, n) tensor counts E; with `sharding`
        only this rank's share); for tests and benchmarks."""
        self.reset()

    def reset(self) -> None:
        """Drops the step's matrices, their graph and the gradients gathered on the leaves."""
        self._graph: dict[str | int, torch.Tensor] = {}  # Q = map(X), with its graph to X
        self._leaf: dict[str | int, torch.Tensor] = {}  # Q' = Q.detach(): earlier dL/dQ
        self._current: dict[str | int, torch.Tensor] = {}  # what this micro-batch's forwards use
        self._micro: tuple[int, bool] | None = None
        self._delivered: set[str | int] = set()

    @property
    def empty(self) -> bool:
        return not self._graph

    @contextlib.contextmanager
    def micro_batch(self, index: int, last: bool) -> Iterator[OrthogonalStepCache]:
        """Within the block, training forwards (gradients on) of micro-batch `index` use the
        step's matrices. Several forwards of one micro-batch (e.g. one encoder applied to two
        inputs, or a forward run again) share the very same tensors."""
        if self._micro is not None and index < self._micro[0]:
            self.reset()  # a new step without reset(): never mix two steps' matrices
        if self._micro != (index, last):
            self._micro = (index, last)
            self._current = {}
        with step_cache_active(self):
            yield self

    def matrices(
        self, pairs: list[tuple[FP32Orthogonal, torch.Tensor]]
    ) -> dict[str | int, torch.Tensor]:
        """{forward_cache_key(map): matrix} for this micro-batch of the (map, free
        parameters) pairs: the step's Q (evaluated now, batched, if this is its first use in the
        step), as the leaf Q' before the last micro-batch, through `_AddStepGradient` in the
        last."""
        assert self._micro is not None, "matrices() outside micro_batch()"
        missing = [(orth, X) for orth, X in pairs if forward_cache_key(orth) not in self._graph]
        if missing:
            matrices, evaluated = evaluate_grouped(missing, self.sharding)
            self.evaluations += evaluated
            self._graph.update(matrices)
        last = self._micro[1]
        out = {}
        for orth, _ in pairs:
            key = forward_cache_key(orth)
            M = self._current.get(key)
            if M is None:
                Q, leaf = self._graph[key], self._leaf.get(key)
                if not last:
                    if leaf is None:
                        leaf = self._leaf[key] = Q.detach().requires_grad_()
                    # Used through a view, not as the leaf itself: autocast keeps one cast of a
                    # leaf for all its uses, where the gradients would meet in bf16; a view is
                    # cast at each use, as the per-forward matrix is, so they meet in fp32.
                    M = leaf.view_as(leaf)
                elif leaf is None:  # first used in the last micro-batch: nothing to add
                    M = Q
                else:
                    M = _AddStepGradient.apply(Q, self, key)
                self._current[key] = M
            out[key] = M
        return out

    def finish(self) -> None:
        """After the last micro-batch's backward: raises if a map's gradient from earlier
        micro-batches was not handed on (the last micro-batch's loss did not depend on the
        map), then drops the step's matrices."""
        try:
            lost = [
                key
                for key, leaf in self._leaf.items()
                if leaf.grad is not None and key not in self._delivered
            ]
            if lost:
                raise RuntimeError(
                    f"{len(lost)} orthogonal map(s) received gradients in earlier micro-batches "
                    "of this optimizer step but not in its last one, so the step cache could "
                    "not hand their gradient on; set model.orthogonal_step_cache=false for a "
                    "model whose last micro-batch may not use every map"
                )
        finally:
            self.reset()

    def _gradient(self, key: str | int) -> torch.Tensor | None:
        self._delivered.add(key)
        leaf = self._leaf.get(key)
        return None if leaf is None else leaf.grad


class _AddStepGradient(torch.autograd.Function):
    """Identity on the step's Q whose backward adds the gradient the earlier micro-batches
    gathered on the leaf Q' (`OrthogonalStepCache`)."""

    @staticmethod
    def forward(ctx, Q: torch.Tensor, cache: OrthogonalStepCache, key: str | int) -> torch.Tensor:
        ctx.cache, ctx.key = cache, key
        return Q.view_as(Q)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        earlier = ctx.cache._gradient(ctx.key)
        return (grad if earlier is None else grad + earlier), None, None


class DataParallelMapSharding:
    """`model.orthogonal.MapSharding` over the ``world_size`` data-parallel ranks (module
    docstring): rank ``rank`` maps its share of each batch, ``all_gather`` (differentiable,
    `HookContext.gather`) hands every rank the whole batch."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        min_size: int = 0,
        all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"map sharding needs rank < world_size >= 2, got {rank}/{world_size}")
        self.rank = rank
        self.world_size = world_size
        self.min_size = min_size
        """Matrices with a side shorter than this are mapped by every rank."""
        self.all_gather = all_gather

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
        if self.all_gather is None:
            raise RuntimeError("DataParallelMapSharding.gather needs the ranks' all_gather")
        sizes = self.sizes(total)
        chunk = sizes[0]  # the largest share: every rank sends this many rows
        if part.size(0) < chunk:
            part = torch.cat([part, part.new_zeros(chunk - part.size(0), *part.shape[1:])])
        full = self.all_gather(part.contiguous())
        if sizes[-1] == chunk:  # equal shares: no padding to drop
            return full
        return torch.cat([full[r * chunk : r * chunk + n] for r, n in enumerate(sizes)])


class OrthogonalMapHooks(StepHooks):
    """The orthogonal maps' `StepHooks`: the step cache and the sharding where they apply, and
    under ``torch.compile`` the maps evaluated eagerly before the compiled encoder."""

    def __init__(
        self,
        model: nn.Module,
        context: HookContext,
        steps: OrthogonalStepCache | None,
        across_micro_batches: bool,
        shard_min_size: int,
    ) -> None:
        self.model = model
        self.context = context
        self.steps = steps
        """The step's maps: once per optimizer step (``orthogonal_step_cache``) and/or in
        shards over the ranks (``orthogonal_shard_maps``; then once per micro-batch without the
        step cache); None where every forward evaluates them itself (compiled: eagerly)."""
        self.across_micro_batches = across_micro_batches
        self.shard_min_size = shard_min_size

    def micro_batch(self, index: int, last: bool) -> contextlib.AbstractContextManager:
        """The model takes its maps from the step's cache in this micro-batch; compiled, the
        maps are evaluated eagerly first (`maps_up_front`)."""
        steps = self.steps
        if steps is None:  # every forward maps for itself: eagerly, as the encoder is compiled
            return self.maps_up_front()
        if not self.across_micro_batches:  # sharded, each micro-batch its own maps
            index, last = 0, True
        if self.context.compiled:
            return self._step_maps_up_front(steps, index, last)
        return steps.micro_batch(index, last)

    @contextlib.contextmanager
    def _step_maps_up_front(
        self, steps: OrthogonalStepCache, index: int, last: bool
    ) -> Iterator[None]:
        """Compiled: the step's maps, evaluated eagerly (with the step cache and the sharding)
        before the compiled encoder runs (`maps_up_front`)."""
        with steps.micro_batch(index, last), self.maps_up_front():
            yield

    @contextlib.contextmanager
    def maps_up_front(self) -> Iterator[None]:
        """Compiled: the orthogonal maps evaluated eagerly into the forward's cache before the
        compiled encoder runs; the compiled graph takes them as inputs instead of evaluating its
        own (it skips maps already in the active cache), and their gradient leaves the graph
        into the eager maps. Eagerly, the Cayley maps run as the block inverse (matrix
        products); traced into the graph they would be the LU solve (slower:
        docs/benchmarks.md#transjects-orthogonal-maps)."""
        with orthogonal_cache() as store:
            evaluate_orthogonal_maps(self.model, store)
            yield

    def after_backward(self, last: bool) -> None:
        if self.steps is not None and (last or not self.across_micro_batches):
            # The maps' gradients reached the parameters in this backward: drop the maps.
            self.steps.finish()

    def before_optimizer_step(self) -> None:
        if self.steps is not None:  # the parameters change: the next step maps anew
            self.steps.reset()

    def after_load(self) -> None:
        if self.steps is not None:  # maps of the loaded parameters from now on
            self.steps.reset()

    def summary(self) -> str | None:
        """How a training step evaluates the orthogonal maps, or None where every forward
        evaluates them itself."""
        steps = self.steps
        if steps is None:
            return None
        how = []
        if self.across_micro_batches:
            how.append(f"once per optimizer step ({self.context.accumulation} micro-batches)")
        if steps.sharding is not None:
            size = self.shard_min_size
            how.append(
                f"shared out over {self.context.world_size} ranks"
                + (f" (matrices from {size} x {size})" if size else "")
            )
        return (
            "orthogonal maps "
            + ", ".join(how)
            + (", before the compiled encoder" if self.context.compiled else "")
        )


def map_settings(model: nn.Module) -> EncoderConfig:
    """The config whose ``orthogonal_step_cache``, ``orthogonal_shard_maps`` and
    ``orthogonal_shard_min_size`` apply to ``model``: that of its first module with an
    `EncoderConfig` as ``config`` (the model's or its encoder's), else the defaults."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, EncoderConfig):
            return config
    return EncoderConfig()


def orthogonal_step_hooks(model: nn.Module, context: HookContext) -> OrthogonalMapHooks | None:
    """The hooks of ``model``'s orthogonal maps, or None where a training step has nothing to
    do for them (no maps; ZeRO-3; neither the step cache nor the sharding applies and the
    encoder is not compiled)."""
    maps = [] if context.zero3 else orthogonal_modules(model)
    if not maps:
        return None
    settings = map_settings(model)
    across = settings.orthogonal_step_cache and context.accumulation > 1
    min_size = settings.orthogonal_shard_min_size
    shard = (
        settings.orthogonal_shard_maps
        and context.world_size > 1
        and context.gather is not None
        and any(  # some matrices large enough to share out
            min(module.parametrizations[name].original.shape[-2:]) >= min_size
            for _, module, name in maps
        )
    )
    steps = None
    if across or shard:
        sharding = (
            DataParallelMapSharding(context.rank, context.world_size, min_size, context.gather)
            if shard
            else None
        )
        steps = OrthogonalStepCache(sharding)
    if steps is None and not context.compiled:
        return None
    return OrthogonalMapHooks(model, context, steps, across, min_size)
