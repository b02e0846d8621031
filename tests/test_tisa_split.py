"""Tests of TISA's `split` backend (model/attention/tisa_split.py, tisa_split_kernels.py).

SDPA with a detached bias plus the gradient of f's values from its own operator: the model's
outputs and every gradient equal the `sdpa` backend's (CPU, where the operator is the dense
reference); the reference equals autograd's gradient; the Triton kernels, run in Triton's
interpreter on CPU tensors (a subprocess with TRITON_INTERPRET=1), equal the reference on
padded and unpadded batches, lengths that are not a multiple of the tile, head widths that are
not a power of two, and batch slices; the operator compiles inside the encoder.
"""

from __future__ import annotations

import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from triton_support import run_in_triton_interpreter

from model.attention.tisa import sdpa_bias, select_backend, toeplitz_bias
from model.attention.tisa_split import reference_values_grad, split_attention
from model.config import EncoderConfig
from model.encoder import Encoder
from model.heads import EncoderForPretraining

REPO = Path(__file__).resolve().parents[1]


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


TRITON_CHECK = textwrap.dedent(
    """
    import torch
    from model.attention.tisa_split import reference_values_grad, triton_values_grad

    torch.manual_seed(0)
    cases = [  # B, H, N, head width, tile, padded, programs per launch
        (3, 2, 37, 24, 16, True, 1024),  # N not a multiple of the tile, width padded to 32
        (2, 3, 32, 16, 16, False, 1024),  # whole tiles, no padding mask
        (5, 2, 50, 64, 32, True, 6),  # batch in slices (5 samples over 2 slices)
        (4, 1, 17, 16, 16, True, 1),  # one slice: every sample in one program
    ]
    import model.attention.tisa_split as split
    for B, H, N, hd, block, padded, programs in cases:
        split.PROGRAMS_PER_LAUNCH = programs
        q, k, v, do = (torch.randn(B, H, N, hd) for _ in range(4))
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, h) memory, as QKV gives
        values = torch.randn(H, 2 * N - 1)
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[1, N - 7 :] = False
        mask[-1, 5:] = False
        mask = mask if padded else None
        index = torch.arange(N)[None, :] - torch.arange(N)[:, None] + N - 1
        scores = torch.einsum("bhid,bhjd->bhij", q, k) * hd**-0.5 + values[:, index]
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        o = torch.softmax(scores, -1) @ v
        want = reference_values_grad(q, k, v, o, do, values, mask)
        got = triton_values_grad(q, k, v, o, do, values, mask, block=block)
        err = (got - want).abs().max().item()
        scale = want.abs().max().item()
        assert err <= 2e-6 * max(scale, 1.0), (B, H, N, hd, block, padded, programs, err, scale)
        print("ok", B, H, N, hd, block, padded, programs, err)
    """
)


def test_triton_kernels_equal_the_reference_in_the_interpreter():
    """The CUDA kernels' arithmetic, run by Triton's interpreter on CPU tensors (what the GPU
    path computes; its speed is a GPU measurement, bench_fast_paths.py tisa-backends)."""
    assert run_in_triton_interpreter(TRITON_CHECK).count("ok ") == 4


@pytest.mark.integration  # compiles six kernels with Triton's toolchain: seconds each
def test_kernels_compile_for_an_h100_within_its_shared_memory():
    """The shipped options of the split backend's kernels and of the Cayley map's Gauss-Jordan
    leaves compile for sm_90 (Triton's compiler and ptxas run without a GPU), fit the H100's
    shared memory per block, and the split kernels spill no register and have their loads
    pipelined (bench/check_triton_kernels.py)."""
    sys.path.insert(0, str(REPO / "bench"))
    import check_triton_kernels as check

    configs = check.split_configs(False) + check.gauss_jordan_configs(False)
    rows = [check.check(config, 90) for config in configs]
    assert all("error" not in row and row["fits"] for row in rows), rows
    assert {row["kernel"] for row in rows} == {"row_lse", "diagonal_grad", "gauss_jordan_inverse"}
    split = [row for row in rows if row["kernel"] != "gauss_jordan_inverse"]
    assert all(row["spill_bytes"] == 0 for row in split), split
    # Every load of Q, K, V, dO is pipelined (async copies): 4 a stage in the gradient kernel.
    assert all(row["async_copies"] >= 2 for row in split), split
    assert max(row["async_copies"] for row in split) >= 8, split
