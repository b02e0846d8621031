"""LAMB with a per-tensor trust ratio, exact on DeepSpeed's flat ZeRO 1-2 partitions, in
``torch._foreach_*`` (multi-tensor) ops, with no host synchronisation.

LAMB (You et al. 2019, Algorithm 2, without bias correction as in ALBERT's LAMB) scales each
parameter tensor's Adam-style update ``u = m / (sqrt(v) + eps) + wd * w`` by the trust ratio
``phi(||w||) / (||u|| + eps)``, so the *tensor* is the unit: a trust ratio computed over any other
slice of the parameters is another optimizer. The formula is ``pytorch_optimizer.Lamb``'s (the
project's reference: ``weight_decouple=False``, ``adam_debias=True``): ``phi(z) = min(z, 10)``, the
ratio is 1 where ``||w||`` or ``||u||`` is 0.

Flat buffers. Under ZeRO stage 1 and 2, DeepSpeed hands the optimizer one flat fp32 buffer per
parameter group and rank: the concatenation of the group's tensors (with alignment padding),
cut into equal partitions, one per rank, so a tensor may start in one rank's partition and end
in the next. :func:`attach_zero_layout` reads that layout from DeepSpeed's ZeRO optimizer; the
step then works on one view per (tensor, rank) piece, sums each piece's squares, adds the pieces
of each tensor across ranks (one ``all_reduce`` of a small vector per group and norm, on the
device) and applies each tensor's trust ratio to its pieces: the result equals per-tensor LAMB
on the unflattened parameters (to rounding; tests/engine/test_lamb.py checks 1e-6 after several steps
on ZeRO 0, 1 and 2 with 1 and 2 processes).

Without host synchronisation. Everything stays on the device: the trust ratios are tensors, the
learning rate may be a device tensor (``lr_multiplier``: the engine's schedule position, so a
skipped step does not advance it) and ``skip`` (a 0-dim bool tensor) makes the step a no-op on
the device when true (the gradient zeroed, the moments' decay 1 and the update's scale 0, all
chosen on the device: weights and moments keep their values exactly, and a step that is not
skipped is the plain step bit for bit), which is how the engine skips a step with a non-finite
loss without asking the host first.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3, 2))
    >>> opt = Lamb([w], lr=0.1, weight_decay=0.0)
    >>> w.grad = torch.full((3, 2), 0.5)
    >>> opt.step()
    >>> round(float((torch.ones(3, 2) - w.detach()).norm()), 4)  # lr * ||w|| (the trust ratio)
    0.2449
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from albatross.compat import foreach_ops, zero_partitions

_FOREACH = foreach_ops()  # torch's multi-tensor ops (torch._foreach_*)
WEIGHT_NORM_CLAMP = 10.0
"""``phi(z) = min(z, 10)``: pytorch_optimizer's clamp of the weight norm in the trust ratio."""


@dataclass(frozen=True)
class FlatLayout:
    """Where the parameter tensors lie in one flat buffer (one rank's partition of a group).

    ``pieces``: ``(start, length, tensor)`` triples, ``start`` and ``length`` in elements of the
    buffer, ``tensor`` an index in ``range(num_tensors)``; the pieces of one tensor on other ranks
    carry the same index there. Elements outside every piece (alignment padding) are left as
    they are. ``group``: the process group over which the tensors are split (None: this buffer
    holds every piece)."""

    pieces: tuple[tuple[int, int, int], ...]
    num_tensors: int
    group: Any = None
    names: tuple[str, ...] = ()
    """Optional: the tensors' names, for error messages and tests."""


def _update(
    w: list[Tensor],
    g: list[Tensor],
    m: list[Tensor],
    v: list[Tensor],
    beta1: float,
    beta2: float,
    eps: float,
    wd: float,
    grad_scale: Tensor | None,
    skipped: Tensor | None,
) -> tuple[list[Tensor], Tensor, Tensor]:
    """The per-piece arithmetic before the trust ratio, in place on ``g``, ``m`` and ``v``: the
    update ``m / (sqrt(v) + eps) + wd * w`` of each piece and the L2 norms of each piece of the
    weights and of the update (stacked). With ``skipped`` (a device bool) true, the gradient is
    zeroed and the moments' decay is 1, chosen on the device."""
    if grad_scale is not None:
        _FOREACH.mul_(g, grad_scale)
    b1: float | Tensor = beta1
    b2: float | Tensor = beta2
    if skipped is not None:
        # the gradient may hold NaN or inf: zeroed in place (no copy of it is made)
        zero = torch.zeros((), dtype=g[0].dtype, device=skipped.device)
        for grad in g:
            torch.where(skipped, zero, grad, out=grad)
        b1, b2 = torch.where(skipped, 1.0, beta1), torch.where(skipped, 1.0, beta2)
    _FOREACH.mul_(m, b1)
    _FOREACH.add_(m, g, alpha=1.0 - beta1)
    _FOREACH.mul_(v, b2)
    _FOREACH.addcmul_(v, g, g, value=1.0 - beta2)
    update = _FOREACH.sqrt(v)
    _FOREACH.add_(update, eps)
    update = _FOREACH.div(m, update)
    if wd != 0.0:
        _FOREACH.add_(update, w, alpha=wd)
    return update, torch.stack(_FOREACH.norm(w)), torch.stack(_FOREACH.norm(update))


def _apply(w: list[Tensor], update: list[Tensor], scale: Tensor) -> None:
    """w += scale[i] * update[i] for every piece i (``scale``: -lr * trust ratio per piece).
    Compiled, one fused multiply-add that leaves ``update`` as it is (scaling it in place, an
    input of the compiled function, would write it back: 4 bytes per parameter); eagerly the
    two multi-tensor operators (a per-tensor broadcast would be one operator per tensor)."""
    scales = list(scale.unbind())
    if torch.compiler.is_compiling():
        _FOREACH.addcmul_(w, update, scales)
        return
    _FOREACH.mul_(update, scales)
    _FOREACH.add_(w, update)


@functools.cache
def _compiled(fn: Any) -> Any:
    """``fn`` (``_update`` or ``_apply``) compiled by torch.compile (Inductor: the foreach
    operators fused into a few kernels), made once per process; each new list of shapes
    compiles once."""
    return torch.compile(fn, dynamic=False)


class Lamb(torch.optim.Optimizer):
    """Per-tensor LAMB (see the module docstring) in ``torch._foreach_*`` ops.

    State per parameter: ``exp_avg`` and ``exp_avg_sq`` (Adam's names, so DeepSpeed's
    checkpoint conversion handles them). Device-side controls, set by the engine before
    ``step`` and read by every ``step`` until changed: ``skip`` (0-dim bool tensor or None),
    ``lr_multiplier`` (0-dim tensor or None: then each group's lr is ``group["initial_lr"] *
    lr_multiplier``; ``initial_lr`` is what ``torch.optim.lr_scheduler`` records, the group's
    ``lr`` when absent), ``grad_scale`` (0-dim tensor or None: multiplies the gradients first; the
    engine's gradient clipping on flat buffers)."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        compiled: bool = False,
    ):
        if not lr > 0:
            raise ValueError(f"lr={lr!r}: must be > 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas={betas!r}: each must be in [0, 1)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.layouts: dict[Tensor, FlatLayout] = {}
        self.skip: Tensor | None = None
        self.lr_multiplier: Tensor | None = None
        self.grad_scale: Tensor | None = None
        self._indices: dict[tuple[tuple[int, ...], str], Tensor] = {}
        self.compiled = compiled
        """The arithmetic compiled by torch.compile (``optimizer.implementation: compiled``): the
        same step, its foreach operators fused by Inductor; the first step of each parameter
        group compiles."""
        self.require_layouts = False
        """True once flat layouts were attached (ZeRO 1-2): a parameter without one is then an
        error, not silently one tensor."""

    def set_layout(self, param: Tensor, layout: FlatLayout | None) -> None:
        """Declare ``param`` a flat buffer laid out as ``layout`` (None: an ordinary tensor)."""
        if layout is None:
            self.layouts.pop(param, None)
            return
        end = max((s + n for s, n, _ in layout.pieces), default=0)
        if param.dim() != 1 or end > param.numel():
            raise ValueError(
                f"a flat layout needs a 1-D buffer of at least {end} elements, got "
                f"{tuple(param.shape)}"
            )
        self.layouts[param] = layout

    def _lr(self, group: dict[str, Any]) -> float | Tensor:
        if self.lr_multiplier is None:
            return group["lr"]
        return self.lr_multiplier * group.get("initial_lr", group["lr"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("Lamb does not support sparse gradients")
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        # One entry per piece: a whole tensor, or one tensor's piece of a flat buffer.
        w, g, m, v = [], [], [], []
        tensor_of: list[int] = []  # piece -> tensor index within this group's norm vector
        reductions: list[tuple[int, int, Any]] = []  # (first tensor index, count, group)
        count = 0
        for p in params:
            state = self.state[p]
            layout = self.layouts.get(p)
            if layout is None and self.require_layouts:
                raise RuntimeError(
                    f"Lamb: a parameter of shape {tuple(p.shape)} has no flat layout, though "
                    "the optimizer's parameters are DeepSpeed's flat partitions (was the ZeRO "
                    "optimizer rebuilt?): the trust ratios would be per buffer, not per tensor"
                )
            if layout is None:
                w.append(p)
                g.append(p.grad)
                m.append(state["exp_avg"])
                v.append(state["exp_avg_sq"])
                tensor_of.append(count)
                count += 1
                continue
            for start, length, index in layout.pieces:
                w.append(p.narrow(0, start, length))
                g.append(p.grad.narrow(0, start, length))
                m.append(state["exp_avg"].narrow(0, start, length))
                v.append(state["exp_avg_sq"].narrow(0, start, length))
                tensor_of.append(count + index)
            reductions.append((count, layout.num_tensors, layout.group))
            count += layout.num_tensors
        if not w:
            # No piece here (a partition of padding only): the other ranks still all-reduce
            # their norms, twice per layout; join them with zeros.
            if reductions:
                like = params[0].new_zeros(0)
                for _ in range(2):
                    self._tensor_norms(like, None, count, reductions, empty=True)
            return
        # A step that may be skipped (``skip`` a device tensor) runs the same in-place
        # arithmetic with its coefficients chosen on the device: when skipped, the gradient is
        # zeroed (it may hold NaN or inf), the moments' decay is 1 and the update's scale 0, so
        # weights and moments keep their values exactly; no second copy of them is made.
        skipped = None if self.skip is None else self.skip.to(w[0].device, torch.bool)
        update_fn = _compiled(_update) if self.compiled else _update
        apply_fn = _compiled(_apply) if self.compiled else _apply
        update, w_piece_norms, u_piece_norms = update_fn(
            w, g, m, v, beta1, beta2, eps, wd, self.grad_scale, skipped
        )
        index = self._index(tensor_of, w[0].device) if len(w) != count or reductions else None
        w_norm = self._tensor_norms(w_piece_norms, index, count, reductions)
        u_norm = self._tensor_norms(u_piece_norms, index, count, reductions)
        w_norm = w_norm.clamp(max=WEIGHT_NORM_CLAMP)
        ratio = torch.where(
            (w_norm > 0) & (u_norm > 0), w_norm / (u_norm + eps), torch.ones_like(w_norm)
        )
        scale = ratio * (-self._lr(group))  # per tensor: -lr * trust ratio
        if skipped is not None:
            scale = scale.masked_fill(skipped, 0.0)
        if index is not None:
            scale = scale.index_select(0, index)  # per piece
        apply_fn(w, update, scale)

    def _index(self, tensor_of: list[int], device: torch.device) -> Tensor:
        """``tensor_of`` as a long tensor on ``device``, made once (through pinned memory and a
        non-blocking copy: no host synchronisation even the first time)."""
        key = (tuple(tensor_of), str(device))
        cached = self._indices.get(key)
        if cached is None:
            host = torch.tensor(tensor_of, dtype=torch.long)
            if device.type == "cuda":
                host = host.pin_memory()
            cached = self._indices[key] = host.to(device, non_blocking=True)
        return cached

    @staticmethod
    def _tensor_norms(
        norms: Tensor,
        index: Tensor | None,
        count: int,
        reductions: list[tuple[int, int, Any]],
        empty: bool = False,
    ) -> Tensor:
        """The L2 norm of every tensor (a vector of ``count``) from the norms of its pieces
        (``norms``, one per piece; ``index``: the tensor of each piece; None: one piece per
        tensor), summed across ranks. ``empty``: no piece here, only the collectives (``norms``
        then only gives the dtype and device)."""
        if empty:
            squares = torch.zeros(count, dtype=norms.dtype, device=norms.device)
        else:
            if index is None:
                return norms
            # A tensor has at most one piece per rank (its elements are contiguous in the flat
            # buffer), so the squares go to distinct slots: no atomic adds, deterministic.
            squares = torch.zeros(count, dtype=norms.dtype, device=norms.device)
            squares.index_copy_(0, index, norms * norms)
        for first, n, process_group in reductions:
            if (
                process_group is not None
                and torch.distributed.is_initialized()
                and torch.distributed.get_world_size(process_group) > 1
            ):
                part = squares[first : first + n]
                torch.distributed.all_reduce(part, group=process_group)
        return squares.sqrt()


# ----------------------------------------------------------------------------- DeepSpeed ZeRO


def zero_layouts(zero_optimizer: Any) -> list[tuple[Tensor, FlatLayout]]:
    """The flat fp32 partition of each parameter group of a DeepSpeed ZeRO stage 1/2 optimizer
    (``deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer``) and where its tensors lie
    in it. DeepSpeed concatenates a group's tensors (``round_robin_bit16_groups``, at
    ``round_robin_bit16_offsets``, with alignment padding) into one flat buffer and cuts it into
    one partition per rank of the group's data-parallel process group; this rank's optimizer
    sees only its partition (``single_partition_of_fp32_groups``)."""
    import torch.distributed as dist

    out = []
    for i, (flat, group, partitions, offsets, metas) in enumerate(zero_partitions(zero_optimizer)):
        rank = dist.get_rank(group=group)
        lo = sum(int(t.numel()) for t in partitions[:rank])
        hi = lo + int(partitions[rank].numel())
        if hi - lo != flat.numel():
            raise RuntimeError(
                f"DeepSpeed ZeRO group {i}: partition of {hi - lo} elements, fp32 buffer of "
                f"{flat.numel()}: an unknown layout"
            )
        pieces = []
        for t, (offset, meta) in enumerate(zip(offsets, metas)):
            start, end = max(int(offset), lo), min(int(offset) + int(meta.numel()), hi)
            if start < end:
                pieces.append((start - lo, end - start, t))
        out.append((flat, FlatLayout(tuple(pieces), len(metas), group)))
    return out


def attach_zero_layouts(optimizer: Lamb, zero_optimizer: Any) -> int:
    """Declare the flat partitions of ``zero_optimizer`` (a DeepSpeed ZeRO stage 1/2 optimizer
    wrapping ``optimizer``) to ``optimizer``; returns how many. Afterwards each step computes
    per-tensor trust ratios on them."""
    layouts = zero_layouts(zero_optimizer)
    for flat, layout in layouts:
        optimizer.set_layout(flat, layout)
    optimizer.require_layouts = True
    return len(layouts)
