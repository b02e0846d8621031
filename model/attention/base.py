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

A family owns everything else about itself too, through the hooks of its `AttentionFamily`
entry: its settings (`options`, a dataclass in the family's file that becomes a section of the
encoder config), their checks against the rest of the config (`validate`), its FLOP count
(`mixing_flops`, or `layer_flops` / `embedding_flops` for a family with its own layer and
embeddings), its diagnostics (`diagnostics`: scalars; `figures`: plots) and how its residual
gates read (`residual_weights`). Code outside `model/attention/` never tests a family's name: a family
registered from outside the package (`register_attention`) trains, logs and exports like the
built-in ones; without a FLOP count it trains without an MFU figure.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import EncoderConfig
from model.orthogonal import (
    Linear,
    active_orthogonal_cache,
    forward_cache_key,
    make_orthogonal,
)

if TYPE_CHECKING:  # annotations only: the encoder imports this module
    from model.attention.hf_export import HFExport
    from model.encoder import Encoder

AuxLosses = dict[str, Tensor]

FlopsFn = Callable[[EncoderConfig, int], int]
"""(config, sequence length N) -> matmul FLOPs on one sequence (see `model/flops.py`)."""
DiagnosticsFn = Callable[["Encoder", Tensor, Tensor], dict[str, float]]
"""(encoder in eval mode, input_ids (B, N), attention_mask (B, N)) -> {tag: value}."""
FiguresFn = Callable[["Encoder"], dict[str, Any]]
"""encoder -> {tag: matplotlib figure}."""


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype activations run in on `x`'s device: autocast's (bf16 on GPU), else x's own."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs of an (m, k) x (k, n) product: one multiply and one add per term."""
    return 2 * m * k * n


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

    padded: bool = True
    """False only when the host knows, without reading the device, that no token of the batch
    is padding (`batch_is_padded`): a kernel may then pass no mask at all to SDPA or
    FlexAttention, which keeps their fastest kernels eligible. True means "may be padded":
    `mask_BN` is always valid either way."""


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
        make_orthogonal(layer, "weight", cfg.orthogonal_map, cfg.cayley_leaf_inverse)
    return layer


class MultiHeadAttention(Attention):
    """Query/key/value/output projections around a `ScoreKernel` (softmax, TISA, linear kernels).

    Q, K and V come from ONE matrix product, x [W_q; W_k; W_v]^T + [b_q; b_k; b_v] (one GEMM
    instead of three), while the weights stay three parameters, `query`, `key` and `value`:
    state-dict keys, the HF ALBERT mapping, releases and checkpoints are unchanged, and LAMB
    keeps one trust ratio per matrix, as in ALBERT (a single (3d, d) parameter would share one).
    The concatenated weight is made once per encoder forward, not once per layer application
    (ALBERT applies one shared layer L times): `cache_fused_qkv` puts it, already cast to the
    autocast dtype, in the forward's cache before the first layer (and before the first
    checkpointed region, so a recomputation finds the same tensor). Made per application, it
    cost a concatenation and a cast of 3 d^2 weights each time, where three Linear products
    cast each leaf weight once per forward (autocast caches casts of leaf parameters only).
    The result is laid out (B, N, 3, H, h), the "packed QKV" layout SDPA's cuDNN kernel accepts.

    Under DeepSpeed ZeRO-3 (parameters partitioned, each gathered around its own module's
    forward) and with `cfg.orthogonal` (weights produced by parametrizations) the three
    projections stay three products: a concatenation would read the empty local shards. (Marking
    the module a ZeRO-3 leaf, so that it gathers its children at once, fails in the backward
    with DeepSpeed 0.19: gradients of the full shape meet the partitioned parameters.)
    """

    def __init__(self, cfg: EncoderConfig, kernel: ScoreKernel):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.query = make_linear(cfg, d, d)
        self.key = make_linear(cfg, d, d)
        self.value = make_linear(cfg, d, d)
        self.output = make_linear(cfg, d, d)
        self.kernel = kernel
        self.fused_qkv = not cfg.orthogonal

    def _split(self, x_BND: Tensor) -> Tensor:
        B, N, _ = x_BND.shape
        return x_BND.view(B, N, self.num_heads, -1).transpose(1, 2)  # (B, H, N, h)

    def qkv_weight(self) -> tuple[Tensor, Tensor | None]:
        """([W_q; W_k; W_v] (3d, d), [b_q; b_k; b_v] (3d,) or None): the fused projection."""
        linears = (self.query, self.key, self.value)
        weight = torch.cat([lin.weight for lin in linears])
        biases = [lin.bias for lin in linears]
        bias = None if any(b is None for b in biases) else torch.cat(biases)
        return weight, bias

    @property
    def projects_fused(self) -> bool:
        """Whether Q/K/V come from one product (not under ZeRO-3: `ds_id` marks parameters
        partitioned by DeepSpeed, gathered around each Linear's own forward, so the
        concatenation would read empty shards; not with orthogonal weights)."""
        return self.fused_qkv and not hasattr(self.query.weight, "ds_id")

    def project_qkv(self, x_BND: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(q, k, v), each (B, H, N, h), from one matrix product (views of one tensor)."""
        if not self.projects_fused:
            return tuple(self._split(lin(x_BND)) for lin in (self.query, self.key, self.value))
        store = active_orthogonal_cache()
        cached = None if store is None else store.get(forward_cache_key(self))
        weight, bias = self.qkv_weight() if cached is None else cached
        B, N, _ = x_BND.shape
        qkv_BN3Hh = F.linear(x_BND, weight, bias).view(B, N, 3, self.num_heads, -1)
        # Unbound along the projection's own axis, then transposed: the backward stacks the
        # three gradients straight into the product's (B, N, 3, H, h) layout. Unbinding a
        # (3, B, H, N, h) permutation (the same views) stacked them heads-first and then needed
        # one more copy back into that layout.
        q_BNHh, k_BNHh, v_BNHh = qkv_BN3Hh.unbind(2)
        return q_BNHh.transpose(1, 2), k_BNHh.transpose(1, 2), v_BNHh.transpose(1, 2)

    def forward(self, x_BND: Tensor, ctx: LayerContext) -> AttentionOutput:
        q_BHNh, k_BHNh, v_BHNh = self.project_qkv(x_BND)
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
    validate: Callable[[EncoderConfig], None] | None = None
    """Checks the family's settings in a config (raises ValueError, may warn); run by
    `EncoderConfig` after the generic checks."""
    mixing_flops: FlopsFn | None = None
    """With ``kernel``: FLOPs of the mixing step (without the Q/K/V/O projections) on one
    sequence. None: not counted (MFU is not logged for this family)."""
    layer_flops: FlopsFn | None = None
    """With ``layer``: FLOPs of one application of the family's own layer."""
    embedding_flops: FlopsFn | None = None
    """With ``embeddings``: FLOPs of the family's embeddings and once-per-forward state.
    None with standard embeddings: ALBERT's e -> d projection."""
    token_embedding_width: Callable[[EncoderConfig], int] | None = None
    """With ``embeddings``: the width e of the token embedding the MLM decoder is tied to.
    None: ``cfg.embedding_size``."""
    diagnostics: DiagnosticsFn | None = None
    """Family-specific scalars for TensorBoard, logged as ``diagnostics/<tag>``."""
    figures: FiguresFn | None = None
    """Family-specific plots for TensorBoard, logged as images under their tags."""
    residual_weights: Callable[[Tensor, EncoderConfig], Tensor] | None = None
    """(raw residual gates (L,), config) -> the weights the layers apply (L,); None: as they
    are (ReZero's alpha)."""
    hf_export: HFExport | None = None
    """How the family exports to Hugging Face `transformers` (`model.attention.hf_export`):
    its HF-side modeling file and, optionally, a native `transformers` model. None: the family
    cannot be exported to `transformers` (the export says so)."""
    compile_auto: bool = False
    """Whether ``engine.compile: auto`` compiles this family's encoder on a GPU: true where its
    compiled training step was measured faster there and correct
    (docs/benchmarks.md#compiled-against-eager). False until measured: a new family runs eager
    under ``auto``."""
    options: type | None = None
    """The family's settings: a dataclass whose fields are the keys of its section of the
    encoder config, ``model.<options_key>.*`` in a recipe, ``cfg.<options_key>`` in code (each
    field with a docstring under it, for docs/config.md; checks in its ``__post_init__``). Every
    config has the section, with the class's defaults when not given (ignored by the other
    families). None: the family has no settings."""
    options_key: str | None = None
    """The key of ``options`` in the encoder config; None: the family's name. Families may share
    one key only with one class."""


def cache_fused_qkv(model: nn.Module, store: dict | None, device_type: str) -> None:
    """Puts the fused Q/K/V weight and bias of every `MultiHeadAttention` of `model` that
    projects fused into `store` (the forward's cache, keyed by `forward_cache_key`), cast to the
    autocast dtype when autocast is on for `device_type` (the same rounding autocast would
    apply at the product). Called by the encoder once per forward, before the first layer."""
    if store is None:
        return
    cast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    for module in model.modules():
        if isinstance(module, MultiHeadAttention) and module.projects_fused:
            weight, bias = module.qkv_weight()
            if cast is not None and weight.is_floating_point():
                weight = weight.to(cast)
                bias = None if bias is None else bias.to(cast)
            store[forward_cache_key(module)] = (weight, bias)


def batch_is_padded(attention_mask: Tensor | None) -> bool:
    """Whether the batch may hold padding, decided on the host without a device sync.

    No mask: no padding. A mask on the CPU (read for free) with no zero: no padding. A mask on
    an accelerator: assumed padded (reading it would stop the host until the device catches
    up); callers that know a batch is unpadded pass no mask. Inside a `torch.compile` trace a
    mask is assumed padded too (reading it would break the graph).
    """
    if attention_mask is None:
        return False
    if attention_mask.device.type == "cpu" and not torch.compiler.is_compiling():
        return not bool(attention_mask.all())
    return True


def sdpa_key_mask(ctx: LayerContext, dtype: torch.dtype) -> Tensor | None:
    """The `attn_mask` of an SDPA call with key padding only: None for an unpadded batch (the
    flash kernel stays eligible), else the additive (B, 1, 1, N) bias of `key_padding_bias`.

    Not a boolean mask for a padded batch: SDPA turns a boolean mask into a float one anyway
    (-inf at False), and on an H100 (ALBERT-base, batch 32 x 512, bf16 training step) the two
    did not differ beyond run-to-run noise. The float bias keeps
    finite scores for a sample without any real token."""
    return key_padding_bias(ctx.mask_BN, dtype) if ctx.padded else None


def key_mask(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Bool (B, N), True at real tokens; all True when no mask is given."""
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    return attention_mask.to(torch.bool)


def masked_fill_padding(x_BND: Tensor, mask_BN: Tensor) -> Tensor:
    """Zeros the padding rows of (B, N, d)."""
    return x_BND * mask_BN.unsqueeze(-1).to(x_BND.dtype)


def key_padding_bias(mask_BN: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive (B, 1, 1, N) bias: 0 at real keys, the dtype's min at padding keys."""
    bias = torch.zeros(mask_BN.shape, dtype=dtype, device=mask_BN.device)
    bias = bias.masked_fill(~mask_BN, torch.finfo(dtype).min)
    return bias[:, None, None, :]
