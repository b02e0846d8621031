"""Diagnostics from the seed papers, as functions on a model and a batch.

Legend: B batch, N tokens, d hidden width, L layer applications, E experts, H heads.

* `activation_factors`: TransJect's activation factor of layer l, here defined (the paper's exact
  formula was not recovered; METHODS.md 3) as max over token pairs (i, j) of one sample of
  ||h_l(i) - h_l(j)|| / ||h_0(i) - h_0(j)||; returned per layer and per sample (L, B).
* `differential_entropy`: per-layer differential entropy of the real-token hidden states under a
  Gaussian estimator, H = 1/2 logdet(2 pi e Sigma) with Sigma the sample covariance (+ a small
  ridge); a maximum-entropy upper bound for the given covariance. In nats.
* `expert_weights`: TransJect's per-sample mixture weights (L, B, E).
* `residual_weights`: the residual scalars per application (TransJect alpha_l = tanh(r_l)/L,
  ReZero alpha_l).
* `tisa_curves`: TISA's f(k) per scorer and head on an offset axis.
* `family_state_diagnostics`: whatever scalars the family's once-per-forward state reports
  through its optional `diagnostics(x0, mask)` method (TransJect: the eigenbasis error).
* `orthogonality_errors`: max |W^T W - I| of every orthogonally parameterised weight.
* `toeplitzness`: share of the variance of P = E_P E_P^T explained by its projection onto
  Toeplitz matrices (averages along each diagonal); the project's definition (METHODS.md 2).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from model.encoder import Encoder, key_mask
from model.orthogonal import orthogonal_cache, orthogonal_modules, orthogonality_error


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
def expert_weights(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None
) -> Tensor:
    """(L, B, E) TransJect mixture weights per layer application; ValueError for other families."""
    enc = _encoder(model)
    if enc.config.attention != "transject":
        raise ValueError(f"expert weights exist for transject only, not {enc.config.attention!r}")
    steps = enc.trace(input_ids, attention_mask)
    layers = [layer for _, layer in enc.layer_applications()]
    with orthogonal_cache():
        weights = [
            layer.attention.expert_weights(states, ctx)
            for layer, (states, ctx) in zip(layers, steps[:-1])
        ]
    return torch.stack(weights)


@torch.no_grad()
def residual_weights(model: nn.Module) -> Tensor | None:
    """(L,) residual scalar per application: tanh(r)/L for TransJect, alpha for ReZero; else None."""
    enc = _encoder(model)
    if enc.residual_gates is None:
        return None
    gates = enc.residual_gates.detach().float()
    if enc.config.attention == "transject":
        return torch.tanh(gates) / enc.config.num_layer_applications
    return gates


@torch.no_grad()
def family_state_diagnostics(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None
) -> dict[str, float]:
    """{name: value} from the family state's `diagnostics(x0_BND, mask_BN)` hook, if it has one."""
    enc = _encoder(model)
    hook = getattr(enc.family_state, "diagnostics", None)
    if hook is None:
        return {}
    with orthogonal_cache():  # the state needs only the embeddings, not the layers
        x0_BND = enc.embeddings(input_ids, None)
    return hook(x0_BND, key_mask(input_ids, attention_mask))


@torch.no_grad()
def tisa_curves(model: nn.Module, max_offset: int = 64) -> tuple[Tensor, Tensor]:
    """(offsets (K,), f values (num_scorers, H, K)) with k = j - i from -max_offset to max_offset."""
    enc = _encoder(model)
    if enc.config.attention != "tisa":
        raise ValueError(f"TISA curves exist for tisa only, not {enc.config.attention!r}")
    offsets = torch.arange(-max_offset, max_offset + 1, dtype=torch.float32)
    curves = torch.stack([scorer.score(offsets) for scorer in enc.family_state.scorers])
    return offsets, curves.float()


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
