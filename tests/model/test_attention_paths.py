"""The attention families' fast paths agree with the reference paths and keep the fast kernels
eligible: no mask for SDPA on an unpadded batch (decided on the host), Q/K/V from one product
with unchanged parameters, TISA's key padding as a FlexAttention block mask and its backend per
length, kernel attention's bf16 products with fp32 accumulation, and the orthogonal maps
evaluated in one batched solve per shape without a host sync.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close_as
from op_log import OpLog
from test_fast_paths import accumulating_engine
from test_model_core import batch, tiny
from torch.nn.attention.flex_attention import create_block_mask
from torch.nn.utils.parametrizations import _Orthogonal

import model.encoder as encoder_module
from model import EncoderConfig, EncoderForPretraining
from model.attention.base import LayerContext, batch_is_padded
from model.attention.kernel import KernelAttention, matmul_fp32, naive_kernel_attention
from model.attention.tisa import (
    PositionScorer,
    TISAState,
    flex_dense_bias,
    key_padding_block_mask,
    select_backend,
    tisa_flex_attention,
    toeplitz_bias,
)
from model.orthogonal import (
    FP32Orthogonal,
    evaluate_orthogonal_maps,
    forward_cache_key,
    orthogonal_cache,
    orthogonal_modules,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.numerics,
]

FAMILIES = ("softmax", "tisa", "kernel", "transject")


def loss_of(out) -> torch.Tensor:
    aux = sum(out.aux_losses.values(), torch.zeros(()))
    return out.logits.square().mean() + out.sop_logits.square().mean() + aux


# ------------------------------------------------------------------------- masks and SDPA


@pytest.fixture
def sdpa_calls(monkeypatch) -> list:
    """Records the `attn_mask` of every scaled_dot_product_attention call."""
    calls = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kw):
        calls.append(attn_mask)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


@pytest.mark.parametrize("given", ["no mask", "all-ones CPU mask"])
def test_sdpa_gets_no_float_mask_for_an_unpadded_batch(sdpa_calls, given):
    """Softmax attention on a batch without padding passes attn_mask=None to SDPA in every
    layer (flash-eligible), not the all-zero float bias it used to; a padded batch gets the
    float key-padding bias, and both give the same outputs at real tokens."""
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny("softmax", num_hidden_layers=3)).eval()
    ids, padded_mask = batch()
    mask = None if given == "no mask" else torch.ones_like(padded_mask)
    with torch.no_grad():
        out = model(ids, mask).logits
    assert len(sdpa_calls) == 3
    assert all(m is None for m in sdpa_calls), [None if m is None else m.dtype for m in sdpa_calls]

    sdpa_calls.clear()
    with torch.no_grad():
        ref = model(ids, torch.ones_like(padded_mask).long() * 1).logits  # the same batch
        padded = model(ids, padded_mask).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    masks = sdpa_calls[3:]
    assert all(m is not None and m.shape == (3, 1, 1, 9) for m in masks)
    assert torch.isfinite(padded).all()


def test_tisa_unpadded_bias_has_no_key_padding(sdpa_calls):
    """TISA's SDPA path on an unpadded batch passes F_P alone, (1, H, N, N), not a (B, H, N, N)
    bias with zeros for the key padding; the outputs equal the padded path's."""
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny("tisa", tisa={"backend": "sdpa"})).eval()
    ids, _ = batch()
    with torch.no_grad():
        unpadded = model(ids, None).logits
        H, N = model.config.num_attention_heads, ids.size(1)
        assert all(m.shape == (1, H, N, N) for m in sdpa_calls)
        sdpa_calls.clear()
        # a CPU mask of ones is recognised as unpadded too; a device one would not be
        model(ids, torch.ones_like(ids))
        assert all(m.shape == (1, H, N, N) for m in sdpa_calls)
    state = model.encoder.family_state
    x0 = torch.randn(3, N, model.config.hidden_size)
    padded_bias = state(x0, torch.ones(3, N, dtype=torch.bool), padded=True)[0]["tisa_bias"]
    assert padded_bias.shape == (3, H, N, N)
    torch.testing.assert_close(
        padded_bias, state(x0, None, padded=False)[0]["tisa_bias"].expand_as(padded_bias)
    )
    assert torch.isfinite(unpadded).all()


def test_batch_is_padded_is_decided_on_the_host():
    assert batch_is_padded(None) is False
    assert batch_is_padded(torch.ones(2, 5, dtype=torch.long)) is False
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    assert batch_is_padded(mask) is True
    # A mask on an accelerator is not read (that would synchronise): assumed padded. The meta
    # device stands in for one here (reading it would fail).
    assert batch_is_padded(torch.ones(2, 5, device="meta")) is True


def test_engine_sends_no_mask_for_an_unpadded_batch(sdpa_calls):
    """Engine.to_device, where every trainer moves its batches: a mask without padding is read
    on the host (free) and becomes None, so on an accelerator the model knows the batch is
    unpadded without a sync and SDPA gets no mask; a padded mask (and the LRA pair's second
    mask) travels as it is. The trainer's forward gives the same loss either way."""
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny("softmax", num_hidden_layers=2))
    engine = accumulating_engine(model, lr=1e-2, total_steps=1)
    ids, padded_mask = batch()
    full = torch.ones_like(padded_mask)
    moved = engine.to_device({"input_ids": ids, "attention_mask": full, "attention_mask_b": full})
    assert moved["attention_mask"] is None and moved["attention_mask_b"] is None
    assert torch.equal(moved["input_ids"], ids)
    kept = engine.to_device({"input_ids": ids, "attention_mask": padded_mask})
    assert torch.equal(kept["attention_mask"], padded_mask)

    engine.train(False)
    with torch.no_grad():
        fast = engine.forward(moved["input_ids"], moved["attention_mask"]).logits
        assert sdpa_calls and all(m is None for m in sdpa_calls)
        ref = engine.forward(ids, full).logits
    torch.testing.assert_close(fast, ref, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_unpadded_and_padded_paths_agree(family):
    """Per family: no mask == an all-ones mask == that mask marked padded (a mask on a device),
    forward and every gradient."""
    torch.manual_seed(0)
    cfg = tiny(family, transject={"num_experts": 2}) if family == "transject" else tiny(family)
    model = EncoderForPretraining(cfg)
    ids, _ = batch()
    results = []
    for padded in (False, True):
        model.zero_grad(set_to_none=True)
        if padded:  # what a mask on a GPU gets: the masked path
            encoder_module.batch_is_padded, real = (lambda m: True), encoder_module.batch_is_padded
        try:
            loss = loss_of(model(ids, torch.ones_like(ids)))
            loss.backward()
        finally:
            if padded:
                encoder_module.batch_is_padded = real
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    for name, g in results[1][1].items():
        torch.testing.assert_close(results[0][1][name], g, rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------------- fused Q/K/V


def test_qkv_is_one_product_and_parameters_are_unchanged():
    """Q, K and V come from one matrix product (three before), equal to the three separate
    projections; the parameters and state-dict keys stay query / key / value."""
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny("softmax"))
    attn = model.encoder.groups[0][0].attention
    x = torch.randn(2, 7, model.config.hidden_size)
    log = OpLog()
    with log, torch.no_grad():
        q, k, v = attn.project_qkv(x)
    assert len(log.matmuls()) == 1, log.matmuls()
    B, N, H = 2, 7, attn.num_heads
    for got, lin in zip((q, k, v), (attn.query, attn.key, attn.value)):
        want = lin(x).view(B, N, H, -1).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    keys = {k for k in model.state_dict() if k.startswith("encoder.groups.0.0.attention.")}
    expected = {
        f"encoder.groups.0.0.attention.{m}.{t}"
        for m in ("query", "key", "value", "output")
        for t in ("weight", "bias")
    }
    assert keys == expected
    # The orthogonal option keeps three products (ZeRO-3 gathers through the maps' modules).
    ortho = EncoderForPretraining(tiny("softmax", orthogonal=True)).encoder.groups[0][0].attention
    log = OpLog()
    with log, torch.no_grad():
        ortho.project_qkv(x)
    assert len(log.matmuls()) == 3


def test_fused_qkv_backward_writes_one_gradient_of_its_size():
    """The backward of the fused projection's split writes the q, k, v gradients once, stacked
    straight into the product's (B, N, 3, H, h) layout: one (B N, 3 d) tensor, no second copy
    (splitting a heads-first permutation stacked them heads-first, then copied them back)."""
    torch.manual_seed(0)
    attn = EncoderForPretraining(tiny("softmax")).encoder.groups[0][0].attention
    B, N, d = 4, 16, attn.query.in_features  # B N > d: the gradients outgrow the weight's
    x = torch.randn(B, N, d, requires_grad=True)
    q, k, v = attn.project_qkv(x)
    grads = [torch.randn_like(t) for t in (q, k, v)]
    log = OpLog()
    with log:
        torch.autograd.backward((q, k, v), grads)
    qkv_sized = [(name, n) for name, n in log.writes() if n >= B * N * 3 * d]
    assert qkv_sized == [("stack", B * N * 3 * d)], log.writes()
    # the gradients themselves, against the three separate projections
    x_ref = x.detach().clone().requires_grad_()
    outs = [lin(x_ref).view(B, N, attn.num_heads, -1).transpose(1, 2)
            for lin in (attn.query, attn.key, attn.value)]  # fmt: skip
    torch.autograd.backward(outs, grads)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_fused_qkv_weight_is_made_once_per_forward(monkeypatch, checkpointing, autocast):
    """ALBERT applies one shared layer L times: the fused weight is concatenated (and cast to
    bf16 under autocast) once per forward, recomputation included, not L times. The loss is
    bit for bit that of making it at every application; the gradients agree to fp32 round-off,
    and under bf16 autocast to the rounding of summing the L applications' gradients in bf16
    before the cast's backward, which is how autocast treats every other shared weight (it
    caches one cast of a leaf parameter per forward)."""
    torch.manual_seed(0)
    cfg = tiny("softmax", num_hidden_layers=4)
    model = EncoderForPretraining(cfg)
    if checkpointing:
        model.encoder.enable_activation_checkpointing()
    ids, mask = batch()

    def run():
        model.zero_grad()
        counter = OpLog()
        with counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(model(ids, mask))
        with counter:  # the recomputation of checkpointed layers runs in backward
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, counter.counts()

    loss, grads, counts = run()
    # one cat of the weights and one of the biases, once per forward, recomputation included
    assert counts["cat"] == 2, counts["cat"]
    monkeypatch.setattr(encoder_module, "cache_fused_qkv", lambda *args: None)
    ref_loss, ref_grads, ref_counts = run()
    assert ref_counts["cat"] == 2 * 4 * (2 if checkpointing else 1)
    if autocast:
        assert ref_counts["_to_copy"] > counts["_to_copy"]
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        tol = {"rtol": 2e-2, "atol": 1e-5} if autocast else {"rtol": 1e-5, "atol": 1e-7}
        torch.testing.assert_close(grads[name], ref_grads[name], **tol)


# ------------------------------------------------------------------------- TISA


@pytest.mark.parametrize("N", [5, 128, 200, 300])
def test_key_padding_block_mask_equals_create_block_mask(N):
    """The BlockMask built from the key mask alone == create_block_mask's (which evaluates the
    mask_mod on the full B x N x N grid): the same partial and full blocks, both directions."""
    g = torch.Generator().manual_seed(N)
    mask = torch.rand(3, N, generator=g) > 0.2
    mask[0] = True
    mask[1, N // 3 :] = False
    ours = key_padding_block_mask(mask)
    ref = create_block_mask(lambda b, h, q, kv: mask[b, kv], 3, None, N, N, device="cpu")
    for name in ("kv", "full_kv", "q", "full_q"):
        counts = getattr(ref, f"{name}_num_blocks")
        assert torch.equal(getattr(ours, f"{name}_num_blocks"), counts), name
        indices = getattr(ref, f"{name}_indices")
        used = torch.arange(indices.size(-1)) < counts[..., None]
        assert torch.equal(getattr(ours, f"{name}_indices")[used], indices[used]), name
    assert torch.equal(ours.to_dense(), ref.to_dense())


def test_flex_with_block_mask_equals_sdpa_bias_padded_and_not():
    """softmax(QK^T/sqrt(h) + F_P) V through flex (score_mod + block mask, or no mask) equals
    SDPA with the materialised bias at every real token (CPU, no grad: eager flex)."""
    torch.manual_seed(0)
    B, H, N, h = 3, 4, 150, 8  # two key blocks, the second partial
    scorer = PositionScorer(3, H)
    q, k, v = torch.randn(3, B, H, N, h).unbind(0)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 40:] = False  # a key block of padding only: skipped
    mask[2, 130:] = False
    with torch.no_grad():
        values = scorer.values(N)
        for m in (mask, None):
            out = tisa_flex_attention(q, k, v, values, m)
            bias = toeplitz_bias(values)
            if m is not None:
                bias = bias.masked_fill(~m[:, None, None, :], float("-inf"))
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_flex_dense_bias_equals_the_table_and_sdpa():
    """`tisa.flex_bias: dense` (F_P read from an fp32 (H, N, N) tensor) gives the table's and
    SDPA's outputs, padded and not, with bf16 queries as under autocast (CPU, no grad: the
    backward's atomic adds are FlexAttention's own and run on CUDA only)."""
    torch.manual_seed(0)
    B, H, N, h = 3, 4, 150, 8
    scorer = PositionScorer(3, H)
    q, k, v = torch.randn(3, B, H, N, h).unbind(0)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 40:] = False
    mask[2, 130:] = False
    with torch.no_grad():
        values = scorer.values(N)
        dense = flex_dense_bias(values)
        assert dense.shape == (H, N, N) and dense.dtype == torch.float32
        for m in (mask, None):
            table = tisa_flex_attention(q, k, v, values, m)
            out = tisa_flex_attention(q, k, v, values, m, dense_bias_HNN=dense)
            torch.testing.assert_close(out, table, rtol=1e-5, atol=1e-5)
            bias = toeplitz_bias(values)
            if m is not None:
                bias = bias.masked_fill(~m[:, None, None, :], float("-inf"))
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            q16, k16, v16 = (t.bfloat16() for t in (q, k, v))
            out16 = tisa_flex_attention(q16, k16, v16, values, m, dense_bias_HNN=dense)
            assert out16.dtype == torch.bfloat16
            torch.testing.assert_close(out16.float(), ref, rtol=3e-2, atol=3e-2)


def test_auto_backend_is_chosen_per_length():
    cfg = EncoderConfig.preset("debug", attention="tisa", tisa={"flex_min_length": 1024})
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert select_backend(cfg, cuda, False, 512) == "sdpa"
    assert select_backend(cfg, cuda, False, 1024) == "flex"
    assert select_backend(cfg, cuda, True, 4096) == "sdpa"  # flex has no dropout
    assert select_backend(cfg, cpu, False, 4096) == "sdpa"
    assert EncoderConfig.preset("debug", attention="tisa").tisa.flex_min_length == 2048
    with pytest.raises(ValueError, match="flex_min_length"):
        EncoderConfig.preset("debug", attention="tisa", tisa={"flex_min_length": 0})
    # The state builds the block mask once per forward when flex runs a padded batch.
    state = TISAState(EncoderConfig.preset("debug", attention="tisa", tisa={"backend": "flex"}))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    with torch.no_grad():
        x0 = torch.randn(2, 9, state.cfg.hidden_size)
        assert "tisa_block_mask" in state(x0, mask, padded=True)[0]
        assert "tisa_block_mask" not in state(x0, mask, padded=False)[0]
        assert "tisa_flex_bias" not in state(x0, mask, padded=True)[0]  # the table by default
    # With flex_bias: dense (shared scope) it also builds the fp32 (H, N, N) bias once.
    dense_cfg = EncoderConfig.preset(
        "debug", attention="tisa", tisa={"backend": "flex", "flex_bias": "dense"}
    )
    with torch.no_grad():
        extras = TISAState(dense_cfg)(x0.bfloat16(), mask, padded=False)[0]
    heads = dense_cfg.num_attention_heads
    assert extras["tisa_flex_bias"].shape == (heads, 9, 9)
    assert extras["tisa_flex_bias"].dtype == torch.float32
    with pytest.raises(ValueError, match="flex_bias"):
        EncoderConfig.preset("debug", attention="tisa", tisa={"flex_bias": "sparse"})


# ------------------------------------------------------------------------- kernel attention


def test_kernel_products_are_fp32_whatever_the_feature_dtype():
    """bf16 features times the fp32 [KV | z]: an fp32 product (as exact as fp32 on the bf16
    numbers), where rounding [KV | z] to bf16 would be ~2^-9 off; gradients come back in each
    input's dtype."""
    torch.manual_seed(0)
    a = torch.rand(2, 3, 512, 16).bfloat16().requires_grad_()
    b = torch.randn(2, 3, 16, 17, requires_grad=True)
    out = matmul_fp32(a, b)
    ref = a.double() @ b.double()
    assert out.dtype == torch.float32
    scale = ref.abs().max()
    assert ((out - ref).abs().max() / scale).item() < 1e-6
    assert ((a.double() @ b.bfloat16().double() - ref).abs().max() / scale).item() > 2**-12
    ga, gb = torch.autograd.grad(out, [a, b], torch.ones_like(out))
    assert ga.dtype == torch.bfloat16 and gb.dtype == torch.float32


@pytest.mark.parametrize("feature_map", ["aoglu", "glu", "ffn", "elu"])
def test_kernel_attention_fp32_equals_reference_and_bf16_is_close(feature_map):
    """fp32: the kernel equals the explicit O(N^2) form of its own features to 1e-6. bf16
    autocast (CPU): the feature maps run in bf16 and the output stays within bf16 tolerance of
    the fp32 output, gradients too."""
    torch.manual_seed(0)
    cfg = tiny("kernel", kernel={"feature_map": feature_map, "dropout": 0.0})
    kernel = KernelAttention(cfg)
    B, H, N, h = 2, cfg.num_attention_heads, 40, cfg.head_dim
    q, k, v = (torch.randn(B, H, N, h, requires_grad=True) for _ in range(3))
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 25:] = False
    ctx = LayerContext(mask_BN=mask)
    out32, _ = kernel(q, k, v, ctx)
    with torch.no_grad():
        ref = naive_kernel_attention(kernel.phi(q), kernel.phi(k), v, mask, cfg.kernel.eps)
    torch.testing.assert_close(out32, ref, rtol=1e-6, atol=1e-6)
    grads32 = torch.autograd.grad(out32.square().sum(), [q, k, v])

    features = []
    hook = kernel.phi.register_forward_hook(lambda mod, args, out: features.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out16, _ = kernel(q, k, v, ctx)
    hook.remove()
    assert features == [torch.bfloat16, torch.bfloat16]
    torch.testing.assert_close(out16.float(), out32, rtol=3e-2, atol=3e-2)
    grads16 = torch.autograd.grad(out16.float().square().sum(), [q, k, v])
    for g16, g32 in zip(grads16, grads32):
        err = ((g16.float() - g32).abs().max() / g32.abs().max()).item()
        assert err < 5e-2, err


# ------------------------------------------------------------------------- orthogonal maps


def reference_map(orth: FP32Orthogonal, X: torch.Tensor) -> torch.Tensor:
    """The map as evaluated before: torch's own `_Orthogonal.forward` (linalg.solve), one
    matrix at a time, in fp32."""
    flat = X.float().reshape(-1, *X.shape[-2:])
    return torch.stack([_Orthogonal.forward(orth, x) for x in flat]).reshape(X.shape)


@pytest.mark.parametrize(
    "cfg",
    [
        tiny("transject", num_hidden_layers=2, num_hidden_groups=2, transject={"num_experts": 3}),
        tiny("softmax", orthogonal=True, intermediate_size=32),
        tiny("softmax", orthogonal=True, orthogonal_map="matrix_exp", intermediate_size=32),
    ],
    ids=["transject", "orthogonal-cayley", "orthogonal-matrix_exp"],
)
def test_grouped_maps_equal_per_map_evaluation_values_and_gradients(cfg):
    """One batched evaluation per (map, shape) == torch's per-map evaluation: every matrix and
    the gradient of a functional of all of them, within fp32's rounding bound for d-term
    products (not a tolerance tuned to one CPU's kernels)."""
    torch.manual_seed(0)
    model = EncoderForPretraining(cfg)
    found = orthogonal_modules(model.encoder)
    weights = [torch.randn(getattr(m, n).shape) for _, m, n in found]
    originals = [m.parametrizations[n].original for _, m, n in found]

    with orthogonal_cache() as store:
        evaluate_orthogonal_maps(model.encoder, store)
        grouped = [store[forward_cache_key(m.parametrizations[n][0])] for _, m, n in found]
    refs = [
        reference_map(m.parametrizations[n][0], m.parametrizations[n].original) for _, m, n in found
    ]
    if cfg.orthogonal_map == "matrix_exp":  # torch's own map in fp32 (ours runs it in fp64)
        refs = [
            _Orthogonal.forward(m.parametrizations[n][0], m.parametrizations[n].original.double())
            for _, m, n in found
        ]
    # fp32 maps of d x d matrices: each entry a chain of d-term products (tests/numerics.py)
    d = max(q.shape[-1] for q in grouped)
    for got, want in zip(grouped, refs):
        assert_close_as(torch.float32, got, want, terms=d)
    total = sum((w * q).sum() for w, q in zip(weights, grouped))
    total_ref = sum((w.double() * q.double()).sum() for w, q in zip(weights, refs))
    for got, want in zip(
        torch.autograd.grad(total, originals), torch.autograd.grad(total_ref, originals)
    ):
        assert_close_as(torch.float32, got, want, terms=d)


def test_one_evaluation_per_shape_and_no_checked_solve(monkeypatch):
    """A TransJect encoder's maps (experts U, V, FFN in, out, eigenbasis: all d x d) are one
    evaluation per forward, and the cayley map never calls the synchronising linalg.solve."""
    calls = []
    evaluate = FP32Orthogonal.evaluate
    monkeypatch.setattr(
        FP32Orthogonal, "evaluate", lambda self, X: calls.append(X.shape) or evaluate(self, X)
    )

    def no_checked_solve(*args, **kwargs):
        raise AssertionError("torch.linalg.solve checks errors (a host sync); use solve_ex")

    monkeypatch.setattr(torch.linalg, "solve", no_checked_solve)
    torch.manual_seed(0)
    cfg = tiny("transject", num_hidden_layers=2, num_hidden_groups=2, transject={"num_experts": 3})
    model = EncoderForPretraining(cfg)
    ids, mask = batch()
    loss_of(model(ids, mask)).backward()
    d = cfg.hidden_size
    # 2 layers x (3 + 3 experts + 2 FFN maps) + the eigenbasis = 17 matrices, one evaluation
    assert calls == [torch.Size([17, d, d])], calls


def test_model_with_grouped_maps_equals_per_map_model(monkeypatch):
    """Loss and every gradient of a TransJect training step are the same whether the maps are
    evaluated up front in one batch or one by one where used."""
    torch.manual_seed(0)
    cfg = tiny("transject", num_hidden_layers=2, num_hidden_groups=2, transject={"num_experts": 2})
    model = EncoderForPretraining(cfg)
    ids, mask = batch()
    results = []
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(encoder_module, "evaluate_orthogonal_maps", lambda *a, **k: None)
        model.zero_grad(set_to_none=True)
        loss = loss_of(model(ids, mask))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    for name, g in results[0][1].items():
        torch.testing.assert_close(g, results[1][1][name], rtol=1e-5, atol=1e-6, msg=name)
