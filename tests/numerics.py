"""Tolerances for comparing two computations of the same values, derived from the dtype and the
operation instead of tuned to one machine's kernels.

Two correct implementations (a batched and a per-item evaluation, a fused and an eager kernel,
AVX2 against AVX-512/AMX) round differently. A value computed through ``terms`` rounded
operations (a dot product of length n: about n) is off by at most gamma_n = n*u / (1 - n*u)
relative to the magnitude of what was summed, u the unit roundoff of the dtype (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1). ``tolerance`` gives
that bound as ``rtol``, and as ``atol`` scaled by the magnitude of the values, so
``torch.testing.assert_close(got, want, **tolerance(torch.float32, terms=d, scale=...))`` holds
on every CPU while an error of a few ulps times more than the bound still fails it.
"""

from __future__ import annotations

import torch


def tolerance(dtype: torch.dtype, terms: int, scale: float = 1.0) -> dict[str, float]:
    """``rtol`` / ``atol`` for values of ``dtype`` computed through ``terms`` rounded
    operations, whose summands are at most ``scale`` in magnitude."""
    u = torch.finfo(dtype).eps / 2
    gamma = terms * u / (1 - terms * u)
    return {"rtol": gamma, "atol": gamma * scale}


def assert_close_as(dtype: torch.dtype, got, want, terms: int) -> None:
    """``assert_close`` in float64 with ``tolerance(dtype, terms)``, scaled by the largest
    magnitude of ``want``."""
    got, want = got.double(), want.double()
    scale = max(float(want.abs().max()), 1.0) if want.numel() else 1.0
    torch.testing.assert_close(got, want, **tolerance(dtype, terms, scale))
