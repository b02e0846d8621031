"""The `kernel` attention family: trainable feed-forward kernels (Yorsh & Kovalenko 2022).

Checked against the explicit O(N^2) form, the feature-map formulas written out per head, the
orthogonal init and penalty, padding invariance of the whole model, bf16 autocast, gradients,
and the absence of any N x N intermediate.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_log import OpLog

from model.attention import ATTENTION_REGISTRY, LayerContext
from model.attention.kernel import (
    FeatureMapUnit,
    KernelAttention,
    naive_kernel_attention,
)
from model.config import EncoderConfig
from model.encoder import Encoder
from model.heads import EncoderForPretraining

FEATURE_MAPS = ["ffn", "glu", "oglu", "aoglu", "elu"]
ORTHOGONAL = ["ffn", "oglu", "aoglu"]
STACKS = [1, 3]
# Every feature map with 1 and 3 stacked units (elu has no units: once).
CASES = [(fm, k) for fm in FEATURE_MAPS for k in STACKS if fm != "elu" or k == 1]
ORTHOGONAL_CASES = [(fm, k) for fm in ORTHOGONAL for k in STACKS]


def make_cfg(feature_map: str, stacked: int = 1, **kernel) -> EncoderConfig:
    kernel = {"feature_map": feature_map, "num_stacked": stacked, "dropout": 0.0, **kernel}
    return EncoderConfig.preset("debug", attention="kernel", kernel=kernel)


def make_kernel(cfg: EncoderConfig) -> KernelAttention:
    return KernelAttention(cfg).eval()


def random_qkv(cfg: EncoderConfig, B: int = 3, N: int = 9):
    shape = (B, cfg.num_attention_heads, N, cfg.head_dim)
    return tuple(torch.randn(shape) for _ in range(3))


def padded_mask(B: int, N: int) -> torch.Tensor:
    """Row 0 full, row 1 padded at the end, row 2 with holes (padding need not be trailing)."""
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, N // 2 :] = False
    mask[2, ::3] = False
    return mask


def units(kernel: KernelAttention) -> list[FeatureMapUnit]:
    return [m for m in kernel.modules() if isinstance(m, FeatureMapUnit)]


def manual_phi(feature_map: str, unit_list: list[FeatureMapUnit], x_BHNh: torch.Tensor):
    """The feature maps of docs/methods.md (trainable kernels), one head at a time."""
    if feature_map == "elu":
        return F.elu(x_BHNh) + 1
    heads = []
    for head in range(x_BHNh.size(1)):
        x = x_BHNh[:, head]
        for i, u in enumerate(unit_list):
            g = F.softplus if i == len(unit_list) - 1 else (lambda t: t)
            y = g(x @ u.w_Hhh[head])
            if feature_map in ("glu", "oglu"):
                y = y * torch.sigmoid(x @ u.v_Hhh[head])
            elif feature_map == "aoglu":
                y = y * torch.sigmoid(x @ u.a_Hhr[head] @ u.b_Hrh[head])
            x = y
        heads.append(x)
    return torch.stack(heads, dim=1)


def orthogonality_formula(unit_list: list[FeatureMapUnit]) -> torch.Tensor:
    total = torch.zeros(())
    for u in unit_list:
        w = u.w_Hhh.detach()
        total = total + ((w @ w.mT - torch.eye(w.size(-1))) ** 2).mean()
    return total


def test_registered():
    family = ATTENTION_REGISTRY.get("kernel")
    assert family.kernel is KernelAttention
    cfg = make_cfg("aoglu")
    layer = Encoder(cfg).groups[0][0]
    assert isinstance(layer.attention.kernel, KernelAttention)


@pytest.mark.parametrize(("feature_map", "stacked"), CASES)
def test_feature_map_formula_positive_and_shared(feature_map, stacked):
    torch.manual_seed(0)
    cfg = make_cfg(feature_map, stacked)
    kernel = make_kernel(cfg)
    H, h = cfg.num_attention_heads, cfg.head_dim
    # Per-head weights, the declared shapes, and no parameter outside the one shared phi.
    assert set(kernel.parameters()) == set(kernel.phi.parameters())
    for u in units(kernel):
        assert u.w_Hhh.shape == (H, h, h)
        if feature_map == "aoglu":
            assert u.a_Hhr.shape == (H, h, h // cfg.kernel.gate_rank_divisor)
            assert u.b_Hrh.shape == (H, h // cfg.kernel.gate_rank_divisor, h)
    assert len(units(kernel)) == (0 if feature_map == "elu" else stacked)

    x = 3 * torch.randn(2, H, 11, h)
    phi = kernel.phi(x)
    torch.testing.assert_close(phi, manual_phi(feature_map, units(kernel), x))
    assert (phi > 0).all()

    # The same module maps queries and keys.
    seen = []
    kernel.phi.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    q, k, v = random_qkv(cfg)
    kernel(q, k, v, LayerContext(mask_BN=torch.ones(3, 9, dtype=torch.bool)))
    assert len(seen) == 2
    torch.testing.assert_close(seen[0], q)
    torch.testing.assert_close(seen[1], k)


def test_dropout_on_kernel_input():
    """Dropout hits the per-head q and k before phi in training, and nothing in eval."""
    torch.manual_seed(11)
    cfg = make_cfg("aoglu", dropout=0.5)
    kernel = KernelAttention(cfg).train()
    seen = []
    unit = units(kernel)[0]
    # the units run heads first: (H, B, N, h) back to (B, H, N, h)
    unit.dropout.register_forward_hook(lambda mod, args, out: seen.append(out.transpose(0, 1)))
    q, k, v = random_qkv(cfg)
    ctx = LayerContext(mask_BN=torch.ones(3, 9, dtype=torch.bool))
    out_train, _ = kernel(q, k, v, ctx)
    for x, raw in zip(seen, (q, k)):
        dropped = x == 0
        assert 0.3 < dropped.float().mean() < 0.7
        torch.testing.assert_close(x[~dropped], 2 * raw[~dropped])
    assert not torch.equal(seen[0] == 0, seen[1] == 0)  # independent masks for q and k
    seen.clear()
    kernel.eval()
    out_eval, _ = kernel(q, k, v, ctx)
    torch.testing.assert_close(seen[0], q)
    assert not torch.allclose(out_train, out_eval)


def test_elu_baseline_has_no_dropout():
    """elu(x)+1 (Katharopoulos et al.) has no dropout, whatever kernel.dropout says."""
    torch.manual_seed(12)
    cfg = make_cfg("elu", dropout=0.5)
    kernel = KernelAttention(cfg).train()
    assert not any(isinstance(m, torch.nn.Dropout) for m in kernel.modules())
    q, k, v = random_qkv(cfg)
    ctx = LayerContext(mask_BN=torch.ones(3, 9, dtype=torch.bool))
    torch.testing.assert_close(kernel(q, k, v, ctx)[0], kernel.eval()(q, k, v, ctx)[0])


@pytest.mark.parametrize(("feature_map", "stacked"), CASES)
def test_matches_naive_with_padding(feature_map, stacked):
    torch.manual_seed(1)
    cfg = make_cfg(feature_map, stacked)
    kernel = make_kernel(cfg)
    q, k, v = random_qkv(cfg, B=3, N=9)
    mask = padded_mask(3, 9)
    out, aux = kernel(q, k, v, LayerContext(mask_BN=mask))
    assert aux == {}
    ref = naive_kernel_attention(kernel.phi(q), kernel.phi(k), v, mask, cfg.kernel.eps)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Keys and values at padding do not matter...
    k2, v2 = k.clone(), v.clone()
    k2[~mask[:, None, :, None].expand_as(k)] = 100.0
    v2[~mask[:, None, :, None].expand_as(v)] = -100.0
    out2, _ = kernel(q, k2, v2, LayerContext(mask_BN=mask))
    torch.testing.assert_close(out2, out, atol=1e-5, rtol=1e-5)
    # ...and a trailing-padded row equals the same row computed without its padding.
    n = int(mask[1].sum())
    short, _ = kernel(
        q[1:2, :, :n], k[1:2, :, :n], v[1:2, :, :n], LayerContext(mask_BN=mask[1:2, :n])
    )
    torch.testing.assert_close(out[1:2, :, :n], short, atol=1e-5, rtol=1e-5)


def test_naive_reference_is_row_normalised_attention():
    """The reference itself, against weights written out by hand."""
    torch.manual_seed(2)
    pq, pk, v = torch.rand(1, 1, 4, 3), torch.rand(1, 1, 5, 3), torch.randn(1, 1, 5, 2)
    mask = torch.tensor([[True, False, True, True, False]])
    weights = torch.stack(
        [torch.stack([pq[0, 0, i] @ pk[0, 0, j] for j in (0, 2, 3)]) for i in range(4)]
    )
    expected = weights @ v[0, 0, [0, 2, 3]] / (weights.sum(-1, keepdim=True) + 1e-6)
    got = naive_kernel_attention(pq, pk, v, mask, 1e-6)[0, 0]
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(("feature_map", "stacked"), CASES)
def test_model_padding_invariance(feature_map, stacked):
    torch.manual_seed(3)
    model = EncoderForPretraining(make_cfg(feature_map, stacked, dropout=0.1)).eval()
    ids = torch.randint(1, 512, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    out = model(ids, mask)
    # Append 6 positions of junk (not even the pad id) marked as padding.
    ids_long = torch.cat([ids, torch.randint(1, 512, (2, 6))], dim=1)
    mask_long = torch.cat([mask, torch.zeros(2, 6, dtype=torch.long)], dim=1)
    out_long = model(ids_long, mask_long)
    real = mask.bool()
    torch.testing.assert_close(
        out_long.encoder.last_hidden_state[:, :10][real],
        out.encoder.last_hidden_state[real],
        atol=1e-5,
        rtol=1e-5,
    )
    torch.testing.assert_close(
        out_long.logits[:, :10][real], out.logits[real], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize(("feature_map", "stacked"), ORTHOGONAL_CASES)
def test_orthogonal_init_and_penalty(feature_map, stacked):
    torch.manual_seed(4)
    lam = 0.1
    cfg = make_cfg(feature_map, stacked, orthogonality_penalty=lam)
    model = EncoderForPretraining(cfg)  # the encoder's generic init must not clobber W
    kernel = model.encoder.groups[0][0].attention.kernel
    eye = torch.eye(cfg.head_dim)
    for u in units(kernel):
        torch.testing.assert_close(u.w_Hhh @ u.w_Hhh.mT, eye.expand_as(u.w_Hhh), atol=1e-5, rtol=0)
        assert u.w_Hhh.std() > 0.1  # not N(0, 0.02)
    assert kernel.orthogonality_loss().item() < 1e-10

    with torch.no_grad():
        for u in units(kernel):
            u.w_Hhh.add_(0.1 * torch.randn_like(u.w_Hhh))
    # The authors add lambda * mean((W W^T - I)^2) at each feature-map call (queries, keys).
    expected = 2 * lam * orthogonality_formula(units(kernel))
    assert expected > 1e-4
    torch.testing.assert_close(kernel.orthogonality_loss(), expected)

    # In the model output; debug has 2 applications of one shared layer: counted once.
    ids = torch.randint(1, 512, (2, 8))
    aux = model(ids).aux_losses
    assert set(aux) == {"kernel_orthogonality"}
    torch.testing.assert_close(aux["kernel_orthogonality"], expected)

    # Without the penalty, no aux loss at all.
    plain = EncoderForPretraining(make_cfg(feature_map, stacked))
    assert plain(ids).aux_losses == {}


def test_glu_not_orthogonal_and_ignored_settings_warn():
    torch.manual_seed(5)
    kernel = make_kernel(make_cfg("glu"))
    w = units(kernel)[0].w_Hhh
    assert (w @ w.mT - torch.eye(w.size(-1))).abs().max() > 0.1
    with pytest.warns(UserWarning, match="orthogonality_penalty"):
        model = EncoderForPretraining(make_cfg("glu", orthogonality_penalty=0.1))
    assert model(torch.randint(1, 512, (1, 6))).aux_losses == {}
    with pytest.warns(UserWarning, match="num_stacked"):
        KernelAttention(make_cfg("elu", 3))


def test_penalty_counted_once_per_distinct_layer():
    """4 applications of 2 groups x 2 inner layers: each of the 4 distinct layers once."""
    torch.manual_seed(6)
    cfg = EncoderConfig.preset(
        "debug",
        attention="kernel",
        num_hidden_layers=4,
        num_hidden_groups=2,
        inner_group_num=2,
        kernel={"feature_map": "aoglu", "orthogonality_penalty": 0.5},
    )
    model = Encoder(cfg)
    kernels = [layer.attention.kernel for group in model.groups for layer in group]
    with torch.no_grad():
        for kernel in kernels:
            for u in units(kernel):
                u.w_Hhh.mul_(1.1)
    expected = sum(2 * 0.5 * orthogonality_formula(units(kernel)) for kernel in kernels)
    aux = model(torch.randint(1, 512, (2, 5))).aux_losses
    torch.testing.assert_close(aux["kernel_orthogonality"], expected)


@pytest.mark.parametrize(("feature_map", "stacked"), CASES)
def test_bf16_autocast(feature_map, stacked):
    torch.manual_seed(7)
    cfg = make_cfg(feature_map, stacked)
    kernel = make_kernel(cfg)
    q, k, v = random_qkv(cfg, B=3, N=16)
    ctx = LayerContext(mask_BN=padded_mask(3, 16))
    ref, _ = kernel(q, k, v, ctx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out32, _ = kernel(q, k, v, ctx)
        out16, _ = kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), ctx)
    assert out32.dtype == torch.float32 and out16.dtype == torch.bfloat16
    torch.testing.assert_close(out32, ref, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(out16.float(), ref, atol=5e-2, rtol=5e-2)

    model = EncoderForPretraining(cfg).eval()
    ids = torch.randint(1, 512, (2, 12))
    ref_h = model(ids).encoder.last_hidden_state
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h16 = model(ids).encoder.last_hidden_state
    assert torch.isfinite(h16).all()
    torch.testing.assert_close(h16.float(), ref_h, atol=0.15, rtol=0.1)


def test_sums_accumulated_in_fp32_under_autocast():
    """Given the bf16 features phi(q), phi(k) and bf16 values, the output must be the exact
    result rounded once to bf16: relative error <= 2^-8, plus an fp32-sized absolute slack for
    outputs near 0. Sums and products kept in bf16 miss this bound by ~1e-3."""
    torch.manual_seed(8)
    cfg = make_cfg("ffn")
    kernel = make_kernel(cfg)
    q, k, v = (t.bfloat16() for t in random_qkv(cfg, B=3, N=512))
    mask = padded_mask(3, 512)
    feats = []
    kernel.phi.register_forward_hook(lambda mod, args, out: feats.append(out))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = kernel(q, k, v, LayerContext(mask_BN=mask))
    phi_q, phi_k = feats
    assert phi_q.dtype == torch.bfloat16
    exact = naive_kernel_attention(phi_q.double(), phi_k.double(), v.double(), mask, cfg.kernel.eps)
    err = (out.double() - exact).abs()
    assert (err <= 2**-8 * exact.abs() + 1e-5).all(), err.max()


@pytest.mark.parametrize(("feature_map", "stacked"), CASES)
def test_gradients_reach_feature_map(feature_map, stacked):
    torch.manual_seed(9)
    lam = 0.1 if feature_map in ORTHOGONAL else 0.0  # the penalty's gradient too
    model = EncoderForPretraining(make_cfg(feature_map, stacked, orthogonality_penalty=lam))
    model.train()
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 5:] = 0
    out = model(torch.randint(1, 512, (2, 8)), mask)
    (out.logits.square().mean() + sum(out.aux_losses.values(), torch.zeros(()))).backward()
    kernel = model.encoder.groups[0][0].attention.kernel
    params = dict(kernel.phi.named_parameters())
    per_unit = {"ffn": 1, "glu": 2, "oglu": 2, "aoglu": 3, "elu": 0}[feature_map]  # W, V / A, B
    assert len(params) == per_unit * stacked
    for name, p in params.items():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name


def test_linear_cost_no_N_by_N_intermediate():
    """Forward and backward at N = 4096 never make a tensor larger than one (B, H, N, h + 1)
    (the numerator and the normaliser come out of one product, phi(Q) [KV | z]).
    (Wall time on a shared 2-core runner cannot tell O(N) from O(N^2) at this size; this can.)"""
    torch.manual_seed(10)
    N = 4096
    cfg = EncoderConfig.preset(
        "debug",
        attention="kernel",
        hidden_size=8,
        num_attention_heads=2,
        kernel={"feature_map": "aoglu", "num_stacked": 2, "dropout": 0.1},
    )
    kernel = KernelAttention(cfg).train()
    q, k, v = (t.requires_grad_() for t in random_qkv(cfg, B=1, N=N))
    mask = torch.ones(1, N, dtype=torch.bool)
    mask[0, -100:] = False
    with OpLog() as probe:
        out, _ = kernel(q, k, v, LayerContext(mask_BN=mask))
        out.square().sum().backward()
    h = q.size(-1)
    assert probe.largest_output() <= q.numel() // h * (h + 1), (
        probe.largest_output()
    )  # never (N, N)
    assert out.shape == q.shape and torch.isfinite(q.grad).all()
    # The probe does see an N x N tensor when there is one.
    n = 64
    with OpLog() as naive_probe:
        naive_kernel_attention(q[..., :n, :], k[..., :n, :], v[..., :n, :], mask[:, :n], 1e-6)
    assert naive_probe.largest_output() >= n * n


# --------------------------------------------------------------------------------------------
# Against a port of the authors' code (vladyorsh/lra_efficient_transformers, the LRA notebooks:
# HWLinear, GatedOrthoKernel, AMGOLU, LinearKernel, LKAAttention); written for these tests.
# --------------------------------------------------------------------------------------------


class _AuthorsUnit(torch.nn.Module):
    """One of the authors' kernel units: dropout on the input, then
    kernel_nonlinearity(x W) * gate_nonlinearity(gate(x)), and the penalty appended per call."""

    def __init__(self, w, gate_weights, last: bool, dropout: float, lam: float):
        super().__init__()
        self.w, self.gate_weights, self.last, self.lam = w, gate_weights, last, lam
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x, losses):
        x = self.dropout(x)
        y = torch.matmul(x, self.w)
        y = F.softplus(y) if self.last else y
        if self.gate_weights:
            g = x
            for m in self.gate_weights:
                g = torch.matmul(g, m)
            y = y * torch.sigmoid(g)
        eye = torch.eye(self.w.size(-1)).unsqueeze(0).expand(self.w.size(0), -1, -1)
        losses.append(
            torch.nn.MSELoss()(torch.matmul(self.w, self.w.transpose(-1, -2)), eye) * self.lam
        )
        return y


def _authors_attention(port_units, q, k, v, losses):
    """LKAAttention's kernel step: lka on q, then on k (each call appends the losses)."""
    for u in port_units:
        q = u(q, losses)
    for u in port_units:
        k = u(k, losses)
    h = q.size(-1)
    q, k = q / h**0.5, k / h**0.5
    numerator = torch.matmul(q, (k.unsqueeze(-1) * v.unsqueeze(-2)).sum(dim=2))
    denominator = q.matmul(k.sum(dim=2).unsqueeze(-1))
    return numerator / denominator


def _port_of(kernel: KernelAttention, dropout: float, lam: float) -> list[_AuthorsUnit]:
    out = []
    for u in units(kernel):
        if u.feature_map == "aoglu":
            gate_weights = [u.a_Hhr, u.b_Hrh]
        elif u.feature_map in ("glu", "oglu"):
            gate_weights = [u.v_Hhh]
        else:
            gate_weights = []
        out.append(_AuthorsUnit(u.w_Hhh, gate_weights, u.last, dropout, lam))
    return out


class _ReplayedDropout(torch.nn.Module):
    """Inverted dropout with given masks, one per call in order (the port's stand-in for
    nn.Dropout, so that it drops exactly what ours dropped)."""

    def __init__(self, kept_masks: list[torch.Tensor], p: float):
        super().__init__()
        self.kept_masks, self.p = kept_masks, p

    def forward(self, x):
        return x * self.kept_masks.pop(0) / (1 - self.p)


@pytest.mark.parametrize(("feature_map", "stacked"), [("aoglu", 3), ("oglu", 2), ("ffn", 1)])
def test_matches_authors_port(feature_map, stacked):
    """Same output and the same penalty as the authors' kernel attention, with dropout: the
    port drops what ours dropped (our masks recorded per unit and call, replayed in the port's
    order: the queries' units, then the keys'); padding-free since their kernel has no mask."""
    lam, p = 0.1, 0.2
    cfg = make_cfg(feature_map, stacked, dropout=p, orthogonality_penalty=lam)
    torch.manual_seed(7)
    kernel = KernelAttention(cfg).train()
    kept: list[torch.Tensor] = []
    for u in units(kernel):
        u.init_parameters()
        # our units run heads first: a kept mask (H, B, N, h) back to (B, H, N, h)
        u.dropout.register_forward_hook(lambda m, a, out: kept.append((out != 0).transpose(0, 1)))
    port = _port_of(kernel, p, lam)
    q, k, v = random_qkv(cfg, B=2, N=11)
    ctx = LayerContext(mask_BN=torch.ones(2, 11, dtype=torch.bool))
    ours, aux = kernel(q, k, v, ctx)
    assert (
        len(kept) == 2 * stacked
        and 0.1 < 1 - torch.cat([m.flatten() for m in kept]).float().mean() < 0.3
    )
    for u in port:
        u.dropout = _ReplayedDropout(kept, p)
    losses: list[torch.Tensor] = []
    theirs = _authors_attention(port, q, k, v, losses)
    assert not kept  # every mask used once
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    assert len(losses) == 2 * stacked
    torch.testing.assert_close(aux["kernel_orthogonality"], sum(losses))


def test_non_orthogonal_weights_are_he_normal():
    """The authors' HWLinear init N(0, 2 / fan_in) for V (glu), A and B (aoglu); about 6x the
    std of nn.Linear's U(+-1/sqrt(fan_in)) at fan_in 8 (aoglu's B)."""
    torch.manual_seed(8)
    big = EncoderConfig.preset(
        "debug",
        attention="kernel",
        hidden_size=256,
        num_attention_heads=4,
        kernel={"feature_map": "aoglu"},
    )
    unit = units(KernelAttention(big))[0]
    h, r = big.head_dim, big.head_dim // 4
    assert abs(unit.a_Hhr.std().item() / (2 / h) ** 0.5 - 1) < 0.05
    assert abs(unit.b_Hrh.std().item() / (2 / r) ** 0.5 - 1) < 0.05
    glu = units(KernelAttention(make_cfg("glu")))[0]
    for w in (glu.w_Hhh, glu.v_Hhh):  # glu's W is not orthogonal: He-normal as well
        assert abs(w.std().item() / (2 / w.size(-2)) ** 0.5 - 1) < 0.2
