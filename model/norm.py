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
is never mistaken for NVIDIA apex.

Under autocast (`engine.precision: bf16-mixed`) a LayerNorm computes in fp32 on every device and
kernel, and returns what `EncoderConfig.norm_output` says: `compute` (the default) rounds its
result to the autocast dtype, so the post-LN residual stream between layers, and the gradient
flowing back along it, are bf16 (Megatron-LM's default, `fp32_residual_connection: false`);
`fp32` returns fp32, torch's autocast rule for layer_norm on CUDA (on the CPU torch's autocast
leaves layer_norm in its input's dtype; both options apply their rule there too, so a CPU run
counts and computes what a GPU run does; with `compute` and a bf16 input the CPU runs torch's
mixed-dtype kernel, fp32 inside, without fp32 copies). Outside autocast it runs in its input's
dtype.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import AutocastOutput, EncoderConfig

AUTOCAST_OUTPUTS = get_args(AutocastOutput)
"""What a LayerNorm may return under autocast: the autocast dtype, or fp32."""


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
    """`nn.LayerNorm` that runs NVIDIA apex's fused kernel on CUDA when apex is importable, and
    under autocast returns fp32 or the autocast dtype (`autocast_output`, from
    `EncoderConfig.norm_output`; module docstring)."""

    def __init__(self, *args, autocast_output: str = "compute", **kwargs):
        super().__init__(*args, **kwargs)
        if autocast_output not in AUTOCAST_OUTPUTS:
            raise ValueError(
                f"autocast_output={autocast_output!r}: expected one of {AUTOCAST_OUTPUTS}"
            )
        self.autocast_output = autocast_output

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, autocast_output={self.autocast_output}"

    def forward(self, x: Tensor) -> Tensor:
        device_type = x.device.type
        if not torch.is_autocast_enabled(device_type):
            return self._layer_norm(x, self.weight, self.bias)
        dtype = torch.get_autocast_dtype(device_type)
        if (
            self.autocast_output == "compute"
            and x.dtype == dtype
            and device_type == "cpu"
            and layer_norm_backend(device_type, torch.compiler.is_compiling()) == "torch"
        ):
            # The CPU's kernel takes a bf16 input with fp32 parameters, computes in fp32 and
            # returns bf16: the same values without an fp32 copy of x and of the result (what
            # torch's CPU autocast runs for layer_norm).
            with torch.autocast(device_type, enabled=False):
                return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        # fp32 in (the upcast fuses into the kernel when compiled), fp32 statistics and affine
        with torch.autocast(device_type, enabled=False):
            y = self._layer_norm(
                x.float(),
                None if self.weight is None else self.weight.float(),
                None if self.bias is None else self.bias.float(),
            )
        return y.to(dtype) if self.autocast_output == "compute" else y

    def _layer_norm(self, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
        """apex's fused kernel when it applies (`layer_norm_backend`; affine, one dtype for
        input and parameters, which apex wants), else torch's."""
        if (
            weight is None
            or bias is None
            or weight.dtype != x.dtype
            or layer_norm_backend(x.device.type, torch.compiler.is_compiling()) == "torch"
        ):
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)
        return apex_layer_norm_fn()(x, weight, bias, self.normalized_shape, self.eps)


def layer_norm(cfg: EncoderConfig, width: int) -> LayerNorm:
    """The model's LayerNorm of `width` features: `cfg.layer_norm_eps`, `cfg.norm_output`."""
    return LayerNorm(width, eps=cfg.layer_norm_eps, autocast_output=cfg.norm_output)


__all__ = [
    "AUTOCAST_OUTPUTS",
    "LayerNorm",
    "apex_layer_norm_fn",
    "layer_norm",
    "layer_norm_backend",
]
