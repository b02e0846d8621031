"""TransJect's eigen-state, computed once per forward from the embeddings X0 and shared by every
layer and expert (`model/attention/transject.py` is the family): the eigenvalues of
M = X0^T X0 approximated through a learned orthogonal basis U (or, Random-TransJect, a learned
diagonal), normalised by their largest magnitude, the reconstruction loss, and the bf16x3
products that keep them accurate on tensor cores (docs/methods.md, TransJect).

Shapes: B batch, N tokens, d hidden width (the module legend of transject.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from model.attention.base import AuxLosses, FamilyState
from model.config import EncoderConfig
from model.orthogonal import make_orthogonal

LAMBDA_KEY = "transject_lambda"
"""Key of the eigenvalues (B, d) or (1, d) in `LayerContext.extras`."""

RECONSTRUCTION_KEY = "transject_reconstruction"
"""Name of the weighted eigen-reconstruction auxiliary loss."""

_EPS = 1e-12  # floor of the eigenvalue scale s (an all-padding sample has M = 0)


def _normalise(lam_raw_Bd: Tensor) -> tuple[Tensor, Tensor]:
    """lambda / s with s = max|lambda| per row (floored): the largest |eigenvalue| becomes 1."""
    s_B1 = lam_raw_Bd.abs().amax(dim=-1, keepdim=True).clamp_min(_EPS)
    return lam_raw_Bd / s_B1, s_B1


def _real_tokens(x0_BND: Tensor, mask_BN: Tensor) -> Tensor:
    """X0 in fp32 with the padding rows zeroed: M = X^T X then sums over the real tokens only."""
    return x0_BND.float() * mask_BN.unsqueeze(-1).float()


def _bf16_halves(a: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 a as hi + lo, both bf16: hi = a rounded to bf16, lo = the rest rounded to bf16
    (together about 16 significant bits of a's 24)."""
    hi = a.to(torch.bfloat16)
    return hi, (a - hi.float()).to(torch.bfloat16)


def _bf16_product(a: Tensor, b: Tensor) -> Tensor:
    """a @ b of bf16 operands with fp32 accumulation and an fp32 result: on CUDA one tensor-core
    product (``out_dtype``); elsewhere the fp32 product of the upcast operands, the same values
    up to the order of the sums (products of bf16 numbers are exact in fp32)."""
    if a.is_cuda:
        product = torch.bmm if a.dim() == 3 else torch.mm
        return product(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _bf16x3(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> Tensor:
    """fp32 a @ b (2-D, or 3-D batched alike) from the bf16 halves of a and b (`_bf16_halves`)
    by three bf16 products with fp32 accumulation: hi_a hi_b + (hi_a lo_b + lo_a hi_b);
    lo_a lo_b, about 2^-16 of the rest, is left out."""
    (a_hi, a_lo), (b_hi, b_lo) = a, b
    return _bf16_product(a_hi, b_hi) + (_bf16_product(a_hi, b_lo) + _bf16_product(a_lo, b_hi))


def _transposed(halves: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    return halves[0].mT, halves[1].mT


class Bf16x3Product(torch.autograd.Function):
    """a @ b for fp32 a and b (both 2-D, or both 3-D with the same batch) by `_bf16x3`, forward
    and backward (grad_a = grad @ b^T and grad_b = a^T @ grad, each by `_bf16x3` too), so the
    gradient is as accurate as the value (`TransJectConfig.eigen_products`)."""

    @staticmethod
    def forward(a: Tensor, b: Tensor) -> Tensor:
        return _bf16x3(_bf16_halves(a), _bf16_halves(b))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        a, b = ctx.saved_tensors
        g = _bf16_halves(grad)  # once for both gradients
        grad_a = _bf16x3(g, _transposed(_bf16_halves(b))) if ctx.needs_input_grad[0] else None
        grad_b = _bf16x3(_transposed(_bf16_halves(a)), g) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


EIGEN_PRODUCTS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "fp32": torch.matmul,
    "bf16x3": Bf16x3Product.apply,
}
"""The eigen-state's matrix product per `TransJectConfig.eigen_products`."""


def _gram_energy(x_BND: Tensor, product: Callable = torch.matmul) -> Tensor:
    """(B,) ||M||_F^2 for M = X^T X, through whichever Gram matrix is smaller: X^T X (d x d)
    or X X^T (N x N), whose Frobenius norms are equal. `product`: `EIGEN_PRODUCTS`'."""
    tokens, width = x_BND.shape[-2:]
    G = product(x_BND, x_BND.mT) if tokens < width else product(x_BND.mT, x_BND)
    return (G * G).sum(dim=(-2, -1))


def _basis_diagonal(x_BND: Tensor, U: Tensor, product: Callable = torch.matmul) -> Tensor:
    """(B, d) diag(U^T M U)_k = u_k^T X^T X u_k = sum_n (x_n . u_k)^2: one product X U, not M."""
    B, N, d = x_BND.shape
    xu_BND = product(x_BND.reshape(B * N, d), U).view(B, N, -1)
    return (xu_BND * xu_BND).sum(dim=-2)


def _eigen_terms(
    x0_BND: Tensor, mask_BN: Tensor, U_dd: Tensor, products: str = "fp32"
) -> tuple[Tensor, Tensor]:
    """(lam_raw_Bd, energy_B): diag(U^T M U) and ||M||_F^2 for M = X0^T X0 over the real
    tokens, fp32 with autocast off (its two products in fp32 or by `Bf16x3Product`:
    `TransJectConfig.eigen_products`); everything the eigen-state needs
    (`approximate_eigenvalues`)."""
    product = EIGEN_PRODUCTS[products]
    with torch.autocast(device_type=x0_BND.device.type, enabled=False):
        x_BND = _real_tokens(x0_BND, mask_BN)
        return _basis_diagonal(x_BND, U_dd.float(), product), _gram_energy(x_BND, product)


def _lambda_and_reconstruction(
    lam_raw_Bd: Tensor, energy_B: Tensor, reconstruction: str
) -> tuple[Tensor, Tensor]:
    """(lam_Bd, recon_B) from the two terms (`approximate_eigenvalues`); elementwise only."""
    d = lam_raw_Bd.size(-1)
    lam_Bd, s_B1 = _normalise(lam_raw_Bd)
    if reconstruction == "authors":
        squared_B = energy_B - 2 * (lam_Bd * lam_raw_Bd).sum(-1) + (lam_Bd * lam_Bd).sum(-1)
    else:
        squared_B = (energy_B - (lam_raw_Bd * lam_raw_Bd).sum(-1)) / s_B1.squeeze(-1) ** 2
    return lam_Bd, squared_B.clamp_min(0.0) / (d * d)


def _eigenbasis_error(lam_raw_Bd: Tensor, energy_B: Tensor) -> Tensor:
    """(B,) (||M||_F^2 - |lam_raw|^2) / ||M||_F^2 from the two terms (`eigenbasis_error`)."""
    total_B = energy_B.clamp_min(_EPS)
    return ((total_B - (lam_raw_Bd * lam_raw_Bd).sum(-1)) / total_B).clamp_min(0.0)


def approximate_eigenvalues(
    x0_BND: Tensor,
    mask_BN: Tensor,
    U_dd: Tensor,
    reconstruction: str = "scale_free",
    products: str = "fp32",
) -> tuple[Tensor, Tensor]:
    """Approximate eigenvalues of M = X0^T X0 in the basis U, normalised; and the reconstruction loss.

    Returns (lam_Bd, recon_B):
        M_Bdd    = X0^T X0 over the real tokens of each sample
        lam_raw  = diag(U^T M U)             (a real matrix product: docs/methods.md)
        lam      = lam_raw / s,              s = max_k |lam_raw_k|
        recon    = mean_{ij} ( M/s - U diag(lam) U^T )^2_{ij}    reconstruction="scale_free"
                   mean_{ij} ( M - U diag(lam) U^T )^2_{ij}      reconstruction="authors"
    Everything in fp32 with autocast off; `products` (`TransJectConfig.eigen_products`): the two
    matrix products in fp32, or each from three bf16 products with fp32 accumulation.

    Computed without forming U^T M U or U diag(lam) U^T (d x d per sample): U is orthogonal, so
    ||M - U D U^T||_F^2 = ||M||_F^2 - 2 sum_k D_k lam_raw_k + sum_k D_k^2 for a diagonal D, and
    lam_raw_k = sum_n (x_n . u_k)^2. Hence
        scale_free: recon = (||M||_F^2 - |lam_raw|^2) / (s^2 d^2)
        authors:    recon = (||M||_F^2 - 2 lam . lam_raw + |lam|^2) / d^2
    the same values and (on the orthogonal U the parametrisation keeps) the same gradients to
    fp32 rounding: one product X U and one Gram matrix instead of three d x d products per
    sample (docs/methods.md, "Computation"). The difference of the first two terms loses about
    1e-7 of ||M||_F^2 to rounding, so the loss is floored at 0 where U diagonalises M exactly.
    """
    terms = _eigen_terms(x0_BND, mask_BN, U_dd, products)
    return _lambda_and_reconstruction(*terms, reconstruction)


@torch.no_grad()
def eigenbasis_error(x0_BND: Tensor, mask_BN: Tensor, U_dd: Tensor) -> Tensor:
    """(B,) how far U is from an eigenbasis of M: ||offdiag(U^T M U)||_F^2 / ||M||_F^2.

    Equals ||M - U diag(lam_raw) U^T||_F^2 / ||M||_F^2 (U orthogonal): 0 when U diagonalises M,
    about 1 - 1/d for a random U. Scale-free, so it is comparable across runs and lengths; the
    diagnostic logged to show that the eigenbasis trains. Computed as
    (||M||_F^2 - |diag(U^T M U)|^2) / ||M||_F^2 (`approximate_eigenvalues`).
    """
    return _eigenbasis_error(*_eigen_terms(x0_BND, mask_BN, U_dd))


class EigenState(FamilyState):
    """Lambda (shared by all layers and experts), computed once per forward from X0.

    `cfg.transject.eigenvalues`:
    * `approx`: approximate eigenvalues of M = X0^T X0 with a learnable orthogonal basis U
      (`approximate_eigenvalues`), plus the weighted auxiliary loss `transject_reconstruction`.
    * `random` (Random-TransJect): a learned diagonal of size d, normalised the same way (largest
      |lambda| = 1), no loss. **Decision** (docs/methods.md): learned, not resampled every forward as
      in the authors' code. Initialised U(0, 1) as the code samples it.

    Returns extras {"transject_lambda": (B, d) for approx, (1, d) for random}, fp32.
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.hidden_size
        self.mode = cfg.transject.eigenvalues
        self.reconstruction_weight = cfg.transject.reconstruction_weight
        self.reconstruction = cfg.transject.reconstruction
        self.products = cfg.transject.eigen_products
        if self.mode == "approx":
            self.eigenbasis = nn.Parameter(torch.empty(d, d))
            make_orthogonal(self, "eigenbasis", cfg.orthogonal_map, cfg.cayley_leaf_inverse)
        else:
            self.eigenvalues = nn.Parameter(torch.rand(d))

    def forward(self, x0_BND: Tensor, mask_BN: Tensor) -> tuple[dict[str, Any], AuxLosses]:
        if self.mode == "random":
            lam_1d, _ = _normalise(self.eigenvalues.float()[None, :])
            return {LAMBDA_KEY: lam_1d}, {}
        lam_Bd, recon_B = approximate_eigenvalues(
            x0_BND, mask_BN, self.eigenbasis, self.reconstruction, self.products
        )
        return {LAMBDA_KEY: lam_Bd}, {
            RECONSTRUCTION_KEY: self.reconstruction_weight * recon_B.mean()
        }

    @torch.no_grad()
    def diagnostics(self, x0_BND: Tensor, mask_BN: Tensor) -> dict[str, float]:
        """Scalars for TensorBoard: the eigenbasis error (mean over the batch) and the
        unweighted reconstruction loss; empty for Random-TransJect."""
        if self.mode == "random":
            return {}
        terms = _eigen_terms(x0_BND, mask_BN, self.eigenbasis)  # once for both scalars
        _, recon_B = _lambda_and_reconstruction(*terms, self.reconstruction)
        error_B = _eigenbasis_error(*terms)
        return {
            "transject/eigenbasis_error": float(error_B.mean()),
            "transject/reconstruction_loss": float(recon_B.mean()),
        }
