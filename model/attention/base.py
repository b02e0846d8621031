"""The attention contract, documented once.

Shape legend (used in names across `model/`):
    B batch, N tokens, d hidden width, H heads, h head width (d / H), E experts, S TISA kernels.
    `x_BND` is (B, N, d); `mask_BN` is bool (B, N), True at real tokens, False at padding.

**Attention** (`Attention.forward(x_BND, ctx) -> AttentionOutput`): takes hidden states
(B, N, d) and a `LayerContext` holding the key-padding mask, returns (B, N, d) plus a dict of
auxiliary losses (already weighted; empty for most families). Outputs at real tokens must not
depend on padding.

Most families differ only in the score/mixing step, so the projections live in
`MultiHeadAttention` and the step in a **ScoreKernel**
(`ScoreKernel.forward(q_BHNh, k_BHNh, v_BHNh, ctx) -> (out_BHNh, aux)`): softmax, TISA and
trainable-kernel linear attention are kernels; TransJect replaces the whole attention (and its
layer and embeddings) because it mixes over features, not tokens.

A family may also need state computed **once per forward** and shared by all layer
applications (TISA's positional score f, TransJect's eigenvalues): that is a `FamilyState`
module held by the encoder; what it returns reaches every layer in `LayerContext.extras`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from model.config import EncoderConfig
from model.orthogonal import Linear, make_orthogonal

AuxLosses = dict[str, Tensor]


@dataclass
class LayerContext:
    """What one layer application sees besides its hidden states. Built by the encoder."""

    mask_BN: Tensor
    """bool (B, N): True at real tokens."""

    layer_index: int = 0
    """Index of this application in 0 .. num_layer_applications - 1 (depth, not weight id)."""

    first_use: bool = True
    """True at the first application of this layer's weights in this forward (under sharing a
    layer runs many times): per-weight terms such as penalties are reported only then."""

    residual_gate: Tensor | None = None
    """Scalar residual weight of this application (ReZero alpha, TransJect r_l), if the layer uses one."""

    extras: dict[str, Any] = field(default_factory=dict)
    """Per-forward values from the family's `FamilyState` (e.g. TISA scores, TransJect Lambda)."""


@dataclass
class AttentionOutput:
    hidden_BND: Tensor
    aux_losses: AuxLosses = field(default_factory=dict)


class Attention(nn.Module, ABC):
    """(B, N, d) hidden states + key-padding mask -> (B, N, d) + auxiliary losses."""

    @abstractmethod
    def forward(self, x_BND: Tensor, ctx: LayerContext) -> AttentionOutput: ...


class ScoreKernel(nn.Module, ABC):
    """The mixing step on per-head queries, keys, values: (B, H, N, h) x 3 -> (B, H, N, h).

    Padding keys (ctx.mask_BN False) must contribute nothing to any output.
    """

    @abstractmethod
    def forward(
        self, q_BHNh: Tensor, k_BHNh: Tensor, v_BHNh: Tensor, ctx: LayerContext
    ) -> tuple[Tensor, AuxLosses]: ...


class FamilyState(nn.Module, ABC):
    """Optional per-encoder module run once per forward, before the first layer."""

    @abstractmethod
    def forward(self, x0_BND: Tensor, mask_BN: Tensor) -> tuple[dict[str, Any], AuxLosses]:
        """Returns (extras for every LayerContext, auxiliary losses)."""


def make_linear(cfg: EncoderConfig, d_in: int, d_out: int, bias: bool = True) -> Linear:
    """A Linear; orthogonally parameterised when `cfg.orthogonal` and the map is square."""
    layer = Linear(d_in, d_out, bias=bias)
    if cfg.orthogonal and d_in == d_out:
        make_orthogonal(layer, "weight", cfg.orthogonal_map)
    return layer


class MultiHeadAttention(Attention):
    """Query/key/value/output projections around a `ScoreKernel` (softmax, TISA, linear kernels)."""

    def __init__(self, cfg: EncoderConfig, kernel: ScoreKernel):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.query = make_linear(cfg, d, d)
        self.key = make_linear(cfg, d, d)
        self.value = make_linear(cfg, d, d)
        self.output = make_linear(cfg, d, d)
        self.kernel = kernel

    def _split(self, x_BND: Tensor) -> Tensor:
        B, N, _ = x_BND.shape
        return x_BND.view(B, N, self.num_heads, -1).transpose(1, 2)  # (B, H, N, h)

    def forward(self, x_BND: Tensor, ctx: LayerContext) -> AttentionOutput:
        q_BHNh = self._split(self.query(x_BND))
        k_BHNh = self._split(self.key(x_BND))
        v_BHNh = self._split(self.value(x_BND))
        o_BHNh, aux = self.kernel(q_BHNh, k_BHNh, v_BHNh, ctx)
        B, H, N, h = o_BHNh.shape
        o_BND = o_BHNh.transpose(1, 2).reshape(B, N, H * h)
        return AttentionOutput(self.output(o_BND), aux)


@dataclass(frozen=True)
class AttentionFamily:
    """A registry entry: how to build one family's parts from an `EncoderConfig`.

    Standard families give `kernel` and get `MultiHeadAttention` inside the standard
    `model.encoder.EncoderLayer` and ALBERT embeddings. A family that changes more (TransJect)
    gives its own `layer` and/or `embeddings` classes, each built as `cls(cfg)`.
    """

    name: str
    description: str
    kernel: Callable[[EncoderConfig], ScoreKernel] | None = None
    """Builds the ScoreKernel of a standard layer: cfg -> kernel."""
    layer: Callable[[EncoderConfig], nn.Module] | None = None
    """Builds a whole layer (replaces the standard layer): cfg -> module."""
    embeddings: Callable[[EncoderConfig], nn.Module] | None = None
    """Builds the embeddings (replaces ALBERT's factorised embeddings): cfg -> module."""
    state: Callable[[EncoderConfig], FamilyState] | None = None
    """Builds the per-forward FamilyState, if the family needs one."""


class AttentionRegistry:
    """Maps a config string to an `AttentionFamily`. Unknown names raise ValueError."""

    def __init__(self) -> None:
        self._families: dict[str, AttentionFamily] = {}

    def register(self, family: AttentionFamily) -> AttentionFamily:
        if family.name in self._families:
            raise ValueError(f"attention family {family.name!r} is already registered")
        if (family.kernel is None) == (family.layer is None):
            raise ValueError(f"family {family.name!r} must give exactly one of kernel= or layer=")
        self._families[family.name] = family
        return family

    def get(self, name: str) -> AttentionFamily:
        if name not in self._families:
            raise ValueError(f"unknown attention {name!r}; valid: {sorted(self._families)}")
        return self._families[name]

    def names(self) -> list[str]:
        return sorted(self._families)

    def __contains__(self, name: object) -> bool:
        return name in self._families


def masked_fill_padding(x_BND: Tensor, mask_BN: Tensor) -> Tensor:
    """Zeros the padding rows of (B, N, d)."""
    return x_BND * mask_BN.unsqueeze(-1).to(x_BND.dtype)


def key_padding_bias(mask_BN: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive (B, 1, 1, N) bias: 0 at real keys, the dtype's min at padding keys."""
    bias = torch.zeros(mask_BN.shape, dtype=dtype, device=mask_BN.device)
    bias = bias.masked_fill(~mask_BN, torch.finfo(dtype).min)
    return bias[:, None, None, :]
