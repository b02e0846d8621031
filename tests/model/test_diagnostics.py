"""model.diagnostics: each function checked against a case whose answer is known."""

from __future__ import annotations

import math

import pytest
import torch

from model import EncoderConfig, EncoderForPretraining
from model import diagnostics as diag
from model.attention.tisa import tisa_curves
from model.attention.transject import expert_weights


def make(attention="softmax", **kw):
    torch.manual_seed(0)
    cfg = EncoderConfig.preset("debug", attention=attention, num_hidden_layers=3, **kw)
    return EncoderForPretraining(cfg).eval()


def batch():
    ids = torch.randint(4, 512, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False
    return ids, mask


def test_activation_factor_is_one_for_an_identity_stack():
    """TransJect with residual weights 0 is the identity after the embedding: every ratio is 1."""
    model = make("transject", transject={"num_experts": 2})
    ids, mask = batch()
    factors = diag.activation_factors(model, ids, mask)
    assert factors.shape == (3, 2)
    torch.testing.assert_close(factors, torch.ones(3, 2), atol=1e-6, rtol=0)
    torch.nn.init.constant_(model.encoder.residual_gates, 3.0)
    assert not torch.allclose(diag.activation_factors(model, ids, mask), torch.ones(3, 2))


def test_activation_factor_ignores_padding():
    model = make()
    ids, mask = batch()
    a = diag.activation_factors(model, ids, mask)[:, 1]
    b = diag.activation_factors(model, ids[1:, :5], mask[1:, :5])[:, 0]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_gaussian_entropy_matches_closed_form():
    sigma = torch.tensor([0.5, 1.0, 2.0, 3.0])
    x = torch.randn(200_000, 4, generator=torch.Generator().manual_seed(0)) * sigma
    expected = 0.5 * sum(math.log(2 * math.pi * math.e * s**2) for s in sigma.tolist())
    assert abs(diag.gaussian_entropy(x).item() - expected) < 0.02


def test_differential_entropy_per_layer():
    model = make()
    ids, mask = batch()
    ent = diag.differential_entropy(model, ids, mask)
    assert ent.shape == (4,) and torch.isfinite(ent).all()


def test_expert_and_residual_weights():
    model = make("transject", transject={"num_experts": 3})
    torch.nn.init.constant_(model.encoder.residual_gates, 0.5)
    ids, mask = batch()
    w = expert_weights(model.encoder, ids, mask)
    assert w.shape == (3, 2, 3)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 2))
    torch.testing.assert_close(diag.residual_weights(model), torch.full((3,), math.tanh(0.5) / 3))
    assert diag.residual_weights(make()) is None
    # The family's diagnostics hook reports the same weights (batch means) and its eigen-state.
    values = diag.family_diagnostics(model, ids, mask)
    assert values["expert_weight/layer_02/expert_1"] == pytest.approx(float(w[2, :, 1].mean()))
    assert "transject/eigenbasis_error" in values
    assert diag.family_diagnostics(make(), ids, mask) == {}  # softmax reports nothing of its own


def test_tisa_curves_follow_the_formula():
    model = make("tisa", tisa={"scope": "per_layer"})
    offsets, curves = tisa_curves(model.encoder, max_offset=10)
    assert offsets.shape == (21,) and curves.shape == (3, 4, 21)
    scorer = model.encoder.family_state.scorers[1]
    a, b, c = scorer.a.detach(), scorer.b.detach(), scorer.c.detach()  # (S, H)
    k = offsets[None, None, :]
    expected = (a[..., None] * torch.exp(-b.abs()[..., None] * (k - c[..., None]) ** 2)).sum(0)
    torch.testing.assert_close(curves[1], expected, atol=1e-6, rtol=1e-5)


def test_orthogonality_errors_cover_every_orthogonal_weight():
    model = make(orthogonal=True)
    errors = diag.orthogonality_errors(model)
    assert "encoder.groups.0.0.attention.query.weight" in errors
    assert max(errors.values()) < 1e-5
    assert diag.orthogonality_errors(make()) == {}


def test_toeplitzness():
    n = torch.arange(64, dtype=torch.float64)[:, None]
    freqs = 1.0 / 100 ** (torch.arange(8, dtype=torch.float64) / 8)
    sinusoidal = torch.cat([torch.sin(n * freqs), torch.cos(n * freqs)], 1)  # Gram is Toeplitz
    assert diag.toeplitzness(sinusoidal) == pytest.approx(1.0, abs=1e-9)
    random = torch.randn(64, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert diag.toeplitzness(random) < 0.5
    P = torch.randn(5, 5, dtype=torch.float64)
    T = diag.toeplitz_projection(P)
    torch.testing.assert_close(diag.toeplitz_projection(T), T)
    assert T[0, 1] == pytest.approx(P.diagonal(1).mean().item())
