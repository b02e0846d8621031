"""Tests of the `tisa` attention family (model/attention/tisa.py)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from model.attention.base import LayerContext
from model.attention.softmax import naive_softmax_attention
from model.attention.tisa import PositionScorer, TISAKernel, TISAState, toeplitz_bias
from model.config import EncoderConfig
from model.encoder import Encoder
from model.heads import EncoderForPretraining

# Eager FlexAttention on CPU warns that it materialises the scores; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def tisa_config(**overrides) -> EncoderConfig:
    tisa = overrides.pop("tisa", {})
    return EncoderConfig.preset("debug", attention="tisa", tisa=tisa, **overrides)


def qkv_and_mask(B=2, H=4, N=7, h=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, h, generator=gen) for _ in range(3))
    mask_BN = torch.ones(B, N, dtype=torch.bool)
    mask_BN[1, 4:] = False  # second sequence has 4 real tokens
    return q, k, v, mask_BN


def random_scorer(S=3, H=4, seed=0) -> PositionScorer:
    torch.manual_seed(seed)
    scorer = PositionScorer(S, H)
    with torch.no_grad():  # larger, varied amplitudes and widths so the bias matters
        scorer.a.normal_(0.0, 1.0)
        scorer.b.uniform_(-0.5, 0.5)
    return scorer


def batch(B=2, N=9, vocab=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, N), generator=gen)
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1, 6:] = 0
    return ids, mask


def test_bias_is_the_toeplitz_matrix_of_f():
    scorer = random_scorer()
    N = 6
    with torch.no_grad():
        bias_HNN = toeplitz_bias(scorer.values(N))
    a, b, c = (p.tolist() for p in (scorer.a, scorer.b, scorer.c))  # (S, H) nested lists
    S, H = len(a), len(a[0])
    expected = torch.zeros(H, N, N)
    for head in range(H):
        for i in range(N):
            for j in range(N):
                k = j - i  # key position minus query position
                expected[head, i, j] = sum(
                    a[s][head] * math.exp(-abs(b[s][head]) * (k - c[s][head]) ** 2)
                    for s in range(S)
                )
    torch.testing.assert_close(bias_HNN, expected, rtol=1e-5, atol=1e-6)
    # score() agrees with values() at the same offsets, on the paper's axis.
    torch.testing.assert_close(
        scorer.score([-(N - 1), 0, N - 1]), scorer.values(N)[:, [0, N - 1, -1]]
    )


@pytest.mark.parametrize("scope", ["shared", "per_layer"])
def test_kernel_matches_naive_softmax_with_bias(scope):
    cfg = tisa_config(num_hidden_layers=3, tisa={"scope": scope, "backend": "sdpa"})
    q, k, v, mask_BN = qkv_and_mask()
    scorers = [random_scorer(seed=s) for s in range(3)]
    layer = 2 if scope == "per_layer" else 0
    kernel = TISAKernel(cfg)
    for inputs in (q, k, v):
        inputs.requires_grad_(True)
    values_PHM = torch.stack([s.values(q.size(-2)) for s in scorers])
    out, aux = kernel(q, k, v, LayerContext(mask_BN, layer, extras={"tisa_values": values_PHM}))
    # per_layer must pick the scorer of this application; shared always uses scorer 0
    ref = naive_softmax_attention(q, k, v, mask_BN, toeplitz_bias(values_PHM[layer]))
    assert aux == {}
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # gradients agree too, including those of the scorer parameters
    grads = torch.autograd.grad(out.square().sum(), [q, scorers[layer].c], retain_graph=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), [q, scorers[layer].c])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


FLEX_VARIANTS = {
    "sdpa": {"backend": "sdpa"},
    "flex": {"backend": "flex"},
    "flex-dense": {"backend": "flex", "flex_bias": "dense"},
}


def test_flex_and_sdpa_paths_agree():
    q, k, v, mask_BN = qkv_and_mask()
    values_PHM = random_scorer().values(q.size(-2)).detach()[None]
    ctx = LayerContext(mask_BN, extras={"tisa_values": values_PHM})
    outs = {}
    with torch.no_grad():
        for name, tisa in FLEX_VARIANTS.items():
            kernel = TISAKernel(tisa_config(tisa=tisa))
            outs[name], _ = kernel(q, k, v, ctx)  # dense: the kernel builds its (H, N, N) bias
    torch.testing.assert_close(outs["flex"], outs["sdpa"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["flex-dense"], outs["sdpa"], rtol=1e-5, atol=1e-5)
    # and at the model level (flex under no_grad on CPU), with padding, both scopes
    ids, mask = batch()
    real = mask.bool()
    for scope in ("shared", "per_layer"):
        models = {}
        for name, tisa in FLEX_VARIANTS.items():
            torch.manual_seed(0)
            models[name] = Encoder(tisa_config(tisa={**tisa, "scope": scope})).eval()
        with torch.no_grad():
            hid = {b: m(ids, mask).last_hidden_state for b, m in models.items()}
        for name in ("flex", "flex-dense"):
            torch.testing.assert_close(hid[name][real], hid["sdpa"][real], rtol=1e-5, atol=1e-5)


def test_zero_amplitude_tisa_equals_softmax_model():
    torch.manual_seed(0)
    softmax_model = EncoderForPretraining(EncoderConfig.preset("debug")).eval()
    tisa_model = EncoderForPretraining(
        tisa_config(position_embedding="absolute", tisa={"init": "zero_amplitude"})
    ).eval()
    result = tisa_model.load_state_dict(softmax_model.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert sorted(result.missing_keys) == [
        f"encoder.family_state.scorers.0.{p}" for p in ("a", "b", "c")
    ]
    assert torch.count_nonzero(tisa_model.encoder.family_state.scorers[0].a) == 0
    ids, mask = batch()
    with torch.no_grad():
        want = softmax_model(ids, mask)
        got = tisa_model(ids, mask)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.sop_logits, want.sop_logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scope", ["shared", "per_layer"])
@pytest.mark.parametrize("position_embedding", ["none", "absolute"])
def test_padding_does_not_change_real_tokens(scope, position_embedding):
    torch.manual_seed(0)
    cfg = tisa_config(position_embedding=position_embedding, tisa={"scope": scope})
    model = Encoder(cfg).eval()
    ids, mask = batch(N=8)
    pad = 5
    padded_ids = torch.cat([ids, torch.full((ids.size(0), pad), 7)], dim=1)  # non-pad id on purpose
    padded_mask = torch.cat([mask, torch.zeros(ids.size(0), pad, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        out = model(ids, mask).last_hidden_state
        out_padded = model(padded_ids, padded_mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(out_padded[:, :8][real], out[real], rtol=1e-5, atol=1e-5)


def test_scope_per_layer_uses_one_scorer_per_application():
    cfg = tisa_config(num_hidden_layers=2, inner_group_num=2, tisa={"scope": "per_layer"})
    assert cfg.num_layer_applications == 4
    torch.manual_seed(0)
    model = Encoder(cfg)
    scorers = model.family_state.scorers
    assert len(scorers) == 4
    ids, mask = batch()
    model(ids, mask).last_hidden_state.square().sum().backward()
    for scorer in scorers:  # every application reaches its own scorer
        for p in (scorer.a, scorer.b, scorer.c):
            assert p.grad is not None and p.grad.abs().sum() > 0
    # Changing the last scorer changes the output: it is really used by the last application.
    with torch.no_grad():
        before = model(ids, mask).last_hidden_state
        scorers[3].a.add_(1.0)
        after = model(ids, mask).last_hidden_state
    assert (after - before).abs().max() > 1e-4

    shared = Encoder(tisa_config(num_hidden_layers=2, inner_group_num=2))
    assert len(shared.family_state.scorers) == 1


@pytest.mark.parametrize("scope", ["shared", "per_layer"])
def test_values_computed_once_per_forward_and_gradients_reach_a_b_c(scope, monkeypatch):
    cfg = tisa_config(num_hidden_layers=3, tisa={"scope": scope, "backend": "sdpa"})
    torch.manual_seed(0)
    model = EncoderForPretraining(cfg)
    calls = {"values": [], "bias": 0}
    original_values, original_bias = PositionScorer.values, toeplitz_bias

    def counting_values(self, N):
        calls["values"].append(id(self))
        return original_values(self, N)

    def counting_bias(values_HM):
        calls["bias"] += 1
        return original_bias(values_HM)

    monkeypatch.setattr(PositionScorer, "values", counting_values)
    monkeypatch.setattr("model.attention.tisa.toeplitz_bias", counting_bias)
    ids, mask = batch()
    out = model(ids, mask)
    scorers = model.encoder.family_state.scorers
    assert sorted(calls["values"]) == sorted(id(s) for s in scorers)  # each scorer once
    assert calls["bias"] == (1 if scope == "shared" else 3)  # shared: one (H, N, N) bias
    out.logits.square().mean().backward()
    for scorer in scorers:
        for p in (scorer.a, scorer.b, scorer.c):
            assert p.grad is not None and torch.isfinite(p.grad).all()
            assert p.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", ["sdpa", "split"])
def test_shared_bias_works_with_activation_checkpointing(backend):
    torch.manual_seed(0)
    model = Encoder(tisa_config(num_hidden_layers=3, tisa={"backend": backend}))
    ids, mask = batch()
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.enable_activation_checkpointing()
        model.zero_grad()
        model(ids, mask).last_hidden_state.square().sum().backward()
        grads.append(model.family_state.scorers[0].c.grad.clone())
    torch.testing.assert_close(grads[1], grads[0])


def test_flex_on_cpu_with_grad_raises_and_dropout_falls_back_to_sdpa():
    ids, mask = batch()
    model = Encoder(tisa_config(tisa={"backend": "flex"})).eval()
    with pytest.raises(ValueError, match="FlexAttention has no backward"):
        model(ids, mask)
    with torch.no_grad():
        model(ids, mask)  # fine without gradients

    torch.manual_seed(0)
    dropout_model = Encoder(tisa_config(attention_probs_dropout_prob=0.1, tisa={"backend": "flex"}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            dropout_model(ids, mask).last_hidden_state.sum().backward()  # sdpa: trains on CPU
    fallbacks = [w for w in caught if "falling back to sdpa" in str(w.message)]
    assert len(fallbacks) == 1


def test_state_extras_shapes():
    cfg = tisa_config(num_hidden_layers=3, tisa={"scope": "per_layer", "num_kernels": 2})
    state = TISAState(cfg)
    extras, aux = state(torch.zeros(2, 5, cfg.hidden_size), torch.ones(2, 5, dtype=torch.bool))
    assert aux == {}
    assert extras["tisa_values"].shape == (3, cfg.num_attention_heads, 9)
    assert "tisa_bias" not in extras  # per_layer kernels build their own bias
    assert state.scorers[0].a.shape == (2, cfg.num_attention_heads)


def _authors_tisa_matrix(a, b, c, seq_len: int) -> torch.Tensor:
    """A port of ulmewennberg/tisa Tisa.forward (written for this test): RBF scores at offsets
    -N .. N, gathered into the (H, N, N) matrix with their 'deformed Toeplitz' index."""
    offsets = torch.arange(-seq_len, seq_len + 1)
    scores = (
        a.unsqueeze(-1)
        * torch.exp(-torch.abs(b.unsqueeze(-1)) * ((c.unsqueeze(-1) - offsets) ** 2))
    ).sum(axis=0)
    index = (
        (torch.arange(0, -(seq_len**2), step=-1) + (seq_len - 1)).view(seq_len, seq_len)
        + (seq_len + 1) * torch.arange(seq_len).view(-1, 1)
    ).view(-1)
    return torch.take_along_dim(scores, index.view(1, -1), 1).view(a.shape[1], seq_len, seq_len)


def test_bias_matches_authors_port_up_to_the_offset_convention():
    """Their matrix is f(i - j - 1); ours is f(j - i). The same function with centres c' = -c - 1
    (a reparameterisation: same a, b), so the two biases are equal entry by entry."""
    from model.attention.tisa import PositionScorer, toeplitz_bias

    torch.manual_seed(0)
    scorer = PositionScorer(num_kernels=5, num_heads=3)
    theirs = _authors_tisa_matrix(scorer.a, scorer.b, scorer.c, 9)
    with torch.no_grad():
        scorer.c.copy_(-scorer.c - 1)
    ours = toeplitz_bias(scorer.values(9))
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("flex_bias", ["table", "dense"])
def test_compiled_encoder_traces_the_flex_score_mod(flex_bias):
    """The flex path inside a compiled encoder (engine.compile; Dynamo captures flex_attention
    with the score_mod's closure over the table or the dense bias the state made in the same
    graph), equal to the eager SDPA model at every real token (CPU, no grad, aot_eager)."""
    ids, mask = batch()
    torch.manual_seed(0)
    ref_model = Encoder(tisa_config(tisa={"backend": "sdpa"})).eval()
    torch.manual_seed(0)
    model = Encoder(tisa_config(tisa={"backend": "flex", "flex_bias": flex_bias})).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        ref = ref_model(ids, mask).last_hidden_state
        out = compiled(ids, mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5)
