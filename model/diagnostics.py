"""Diagnostics from the three methods' papers, as functions on a model and a batch.

Legend: B batch, N tokens, d hidden width, L layer applications, E experts, H heads.

* `activation_factors`: TransJect's activation factor of layer l, here defined (the paper's exact
  formula was not recovered; docs/methods.md, Diagnostics) as max over token pairs (i, j) of one
  sample of ||h_l(i) - h_l(j)|| / ||h_0(i) - h_0(j)||; returned per layer and per sample (L, B).
* `differential_entropy`: per-layer differential entropy of the real-token hidden states under a
  Gaussian estimator, H = 1/2 logdet(2 pi e Sigma) with Sigma the sample covariance (+ a small
  ridge); a maximum-entropy upper bound for the given covariance. In nats.
* `residual_weights`: the residual scalars per application, as the family reads its gates
  (TransJect alpha_l = tanh(r_l)/L, ReZero alpha_l).
* `family_diagnostics` / `family_figures`: whatever the attention family reports through its
  `AttentionFamily.diagnostics` / `figures` hooks (TransJect: expert weights, the eigenbasis
  error; TISA: its f(k) curves). Family-specific functions live in the family's file
  (`model.attention.transject.expert_weights`, `model.attention.tisa.tisa_curves`).
* `orthogonality_errors`: max |W^T W - I| of every orthogonally parameterised weight.
* `toeplitzness`: share of the variance of P = E_P E_P^T explained by its projection onto
  Toeplitz matrices (averages along each diagonal); the project's definition (docs/methods.md,
  Diagnostics).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from model.attention import ATTENTION_REGISTRY
from model.attention.base import key_mask
from model.encoder import Encoder
from model.orthogonal import orthogonal_modules, orthogonality_error


def _encoder(model: nn.Module) -> Encoder:
    enc = model if isinstance(model, Encoder) else getattr(model, "encoder", None)
    if not isinstance(enc, Encoder):
        raise ValueError(
            f"expected an Encoder or a model with .encoder, got {type(model).__name__}"
        )
    return enc


@torch.no_grad()
def activation_factors(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None
) -> Tensor:
    """(L, B): per layer application l and sample b, max_{i != j} ||h_l(i)-h_l(j)|| / ||h_0(i)-h_0(j)||."""
    steps = _encoder(model).trace(input_ids, attention_mask)
    mask_BN = steps[0][1].mask_BN
    h0 = steps[0][0].double()
    d0_BNN = torch.cdist(h0, h0)
    pair_BNN = mask_BN[:, :, None] & mask_BN[:, None, :]
    pair_BNN &= ~torch.eye(mask_BN.size(1), dtype=torch.bool, device=mask_BN.device)
    pair_BNN &= d0_BNN > 0
    factors = []
    for states, _ in steps[1:]:
        h = states.double()
        ratio_BNN = torch.cdist(h, h) / d0_BNN.clamp_min(1e-30)
        factors.append(ratio_BNN.masked_fill(~pair_BNN, float("-inf")).flatten(1).amax(1))
    return torch.stack(factors).float()


@torch.no_grad()
def differential_entropy(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None, ridge: float = 1e-6
) -> Tensor:
    """(L + 1,): Gaussian differential entropy (nats) of the real-token hidden states, h_0 .. h_L."""
    steps = _encoder(model).trace(input_ids, attention_mask)
    mask_BN = steps[0][1].mask_BN
    return torch.stack([gaussian_entropy(states[mask_BN], ridge) for states, _ in steps]).float()


def gaussian_entropy(x_TD: Tensor, ridge: float = 1e-6) -> Tensor:
    """Differential entropy (nats) of a Gaussian fitted to the rows of x: 1/2 logdet(2 pi e Sigma)."""
    x = x_TD.double()
    x = x - x.mean(0, keepdim=True)
    cov = x.T @ x / max(x.shape[0] - 1, 1)
    cov = cov + ridge * torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device)
    return 0.5 * (torch.logdet(cov) + cov.shape[0] * math.log(2 * math.pi * math.e))


@torch.no_grad()
def residual_weights(model: nn.Module) -> Tensor | None:
    """(L,) residual weight per application (the family's reading of its gates: tanh(r)/L for
    TransJect, alpha for ReZero); None without residual gates."""
    enc = _encoder(model)
    if enc.residual_gates is None:
        return None
    gates = enc.residual_gates.detach().float()
    read = ATTENTION_REGISTRY.get(enc.config.attention).residual_weights
    return gates if read is None else read(gates, enc.config)


@torch.no_grad()
def family_diagnostics(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None
) -> dict[str, float]:
    """{tag: value} from the attention family's ``diagnostics`` hook ({} without one)."""
    enc = _encoder(model)
    hook = ATTENTION_REGISTRY.get(enc.config.attention).diagnostics
    if hook is None:
        return {}
    return hook(enc, input_ids, key_mask(input_ids, attention_mask))


def family_figures(model: nn.Module) -> dict[str, Any]:
    """{tag: matplotlib figure} from the attention family's ``figures`` hook ({} without one)."""
    enc = _encoder(model)
    hook = ATTENTION_REGISTRY.get(enc.config.attention).figures
    return {} if hook is None else hook(enc)


def orthogonality_errors(model: nn.Module) -> dict[str, float]:
    """{qualified tensor name: max |W^T W - I|} for every fp32-orthogonal parametrized tensor."""
    with torch.no_grad():
        return {
            f"{qual}.{name}" if qual else name: orthogonality_error(getattr(mod, name))
            for qual, mod, name in orthogonal_modules(model)
        }


def toeplitz_projection(P_NN: Tensor) -> Tensor:
    """Projects a square matrix onto Toeplitz matrices: each diagonal replaced by its mean."""
    N = P_NN.shape[0]
    offsets_NN = torch.arange(N)[None, :] - torch.arange(N)[:, None] + N - 1  # j - i + N - 1
    sums = torch.zeros(2 * N - 1, dtype=P_NN.dtype).index_add_(
        0, offsets_NN.flatten(), P_NN.flatten()
    )
    counts = torch.bincount(offsets_NN.flatten(), minlength=2 * N - 1).to(P_NN.dtype)
    return (sums / counts)[offsets_NN]


@torch.no_grad()
def toeplitzness(position_embeddings_NE: Tensor) -> float:
    """Share of the variance of P = E_P E_P^T explained by its Toeplitz projection, in [0, 1]."""
    E = position_embeddings_NE.detach().double().cpu()
    P = E @ E.T
    T = toeplitz_projection(P)
    total = ((P - P.mean()) ** 2).sum()
    residual = ((P - T) ** 2).sum()
    return float(1.0 - residual / total) if total > 0 else 1.0


def scalars(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Every diagnostic of ``model`` on the batch ``ids`` / ``mask`` as TensorBoard scalars
    (``diagnostics/...``): activation factors, entropy and residual weights per layer, the
    family's own, the largest orthogonality error."""
    values: dict[str, float] = {}
    factors = activation_factors(model, ids, mask)  # (L, B)
    for layer, f in enumerate(factors.mean(1).tolist()):
        values[f"diagnostics/activation_factor/layer_{layer:02d}"] = f
    entropy = differential_entropy(model, ids, mask)  # (L + 1,): h_0 .. h_L
    for layer, h in enumerate(entropy[1:].tolist()):
        values[f"diagnostics/entropy/layer_{layer:02d}"] = h
    residual = residual_weights(model)
    if residual is not None:
        for layer, r in enumerate(residual.tolist()):
            values[f"diagnostics/residual/layer_{layer:02d}"] = r
    for name, value in family_diagnostics(model, ids, mask).items():
        values[f"diagnostics/{name}"] = value
    errors = orthogonality_errors(model)
    if errors:
        values["diagnostics/orthogonality_error_max"] = max(errors.values())
    return values
