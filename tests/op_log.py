"""`OpLog`: every aten operator a block of code runs, recorded as it reaches the kernels (after
autograd and autocast; the CPU backward runs on the same thread, so it is seen too), for tests
that count matrix products, copies, casts, writes or allocations, or check the largest tensor.

    with OpLog() as log:
        kernel(q, k, v, ctx)
    assert len(log.matmuls()) == 2
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MATMULS = ("mm", "bmm", "matmul", "addmm", "baddbmm", "baddbmm_")
"""The matrix products (in place too)."""

COPIES = ("clone", "copy_", "_to_copy", "contiguous")
"""The operators that copy a tensor (a cast included)."""


@dataclass(frozen=True)
class Op:
    """One operator call."""

    name: str
    """Without the overload: "bmm", "add_", "_to_copy"."""
    input_dtypes: tuple[torch.dtype, ...]
    """Of its positional tensor arguments."""
    output_numels: tuple[int, ...]
    """Of the tensors it returns."""
    returns_tensor: bool
    """It returns one tensor (not a tuple or list)."""
    is_view: bool
    creates: bool
    """It returns new tensors: neither in place nor into an ``out=`` argument."""
    matmul_precision: str
    """``torch.get_float32_matmul_precision()`` when it ran."""


class OpLog(TorchDispatchMode):
    """Records an `Op` per operator call while active (it may be entered more than once)."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        outputs = out if isinstance(out, (list, tuple)) else (out,)
        self.ops.append(
            Op(
                name=func.__name__.split(".")[0],
                input_dtypes=tuple(a.dtype for a in args if isinstance(a, torch.Tensor)),
                output_numels=tuple(t.numel() for t in outputs if isinstance(t, torch.Tensor)),
                returns_tensor=isinstance(out, torch.Tensor),
                is_view=func.is_view,
                creates=not schema.name.endswith("_")
                and not any(a.is_out for a in schema.arguments),
                matmul_precision=torch.get_float32_matmul_precision(),
            )
        )
        return out

    def counts(self) -> Counter:
        """Calls per operator name."""
        return Counter(op.name for op in self.ops)

    def named(self, names: Iterable[str]) -> list[Op]:
        names = set(names)
        return [op for op in self.ops if op.name in names]

    def matmuls(self) -> list[Op]:
        return self.named(MATMULS)

    def copies(self) -> list[tuple[str, int]]:
        """(name, elements written) of every copy that returns one tensor."""
        return [(op.name, op.output_numels[0]) for op in self.named(COPIES) if op.returns_tensor]

    def writes(self) -> list[tuple[str, int]]:
        """(name, elements written) of every operator that returns one tensor, not a view."""
        return [
            (op.name, op.output_numels[0])
            for op in self.ops
            if op.returns_tensor and not op.is_view
        ]

    def created_elements(self) -> int:
        """Elements of all the new tensors the operators returned."""
        return sum(sum(op.output_numels) for op in self.ops if op.creates)

    def largest_output(self) -> int:
        """The most elements of any tensor an operator returned."""
        return max((n for op in self.ops for n in op.output_numels), default=0)
