"""Trainable feed-forward kernels for non-causal linear attention; docs/methods.md.

Yorsh & Kovalenko 2022, "Linear Self-Attention Approximation via Trainable Feedforward Kernel",
https://arxiv.org/abs/2211.04076. Softmax attention is replaced by a kernel
k(q, k') = phi(q)^T phi(k') with a learned, positive feature map phi, applied head-wise (each
head has its own weights) and shared by queries and keys. Being non-causal, the attention
factorises into two sums over keys, so its cost is O(N h^2) instead of O(N^2 h):

    out_i = phi(q_i)^T KV / (phi(q_i)^T z + eps),   KV = sum_j phi(k_j) v_j^T,   z = sum_j phi(k_j)

Feature maps (`KernelConfig.feature_map`; W, V are h x h, A is h x r, B is r x h per head,
r = h // gate_rank_divisor, no bias):
    ffn    phi(x) = softplus(x W)                 W orthogonally initialised
    glu    phi(x) = g(x W) * sigmoid(x V)
    oglu   glu, W orthogonally initialised
    aoglu  phi(x) = g(x W) * sigmoid(x A B)       low-rank gate, W orthogonally initialised
    elu    phi(x) = elu(x) + 1                    parameter-free baseline (Katharopoulos et al. 2020)
`num_stacked` units run in sequence; g is the identity in all but the last unit and softplus in
the last, so phi > 0. (Stacked `ffn` units are thus a product of linear maps before the softplus.)
As in the authors' code (vladyorsh/lra_efficient_transformers, the LRA notebooks' HWLinear,
GatedOrthoKernel, AMGOLU, LinearKernel):
* non-orthogonal matrices (V, A, B) are He-normal, N(0, 2 / fan_in);
* every unit drops out its own input (`kernel.dropout`), so a stack of k units drops k times, and
  queries and keys get independent masks; the parameter-free `elu` baseline has no dropout;
* the authors divide phi(q) and phi(k) by sqrt(h) and add no eps: both cancel in the ratio up to
  the eps this project adds to the normaliser (1e-6, against a ratio of sums of positive terms).

Orthogonality penalty: the authors' `MSELoss(W W^T, I) * LAMBDA` (mean over heads and entries)
is appended at every call of the feature map, i.e. once for the queries and once for the keys:
2 * lambda * mean((W W^T - I)^2) per orthogonally initialised W per layer. This module returns
exactly that (`PENALTY_CALLS_PER_FORWARD = 2`) as the auxiliary loss `kernel_orthogonality` when
lambda > 0. **Decision (cross-layer sharing):** the penalty is a property of the weights, not of
how often they run, so a layer reports it only at the FIRST application of its weights in a
forward (`LayerContext.first_use`); the encoder's sum over applications then counts every
distinct W once, whatever the depth. Without sharing this is the authors' sum over layers.

Forwards without a gradient or dropout may run the feature maps and the mixing as two fused
Triton kernels instead (`KernelConfig.inference_backend`, kernel_triton.py); training forwards
may run the mixing after the feature maps as one fused operator with its own backward, Triton
kernels in both (`KernelConfig.training_backend`).

Legend: B batch, H heads, N tokens, h head width, r gate rank, c a unit's product width (h,
2h or h + r). `q_BHNh` is (B, H, N, h), `w_Hhh` is (H, h, h); the feature maps and the sums run
heads first, on (H, B, N, h) views such as `phi_q_HBNh` (`per_head_matmul`); `kvz_HBhH1` is
the per-head [KV | z] summary, h x (h + 1).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.attention import kernel_triton
from model.attention.base import (
    AttentionFamily,
    AuxLosses,
    LayerContext,
    ScoreKernel,
    compute_dtype,
    matmul_flops,
)
from model.attention.hf_export import HFExport, family_code
from model.config import EncoderConfig
from model.typed_config import _check_choice, _check_positive, _check_prob


@dataclass
class KernelConfig:
    """Trainable feed-forward kernels for linear attention (Yorsh & Kovalenko 2022).

    The method and the differences from the authors' code: docs/methods.md."""

    feature_map: Literal["ffn", "glu", "oglu", "aoglu", "elu"] = "aoglu"
    """The learned feature map phi, shared by queries and keys. `elu` is the parameter-free
    elu(x)+1 baseline of Katharopoulos et al. 2020."""

    num_stacked: int = 1
    """k units applied in sequence; g is the identity in all but the last, softplus in the last."""

    gate_rank_divisor: int = 4
    """For `aoglu`: the low-rank gate A B has rank r = head_dim // gate_rank_divisor."""

    orthogonality_penalty: float = 0.0
    """lambda_orth of the authors' penalty lambda_orth * mean((W W^T - I)^2), counted once per
    feature-map call as in their code (phi runs on queries and on keys, so each W contributes
    2 * lambda_orth * mean(...)); summed over the orthogonally initialised W of every unit (ffn,
    oglu, aoglu); returned as the auxiliary loss `kernel_orthogonality`."""

    dropout: float = 0.1
    """Dropout on the input of every feature-map unit (the authors' per-unit dropout: a stack of
    k units drops k times; queries and keys get independent masks). The parameter-free `elu`
    baseline has no dropout, as in Katharopoulos et al."""

    eps: float = 1e-6
    """Added to the normaliser phi(q)^T sum_j phi(k_j)."""

    inference_backend: Literal["torch", "triton"] = "torch"
    """How forwards that need no gradient (evaluation, inference, the scaling benchmark) run on
    CUDA: `torch`, the default path's operators; `triton`, two fused Triton kernels (one pass
    over the keys for the [KV | z] summary, one over the queries for the output; the features
    never reach memory), equal to `torch` up to the order of sums (docs/performance.md). Needs
    Triton and a head width of at most 128; training steps and forwards that need a gradient
    or drop out the feature maps' inputs run as `training_backend` says."""

    training_backend: Literal["torch", "triton"] = "torch"
    """How the mixing of forwards that need a gradient or drop out (training steps) runs on
    CUDA: `torch`, separate operators (fp32 copies of the features, two fp32 products, the
    normalisation, each writing its result); `triton`, the feature maps as in `torch` (their
    operators and dropout) and the mixing after them as one operator of Triton kernels, two in
    the forward and three in the backward, which keeps only its inputs and a per-head summary
    for the backward. Equal to `torch` up to the order of sums and rounding (docs/performance.md).
    Needs Triton and a head width of at most 128."""

    def __post_init__(self) -> None:
        _check_choice(
            "kernel.feature_map", self.feature_map, ("ffn", "glu", "oglu", "aoglu", "elu")
        )
        _check_choice("kernel.inference_backend", self.inference_backend, ("torch", "triton"))
        _check_choice("kernel.training_backend", self.training_backend, ("torch", "triton"))
        _check_positive("kernel.num_stacked", self.num_stacked)
        _check_positive("kernel.gate_rank_divisor", self.gate_rank_divisor)
        _check_positive("kernel.orthogonality_penalty", self.orthogonality_penalty, True)
        _check_prob("kernel.dropout", self.dropout)
        _check_positive("kernel.eps", self.eps)


ORTHOGONAL_MAPS = ("ffn", "oglu", "aoglu")
"""Feature maps whose W is orthogonally initialised (and subject to the penalty)."""

PENALTY_CALLS_PER_FORWARD = 2
"""The authors add the penalty at every feature-map call: phi(queries) and phi(keys)."""


def naive_kernel_attention(
    phi_q_BHNh: Tensor, phi_k_BHNh: Tensor, v_BHNh: Tensor, mask_BN: Tensor, eps: float
) -> Tensor:
    """The explicit O(N^2) form: A = phi(Q) phi(K)^T with padding columns zeroed, each row
    divided by its sum + eps, times V. The reference for tests."""
    scores_BHNN = phi_q_BHNh @ phi_k_BHNh.transpose(-1, -2)
    scores_BHNN = scores_BHNN.masked_fill(~mask_BN[:, None, None, :], 0.0)
    return scores_BHNN @ v_BHNh / (scores_BHNN.sum(-1, keepdim=True) + eps)


def per_head_matmul(x_HBNa: Tensor, w_Hab: Tensor) -> Tensor:
    """x (H, B, N, a) @ w (H, a, b) per head, as ONE (H, B N, a) x (H, a, b) batched product.

    Heads first, so that batch and tokens merge into the rows of each head's product: for the
    projection's strided views (q, k sliced out of the fused (B, N, 3, H, h) tensor) and for
    every tensor the feature maps make, (H, B N, a) is a view, not a copy. The (B, H, N, a)
    layout needed either a contiguous copy of x (its batch and head dimensions do not merge)
    or w broadcast and copied B times (torch.matmul's batching). Casts w to x's dtype outside
    autocast."""
    if w_Hab.dtype != x_HBNa.dtype and not torch.is_autocast_enabled(x_HBNa.device.type):
        w_Hab = w_Hab.to(x_HBNa.dtype)
    H, B, N, a = x_HBNa.shape
    return torch.bmm(x_HBNa.reshape(H, B * N, a), w_Hab).view(H, B, N, -1)


def matmul_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b in fp32: the inputs upcast (whatever their dtype), an fp32 product and result.

    Kernel attention's two products sum over the tokens (phi(K)^T [V | 1]) or use those fp32
    sums (phi(Q) [KV | z]); they run in fp32 while the feature maps before them run in the
    autocast dtype. Measured on an H100 (ALBERT-base, aoglu, bf16 autocast, eager training
    step): as fast as the all-fp32 path at 512 tokens and faster at 4096, while bf16 products
    with fp32 accumulation (`torch.bmm(..., out_dtype=torch.float32)`, the fp32 operand split
    into bf16 hi + lo halves, a custom autograd Function) were slower at both.
    """
    return a.float() @ b.float()


def kernel_mixing(
    phi_q_BHNh: Tensor,
    phi_k_BHNh: Tensor,
    v_BHNh: Tensor,
    key_valid_BN: Tensor | None,
    eps: float,
    dtype: torch.dtype,
) -> Tensor:
    """The mixing after the feature maps, as torch operators (`kernel.training_backend:
    torch`): phi(q_i)^T KV / (phi(q_i)^T z + eps) with [KV | z] = sum over real keys j of
    phi(k_j) [v_j | 1]. The features come in the compute dtype `dtype` (bf16 under autocast:
    half the memory traffic of fp32 ones); the sums over keys, the numerator and the
    normaliser are fp32 products of the upcast features (`matmul_fp32`). Runs heads first on
    views (the features are heads-first tensors, v a view of the fused projection). Returns
    (B, H, N, h) in v's dtype. Call with autocast off."""
    phi_q_HBNh, phi_k_HBNh = phi_q_BHNh.transpose(0, 1), phi_k_BHNh.transpose(0, 1)
    v_HBNh = v_BHNh.transpose(0, 1)
    if key_valid_BN is not None:
        # Padding keys contribute nothing (masked_fill, not a product: safe if phi is inf).
        phi_k_HBNh = phi_k_HBNh.masked_fill(~key_valid_BN[None, :, :, None], 0.0)
    # [KV | z] = phi(K)^T [V | 1] (h, h + 1) in one product: KV = sum_j phi(k_j) v_j^T and
    # z = sum_j phi(k_j), both summed over the tokens in fp32. [V | 1] is made in fp32 in one
    # pass (a concatenation that upcasts), not padded and then upcast.
    ones_HBN1 = v_HBNh.new_ones((*v_HBNh.shape[:-1], 1), dtype=torch.float32)
    v1_HBNH1 = torch.cat([v_HBNh.to(dtype), ones_HBN1], dim=-1)
    kvz_HBhH1 = matmul_fp32(phi_k_HBNh.mT, v1_HBNH1)
    # Numerator phi(q_i)^T KV and normaliser phi(q_i)^T z in one product.
    numden_HBNH1 = matmul_fp32(phi_q_HBNh, kvz_HBhH1)
    num_HBNh, den_HBN1 = numden_HBNH1.split([v_BHNh.size(-1), 1], dim=-1)
    # Times the reciprocal of the (B, H, N, 1) normaliser, not divided by it: the backward
    # then makes no (B, H, N, h) quotient of the normaliser's gradient.
    out_HBNh = (num_HBNh * (den_HBN1 + eps).reciprocal()).to(v_BHNh.dtype)
    return out_HBNh.transpose(0, 1)


def _he_normal_(w: Tensor) -> None:
    """The authors' HWLinear init for a stack of (fan_in, fan_out) matrices: N(0, 2 / fan_in)."""
    nn.init.normal_(w, mean=0.0, std=math.sqrt(2.0 / w.size(-2)))


class FeatureMapUnit(nn.Module):
    """One unit g(Drop(x) W) [* sigmoid(gate(Drop(x)))], per head, with its own dropout on its
    input. Owns its raw parameters and their init."""

    def __init__(
        self,
        feature_map: str,
        num_heads: int,
        head_dim: int,
        rank: int,
        last: bool,
        dropout: float = 0.0,
    ):
        super().__init__()
        H, h = num_heads, head_dim
        self.feature_map = feature_map
        self.last = last
        self.dropout = nn.Dropout(dropout)
        self.w_Hhh = nn.Parameter(torch.empty(H, h, h))
        if feature_map in ("glu", "oglu"):
            self.v_Hhh = nn.Parameter(torch.empty(H, h, h))
        elif feature_map == "aoglu":
            self.a_Hhr = nn.Parameter(torch.empty(H, h, rank))
            self.b_Hrh = nn.Parameter(torch.empty(H, rank, h))
        self.init_parameters()

    @property
    def orthogonal(self) -> bool:
        """Whether W is orthogonally initialised (and penalised)."""
        return self.feature_map in ORTHOGONAL_MAPS

    @torch.no_grad()
    def init_parameters(self) -> None:
        """Orthogonal W per head (ffn, oglu, aoglu), else He-normal (the authors'). Called by
        the encoder's generic init instead of its N(0, 0.02)."""
        for name, param in self.named_parameters(recurse=False):
            if name == "w_Hhh" and self.orthogonal:
                for w_hh in param:  # nn.init.orthogonal_ would flatten the head dimension
                    nn.init.orthogonal_(w_hh)
            else:
                _he_normal_(param)

    def input_weight(self) -> Tensor:
        """What multiplies the unit's input, in one product: W (H, h, h), [W | V] (H, h, 2h) for
        glu and oglu, [W | A] (H, h, h + r) for aoglu. One read of the input and one product
        instead of two; the same dot products."""
        gate = {"glu": "v_Hhh", "oglu": "v_Hhh", "aoglu": "a_Hhr"}.get(self.feature_map)
        if gate is None:
            return self.w_Hhh
        return torch.cat([self.w_Hhh, getattr(self, gate)], dim=-1)

    def forward(self, x_HBNh: Tensor) -> Tensor:
        """One unit on heads-first (H, B, N, h) input (`per_head_matmul`), in the compute dtype
        (`compute_dtype`: bf16 under autocast): the products through autocast, the element-wise
        softplus / sigmoid / product in that dtype too (autocast alone would run softplus in
        fp32, and everything after it)."""
        dtype = compute_dtype(x_HBNh)
        x_HBNh = self.dropout(x_HBNh)
        y_HBNc = per_head_matmul(x_HBNh, self.input_weight()).to(dtype)
        h, c = self.w_Hhh.size(-1), y_HBNc.size(-1)
        # split, not sliced: the backward of a split is one concatenation, that of two slices
        # two zero-filled tensors and two copies
        y_HBNh, gate_HBNc = y_HBNc.split([h, c - h], dim=-1) if c > h else (y_HBNc, None)
        if self.last:
            with torch.autocast(x_HBNh.device.type, enabled=False):
                y_HBNh = F.softplus(y_HBNh)
        if self.feature_map == "aoglu":  # x A (in gate_HBNc), then B
            gate_HBNc = per_head_matmul(gate_HBNc, self.b_Hrh).to(dtype)
        if gate_HBNc is not None:
            y_HBNh = y_HBNh * torch.sigmoid(gate_HBNc)
        return y_HBNh

    def orthogonality_error(self) -> Tensor:
        """mean((W W^T - I)^2) over heads and entries, in fp32."""
        with torch.autocast(self.w_Hhh.device.type, enabled=False):
            w_Hhh = self.w_Hhh.float()
            eye_hh = torch.eye(w_Hhh.size(-1), device=w_Hhh.device)
            return (w_Hhh @ w_Hhh.mT - eye_hh).pow(2).mean()


class FeedForwardFeatureMap(nn.Module):
    """phi: `num_stacked` FeatureMapUnits in sequence, softplus in the last; positive output."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        kc, h = cfg.kernel, cfg.head_dim
        rank = h // kc.gate_rank_divisor
        self.units = nn.ModuleList(
            FeatureMapUnit(
                kc.feature_map,
                cfg.num_attention_heads,
                h,
                rank,
                last=i == kc.num_stacked - 1,
                dropout=kc.dropout,
            )
            for i in range(kc.num_stacked)
        )

    def forward(self, x_BHNh: Tensor) -> Tensor:
        """phi on (B, H, N, h); the units run heads first (`per_head_matmul`), and the result
        is a (B, H, N, h) view of a heads-first tensor."""
        x_HBNh = x_BHNh.transpose(0, 1)
        for unit in self.units:
            x_HBNh = unit(x_HBNh)
        return x_HBNh.transpose(0, 1)

    def orthogonality_error(self) -> Tensor | None:
        """Sum over units of mean((W W^T - I)^2); None when no W is orthogonally initialised."""
        errors = [unit.orthogonality_error() for unit in self.units if unit.orthogonal]
        return torch.stack(errors).sum() if errors else None

    def drops_out(self) -> bool:
        """Whether a forward now drops out the units' inputs (training with dropout > 0)."""
        return self.training and any(unit.dropout.p > 0 for unit in self.units)

    def fused_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """The units' weights for the fused kernels (kernel_triton.py), in `dtype`: their input
        weights stacked (U, H, h, c), and for aoglu their gates' B stacked (U, H, r, h)."""
        win = torch.stack([unit.input_weight() for unit in self.units]).to(dtype)
        if self.units[0].feature_map != "aoglu":
            return win, None
        return win, torch.stack([unit.b_Hrh for unit in self.units]).to(dtype)


class EluFeatureMap(nn.Module):
    """phi(x) = elu(x) + 1 (Katharopoulos et al. 2020, arXiv 2006.16236); no parameters."""

    def forward(self, x_BHNh: Tensor) -> Tensor:
        return F.elu(x_BHNh.to(compute_dtype(x_BHNh))) + 1.0  # in the autocast dtype

    def orthogonality_error(self) -> Tensor | None:
        return None

    def drops_out(self) -> bool:
        return False

    def fused_weights(self, dtype: torch.dtype) -> tuple[None, None]:
        """No weights: the fused kernels' elu+1 map."""
        return None, None


class KernelAttention(ScoreKernel):
    """Non-causal linear attention with a trainable feature map phi shared by queries and keys."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        kc = cfg.kernel
        self.eps = kc.eps
        self.penalty = kc.orthogonality_penalty
        self.inference_backend = kc.inference_backend
        self.training_backend = kc.training_backend
        # Where the fused kernels can run, decided once (not in a traced forward): CUDA with
        # Triton, or any device in Triton's interpreter (tests).
        self.fused_on_cpu = kernel_triton.interpreting()
        self.triton_importable = "triton" in (kc.inference_backend, kc.training_backend) and (
            kernel_triton.importable()
        )
        self.phi = EluFeatureMap() if kc.feature_map == "elu" else FeedForwardFeatureMap(cfg)
        if self.penalty > 0 and kc.feature_map not in ORTHOGONAL_MAPS:
            warnings.warn(
                f"kernel.orthogonality_penalty={self.penalty} is ignored: feature_map="
                f"{kc.feature_map!r} has no orthogonally initialised W",
                stacklevel=2,
            )
        if kc.num_stacked != 1 and kc.feature_map == "elu":
            warnings.warn(
                f"kernel.num_stacked={kc.num_stacked} is ignored: feature_map='elu' has no units",
                stacklevel=2,
            )

    def orthogonality_loss(self) -> Tensor | None:
        """2 * lambda * sum over units of mean((W W^T - I)^2) (the authors count it for the
        queries' and the keys' call); None if lambda = 0 or no such W."""
        error = self.phi.orthogonality_error() if self.penalty > 0 else None
        return None if error is None else PENALTY_CALLS_PER_FORWARD * self.penalty * error

    def _fused_runs(self, q_BHNh: Tensor, v_BHNh: Tensor, option: str) -> bool:
        """Whether the Triton kernels run on these inputs: on CUDA (or in Triton's interpreter),
        in a dtype they take, with Triton installed; without Triton, `option` falls back to
        `torch` with a warning."""
        if not (q_BHNh.is_cuda or self.fused_on_cpu):
            return False
        if (
            compute_dtype(q_BHNh) not in kernel_triton.ROUND
            or v_BHNh.dtype not in kernel_triton.ROUND
        ):
            return False  # fp64: the torch path
        if not self.triton_importable:
            warnings.warn(
                f"kernel.{option}='triton' without Triton: the torch path runs instead; "
                "install the triton that matches torch",
                stacklevel=3,
            )
            setattr(self, option, "torch")
            return False
        return True

    def fused_inference(self, q_BHNh: Tensor, k_BHNh: Tensor, v_BHNh: Tensor) -> bool:
        """Whether this forward runs the fused Triton kernels (`kernel.inference_backend:
        triton`): on a device they run on, with nothing that needs a gradient and no dropout."""
        if self.inference_backend != "triton" or self.phi.drops_out():
            return False
        if torch.is_grad_enabled() and (
            q_BHNh.requires_grad
            or k_BHNh.requires_grad
            or v_BHNh.requires_grad
            or any(p.requires_grad for p in self.parameters())
        ):
            return False
        return self._fused_runs(q_BHNh, v_BHNh, "inference_backend")

    def fused_training(self, q_BHNh: Tensor, v_BHNh: Tensor) -> bool:
        """Whether the mixing after the feature maps runs as the fused training operator
        (`kernel.training_backend: triton`), on a device its kernels run on; asked of the
        forwards that do not take the inference kernels."""
        if self.training_backend != "triton":
            return False
        return self._fused_runs(q_BHNh, v_BHNh, "training_backend")

    def forward(
        self, q_BHNh: Tensor, k_BHNh: Tensor, v_BHNh: Tensor, ctx: LayerContext
    ) -> tuple[Tensor, AuxLosses]:
        dtype = compute_dtype(q_BHNh)
        key_valid_BN = ctx.mask_BN if ctx.padded else None
        if self.fused_inference(q_BHNh, k_BHNh, v_BHNh):
            win, bw = self.phi.fused_weights(dtype)
            out_BHNh = kernel_triton.kernel_attention_inference(
                q_BHNh, k_BHNh, v_BHNh, win, bw, key_valid_BN, self.eps, dtype
            )
            return out_BHNh, self._aux(ctx)
        # Heads first (views): the feature maps' products and the mixing's products batch
        # over (H, B) without copying the projection's strided q, k, v.
        phi_q_BHNh = self.phi(q_BHNh)  # each unit drops out its own input
        phi_k_BHNh = self.phi(k_BHNh)
        fused = self.fused_training(q_BHNh, v_BHNh)
        mix = kernel_triton.kernel_attention_train if fused else kernel_mixing
        with torch.autocast(q_BHNh.device.type, enabled=False):
            out_BHNh = mix(
                phi_q_BHNh.to(dtype), phi_k_BHNh.to(dtype), v_BHNh, key_valid_BN, self.eps, dtype
            )
        return out_BHNh, self._aux(ctx)

    def _aux(self, ctx: LayerContext) -> AuxLosses:
        """The orthogonality penalty, at the first application of this layer's weights."""
        aux: AuxLosses = {}
        if ctx.first_use:
            loss = self.orthogonality_loss()
            if loss is not None:
                aux["kernel_orthogonality"] = loss
        return aux


def _feature_map_unit_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """One unit of the feature map phi on one (N, h) input, summed over heads."""
    h, fm = cfg.head_dim, cfg.kernel.feature_map
    if fm == "elu":
        return 0
    per_head = matmul_flops(seq_len, h, h)  # x W
    if fm in ("glu", "oglu"):
        per_head += matmul_flops(seq_len, h, h)  # the gate x V
    elif fm == "aoglu":
        rank = h // cfg.kernel.gate_rank_divisor
        per_head += matmul_flops(seq_len, h, rank) + matmul_flops(seq_len, rank, h)  # x A B
    return cfg.num_attention_heads * per_head


def kernel_mixing_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """phi(q), phi(k) (`num_stacked` units each; none for elu), then [KV | z] = phi(K)^T [V | 1]
    and phi(Q) [KV | z] (the numerator and the normaliser):
    2 x units x 2 N h (h [+ h | + 2 r]) + 4 N (h + 1) d."""
    units = 0 if cfg.kernel.feature_map == "elu" else cfg.kernel.num_stacked
    phi = 2 * units * _feature_map_unit_flops(cfg, seq_len)  # queries and keys
    h = cfg.head_dim
    kvz = matmul_flops(h, seq_len, h + 1)  # (h, N) x (N, h + 1)
    numden = matmul_flops(seq_len, h, h + 1)  # (N, h) x (h, h + 1)
    return phi + cfg.num_attention_heads * (kvz + numden)


def validate(cfg: EncoderConfig) -> None:
    """The aoglu gate needs a rank of at least 1; the fused kernels (inference and training) a
    head width of at most `kernel_triton.MAX_HEAD_DIM`."""
    if cfg.kernel.feature_map == "aoglu" and cfg.head_dim // cfg.kernel.gate_rank_divisor < 1:
        raise ValueError(
            f"kernel.gate_rank_divisor={cfg.kernel.gate_rank_divisor} leaves rank 0 "
            f"for head_dim={cfg.head_dim}"
        )
    for option in ("inference_backend", "training_backend"):
        if getattr(cfg.kernel, option) == "triton" and cfg.head_dim > kernel_triton.MAX_HEAD_DIM:
            raise ValueError(
                f"kernel.{option}='triton' takes heads of at most "
                f"{kernel_triton.MAX_HEAD_DIM} wide, not head_dim={cfg.head_dim} (hidden_size / "
                f"num_attention_heads): use kernel.{option}='torch'"
            )


FAMILY = AttentionFamily(
    name="kernel",
    description="linear attention with trainable feed-forward kernels (Yorsh & Kovalenko 2022)",
    kernel=KernelAttention,
    validate=validate,
    mixing_flops=kernel_mixing_flops,
    hf_export=HFExport(code=family_code(__file__, "kernel_hf.py")),
    options=KernelConfig,
    # Compiled on a GPU it was measured faster: docs/benchmarks.md#compiled-against-eager.
    compile_auto=True,
)

__all__ = [
    "FAMILY",
    "PENALTY_CALLS_PER_FORWARD",
    "EluFeatureMap",
    "FeatureMapUnit",
    "FeedForwardFeatureMap",
    "KernelAttention",
    "KernelConfig",
    "kernel_mixing",
    "kernel_mixing_flops",
    "naive_kernel_attention",
]
