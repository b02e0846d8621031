"""The fast paths on a CUDA GPU, where they take kernels the CPU has not: TISA on FlexAttention
equal to SDPA with the bias (values and every gradient) and compiled once, the
inductor-compiled encoder equal to eager for every family, apex's LayerNorm equal to torch's,
softmax on SDPA's flash kernel without a mask, kernel attention's fp32 products of bf16
features, the orthogonal maps in one batched evaluation equal to one by one, and the
key-padding BlockMask equal to FlexAttention's own. Their speed: bench/bench_fast_paths.py.

    pytest -m gpu tests/bench/test_gpu_fast_paths.py
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from gpu_support import FAMILY_SETTINGS, GPU, albert_base_width, padded_batch, pretraining_loss

from model import EncoderForPretraining

pytestmark = GPU


def tisa_mixing(backend: str, q, k, v, values, mask, dtype):
    """TISA's attention output: FlexAttention reading f from its table (`flex`) or from the
    dense (H, N, N) bias (`flex_dense`), or SDPA with the materialised bias (`sdpa`)."""
    from model.attention.tisa import flex_dense_bias, sdpa_bias, tisa_flex_attention

    if backend == "flex":
        return tisa_flex_attention(q, k, v, values, mask)
    if backend == "flex_dense":
        return tisa_flex_attention(q, k, v, values, mask, dense_bias_HNN=flex_dense_bias(values))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_bias(values, mask, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tisa_flex_equals_the_sdpa_bias_with_every_gradient(dtype):
    from model.attention.tisa import PositionScorer

    tol, grad_tol = (1e-4, 1e-3) if dtype == torch.float32 else (2e-2, 5e-2)
    B, H, N, h = 4, 12, 512, 64
    scorer = PositionScorer(5, H).cuda()
    q, k, v = (
        torch.randn(B, H, N, h, device="cuda", dtype=dtype, requires_grad=True) for _ in "qkv"
    )
    mask = torch.ones(B, N, dtype=torch.bool, device="cuda")
    mask[1, 300:] = False
    mask[3, 17:] = False
    results = {}
    for backend in ("flex", "flex_dense", "sdpa"):
        out = tisa_mixing(backend, q, k, v, scorer.values(N), mask, dtype)
        real = mask[:, None, :, None].expand_as(out)
        loss = out[real].float().square().sum()
        grads = torch.autograd.grad(loss, [q, k, v, scorer.a, scorer.b, scorer.c])
        results[backend] = (out[real].float(), [g.float() for g in grads])
    for flex in ("flex", "flex_dense"):
        torch.testing.assert_close(results[flex][0], results["sdpa"][0], rtol=tol, atol=tol)
        for got, want, name in zip(results[flex][1], results["sdpa"][1], "qkvabc"):
            err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
            assert err < grad_tol, (flex, name, err)


def test_tisa_flex_training_steps_compile_once():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = EncoderForPretraining(albert_base_width("tisa", tisa={"backend": "flex"})).cuda()
    ids, mask = padded_batch(8, 512)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids, mask, masked_positions=mask & (ids % 7 == 0))
            loss = pretraining_loss(out)
        loss.backward()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 2, f"flex recompiled: {graphs} graphs for 3 steps"  # forward (+ backward)


@pytest.mark.parametrize("family", list(FAMILY_SETTINGS))
def test_the_inductor_compiled_encoder_equals_eager(family):
    from engine.engine import compile_encoder

    torch._dynamo.reset()
    eager = EncoderForPretraining(albert_base_width(family)).cuda()
    compiled = EncoderForPretraining(albert_base_width(family)).cuda()
    compiled.load_state_dict(eager.state_dict())
    compile_encoder(compiled, "inductor")
    ids, mask = padded_batch(8, 512)
    grads = []
    for model in (eager, compiled):
        pretraining_loss(model(ids, mask)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() <= grads[1].keys()
    # Relative to the largest gradient of the model: some are 0 in exact arithmetic (a softmax
    # key bias shifts every logit of a row alike), so their own scale is noise.
    scale = max(g.abs().max() for g in grads[0].values()).clamp_min(1e-12)
    for name, g in grads[0].items():
        err = ((grads[1][name] - g).abs().max() / scale).item()
        assert err < 1e-3, (family, name, err)


def test_apex_layer_norm_equals_torchs():
    from model.norm import LayerNorm, apex_layer_norm_fn, layer_norm_backend

    if apex_layer_norm_fn() is None:
        pytest.skip("NVIDIA apex is not importable (torch's LayerNorm is used)")
    assert layer_norm_backend("cuda", False) == "apex"
    ln = LayerNorm(768, eps=1e-12, autocast_output="fp32").cuda()  # as nn.LayerNorm
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    x = torch.randn(32 * 512, 768, device="cuda")
    for autocast in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            xin = x.bfloat16() if autocast else x
            got, want = ln(xin), torch.nn.LayerNorm.forward(ln, xin)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4)


def test_softmax_without_a_mask_runs_on_flash_attention():
    """An unpadded batch reaches SDPA without a mask, so its flash kernel may run (SDPA
    refuses it with any attn_mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = EncoderForPretraining(albert_base_width("softmax")).cuda()
    ids, _ = padded_batch(8, 512)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.autocast("cuda", dtype=torch.bfloat16):
        model(ids, None).logits.float().sum().backward()


def test_kernel_attention_products_of_bf16_features_are_fp32_accurate():
    from model.attention.kernel import matmul_fp32

    a = torch.rand(8, 12, 64, 8192, device="cuda").bfloat16().requires_grad_()
    b = torch.randn(8, 12, 8192, 64, device="cuda").bfloat16().requires_grad_()
    c = torch.randn(8, 12, 64, 65, device="cuda", requires_grad=True)  # fp32 (hi/lo split)
    for x, y in ((a, b), (b, c)):
        out = matmul_fp32(x, y)
        ref = x.double() @ y.double()
        assert out.dtype == torch.float32
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
        got = torch.autograd.grad(out, [x, y], torch.ones_like(out))
        want = torch.autograd.grad(ref, [x, y], torch.ones_like(ref))
        for g, w in zip(got, want):
            assert ((g.double() - w).abs().max() / w.abs().max()).item() < 1e-2


def test_orthogonal_maps_in_one_batch_equal_one_by_one():
    from model.orthogonal import evaluate_orthogonal_maps, orthogonal_cache, orthogonal_modules

    model = EncoderForPretraining(albert_base_width("transject", layers=2)).cuda()
    found = orthogonal_modules(model)
    params = [p for p in model.parameters() if p.requires_grad]

    def maps(grouped: bool):
        with orthogonal_cache() as store:
            if grouped:
                evaluate_orthogonal_maps(model.encoder, store)
            mats = [getattr(m, n) for _, m, n in found]
        ramp = (w * torch.linspace(0, 1, w.numel(), device="cuda").view_as(w) for w in mats)
        return mats, torch.autograd.grad(sum(r.sum() for r in ramp), params, allow_unused=True)

    (one_by_one, g1), (batched, g2) = maps(False), maps(True)
    for x, y in zip(one_by_one, batched):
        assert (x - y).abs().max().item() < 1e-5
    for x, y in zip(g1, g2):
        if x is not None:
            assert ((x - y).abs().max() / x.abs().max().clamp_min(1e-12)).item() < 1e-4


@pytest.mark.parametrize("N", [100, 128, 300, 1024])
def test_the_key_padding_block_mask_equals_create_block_mask(N):
    from torch.nn.attention.flex_attention import create_block_mask

    from model.attention.tisa import key_padding_block_mask

    m = torch.rand(3, N, device="cuda") > 0.2
    m[0] = True
    m[1, N // 3 :] = False
    ours = key_padding_block_mask(m)
    ref = create_block_mask(lambda b, h, q, kv: m[b, kv], 3, None, N, N, device="cuda")
    for attr in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        got, want = getattr(ours, attr), getattr(ref, attr)
        if attr.endswith("indices"):  # only the first `count` entries of a row matter
            counts = getattr(ref, attr.replace("indices", "num_blocks"))
            keep = torch.arange(want.shape[-1], device="cuda") < counts[..., None]
            got, want = got[keep], want[keep]
        assert torch.equal(got, want), attr
