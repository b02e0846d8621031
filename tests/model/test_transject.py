"""Tests of the TransJect family (model/attention/transject.py; docs/methods.md, TransJect).

Tiny widths throughout: the debug preset (d = 32, vocab 512 > d/2, so `auto` picks a plain token
embedding) and a tiny vocabulary (vocab 16, d 64) that fits an orthogonal token embedding.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model.attention import ATTENTION_REGISTRY
from model.attention.base import LayerContext
from model.attention.transject import (
    LAMBDA_KEY,
    RECONSTRUCTION_KEY,
    EigenState,
    PooledAt,
    TransJectAttention,
    TransJectEmbeddings,
    TransJectLayer,
    approximate_eigenvalues,
    eigenbasis_error,
    sinusoidal_encoding,
)
from model.config import EncoderConfig
from model.encoder import Encoder
from model.heads import EncoderForPretraining, EncoderForSequenceClassification
from model.orthogonal import (
    evaluate_orthogonal_maps,
    orthogonal_cache,
    orthogonal_modules,
    orthogonality_error,
)


def debug_cfg(**overrides) -> EncoderConfig:
    """Debug preset (d = 32, vocab 512: plain token embedding under `auto`)."""
    return EncoderConfig.preset("debug", attention="transject", **overrides)


def tiny_vocab_cfg(hidden_size: int = 64, **overrides) -> EncoderConfig:
    """vocab 16 <= d/2: `auto` picks the orthogonal token embedding."""
    return debug_cfg(vocab_size=16, hidden_size=hidden_size, **overrides)


def set_gates(encoder: Encoder, values) -> None:
    """Sets the encoder's residual scalars r_l (alpha_l = tanh(r_l) / L)."""
    with torch.no_grad():
        encoder.residual_gates.copy_(torch.as_tensor(values, dtype=encoder.residual_gates.dtype))


def alphas(encoder: Encoder) -> torch.Tensor:
    return (
        torch.tanh(encoder.residual_gates.detach().double()) / encoder.config.num_layer_applications
    )


def random_batch(cfg: EncoderConfig, B: int = 2, N: int = 9, lengths=None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, (B, N), generator=g)
    mask = torch.ones(B, N, dtype=torch.bool)
    for b, length in enumerate(lengths or []):
        mask[b, length:] = False
    return ids, mask


def pretraining_loss(model: EncoderForPretraining, ids, mask) -> torch.Tensor:
    out = model(ids, mask)
    mlm = F.cross_entropy(out.logits.float().flatten(0, 1), ids.flatten(), reduction="none")
    mlm = (mlm * mask.flatten().float()).sum() / mask.sum()
    sop = F.cross_entropy(out.sop_logits.float(), torch.zeros(ids.shape[0], dtype=torch.long))
    return mlm + sop + sum(v.float() for v in out.aux_losses.values())


def pair_distances(h_BND: torch.Tensor, mask_BN: torch.Tensor) -> list[torch.Tensor]:
    """Per sample: the distances ||h(i) - h(j)|| over pairs i < j of real tokens, in fp64."""
    out = []
    for h, m in zip(h_BND.double(), mask_BN):
        d = torch.cdist(h[m], h[m])
        iu = torch.triu_indices(d.shape[0], d.shape[0], offset=1)
        out.append(d[iu[0], iu[1]])
    return out


# --------------------------------------------------------------------------------------------
# Structure and embeddings
# --------------------------------------------------------------------------------------------


def test_family_structure_and_no_layernorm():
    family = ATTENTION_REGISTRY.get("transject")
    assert family.layer is TransJectLayer
    assert family.embeddings is TransJectEmbeddings
    assert family.state is EigenState
    encoder = Encoder(debug_cfg(num_hidden_layers=3))
    assert isinstance(encoder.embeddings, TransJectEmbeddings)
    assert isinstance(encoder.groups[0][0], TransJectLayer)
    assert isinstance(encoder.family_state, EigenState)
    assert encoder.residual_gates.shape == (3,)
    assert torch.all(encoder.residual_gates == 0)  # ReZero start: alpha = 0
    assert not any(isinstance(m, nn.LayerNorm) for m in encoder.modules())

    def biases(bias: str) -> set[str]:
        enc = Encoder(debug_cfg(transject={"bias": bias}))
        names = [n for n, _ in enc.named_parameters() if "bias" in n]
        return {n if n.startswith("pooler") else n.split(".", 3)[-1] for n in names}

    # The authors' biases that keep the Lipschitz bound (U's and the FFN's) by default; V's only
    # with bias=authors; none with bias=none (only the classifier pooler's).
    lipschitz = {"pooler.bias", "attention.expert_u_bias.bias", "ffn_in.bias", "ffn_out.bias"}
    assert biases("lipschitz") == lipschitz
    assert biases("authors") == lipschitz | {"attention.expert_v_bias.bias"}
    assert biases("none") == {"pooler.bias"}
    # nn.Linear's default init U(+-1/sqrt(d)), not the encoder's zeros.
    layer = encoder.groups[0][0]
    for b in (layer.ffn_in.bias, layer.attention.expert_u_bias.bias):
        assert 0.3 / math.sqrt(32) < b.abs().max() <= 1 / math.sqrt(32)


def test_layer_needs_residual_gate():
    cfg = debug_cfg()
    layer = TransJectLayer(cfg)
    x = torch.randn(1, 3, cfg.hidden_size)
    ctx = LayerContext(
        mask_BN=torch.ones(1, 3, dtype=torch.bool), extras={LAMBDA_KEY: torch.ones(1, 32)}
    )
    with pytest.raises(ValueError, match="residual_gate"):
        layer(x, ctx)


def test_token_embedding_mode_selection():
    assert not Encoder(debug_cfg()).embeddings.orthogonal  # vocab 512 > 16: auto -> plain
    assert Encoder(tiny_vocab_cfg()).embeddings.orthogonal  # vocab 16 <= 32: auto -> orthogonal
    assert not Encoder(tiny_vocab_cfg(transject={"token_embedding": "plain"})).embeddings.orthogonal
    with pytest.raises(ValueError, match="vocab_size"):
        debug_cfg(transject={"token_embedding": "orthogonal"})


def test_plain_embedding_init_scale():
    # The encoder's generic N(0, 0.02) init is replaced by N(0, 1/P) (rows of norm ~1).
    torch.manual_seed(0)
    emb = Encoder(debug_cfg()).embeddings
    std = emb.token_embedding_weight.std().item()
    assert abs(std - 1 / math.sqrt(16)) < 0.02, std


def test_embedding_layout_any_length_and_token_types_ignored():
    cfg = tiny_vocab_cfg(max_position_embeddings=128)
    emb = Encoder(cfg).embeddings.eval()
    P = cfg.hidden_size // 2
    N = 300  # longer than max_position_embeddings: the sinusoid has no maximum length
    ids = torch.randint(0, cfg.vocab_size, (2, N))
    x = emb(ids)
    assert x.shape == (2, N, cfg.hidden_size)
    E = emb.token_embedding_weight
    torch.testing.assert_close(x[..., :P], math.sqrt(P) * E[ids])
    pos = torch.arange(N, dtype=torch.float32)
    torch.testing.assert_close(x[0, :, P], torch.sin(pos))  # PE(i, 0) = sin(i)
    torch.testing.assert_close(x[1, :, P + 1], torch.cos(pos))  # PE(i, 1) = cos(i)
    k = 3  # PE(i, 2k) = sin(i / 10000^(2k/P))
    torch.testing.assert_close(x[0, :, P + 2 * k], torch.sin(pos / 10000 ** (2 * k / P)))
    assert sinusoidal_encoding(5, 7).shape == (5, 7)  # odd widths work too
    types = torch.randint(0, 2, ids.shape)
    torch.testing.assert_close(emb(ids, types), x)


def test_embedding_is_injective():
    cfg = tiny_vocab_cfg()
    emb = Encoder(cfg).embeddings.eval()
    N = 40
    ids = torch.arange(cfg.vocab_size)[:, None].expand(-1, N)  # every (token, position) pair
    x = emb(ids).reshape(-1, cfg.hidden_size).double()
    d = torch.cdist(x, x) + torch.eye(x.shape[0], dtype=x.dtype) * 1e9
    assert d.min() > 0.1


def test_pretraining_head_ties_to_token_embedding():
    cfg = tiny_vocab_cfg()
    model = EncoderForPretraining(cfg)
    ids, mask = random_batch(cfg, N=6)
    out = model(ids, mask)
    assert out.logits.shape == (2, 6, cfg.vocab_size)
    assert model.encoder.embeddings.token_embedding_weight.shape == (16, 32)


# --------------------------------------------------------------------------------------------
# 1. Orthogonality in fp32 and after bf16 training
# --------------------------------------------------------------------------------------------

EXPECTED_ORTHOGONAL = {
    "encoder.embeddings.word_embeddings.weight",
    "encoder.family_state.eigenbasis",
    "encoder.groups.0.0.attention.expert_u",
    "encoder.groups.0.0.attention.expert_v",
    "encoder.groups.0.0.ffn_in.weight",
    "encoder.groups.0.0.ffn_out.weight",
}


def orthogonality_errors(model: nn.Module) -> dict[str, float]:
    with torch.no_grad():
        return {
            f"{qual}.{name}": orthogonality_error(getattr(mod, name))
            for qual, mod, name in orthogonal_modules(model)
        }


@pytest.mark.parametrize("orthogonal_map", ["matrix_exp", "cayley", "householder"])
def test_orthogonality_fp32(orthogonal_map):
    # d = 32: fp32 matrix_exp of unit-variance skew matrices drifts by ~1e-5 at d = 64 and
    # ~7e-5 at d = 768 (the error grows with the norm of the skew matrix), cayley and
    # householder stay below 5e-6.
    model = EncoderForPretraining(tiny_vocab_cfg(hidden_size=32, orthogonal_map=orthogonal_map))
    errors = orthogonality_errors(model)
    assert set(errors) == EXPECTED_ORTHOGONAL
    assert max(errors.values()) <= 1e-5, errors
    # The (E, d, d) expert stacks are orthogonal matrix by matrix; the (16, 16) embedding too.
    assert model.encoder.groups[0][0].attention.expert_u.shape == (4, 32, 32)
    assert model.encoder.embeddings.token_embedding_weight.shape == (16, 16)


@pytest.mark.parametrize("mode", ["bf16_weights", "autocast"])
def test_orthogonality_after_bf16_training(mode):
    torch.manual_seed(0)
    cfg = tiny_vocab_cfg(hidden_size=32, transject={"residual_init": 1.0})
    model = EncoderForPretraining(cfg).train()
    if mode == "bf16_weights":
        model = model.to(torch.bfloat16)
    originals = {
        f"{q}.{n}": mod.parametrizations[n].original.detach().clone()
        for q, mod, n in orthogonal_modules(model)
    }
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids, mask = random_batch(cfg, B=4, N=12, lengths=[12, 7, 12, 3])
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            loss = pretraining_loss(model, ids, mask)
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)
    if mode == "bf16_weights":  # the whole forward runs in the storage dtype
        assert model.encoder(ids, mask).last_hidden_state.dtype == torch.bfloat16
    for q, mod, n in orthogonal_modules(model):  # the free parameters did move
        assert not torch.equal(mod.parametrizations[n].original, originals[f"{q}.{n}"]), (q, n)
    errors = orthogonality_errors(model)
    assert set(errors) == EXPECTED_ORTHOGONAL
    assert max(errors.values()) <= 1e-3, errors


# --------------------------------------------------------------------------------------------
# 2. Injectivity / Lipschitz bound through depth
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def test_pairwise_distance_bound_through_24_layers():
    """Pairwise token distances stay within prod_l (1 -+ |alpha_l|)^2 of the embeddings'.

    Why: within one sample Lambda and the gate weights w are fixed (they depend on the sample,
    not on the token), so each sublayer acts on every token vector by the same map
    x -> x + alpha F(x). F is 1-Lipschitz: the attention is a convex combination (w) of
    ELU(x U_e Lambda V_e^T) with ELU 1-Lipschitz and ||U_e Lambda V_e^T||_2 = max|lambda| = 1
    (U_e, V_e orthogonal), the FFN is ELU(W2 ELU(W1 x)) with W1, W2 orthogonal (eval: no dropout).
    Hence (1 - |alpha|) ||x - y|| <= ||f(x) - f(y)|| <= (1 + |alpha|) ||x - y|| per sublayer, two
    sublayers per layer application. A bias, LayerNorm, an unnormalised Lambda or a non-orthogonal
    weight breaks the per-sublayer check below.
    """
    torch.manual_seed(0)
    L = 24
    cfg = debug_cfg(num_hidden_layers=L)
    encoder = Encoder(cfg).eval()
    signs = torch.tensor([1.0, 1.0, 1.0, -1.0]).repeat(L // 4)  # mostly positive, some negative
    set_gates(encoder, signs * (3.0 + torch.rand(L)))  # |tanh(r)| ~ 1: |alpha_l| ~ 1/L
    a = alphas(encoder).abs()
    assert a.min() > 0.99 / L
    ids, mask = random_batch(cfg, B=3, N=16, lengths=[16, 11, 5])

    steps = encoder.trace(ids, mask)
    rtol = 1e-4
    # Per layer application: each sublayer's F is 1-Lipschitz on the sample's token vectors.
    for (x, ctx), (x_next, _), layer in zip(
        steps[:-1], steps[1:], [m for _, m in encoder.layer_applications()]
    ):
        alpha = torch.tanh(ctx.residual_gate) / L
        f_attn = layer.attention(x, ctx).hidden_BND
        x_mid = x + alpha * f_attn
        f_ffn = layer.ffn(x_mid)
        torch.testing.assert_close(x_mid + alpha * f_ffn, x_next)
        for inp, f in ((x, f_attn), (x_mid, f_ffn)):
            for d_in, d_f in zip(pair_distances(inp, mask), pair_distances(f, mask)):
                assert torch.all(d_f <= d_in * (1 + rtol))
        lo, hi = (1 - alpha.abs().item()) ** 2, (1 + alpha.abs().item()) ** 2
        for d_in, d_out in zip(pair_distances(x, mask), pair_distances(x_next, mask)):
            ratio = d_out / d_in
            assert ratio.min() >= lo * (1 - rtol) and ratio.max() <= hi * (1 + rtol)

    # End to end: h_L versus h_0 within the product of the per-layer bounds.
    lo = torch.prod((1 - a) ** 2).item()
    hi = torch.prod((1 + a) ** 2).item()
    h0, hL = steps[0][0], steps[-1][0]
    for d0, dL in zip(pair_distances(h0, mask), pair_distances(hL, mask)):
        assert d0.min() > 0  # injective embedding: distinct (token, position) pairs
        ratio = dL / d0
        assert ratio.min() >= lo * (1 - rtol), (ratio.min(), lo)
        assert ratio.max() <= hi * (1 + rtol), (ratio.max(), hi)
    # The layers did act: the representation moved away from the embeddings.
    assert (hL - h0)[mask].norm() > 0.05 * h0[mask].norm()


# --------------------------------------------------------------------------------------------
# 3. Depth: 96 layer applications
# --------------------------------------------------------------------------------------------


def test_96_layers_forward_backward_finite():
    torch.manual_seed(0)
    cfg = debug_cfg(num_hidden_layers=96, hidden_dropout_prob=0.1)
    model = EncoderForSequenceClassification(cfg, num_labels=3, pooling="mean").train()
    set_gates(model.encoder, 3.0)  # |alpha_l| ~ 1/96: every layer contributes
    ids, mask = random_batch(cfg, B=2, N=12, lengths=[12, 6])
    out = model(ids, mask)
    loss = F.cross_entropy(out.logits, torch.tensor([0, 2])) + sum(out.aux_losses.values())
    loss.backward()
    assert torch.isfinite(out.encoder.last_hidden_state).all()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        if not name.startswith("encoder.pooler."):  # unused by mean pooling
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert (
        model.encoder.groups[0][0].attention.parametrizations.expert_u.original.grad.abs().sum() > 0
    )


# --------------------------------------------------------------------------------------------
# 4. Gradients reach every parameter
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["approx_orthogonal_embedding", "random_plain_embedding"])
def test_gradients_reach_every_parameter(variant):
    """With alpha_l = tanh(r_l)/L = 0 (the ReZero start) every layer is the identity, so the
    attention, FFN, gate and Lambda parameters get exactly zero gradient (only the r_l do); set
    the r_l nonzero first, then every parameter must get a nonzero gradient."""
    torch.manual_seed(0)
    if variant == "approx_orthogonal_embedding":
        cfg = tiny_vocab_cfg(num_hidden_layers=2, num_hidden_groups=2)
        model = EncoderForPretraining(cfg)
        loss_fn = pretraining_loss
    else:
        cfg = debug_cfg(num_hidden_layers=2, transject={"eigenvalues": "random"})
        model = EncoderForSequenceClassification(cfg, num_labels=2, pooling="cls")

        def loss_fn(m, ids, mask):
            return F.cross_entropy(m(ids, mask).logits, torch.tensor([0, 1]))

    ids, mask = random_batch(cfg, B=2, N=8, lengths=[8, 5])
    attention = model.encoder.groups[0][0].attention

    loss_fn(model, ids, mask).backward()  # alpha = 0
    assert attention.parametrizations.expert_u.original.grad.abs().max() == 0
    assert model.encoder.residual_gates.grad.abs().min() > 0
    model.zero_grad()

    set_gates(model.encoder, 0.5)
    loss_fn(model, ids, mask).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.abs().max() > 0, f"{name} got a zero gradient"


# --------------------------------------------------------------------------------------------
# 5. Eigenvalue paths
# --------------------------------------------------------------------------------------------


def test_eigenvalue_paths():
    torch.manual_seed(0)
    ids, mask = random_batch(debug_cfg(), B=3, N=10, lengths=[10, 6, 3])

    approx = Encoder(debug_cfg(transject={"eigenvalues": "approx", "reconstruction_weight": 0.1}))
    assert approx.config.transject.reconstruction == "scale_free"  # the default
    out = approx(ids, mask)
    assert set(out.aux_losses) == {RECONSTRUCTION_KEY}
    assert out.aux_losses[RECONSTRUCTION_KEY] > 0
    x0 = approx.embeddings(ids)
    extras, aux = approx.family_state(x0, mask)
    lam = extras[LAMBDA_KEY]
    assert lam.shape == (3, 32)
    torch.testing.assert_close(lam.abs().amax(-1), torch.ones(3))

    # Decision: lambda = diag(U^T M U) as a real matrix product, normalised; the loss compares
    # M / s with U diag(lambda) U^T (scale-free).
    U = approx.family_state.eigenbasis.double()
    xm = x0.double() * mask[..., None]
    M = xm.mT @ xm
    lam_raw = torch.diagonal(U.T @ M @ U, dim1=-2, dim2=-1)
    s = lam_raw.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(lam.double(), lam_raw / s, atol=1e-6, rtol=1e-6)
    recon = ((M / s[..., None] - U @ torch.diag_embed(lam_raw / s) @ U.T) ** 2).mean()
    torch.testing.assert_close(aux[RECONSTRUCTION_KEY].double(), 0.1 * recon)
    # Scale-free: scaling X0 leaves lambda and the loss unchanged.
    extras2, aux2 = approx.family_state(7.0 * x0, mask)
    torch.testing.assert_close(extras2[LAMBDA_KEY], lam)
    torch.testing.assert_close(aux2[RECONSTRUCTION_KEY], aux[RECONSTRUCTION_KEY])

    # The authors' option: the raw M against the normalised reconstruction (a port of
    # victor7246/TransJect IsoEncoder's MSELoss(M, M_), with the matrix products of the Decision).
    theirs = Encoder(
        debug_cfg(transject={"reconstruction": "authors", "reconstruction_weight": 0.1})
    )
    theirs.load_state_dict(approx.state_dict())
    _, aux_theirs = theirs.family_state(x0, mask)
    Uw = U.T  # their nn.Linear weight: x U^T
    eigs = torch.diagonal(Uw @ M @ Uw.T, dim1=-2, dim2=-1)
    eigs = eigs / eigs.max(1).values.unsqueeze(1)
    M_ = Uw.T @ torch.diag_embed(eigs) @ Uw
    torch.testing.assert_close(
        aux_theirs[RECONSTRUCTION_KEY].double(), 0.1 * nn.MSELoss()(M, M_), rtol=1e-5, atol=0
    )

    random = Encoder(debug_cfg(transject={"eigenvalues": "random"}))
    out = random(ids, mask)
    assert out.aux_losses == {}
    extras, aux = random.family_state(random.embeddings(ids), mask)
    assert aux == {}
    lam = extras[LAMBDA_KEY]
    assert lam.shape == (1, 32)
    assert lam.abs().max().item() == pytest.approx(1.0)
    # Decision: a learned, registered parameter (not resampled every forward).
    assert "family_state.eigenvalues" in dict(random.named_parameters())
    torch.testing.assert_close(
        random.family_state(random.embeddings(ids), mask)[0][LAMBDA_KEY], lam
    )


def direct_eigen_state(x0, mask, U, reconstruction):
    """The eigen-state as the formulas read (U^T M U and U diag(lam) U^T formed, d x d per
    sample), in fp64: the reference of the closed form `approximate_eigenvalues` uses."""
    x = x0.double() * mask[..., None]
    M = x.mT @ x
    U = U.double()
    lam_raw = torch.diagonal(U.T @ M @ U, dim1=-2, dim2=-1)
    s = lam_raw.abs().amax(-1, keepdim=True)
    lam = lam_raw / s
    target = M if reconstruction == "authors" else M / s[..., None]
    return lam, ((target - U @ torch.diag_embed(lam) @ U.T) ** 2).mean(dim=(-2, -1))


@pytest.mark.parametrize("products", ["fp32", "bf16x3"])
@pytest.mark.parametrize("reconstruction", ["scale_free", "authors"])
@pytest.mark.parametrize("N", [10, 50])  # fewer tokens than d = 32 (X X^T), more (X^T X)
def test_closed_form_eigen_state_equals_the_formulas(reconstruction, N, products):
    """Values and the gradients of the embeddings and of the eigenbasis' free parameters (its
    Cayley map), padded rows included: the closed form against the formulas in fp64, with its
    products in fp32 or by three bf16 products (`transject.eigen_products`)."""
    torch.manual_seed(5)
    cfg = debug_cfg(transject={"reconstruction": reconstruction})
    state = Encoder(cfg).family_state
    free = state.parametrizations.eigenbasis.original
    x0 = torch.randn(3, N, cfg.hidden_size, requires_grad=True)
    mask = torch.ones(3, N, dtype=torch.bool)
    mask[1, N // 2 :] = False
    weights = torch.randn(3, cfg.hidden_size)
    results = []
    closed_form = functools.partial(approximate_eigenvalues, products=products)
    for fn in (closed_form, direct_eigen_state):
        lam, recon = fn(x0, mask, state.eigenbasis, reconstruction)
        total = (weights.to(lam.dtype) * lam).sum() + 100 * recon.sum()
        results.append((lam.double(), recon.double(), *torch.autograd.grad(total, (x0, free))))
    (lam, recon, g_x, g_u), (lam_ref, recon_ref, g_x_ref, g_u_ref) = results
    # bf16x3 keeps about 16 of fp32's 24 significant bits of each operand: 10x the tolerances
    loose = 10.0 if products == "bf16x3" else 1.0
    torch.testing.assert_close(lam, lam_ref, rtol=1e-5 * loose, atol=1e-6 * loose)
    torch.testing.assert_close(recon, recon_ref, rtol=1e-4 * loose, atol=1e-9)
    for got, want in ((g_x, g_x_ref), (g_u, g_u_ref)):
        scale = want.abs().max()
        assert scale > 0 and ((got.double() - want).abs().max() / scale).item() < 1e-4 * loose
    # The diagnostic: ||offdiag(U^T M U)||^2 / ||M||^2, formed directly
    x = x0.detach().double() * mask[..., None]
    M = x.mT @ x
    D = state.eigenbasis.detach().double().T @ M @ state.eigenbasis.detach().double()
    offdiag = (D**2).sum((-2, -1)) - (torch.diagonal(D, dim1=-2, dim2=-1) ** 2).sum(-1)
    torch.testing.assert_close(
        eigenbasis_error(x0, mask, state.eigenbasis).double(),
        offdiag / (M**2).sum((-2, -1)),
        rtol=1e-4,
        atol=1e-6,
    )


# --------------------------------------------------------------------------------------------
# 6. Padding invariance
# --------------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("eigenvalues", ["approx", "random"])
def test_padding_invariance(eigenvalues):
    torch.manual_seed(0)
    cfg = debug_cfg(num_hidden_layers=3, transject={"eigenvalues": eigenvalues})
    encoder = Encoder(cfg).eval()
    set_gates(encoder, [1.0, -2.0, 3.0])
    ids, _ = random_batch(cfg, B=2, N=7)
    ref = encoder(ids)

    # Append 5 padding positions holding arbitrary (non-pad) token ids.
    extra = torch.randint(1, cfg.vocab_size, (2, 5))
    padded_ids = torch.cat([ids, extra], dim=1)
    mask = torch.cat([torch.ones(2, 7, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.bool)], 1)
    out = encoder(padded_ids, mask)
    torch.testing.assert_close(
        out.last_hidden_state[:, :7], ref.last_hidden_state, atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(out.pooled_output, ref.pooled_output, atol=1e-5, rtol=1e-5)
    for name, value in ref.aux_losses.items():
        torch.testing.assert_close(out.aux_losses[name], value, atol=1e-7, rtol=1e-5)

    # A padded batch of different lengths equals each sample run alone.
    short = encoder(ids[1:, :4])
    mask2 = torch.ones(2, 7, dtype=torch.bool)
    mask2[1, 4:] = False
    batch = encoder(ids, mask2)
    torch.testing.assert_close(
        batch.last_hidden_state[1, :4], short.last_hidden_state[0], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        batch.last_hidden_state[0], ref.last_hidden_state[0], atol=1e-5, rtol=1e-5
    )


# --------------------------------------------------------------------------------------------
# 7. Expert weights, and the attention against a naive reference
# --------------------------------------------------------------------------------------------


def naive_transject_attention(
    attn: TransJectAttention, x_BND, mask_BN, lam_Bd, alpha
) -> torch.Tensor:
    """Loops over samples and experts: sum_e w_e ELU((x U_e + b_e) diag(lambda) V_e^T), the
    gate pooling each expert's sublayer output x + alpha A_e(x) over the real tokens."""
    U, V = attn.expert_u.double(), attn.expert_v.double()
    b_u = attn.expert_u_bias.bias.double()
    g = attn.gate.weight.double()[0]
    outs = []
    for b in range(x_BND.shape[0]):
        x = x_BND[b].double()
        lam = lam_Bd[min(b, lam_Bd.shape[0] - 1)].double()
        experts = [F.elu((x @ U[e] + b_u[e]) @ torch.diag(lam) @ V[e].T) for e in range(U.shape[0])]
        logits = torch.stack([g @ (x + alpha * a)[mask_BN[b]].amax(0) for a in experts])
        w = logits.softmax(0)
        outs.append(sum(w[e] * experts[e] for e in range(len(experts))))
    return torch.stack(outs)


@torch.no_grad()
def test_expert_weights_and_reference():
    torch.manual_seed(0)
    cfg = debug_cfg(num_hidden_layers=2, transject={"num_experts": 3})
    encoder = Encoder(cfg).eval()
    set_gates(encoder, 1.0)
    ids, mask = random_batch(cfg, B=3, N=9, lengths=[9, 5, 2])
    steps = encoder.trace(ids, mask)
    for (x, ctx), (_, layer) in zip(steps[:-1], encoder.layer_applications()):
        attn = layer.attention
        w = attn.expert_weights(x, ctx)
        assert w.shape == (3, 3)
        assert torch.all(w >= 0)
        torch.testing.assert_close(w.sum(-1), torch.ones(3))

        # The forward equals a naive per-sample, per-expert loop.
        alpha = torch.tanh(ctx.residual_gate.double()) / cfg.num_layer_applications
        ref = naive_transject_attention(attn, x, mask, ctx.extras[LAMBDA_KEY], alpha)
        torch.testing.assert_close(attn(x, ctx).hidden_BND.double(), ref, atol=1e-5, rtol=1e-5)

        # The gate ignores padding: huge values at padding rows change nothing...
        x_bad = x.clone()
        x_bad[~mask] = 100.0 * torch.randn(int((~mask).sum()), cfg.hidden_size)
        torch.testing.assert_close(attn.expert_weights(x_bad, ctx), w)
        # ...while they would, were padding counted as real tokens.
        ctx_all = LayerContext(
            mask_BN=torch.ones_like(mask), residual_gate=ctx.residual_gate, extras=ctx.extras
        )
        assert not torch.allclose(attn.expert_weights(x_bad, ctx_all), w, atol=1e-3)


# --------------------------------------------------------------------------------------------
# 8. The eigen basis learns the eigenvectors
# --------------------------------------------------------------------------------------------


def test_reconstruction_loss_trains_eigenbasis():
    torch.manual_seed(0)
    cfg = debug_cfg()
    state = EigenState(cfg)
    d = cfg.hidden_size
    # X0 with an anisotropic spectrum in a random (non-axis) basis.
    Q, _ = torch.linalg.qr(torch.randn(d, d))
    scales = torch.linspace(0.2, 3.0, d)
    x0 = torch.randn(4, 48, d) * scales @ Q.T
    mask = torch.ones(4, 48, dtype=torch.bool)
    mask[1, 30:] = False

    def loss() -> torch.Tensor:
        return state(x0, mask)[1][RECONSTRUCTION_KEY]

    def eigen_error() -> float:
        # lambda (sorted) against the true normalised eigenvalues of M.
        lam, _ = approximate_eigenvalues(x0, mask, state.eigenbasis.detach())
        xm = x0 * mask[..., None]
        true = torch.linalg.eigvalsh(xm.mT @ xm)
        true = true / true.amax(-1, keepdim=True)
        return (lam.sort(-1).values - true).abs().mean().item()

    original = state.parametrizations.eigenbasis.original
    opt = torch.optim.Adam([original], lr=0.05)
    first, err_first = loss().item(), eigen_error()
    basis_first = eigenbasis_error(x0, mask, state.eigenbasis.detach()).mean().item()
    for _ in range(60):
        opt.zero_grad()
        loss().backward()
        opt.step()
    last, err_last = loss().item(), eigen_error()
    basis_last = eigenbasis_error(x0, mask, state.eigenbasis.detach()).mean().item()
    assert last < first, (first, last)
    assert err_last < err_first, (err_first, err_last)
    assert basis_last < 0.5 * basis_first, (basis_first, basis_last)
    assert orthogonality_error(state.eigenbasis) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    ("reconstruction", "weight", "trains"),
    [("scale_free", 1e-3, True), ("authors", 1e-3, False), ("scale_free", 0.0, False)],
)
def test_eigenbasis_trains_in_a_classifier(reconstruction, weight, trains):
    """The measured reason for the default loss: a 2-layer TransJect classifier trained with
    AdamW at the authors' classification weight 1e-3. The scale-free loss moves U towards an
    eigenbasis of M (docs/methods.md: 0.789 -> 0.642 in 200 steps); the authors' loss, whose
    minimum spreads diag(U^T M U) evenly, does not (0.789 -> 0.807), nor does no loss."""
    torch.manual_seed(0)
    cfg = debug_cfg(
        vocab_size=20,
        hidden_size=64,
        num_hidden_groups=2,
        transject={"reconstruction": reconstruction, "reconstruction_weight": weight},
    )
    model = EncoderForSequenceClassification(cfg, num_labels=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    probe = torch.randint(1, 20, (8, 48), generator=g)
    ones = torch.ones_like(probe, dtype=torch.bool)

    def error() -> float:
        with torch.no_grad():
            x0 = model.encoder.embeddings(probe)
            basis = model.encoder.family_state.eigenbasis
            return eigenbasis_error(x0, ones, basis).mean().item()

    before = error()
    for _ in range(80):
        ids = torch.randint(1, 20, (16, 48), generator=g)
        out = model(ids, torch.ones_like(ids, dtype=torch.bool))
        loss = F.cross_entropy(out.logits, (ids[:, 1] + ids[:, 5]) % 10)
        loss = loss + sum(out.aux_losses.values(), torch.zeros(()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = error()
    if trains:
        assert after < before - 0.05, (before, after)
    else:
        assert after > before - 0.01, (before, after)


# --------------------------------------------------------------------------------------------
# Activation checkpointing (encoder path) agrees with the plain path
# --------------------------------------------------------------------------------------------


def test_activation_checkpointing_matches():
    """The encoder's checkpointed path (layers recomputed in backward, orthogonal maps from the
    forward's cache) gives the same loss and gradients as the plain path."""
    torch.manual_seed(0)
    cfg = debug_cfg(num_hidden_layers=3, transject={"residual_init": 1.0})
    model = EncoderForPretraining(cfg).train()
    ids, mask = random_batch(cfg, B=2, N=8, lengths=[8, 5])

    def run():
        model.zero_grad()
        loss = pretraining_loss(model, ids, mask)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_plain, grads_plain = run()
    model.encoder.enable_activation_checkpointing()
    loss_ckpt, grads_ckpt = run()
    torch.testing.assert_close(loss_ckpt, loss_plain)
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], grad, msg=name)


# --------------------------------------------------------------------------------------------
# Against a port of the authors' layer (victor7246/TransJect models/layers.py IsoEncoderLayer
# with random_features=False, written for this test): gate on the sublayer outputs, biases,
# orthogonal FFN, residual.
# --------------------------------------------------------------------------------------------


def authors_iso_encoder_layer(layer: TransJectLayer, x, resweight, eig_Bdd, gate_bias):
    """IsoEncoderLayer.forward: each expert's sublayer x + resweight * ELU(U(x) @ V(eig)), the
    gate softmax(attn_combine(max over tokens)), the mix, then out + resweight * ff(out)."""
    attn = layer.attention
    outs = []
    for e in range(attn.num_experts):
        U_w, b_u = attn.expert_u[e].T, attn.expert_u_bias.bias[e]  # nn.Linear: x @ W^T + b
        V_w = attn.expert_v[e]
        b_v = attn.expert_v_bias.bias[e] if attn.expert_v_bias is not None else 0 * b_u
        u_x = x @ U_w.T + b_u
        v_eig = eig_Bdd @ V_w.T + b_v
        outs.append(x + resweight * F.elu(torch.matmul(u_x, v_eig)))
    out = torch.stack(outs, 1)  # (B, E, N, d)
    logits = out.max(2).values @ attn.gate.weight.T + gate_bias  # attn_combine (with its bias)
    w = F.softmax(logits, dim=1).squeeze(-1)
    out = torch.einsum("be,bemn->bmn", w, out)
    ff = F.elu(layer.ffn_out(F.elu(layer.ffn_in(out))))  # eval: the dropout is the identity
    return out + resweight * ff


@torch.no_grad()
@pytest.mark.parametrize("bias", ["authors", "lipschitz"])
def test_layer_matches_authors_port(bias):
    torch.manual_seed(3)
    cfg = debug_cfg(num_hidden_layers=3, transject={"num_experts": 3, "bias": bias})
    encoder = Encoder(cfg).eval()
    set_gates(encoder, [0.7, -1.3, 2.0])
    ids, mask = random_batch(cfg, B=2, N=11)  # no padding: their code has no mask
    steps = encoder.trace(ids, mask)
    for (x, ctx), (x_next, _), (_, layer) in zip(
        steps[:-1], steps[1:], encoder.layer_applications()
    ):
        resweight = torch.tanh(ctx.residual_gate) / cfg.num_layer_applications
        eig = torch.diag_embed(ctx.extras[LAMBDA_KEY].expand(x.shape[0], -1))
        ref = authors_iso_encoder_layer(layer, x, resweight, eig, gate_bias=torch.tensor(0.37))
        torch.testing.assert_close(x_next, ref, atol=2e-5, rtol=1e-5)


def test_gate_input_options():
    """Uniform expert weights at the ReZero start with the authors' sublayer gate; not with the
    gate on A_e(X) alone (the earlier reading, kept as gate_input=attention)."""
    torch.manual_seed(4)
    for gate_input, uniform in (("sublayer", True), ("attention", False)):
        cfg = debug_cfg(transject={"num_experts": 3, "gate_input": gate_input})
        encoder = Encoder(cfg).eval()  # r_l = 0: alpha = 0
        ids, mask = random_batch(cfg, B=2, N=7)
        (x, ctx), *_ = encoder.trace(ids, mask)
        w = encoder.groups[0][0].attention.expert_weights(x, ctx)
        assert torch.allclose(w, torch.full_like(w, 1 / 3), atol=1e-6) == uniform


# --------------------------------------------------------------------------------------------
# The gate's pooled values: a gather whose backward is dense (PooledAt)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooled", [1, 4])  # the experts' (one token each) and X's (E tokens)
def test_pooled_at_gradient_is_the_gather_gradient(pooled):
    """PooledAt's forward is gather's and its backward is gather's (scatter-add): exactly, with
    one pooled entry per position; with E entries, some at the same token, up to the order of
    the sums."""
    g = torch.Generator().manual_seed(0)
    src = torch.randn(3, 10, 6, generator=g, dtype=torch.float64)
    index = torch.randint(0, 10, (3, pooled, 6), generator=g)
    index[0, :, 0] = 7  # every pooled entry of one column on one token: their gradients add
    upstream = torch.randn(3, pooled, 6, generator=g, dtype=torch.float64)
    grads = []
    for pool in (PooledAt.apply, lambda s, i, d: s.gather(d, i)):
        leaf = src.clone().requires_grad_()
        out = pool(leaf, index, 1)
        torch.testing.assert_close(out, src.gather(1, index), rtol=0, atol=0)
        (out * upstream).sum().backward()
        grads.append(leaf.grad)
    if pooled == 1:
        assert torch.equal(grads[0], grads[1])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-15, atol=1e-15)
    assert grads[0][0, 7, 0] == upstream[0, :, 0].sum()  # the tied column's entries summed
    assert torch.autograd.gradcheck(lambda s: PooledAt.apply(s, index, 1), src.requires_grad_())


@pytest.mark.parametrize("gate_input", ["sublayer", "attention"])
def test_gate_gradients_match_a_max_over_tokens(gate_input):
    """The whole attention's gradients, eager (the pooled values' gather) and compiled
    (`PooledAt`'s dense backward), against the gate as the authors write it: a masked max over
    the tokens of the (E, B, N, d) sublayer outputs with autograd's own backward, padding
    included."""
    torch.manual_seed(5)
    cfg = debug_cfg(transject={"num_experts": 3, "gate_input": gate_input, "residual_init": 1.0})
    encoder = Encoder(cfg).train()
    ids, mask = random_batch(cfg, B=3, N=10, lengths=[10, 6, 3])
    (x, ctx), *_ = encoder.trace(ids, mask)
    attn = encoder.groups[0][0].attention
    x = x.detach().double().requires_grad_()
    attn.double()
    ctx.extras[LAMBDA_KEY] = ctx.extras[LAMBDA_KEY].detach().double()
    ctx.residual_gate = ctx.residual_gate.detach().double()

    def reference(x):
        a_EBND, _ = attn.experts(x, ctx)  # the expert outputs (the weights recomputed below)
        alpha = torch.tanh(ctx.residual_gate) / cfg.num_layer_applications
        gated = x[None] + alpha * a_EBND if gate_input == "sublayer" else a_EBND
        gated = gated.masked_fill(~mask[None, :, :, None], float("-inf"))
        w_BE = attn.gate(gated.amax(dim=2)).squeeze(-1).T.float().softmax(dim=-1)  # as ours
        return torch.einsum("be,ebnd->bnd", w_BE.double(), a_EBND)

    def ours(x):
        return attn(x, ctx).hidden_BND

    torch._dynamo.reset()
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)  # PooledAt's backward
    upstream = torch.randn_like(x)
    results = []
    for fn in (reference, ours, compiled):
        attn.zero_grad()
        x.grad = None
        with orthogonal_cache() as store:  # the same matrices for all three (as the engine)
            evaluate_orthogonal_maps(attn, store)
            out = fn(x)
        (out * upstream).sum().backward()
        results.append([x.grad.clone()] + [p.grad.clone() for p in attn.parameters()])
    torch._dynamo.reset()
    for grads in results[1:]:  # eager (gather's scatter) and compiled (dense)
        for ours_grad, reference_grad in zip(grads, results[0]):
            torch.testing.assert_close(ours_grad, reference_grad, rtol=1e-9, atol=1e-12)
    assert results[0][-1].abs().max() > 0  # the gate's weight has a gradient


def test_compiled_gate_backward_has_no_scatter():
    """Traced for torch.compile, the attention's backward graph routes the pooled gradients
    without a scatter (the dense expression Inductor fuses), its forward gathers, and the
    experts are mixed by a sum, not a product (one bmm: the V products)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)

        return compiler

    torch._dynamo.reset()
    cfg = debug_cfg(transject={"num_experts": 3, "residual_init": 1.0})
    encoder = Encoder(cfg).train()
    ids, mask = random_batch(cfg, B=2, N=8, lengths=[8, 5])
    (x, ctx), *_ = encoder.trace(ids, mask)
    x = x.detach().requires_grad_()
    attn = encoder.groups[0][0].attention
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    compiled = torch.compile(lambda x: attn(x, ctx).hidden_BND, backend=backend, fullgraph=True)
    compiled(x).sum().backward()
    torch._dynamo.reset()
    assert any("gather" in op for op in graphs["forward"]), graphs["forward"]
    assert graphs["forward"].count("aten.bmm.default") == 1, graphs["forward"]
    scatters = sorted(op for op in graphs["backward"] if "scatter" in op or "index_put" in op)
    assert not scatters, scatters
    assert x.grad is not None and attn.gate.weight.grad.abs().max() > 0


# --------------------------------------------------------------------------------------------
# The eigen-state's products by three bf16 products (`transject.eigen_products=bf16x3`)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [((96, 40), (40, 24)), ((3, 20, 40), (3, 40, 20))])
def test_bf16x3_product_is_near_fp32_forward_and_backward(shape):
    """`Bf16x3Product` against fp64, value and both gradients: within 3e-5 relative (about 16
    significant bits of each operand kept), and over 30x closer than one bf16 product with fp32
    accumulation (what a plain bf16 product under autocast would do at best)."""
    from model.attention.transject_eigen import Bf16x3Product

    g = torch.Generator().manual_seed(0)
    a = torch.randn(shape[0], generator=g).requires_grad_()
    b = torch.randn(shape[1], generator=g).requires_grad_()
    weights = torch.randn((a @ b).shape, generator=g, dtype=torch.float64)

    def run(product):
        a_, b_ = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        out = product(a_, b_)
        (out.double() * weights).sum().backward()
        return [out.detach().double(), a_.grad.double(), b_.grad.double()]

    ref = run(lambda x, y: x.double() @ y.double())
    split = run(Bf16x3Product.apply)
    one = run(lambda x, y: x.bfloat16().float() @ y.bfloat16().float())
    for got, single, want in zip(split, one, ref, strict=True):
        error = ((got - want).norm() / want.norm()).item()
        single_error = ((single - want).norm() / want.norm()).item()
        assert error < 3e-5 and error * 30 < single_error, (error, single_error)


def test_bf16x3_product_calls_on_cuda_are_well_formed():
    """The CUDA branch (bf16 operands, fp32 results through `out_dtype`) traced with fake CUDA
    tensors: every product of the forward and of the backward (2-D, and batched both ways
    round as the Gram matrix takes them) has the shape and dtype of the fp32 product. Values
    are a GPU's: `bench/bench_fast_paths.py eigen-products --device cuda`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from model.attention.transject_eigen import _bf16_halves, _bf16x3

    with FakeTensorMode():
        x = torch.empty(2 * 7, 5, device="cuda")
        u = torch.empty(5, 5, device="cuda")
        xs = torch.empty(2, 7, 5, device="cuda")
        for a, b in ((x, u), (x.mT, x), (xs, xs.mT), (xs.mT, xs)):
            out = _bf16x3(_bf16_halves(a), _bf16_halves(b))
            assert out.is_cuda and out.dtype == torch.float32
            assert (
                out.shape
                == torch.empty(a.shape, device="meta")
                .matmul(torch.empty(b.shape, device="meta"))
                .shape
            )


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.integration)])
def test_eigen_products_option_trains_like_fp32(compiled):
    """A TransJect pretraining step with `transject.eigen_products=bf16x3` against the fp32
    default: the eigenvalues, the losses and every parameter's gradient within 1e-4 relative
    (fp32 model), eagerly and compiled (aot_eager, the encoder in one graph); a typo in the
    option is refused."""
    torch._dynamo.reset()
    ids, mask = random_batch(debug_cfg(), B=2, N=12, lengths=[12, 7])
    runs = {}
    for products in ("fp32", "bf16x3"):
        torch.manual_seed(0)
        model = EncoderForPretraining(debug_cfg(transject={"eigen_products": products}))
        if compiled and products == "bf16x3":
            model.encoder.compile(backend="aot_eager", fullgraph=True)
        loss = pretraining_loss(model, ids, mask)
        loss.backward()
        runs[products] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert model.encoder.family_state.products == "bf16x3"
    (loss32, grads32), (loss3, grads3) = runs["fp32"], runs["bf16x3"]
    torch.testing.assert_close(loss3, loss32, rtol=1e-4, atol=1e-6)
    for name, want in grads32.items():
        got = grads3[name]
        assert (want is None) == (got is None), name
        if want is not None and want.abs().max() > 0:
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4, name
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"transject\.eigen_products"):
        debug_cfg(transject={"eigen_products": "tf32"})


def test_residual_stream_option_sets_the_dtype_between_layers():
    """`transject.residual_stream`: under autocast the stream between layers stays fp32 (`fp32`,
    the default, as torch's autocast leaves it) or is rounded to bf16 after each layer
    (`compute`); the outputs agree to bf16 rounding; no effect without autocast; a typo is
    refused with the field's name."""
    with pytest.raises(ValueError, match="residual_stream"):
        debug_cfg(transject={"residual_stream": "bf16"})
    torch.manual_seed(0)
    ids, mask = random_batch(debug_cfg(), B=2, N=12, lengths=[12, 7])
    models = {}
    for stream in ("fp32", "compute"):
        torch.manual_seed(0)
        models[stream] = EncoderForPretraining(
            debug_cfg(num_hidden_layers=3, transject={"residual_stream": stream})
        )
        set_gates(models[stream].encoder, [1.0, 1.0, 1.0])  # alpha != 0: the layers act
    assert torch.equal(models["fp32"](ids, mask).logits, models["compute"](ids, mask).logits)
    hidden, seen = {}, {}
    for stream, model in models.items():
        dtypes = []
        hooks = [
            layer.register_forward_hook(lambda m, a, out, d=dtypes: d.append(out[0].dtype))
            for layer in model.encoder.groups[0]
        ]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden[stream] = model.encoder(ids, mask).last_hidden_state.float()
        for hook in hooks:
            hook.remove()
        seen[stream] = set(dtypes)
    assert seen == {"fp32": {torch.float32}, "compute": {torch.bfloat16}}
    torch.testing.assert_close(hidden["compute"], hidden["fp32"], rtol=2e-2, atol=2e-2)
    assert not torch.equal(hidden["compute"], hidden["fp32"])  # the option took effect
