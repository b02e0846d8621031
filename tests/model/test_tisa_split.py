"""Tests of TISA's `split` backend (model/attention/tisa_split.py).

SDPA with a detached bias plus the gradient of f's values from its own operator: the model's
outputs and every gradient equal the `sdpa` backend's (CPU, where the operator is the dense
reference); the reference equals autograd's gradient; the operator compiles inside the encoder.
The Triton kernels themselves (in Triton's interpreter, and compiled for an H100) are checked in
tests/model/test_triton_kernels.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from model.attention.tisa import sdpa_bias, select_backend, toeplitz_bias
from model.attention.tisa_split import reference_values_grad, split_attention
from model.config import EncoderConfig
from model.encoder import Encoder
from model.heads import EncoderForPretraining


def tisa_config(**overrides) -> EncoderConfig:
    tisa = overrides.pop("tisa", {})
    return EncoderConfig.preset("debug", attention="tisa", tisa=tisa, **overrides)


def batch(B=3, N=11, vocab=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, N), generator=gen)
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    return ids, mask


def attention_inputs(B=3, H=2, N=13, hd=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, hd, generator=gen, dtype=dtype) for _ in range(3))
    values = torch.randn(H, 2 * N - 1, generator=gen, dtype=dtype)
    mask_BN = torch.ones(B, N, dtype=torch.bool)
    mask_BN[1, N - 4 :] = False
    mask_BN[2, 2:] = False
    return q, k, v, values, mask_BN


@pytest.mark.parametrize("padded", [False, True])
def test_split_attention_gives_sdpa_outputs_and_gradients(padded):
    q, k, v, values, mask_BN = attention_inputs()
    mask_BN = mask_BN if padded else None
    grads = []
    for split in (False, True):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, values)]
        bias = sdpa_bias(leaves[3], mask_BN, torch.float64)
        if split:
            out = split_attention(*leaves[:3], leaves[3], bias, mask_BN)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(*leaves[:3], attn_mask=bias)
        torch.autograd.backward(
            out, torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        )
        grads.append([out.detach()] + [x.grad for x in leaves])
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_reference_gradient_is_autograds_and_chunking_does_not_change_it():
    q, k, v, values, mask_BN = attention_inputs(B=5)
    values = values.requires_grad_()
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * q.size(-1) ** -0.5 + toeplitz_bias(values)
    scores = scores.masked_fill(~mask_BN[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, -1) @ v
    do = torch.randn_like(out)
    (want,) = torch.autograd.grad(out, values, do)
    for chunk in (1, 2, 8):
        got = reference_values_grad(q, k, v, out.detach(), do, values.detach(), mask_BN, chunk)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scope", ["shared", "per_layer"])
def test_split_model_equals_sdpa_model_outputs_and_every_gradient(scope):
    """Pretraining model, padded batch: logits and the gradient of every parameter (the scorers'
    a, b, c included) as with `sdpa`."""
    ids, mask = batch()
    results = []
    for backend in ("sdpa", "split"):
        torch.manual_seed(0)
        cfg = tisa_config(num_hidden_layers=2, tisa={"scope": scope, "backend": backend})
        model = EncoderForPretraining(cfg)
        out = model(ids, mask)
        (out.logits.square().mean() + out.sop_logits.square().mean()).backward()
        results.append((out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want_logits, want_grads), (logits, grads) = results
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)  # CPU SDPA kernels differ
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    scorer_grads = [g for n, g in grads.items() if "scorers" in n]
    assert scorer_grads and all(g.abs().sum() > 0 for g in scorer_grads)


def test_split_without_gradients_is_plain_sdpa():
    """No gradient (eval, inference): no tap, the outputs of `sdpa`."""
    ids, mask = batch()
    outs = []
    for backend in ("sdpa", "split"):
        torch.manual_seed(0)
        model = Encoder(tisa_config(num_hidden_layers=2, tisa={"backend": backend})).eval()
        with torch.no_grad():
            outs.append(model(ids, mask).last_hidden_state)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def test_split_with_dropout_falls_back_to_sdpa_with_one_warning():
    cfg = tisa_config(attention_probs_dropout_prob=0.1, tisa={"backend": "split"})
    assert select_backend(cfg, torch.device("cuda"), True, 512) == "sdpa"
    assert select_backend(cfg, torch.device("cuda"), False, 512) == "split"
    assert select_backend(cfg, torch.device("cpu"), False, 512) == "split"
    ids, mask = batch()
    torch.manual_seed(0)
    model = Encoder(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(ids, mask).last_hidden_state.sum().backward()
    fallbacks = [w for w in caught if "falling back to sdpa" in str(w.message)]
    assert len(fallbacks) == 1 and "split" in str(fallbacks[0].message)


def test_compiled_split_model_matches_eager_gradients():
    """The autograd tap and the custom operator inside a compiled encoder (engine.compile):
    forward and backward under torch.compile (aot_eager on CPU) give the eager gradients."""
    ids, mask = batch()
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = EncoderForPretraining(tisa_config(num_hidden_layers=2, tisa={"backend": "split"}))
        torch._dynamo.reset()
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        run(ids, mask).logits.square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    for name in grads[1].keys() - grads[0].keys():  # unused heads: None eagerly, zero compiled
        assert grads[1].pop(name).count_nonzero() == 0, name
    assert grads[1].keys() == grads[0].keys()
    assert grads[1]["encoder.family_state.scorers.0.c"].abs().sum() > 0
    for name, grad in grads[1].items():
        torch.testing.assert_close(grad, grads[0][name], rtol=1e-5, atol=1e-6, msg=name)
