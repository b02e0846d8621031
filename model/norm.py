"""LayerNorm: torch's, or NVIDIA apex's fused CUDA kernel when that is importable.

`LayerNorm` is an `nn.LayerNorm` (same parameters, same state-dict keys `weight` / `bias`, same
`isinstance` checks in the optimizer's no-decay rule and the init), so checkpoints, releases and
the HF import do not care which kernel ran. The choice is made at every call, not when the model
is built (models are built on CPU and moved to the GPU by the engine):

* apex's `fused_layer_norm_affine` when the input is on CUDA, NVIDIA apex is importable with its
  CUDA extension (`apex.normalization.FusedLayerNorm` and `fused_layer_norm_cuda`), and the call
  is not being traced by torch.compile (an autograd.Function from an extension would break the
  graph; Inductor fuses torch's layer norm itself);
* `torch.nn.functional.layer_norm` otherwise (CPU, no apex, compiled).

The PyPI package called `apex` is an unrelated web toolkit: it has no `apex.normalization`, so it
is never mistaken for NVIDIA apex. Under autocast the apex path keeps torch's autocast semantics
for layer_norm (computed and returned in fp32), so switching kernels changes no dtype downstream.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@functools.cache
def apex_layer_norm_fn() -> Callable | None:
    """NVIDIA apex's `fused_layer_norm_affine`, or None when NVIDIA apex (with its CUDA
    extension) is not importable. Looked up once per process."""
    try:
        normalization = importlib.import_module("apex.normalization")
        normalization.FusedLayerNorm  # noqa: B018 - NVIDIA apex only, not the PyPI web toolkit
        fn = importlib.import_module("apex.normalization.fused_layer_norm").fused_layer_norm_affine
        importlib.import_module("fused_layer_norm_cuda")  # apex built without its CUDA extension
    except Exception:  # missing, the PyPI `apex`, or a broken build: torch's layer norm
        return None
    return fn


def layer_norm_backend(device_type: str, compiling: bool) -> str:
    """ "apex" or "torch": which kernel a LayerNorm call on `device_type` uses."""
    if device_type == "cuda" and not compiling and apex_layer_norm_fn() is not None:
        return "apex"
    return "torch"


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` that runs NVIDIA apex's fused kernel on CUDA when apex is importable."""

    def forward(self, x: Tensor) -> Tensor:
        if (
            self.weight is None
            or self.bias is None
            or layer_norm_backend(x.device.type, torch.compiler.is_compiling()) == "torch"
            or (self.weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type))
        ):  # (apex's kernel wants one dtype: mixed input/parameters go to torch's)
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        fused = apex_layer_norm_fn()
        if torch.is_autocast_enabled(x.device.type):
            # torch's autocast runs layer_norm in fp32 and returns fp32; apex would cast input
            # and parameters to the autocast dtype instead. Keep torch's semantics.
            with torch.autocast(x.device.type, enabled=False):
                return fused(
                    x.float(), self.weight.float(), self.bias.float(), self.normalized_shape,
                    self.eps,
                )  # fmt: skip
        return fused(x, self.weight, self.bias, self.normalized_shape, self.eps)


__all__ = ["LayerNorm", "apex_layer_norm_fn", "layer_norm_backend"]
