"""TransJect: injective, Lipschitz-bounded orthogonal attention (Sengupta, Akhtar, Chakraborty 2023).

Paper: https://arxiv.org/abs/2310.14206; formulation and project decisions: docs/methods.md.
Authors' code: github.com/victor7246/TransJect (differs from the paper in places; see "Decisions").

Shape legend (as in `model/attention/base.py`):
    B batch, N tokens, d hidden width, E experts, V vocabulary, P = d/2 (width of each embedding half).
    `x_BND` is (B, N, d); `mask_BN` is bool (B, N), True at real tokens; `a_EBND` is the expert
    outputs (E, B, N, d); `w_BE` the per-sample expert weights; `lam_Bd` the eigenvalues (B, d)
    (or (1, d), broadcastable).

The family replaces the whole layer, the embeddings, and adds a once-per-forward state:

    embeddings   x_i = [ sqrt(P) E(t_i) ; PE(i) ]           E orthogonal rows (when V <= P)
    state        M = X0^T X0 (per sample, padding excluded)
                 lambda = diag(U^T M U) / max|diag(U^T M U)|   U learnable orthogonal (d x d)
                 aux loss  w_rec * mean( (M/s - U diag(lambda) U^T)^2 ),  s = max|diag(U^T M U)|
    attention    A_e(X) = ELU( (X U_e + b_e) diag(lambda) V_e^T )  U_e, V_e orthogonal (d x d)
                 w = softmax_e( g( masked max_n (X + alpha_l A_e(X)) ) )   g: R^d -> R, shared
                 Attn(X) = sum_e w_e A_e(X)
    layer        alpha_l = tanh(r_l) / L_app
                 X <- X + alpha_l Attn(X)
                 X <- X + alpha_l ELU( W2 Drop( ELU( W1 X + b1 ) ) + b2 )  W1, W2 orthogonal

Why the map is injective and Lipschitz (the property the tests check): for one sample, Lambda and
the gate w are fixed, ||U_e Lambda V_e^T||_2 = max|lambda| = 1, ELU is 1-Lipschitz, a bias inside
is a translation, and the gate is a convex combination, so each sublayer F has Lip(F) <= 1 on
token vectors; x + alpha F(x) with |alpha| < 1 then satisfies
(1 - |alpha|) ||x - y|| <= ||f(x) - f(y)|| <= (1 + |alpha|) ||x - y||.
There is no LayerNorm anywhere (LayerNorm is not injective). The authors' bias on V (option
`transject.bias=authors`) adds (sum_k (X U_e + b_e)_k) b_V to every token, a rank-one term of
norm up to sqrt(d) ||b_V|| that this bound does not cover; it is off by default.

Following the authors' code (victor7246/TransJect models/layers.py), where the earlier reading
of the paper differed (each a named option; docs/methods.md has the measurements):
* the gate pools each expert's sublayer output X + alpha A_e(X) (`transject.gate_input`);
* the expert's U map and both FFN maps have biases, initialised as nn.Linear's
  (`transject.bias`); the gate g as nn.Linear's default too;
* alpha_l = tanh(r_l) / L with r_l = 0 at init (ReZero), one r_l per layer shared by the
  attention and the FFN residual: as in the authors' code.

Decisions (docs/methods.md, where the paper and the authors' code disagree or the code is wrong):
* Token embedding orthogonally parameterised (rows orthonormal) when V <= P, else plain
  (`cfg.transject.token_embedding`: auto | orthogonal | plain); the code uses a plain embedding.
* Eigenvalues: lambda = diag(U^T M U) as a real matrix product; the code's element-wise einsums
  compute something else. No tanh, no bias on U (the code has both).
* Random-TransJect: Lambda is a learned (registered) diagonal; the code resamples it every forward.
* The code's undocumented stochastic residual (`random_features`) is not implemented: it breaks
  injectivity.
* Pooling over tokens (in the heads) must be masked: use `pooling="mean"` (masked) for the paper's
  mean pooling; the code averages over padding.
* The reconstruction loss compares M / s with U diag(lambda) U^T (s = max|diag(U^T M U)|, the
  scale that normalises lambda), at the authors' weights: it is zero exactly at an eigenbasis of
  M and does not grow with N or the embedding norm. The authors' loss compares the raw M with the
  normalised reconstruction (`transject.reconstruction=authors`, kept as an option): its minimum
  over U spreads diag(U^T M U) evenly instead of diagonalising M, and measured on a 2-layer
  classifier it moves U away from the eigenbasis (eigenbasis error 0.789 -> 0.807 in 200 AdamW
  steps) while the scale-free loss at the same weight 1e-3 trains it (0.789 -> 0.642; with no
  loss 0.785). `eigenbasis_error` is logged to TensorBoard with the pretraining diagnostics.

Project readings where the paper is silent:
* The token half is multiplied by the fixed constant sqrt(P) (the sqrt(d_model) embedding scale of
  Vaswani et al.): orthonormal rows have norm 1 while the sinusoid has norm sqrt(P/2); scaled, the
  token half has entries of RMS 1 like the authors' plain N(0, 1) embedding, and the two halves
  carry comparable energy. A constant scale keeps the embedding injective; the MLM decoder ties
  to the unscaled (orthonormal) rows. A plain embedding is initialised N(0, 1/P) so both variants
  give the same scale.
* The eigen-state (M, lambda, the loss) is computed in fp32 with autocast off, like the
  orthogonal maps: M sums N outer products and bf16 would lose the small eigenvalues. Its two
  products may run as three bf16 products each with fp32 accumulation
  (`transject.eigen_products=bf16x3`, `Bf16x3Product`: tensor cores on a GPU; within about
  1e-5 of fp32, docs/methods.md).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.attention.base import (
    Attention,
    AttentionFamily,
    AttentionOutput,
    AuxLosses,
    LayerContext,
    compute_dtype,
    key_mask,
    matmul_flops,
)
from model.attention.hf_export import HFExport, family_code
from model.attention.transject_eigen import (  # re-exported: the family's eigen-state
    LAMBDA_KEY,
    RECONSTRUCTION_KEY,
    EigenState,
    approximate_eigenvalues,
    eigenbasis_error,
)
from model.config import AutocastOutput, EncoderConfig
from model.orthogonal import Linear, make_orthogonal, orthogonal_cache
from model.typed_config import _check_choice, _check_positive

EigenProducts = Literal["fp32", "bf16x3"]


@dataclass
class TransJectConfig:
    """TransJect (Sengupta, Akhtar, Chakraborty 2023); docs/methods.md, TransJect."""

    num_experts: int = 4
    """E, the number of orthogonal attention experts mixed by the per-sample gate."""

    eigenvalues: Literal["approx", "random"] = "approx"
    """`approx`: eigenvalues of X0^T X0 approximated once per forward with a learnable orthogonal
    basis, plus a reconstruction loss. `random`: Random-TransJect, a learned diagonal (no loss)."""

    reconstruction_weight: float = 1e-3
    """Weight of the eigen-reconstruction loss (the authors' code: 1e-3 classification, 0.1 LM).
    The model returns the weighted loss as the auxiliary loss `transject_reconstruction`."""

    reconstruction: Literal["scale_free", "authors"] = "scale_free"
    """The eigen-reconstruction loss. `scale_free` (default): mean((M/s - U diag(lambda) U^T)^2),
    s = max|diag(U^T M U)| the scale that normalises lambda; zero exactly when U is an eigenbasis
    of M, independent of N and of the embedding norm. `authors`: mean((M - U diag(lambda) U^T)^2)
    with the raw M and the normalised lambda, as in the authors' code: measured, it pushes U
    AWAY from the eigenbasis (its minimum spreads diag(U^T M U) evenly; docs/methods.md)."""

    gate_input: Literal["sublayer", "attention"] = "sublayer"
    """What the expert gate max-pools over the real tokens. `sublayer`: each expert's sublayer
    output X + alpha * A_e(X), as in the authors' code (uniform weights at the ReZero init).
    `attention`: A_e(X) alone (this project's earlier reading of the paper)."""

    bias: Literal["lipschitz", "authors", "none"] = "lipschitz"
    """Biases of the expert and FFN maps. `authors`: every bias of the authors' code (the
    expert's U and V maps, the FFN's two maps), nn.Linear's default init. `lipschitz` (default):
    the same except V's bias, the one that breaks the paper's Lipschitz bound (it adds
    (sum of the features of X U) * b_V to every token). `none`: no bias anywhere."""

    token_embedding: Literal["auto", "orthogonal", "plain"] = "auto"
    """The d/2-wide token embedding. `orthogonal`: rows orthonormal (needs vocab_size <= d/2);
    `plain`: an ordinary embedding; `auto`: orthogonal when the vocabulary fits, else plain."""

    residual_init: float = 0.0
    """Initial r_l of the injective residual weight alpha_l = tanh(r_l) / L (0: ReZero, as in the
    authors' code, so every layer starts as the identity)."""

    eigen_products: EigenProducts = "fp32"
    """How the eigen-state's two matrix products (X U and the Gram matrix of the embeddings,
    forward and backward) run; the eigen-state itself is fp32 either way (docs/methods.md).
    `fp32` (default): fp32 products, which a GPU runs on its CUDA cores (a visible share of the
    albert-base step on an H100: docs/benchmarks.md#where-the-device-time-goes). `bf16x3`: each
    fp32 operand split into bf16 high and low halves and each product summed from three bf16
    products with fp32 accumulation (the low x low term, about 2^-16 of the rest, left out), on
    tensor cores; the eigenvalues and the reconstruction loss close to fp32's
    (docs/benchmarks.md#transjects-eigen-state-in-bf16-products). Off CUDA the three products
    run as fp32 products of the halves (the same values)."""

    residual_stream: AutocastOutput = "fp32"
    """The dtype of the residual stream between TransJect layers under autocast
    (`engine.precision: bf16-mixed`). `fp32` (default): as torch's autocast leaves it, and as the
    authors' code runs: the fp32 embeddings plus each layer's bf16 update stay fp32 (TransJect
    has no LayerNorm that would round it). `compute`: each layer's output rounded to the
    autocast dtype (bf16), as a post-LN ALBERT layer's is (`norm_output: compute`); a compiled
    albert-base step then moves 51.0 instead of 58.9 GB outside its products (docs/methods.md,
    TransJect). No effect without autocast."""

    def __post_init__(self) -> None:
        _check_positive("transject.num_experts", self.num_experts)
        _check_choice("transject.eigenvalues", self.eigenvalues, ("approx", "random"))
        _check_positive("transject.reconstruction_weight", self.reconstruction_weight, True)
        _check_choice(
            "transject.token_embedding", self.token_embedding, ("auto", "orthogonal", "plain")
        )
        _check_choice("transject.reconstruction", self.reconstruction, ("authors", "scale_free"))
        _check_choice("transject.gate_input", self.gate_input, ("sublayer", "attention"))
        _check_choice("transject.bias", self.bias, ("lipschitz", "authors", "none"))
        _check_choice("transject.eigen_products", self.eigen_products, get_args(EigenProducts))
        _check_choice("transject.residual_stream", self.residual_stream, get_args(AutocastOutput))


def _compute_dtype(x: Tensor, weight: Tensor) -> Tensor:
    """Casts an fp32 orthogonal weight to the activation dtype (autocast picks its own)."""
    if weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
        return weight.to(x.dtype)
    return weight


# ---------------------------------------------------------------------------------------------
# Embeddings
# ---------------------------------------------------------------------------------------------


def sinusoidal_encoding(num_positions: int, width: int, device=None) -> Tensor:
    """(N, width) fp32 sinusoidal position encoding (Vaswani et al. 2017), for any N.

    PE(i, 2k) = sin(i / 10000^(2k / width)),  PE(i, 2k + 1) = cos(i / 10000^(2k / width)).
    """
    positions_N1 = torch.arange(num_positions, device=device, dtype=torch.float32)[:, None]
    k = torch.arange(0, width, 2, device=device, dtype=torch.float32)  # 2k
    angles_NK = positions_N1 * torch.exp(-math.log(10000.0) * k / width)
    pe_NK2 = torch.stack([angles_NK.sin(), angles_NK.cos()], dim=-1)  # interleave sin, cos
    return pe_NK2.flatten(1)[:, :width]  # an odd width drops the last cosine


class TransJectEmbeddings(nn.Module):
    """input ids (B, N) -> (B, N, d): x_i = [ sqrt(P) E(t_i) ; PE(i) ], P = d/2, then dropout.

    Concatenation (not addition) keeps the map (token, position) -> x injective: two tokens at
    one position differ in the first half, two positions differ in the second. The position half
    is computed on the fly, so there is no maximum length. No LayerNorm (it is not injective).

    Token type ids are accepted for the common interface and ignored: the injective embedding has
    no segment term (an added segment vector could make two (token, segment) pairs collide), so
    segments are marked by the [SEP] token alone.

    The token embedding is orthogonally parameterised (rows orthonormal, needs V <= P) per
    `cfg.transject.token_embedding` (auto: orthogonal when V <= P, else plain); docs/methods.md.
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.hidden_size
        if d % 2:
            raise ValueError(f"transject needs an even hidden_size, got {d}")
        self.half = d // 2
        mode = cfg.transject.token_embedding
        if mode == "orthogonal" and cfg.vocab_size > self.half:
            raise ValueError(
                f"transject.token_embedding='orthogonal' needs vocab_size <= hidden_size/2 "
                f"({cfg.vocab_size} > {self.half}); use 'auto' or 'plain'"
            )
        self.orthogonal = mode == "orthogonal" or (mode == "auto" and cfg.vocab_size <= self.half)
        self.word_embeddings = nn.Embedding(cfg.vocab_size, self.half)
        if self.orthogonal:
            make_orthogonal(
                self.word_embeddings, "weight", cfg.orthogonal_map, cfg.cayley_leaf_inverse
            )
        self.scale = math.sqrt(self.half)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def init_parameters(self) -> None:
        """Called by the encoder's init (after its N(0, 0.02) init of the child embedding)."""
        if not self.orthogonal:
            # Rows of expected norm 1, like the orthonormal rows: the same scale in both modes.
            nn.init.normal_(self.word_embeddings.weight, std=1.0 / math.sqrt(self.half))

    @property
    def token_embedding_weight(self) -> Tensor:
        """(V, P) token embedding (orthonormal rows when orthogonal); the MLM decoder ties to it."""
        return self.word_embeddings.weight

    def _storage_dtype(self) -> torch.dtype:
        """The dtype the model is stored in (the orthogonal map itself always returns fp32)."""
        if self.orthogonal:
            return self.word_embeddings.parametrizations.weight.original.dtype
        return self.word_embeddings.weight.dtype

    def forward(self, input_ids_BN: Tensor, token_type_ids_BN: Tensor | None = None) -> Tensor:
        B, N = input_ids_BN.shape
        dtype = self._storage_dtype()
        tok_BNP = F.embedding(input_ids_BN, self.token_embedding_weight).to(dtype) * self.scale
        pos_BNP = sinusoidal_encoding(N, self.half, input_ids_BN.device).to(dtype).expand(B, N, -1)
        return self.dropout(torch.cat([tok_BNP, pos_BNP], dim=-1))


# ---------------------------------------------------------------------------------------------
# Orthogonal mixture-of-experts attention
# ---------------------------------------------------------------------------------------------


def residual_alpha(ctx: LayerContext, num_applications: int) -> Tensor:
    """alpha_l = tanh(r_l) / L_app, the injective residual weight of this application."""
    if ctx.residual_gate is None:
        raise ValueError("TransJect layers need ctx.residual_gate (the encoder's r_l)")
    return torch.tanh(ctx.residual_gate) / num_applications


def _linear_default_init_(param: Tensor, fan_in: int) -> None:
    """nn.Linear's default init of a bias (and of a weight, up to the same bound): U(+-1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    nn.init.uniform_(param, -bound, bound)


class PooledAt(torch.autograd.Function):
    """`src.gather(dim, index)` for the gate's max-pool, whose backward is one dense expression.

    The gradient of a gather is a scatter into a zero-filled tensor of src's shape: compiled,
    one kernel fills it, another scatters, and the next kernel of the backward reads it again,
    for each of the (E, B, N, d) expert outputs and the (B, N, d) input, every layer. Here
    grad_src[..., n, ...] = sum_j where(index[..., j, ...] == n, grad[..., j, ...], 0), over
    the k = index.size(dim) pooled entries (1 for the experts, E for X): a broadcast of the
    small (index, grad) pair that Inductor fuses into the kernel consuming the gradient, so
    nothing of src's size is written for it (a compiled TransJect step moves fewer bytes:
    docs/benchmarks.md#memory-traffic). The gradient is the scatter's exactly where the indices
    along `dim` differ; k = E pooled entries on one token of X add up in another order (fp
    rounding). Eagerly the broadcast is the slower (it writes a comparison and a result of
    src's size per pooled entry), so `pool_at` uses it only under torch.compile.

    apply(src, index, dim) -> src.gather(dim, index); no gradient for the index.
    """

    @staticmethod
    def forward(src: Tensor, index: Tensor, dim: int) -> Tensor:
        return src.gather(dim, index)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        src, index, dim = inputs
        ctx.save_for_backward(index)
        ctx.dim, ctx.size = dim, src.size(dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (index,) = ctx.saved_tensors
        dim = ctx.dim % grad.dim()
        shape = [1] * grad.dim()
        shape[dim] = ctx.size
        positions = torch.arange(ctx.size, device=grad.device).view(shape)
        zero = grad.new_zeros(())
        total = None
        for j in range(index.size(dim)):  # k is static: 1 or E
            term = torch.where(index.narrow(dim, j, 1) == positions, grad.narrow(dim, j, 1), zero)
            total = term if total is None else total + term
        return total, None, None


def pool_at(src: Tensor, index: Tensor, dim: int) -> Tensor:
    """`src.gather(dim, index)`: with `PooledAt`'s dense backward under torch.compile (fused by
    Inductor), with gather's scatter eagerly (the faster of the two there)."""
    if torch.compiler.is_compiling():
        return PooledAt.apply(src, index, dim)
    return src.gather(dim, index)


def mix_experts(w_BE: Tensor, a_EBND: Tensor) -> Tensor:
    """sum_e w_e A_e, (B, N, d). Eagerly one batched product (the einsum reads A once; a
    product then a sum would write one more tensor of A's size). Under torch.compile a sum over
    the expert axis, which Inductor fuses with the ELU that makes A: the einsum's product
    needs A in a (B, N d, E) layout for its backward, so compiled, every forward wrote that
    copy of A (a compiled TransJect step moves fewer bytes without it:
    docs/benchmarks.md#memory-traffic)."""
    if torch.compiler.is_compiling():
        return (w_BE.T[:, :, None, None] * a_EBND).sum(dim=0)
    return torch.einsum("be,ebnd->bnd", w_BE, a_EBND)


class ExpertBias(nn.Module):
    """A per-expert bias (E, d), in a module of its own so that a sharded engine (ZeRO-3), which
    gathers a module's parameters around its forward and backward, sees it used.

    forward(y, scale=None, experts_first=False) -> y + b_e for y with the expert axis second to
    last, (..., E, d), or first, (E, ..., d), with `experts_first`; with `scale` (broadcastable
    to y's leading dimensions and a trailing 1): y + scale * b_e (the authors' V bias). With
    `matrix` (d_in, E d): y (T, d_in) @ matrix + [b_1 ... b_E], (T, E d), the bias added by the
    matrix product itself (`torch.addmm`), not by a pass over its (T, E d) result.
    """

    def __init__(self, num_experts: int, width: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(num_experts, width))

    def forward(
        self,
        y: Tensor,
        scale: Tensor | None = None,
        experts_first: bool = False,
        matrix: Tensor | None = None,
    ) -> Tensor:
        if matrix is not None:
            return torch.addmm(self.bias.to(matrix.dtype).flatten(), y, matrix)
        b = self.bias.to(y.dtype)
        if experts_first:
            b = b.view(b.size(0), *([1] * (y.dim() - 2)), b.size(1))  # (E, 1, ..., d)
        return y + (b if scale is None else scale * b)


class TransJectAttention(Attention):
    """E orthogonal experts A_e(X) = ELU((X U_e + b_e) Lambda V_e^T) mixed by a per-sample gate.

    Mixing is over features, per token: cost O(N E d^2), linear in N; outputs at real tokens do
    not depend on padding (Lambda and the gate's max-pool exclude it). U, V are stacked as
    (E, d, d) orthogonal tensors: X U_e of all experts is one product, X U_e Lambda V_e^T one
    batched product (`experts`). Biases per
    `cfg.transject.bias` (module docstring); the gate pools per `cfg.transject.gate_input`.
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d, E = cfg.hidden_size, cfg.transject.num_experts
        self.num_experts = E
        self.num_applications = cfg.num_layer_applications
        self.gate_input = cfg.transject.gate_input
        self.expert_u = nn.Parameter(torch.empty(E, d, d))
        self.expert_v = nn.Parameter(torch.empty(E, d, d))
        make_orthogonal(self, "expert_u", cfg.orthogonal_map, cfg.cayley_leaf_inverse)
        make_orthogonal(self, "expert_v", cfg.orthogonal_map, cfg.cayley_leaf_inverse)
        bias = cfg.transject.bias
        self.expert_u_bias = ExpertBias(E, d) if bias != "none" else None
        self.expert_v_bias = ExpertBias(E, d) if bias == "authors" else None
        # The gate g: R^d -> R. No bias: a shared bias shifts every expert's logit equally and
        # cancels in the softmax (the authors' has one; it only ever gets a zero gradient).
        self.gate = Linear(d, 1, bias=False)

    def init_parameters(self) -> None:
        """The authors' nn.Linear defaults for the biases and the gate (the encoder's init
        calls this instead of its N(0, 0.02)); U_e, V_e come from their parametrization."""
        d = self.gate.in_features
        with torch.no_grad():
            _linear_default_init_(self.gate.weight, d)
            for b in (self.expert_u_bias, self.expert_v_bias):
                if b is not None:
                    _linear_default_init_(b.bias, d)

    def experts(self, x_BND: Tensor, ctx: LayerContext) -> tuple[Tensor, Tensor]:
        """(a_EBND, w_BE): every expert's output, experts first, and the per-sample weights.

        The tokens of the whole batch are one matrix, T = B N rows: X U_e for all experts is one
        product with the concatenated U = [U_1 ... U_E] (d, E d), and (X U_e Lambda) V_e^T one
        batched product over the E experts. (Broadcasting the batch against the (E, d, d)
        stacks instead made torch expand U and V to (B, E, d, d) copies and reduce their
        gradients over B, and keep the copies for the backward: slower and far more memory;
        docs/methods.md.)
        """
        B, N, d = x_BND.shape
        E = self.num_experts
        lam_Bd = ctx.extras[LAMBDA_KEY]
        U_Edd = _compute_dtype(x_BND, self.expert_u)
        V_Edd = _compute_dtype(x_BND, self.expert_v)
        # A_e(X) = ELU( ((X U_e + b_e) * lambda) V_e^T ), row vectors ("X U" is x @ U).
        U_dEd = U_Edd.permute(1, 0, 2).reshape(d, E * d)  # [U_1 | ... | U_E]
        x_Td = x_BND.reshape(B * N, d)
        if self.expert_u_bias is None:
            xu_BNEd = (x_Td @ U_dEd).view(B, N, E, d)
        else:  # X U + [b_1 ... b_E] in one product (the bias added by the GEMM)
            xu_BNEd = self.expert_u_bias(x_Td, matrix=U_dEd).view(B, N, E, d)
        # lambda (fp32) in the products' dtype (autocast's bf16): the scaled tensor is the next
        # product's input, which autocast would round to that dtype anyway.
        lam_B11d = lam_Bd.to(xu_BNEd.dtype)[:, None, None, :]
        scaled_ETd = (xu_BNEd * lam_B11d).view(B * N, E, d).transpose(0, 1)
        pre_ETd = torch.bmm(scaled_ETd, V_Edd.mT)  # (E, T, d): E products of (T, d) x (d, d)
        if self.expert_v_bias is not None:
            # The authors' V(diag(lambda)) = diag(lambda) V^T + 1 b_V^T: every row gets b_V,
            # so the product adds (sum_k xu_k) b_V to each token.
            sum_ET1 = xu_BNEd.sum(dim=-1).view(B * N, E).T[:, :, None]
            pre_ETd = self.expert_v_bias(pre_ETd, sum_ET1, experts_first=True)
        a_EBND = F.elu(pre_ETd).view(E, B, N, d)

        # Gate: masked max over real tokens -> shared g -> softmax over experts (in fp32). The
        # authors pool each expert's sublayer output X + alpha A_e(X).
        # The max over tokens picks one token per (expert, sample, feature): found without
        # gradients, then the pooled values gathered from X and A_e, so autograd keeps an index
        # (E, B, d) instead of the (E, B, N, d) sum, and the backward routes each pooled gradient
        # to its token (`pool_at`: compiled, a dense expression Inductor fuses, no scatter)
        # (at exactly tied maxima, possible in bf16, the gradient goes to one of them where
        # amax's split it evenly: both are gradients of the max). Padding is excluded by the
        # lowest value of the dtype, put into X (B, N, d) before the sum; X + alpha A_e there
        # stays that lowest value (|alpha A_e| is far below its spacing).
        padding_BN1 = ~ctx.mask_BN[:, :, None]
        if self.gate_input == "sublayer":
            alpha = residual_alpha(ctx, self.num_applications).to(a_EBND.dtype)
            with torch.no_grad():
                x_masked_BND = x_BND.masked_fill(padding_BN1, torch.finfo(x_BND.dtype).min)
                # X + alpha A_e in one pass (addcmul), not alpha A_e and then a sum
                sublayer_EBND = torch.addcmul(x_masked_BND[None], a_EBND, alpha)
                index_EB1D = sublayer_EBND.argmax(dim=2, keepdim=True)
            # x[b, index[e, b, k], k], gathered along the tokens of X itself (B, E, d)
            index_BED = index_EB1D.squeeze(2).transpose(0, 1)
            x_pooled_EBD = pool_at(x_BND, index_BED, 1).transpose(0, 1)
            a_pooled_EBD = pool_at(a_EBND, index_EB1D, 2).squeeze(2)
            pooled_EBD = x_pooled_EBD + alpha * a_pooled_EBD
        else:
            with torch.no_grad():
                masked_EBND = a_EBND.masked_fill(padding_BN1[None], torch.finfo(a_EBND.dtype).min)
                index_EB1D = masked_EBND.argmax(dim=2, keepdim=True)
            pooled_EBD = pool_at(a_EBND, index_EB1D, 2).squeeze(2)
        has_tokens_1B1 = ctx.mask_BN.any(dim=1)[None, :, None]
        pooled_EBD = pooled_EBD.masked_fill(~has_tokens_1B1, 0.0)  # all-padding sample: no -inf
        w_BE = self.gate(pooled_EBD).squeeze(-1).T.float().softmax(dim=-1)
        return a_EBND, w_BE

    def expert_weights(self, x_BND: Tensor, ctx: LayerContext) -> Tensor:
        """(B, E) per-sample mixture weights (each row sums to 1); for diagnostics."""
        return self.experts(x_BND, ctx)[1]

    def forward(self, x_BND: Tensor, ctx: LayerContext) -> AttentionOutput:
        a_EBND, w_BE = self.experts(x_BND, ctx)
        out_BND = mix_experts(w_BE.to(a_EBND.dtype), a_EBND)
        return AttentionOutput(out_BND, {})


# ---------------------------------------------------------------------------------------------
# The layer: injective residuals around attention and an orthogonal FFN
# ---------------------------------------------------------------------------------------------


class TransJectLayer(nn.Module):
    """X <- X + alpha Attn(X);  X <- X + alpha ELU(W2 Drop(ELU(W1 X + b1)) + b2);  alpha = tanh(r_l)/L_app.

    r_l is owned by the encoder (one scalar per layer application, `ctx.residual_gate`), starts at
    `cfg.transject.residual_init` (0: ReZero, the identity map at init), so |alpha| < 1/L_app and
    every application is a contraction-perturbed identity: injective. No LayerNorm. The FFN
    biases follow `cfg.transject.bias` (none only for `none`), initialised as nn.Linear's.
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_applications = cfg.num_layer_applications
        self.residual_stream = cfg.transject.residual_stream
        self.attention = TransJectAttention(cfg)
        bias = cfg.transject.bias != "none"
        self.ffn_in = make_orthogonal(
            Linear(d, d, bias=bias), "weight", cfg.orthogonal_map, cfg.cayley_leaf_inverse
        )
        self.ffn_out = make_orthogonal(
            Linear(d, d, bias=bias), "weight", cfg.orthogonal_map, cfg.cayley_leaf_inverse
        )
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def init_parameters(self) -> None:
        """FFN biases as nn.Linear's default (the encoder's init would zero them); runs after the
        children's init, so it has the last word."""
        with torch.no_grad():
            for linear in (self.ffn_in, self.ffn_out):
                if linear.bias is not None:
                    _linear_default_init_(linear.bias, linear.in_features)

    @staticmethod
    def residual_gate_init(cfg: EncoderConfig) -> float:
        """Initial r_l of every application (the encoder owns the scalars)."""
        return cfg.transject.residual_init

    def ffn(self, x_BND: Tensor) -> Tensor:
        """ELU(W2 Drop(ELU(W1 X))): 1-Lipschitz (in eval mode) since W1, W2 are orthogonal."""
        return F.elu(self.ffn_out(self.dropout(F.elu(self.ffn_in(x_BND)))))

    def forward(self, x_BND: Tensor, ctx: LayerContext) -> tuple[Tensor, AuxLosses]:
        alpha = residual_alpha(ctx, self.num_applications)
        attn = self.attention(x_BND, ctx)
        x_BND = x_BND + alpha * attn.hidden_BND
        x_BND = x_BND + alpha * self.ffn(x_BND)
        if self.residual_stream == "compute":  # rounded to autocast's dtype (none: unchanged)
            x_BND = x_BND.to(compute_dtype(x_BND))
        return x_BND, attn.aux_losses


# ---------------------------------------------------------------------------------------------
# What the family owns besides its modules: config checks, FLOPs, diagnostics
# ---------------------------------------------------------------------------------------------


def validate(cfg: EncoderConfig) -> None:
    """Settings TransJect ignores (a warning), and what its embeddings need."""
    ignored = [
        f"{name}={getattr(cfg, name)!r}"
        for name, default in (("residual", "post_ln"), ("position_embedding", "absolute"))
        if getattr(cfg, name) != default
    ]
    if ignored:
        warnings.warn(
            f"attention='transject' ignores {', '.join(ignored)}: TransJect layers use their "
            "injective residual and a concatenated sinusoidal position encoding",
            stacklevel=4,
        )
    if cfg.hidden_size % 2:
        raise ValueError("transject needs an even hidden_size (token ; position halves)")
    if cfg.transject.token_embedding == "orthogonal" and cfg.vocab_size > cfg.hidden_size // 2:
        raise ValueError(
            f"transject.token_embedding='orthogonal' needs vocab_size <= hidden_size/2 "
            f"({cfg.vocab_size} > {cfg.hidden_size // 2}); use 'auto' or 'plain'"
        )


def transject_layer_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """One `TransJectLayer` application: E experts X U_e Lambda V_e^T (two d x d products each),
    the gate g on the E pooled vectors, the mixture over experts, the orthogonal d x d FFN."""
    d, n, E = cfg.hidden_size, seq_len, cfg.transject.num_experts
    experts = E * 2 * matmul_flops(n, d, d)
    gate = matmul_flops(E, d, 1)
    mixture = matmul_flops(1, E, n * d)  # sum_e w_e A_e, a contraction over experts
    ffn = 2 * matmul_flops(n, d, d)
    return experts + gate + mixture + ffn


def transject_embedding_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """The concatenated embedding has no matmul; the eigen-state with ``eigenvalues="approx"``
    computes X U and the smaller Gram matrix, X X^T or X^T X (see `approximate_eigenvalues`)."""
    if cfg.transject.eigenvalues == "random":
        return 0
    d, n = cfg.hidden_size, seq_len
    gram = matmul_flops(n, d, n) if n < d else matmul_flops(d, n, d)
    return matmul_flops(n, d, d) + gram


@torch.no_grad()
def expert_weights(encoder: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """(L, B, E) mixture weights of every layer application, for an encoder of this family."""
    steps = encoder.trace(input_ids, attention_mask)
    layers = [layer for _, layer in encoder.layer_applications()]
    with orthogonal_cache():
        weights = [
            layer.attention.expert_weights(states, ctx)
            for layer, (states, ctx) in zip(layers, steps[:-1])
        ]
    return torch.stack(weights)


@torch.no_grad()
def transject_diagnostics(
    encoder: nn.Module, input_ids: Tensor, attention_mask: Tensor
) -> dict[str, float]:
    """``expert_weight/layer_LL/expert_E`` (batch means) and, from the eigen-state, the
    eigenbasis error and the unweighted reconstruction loss."""
    values: dict[str, float] = {}
    for layer, row in enumerate(expert_weights(encoder, input_ids, attention_mask).mean(1)):
        for e, w in enumerate(row.tolist()):
            values[f"expert_weight/layer_{layer:02d}/expert_{e}"] = w
    with orthogonal_cache():  # the state needs only the embeddings, not the layers
        x0_BND = encoder.embeddings(input_ids, None)
    values.update(encoder.family_state.diagnostics(x0_BND, key_mask(input_ids, attention_mask)))
    return values


def transject_residual_weights(gates_L: Tensor, cfg: EncoderConfig) -> Tensor:
    """alpha_l = tanh(r_l) / L_app (`residual_alpha`)."""
    return torch.tanh(gates_L) / cfg.num_layer_applications


FAMILY = AttentionFamily(
    name="transject",
    description=(
        "TransJect (arXiv 2310.14206): injective orthogonal mixture-of-experts attention over "
        "features, eigenvalue state, [token ; sinusoid] embeddings, no LayerNorm"
    ),
    layer=TransJectLayer,
    embeddings=TransJectEmbeddings,
    state=EigenState,
    validate=validate,
    layer_flops=transject_layer_flops,
    embedding_flops=transject_embedding_flops,
    token_embedding_width=lambda cfg: cfg.hidden_size // 2,
    diagnostics=transject_diagnostics,
    residual_weights=transject_residual_weights,
    hf_export=HFExport(code=family_code(__file__, "transject_hf.py")),
    options=TransJectConfig,
    # Compiled under `auto`: on an H100 the ALBERT-base recipe's compiled step is faster than
    # eager (docs/benchmarks.md#compiled-against-eager), every loss part, output and gradient
    # finite and within rounding of eager (tests/engine/test_compile_check.py).
    compile_auto=True,
)

__all__ = [
    "FAMILY",
    "LAMBDA_KEY",
    "RECONSTRUCTION_KEY",
    "EigenState",
    "ExpertBias",
    "PooledAt",
    "TransJectAttention",
    "TransJectConfig",
    "TransJectEmbeddings",
    "TransJectLayer",
    "approximate_eigenvalues",
    "eigenbasis_error",
    "expert_weights",
    "mix_experts",
    "pool_at",
    "residual_alpha",
    "sinusoidal_encoding",
    "transject_diagnostics",
    "transject_embedding_flops",
    "transject_layer_flops",
]
