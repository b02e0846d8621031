"""model.flops: a hand count, torch's FlopCounterMode on real forwards, and scaling in N."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from model.attention.softmax import softmax_mixing_flops
from model.config import EncoderConfig
from model.flops import forward_flops, layer_flops, training_flops
from model.heads import EncoderForPretraining

TINY = dict(
    vocab_size=100,
    embedding_size=8,
    hidden_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=64,
)


def test_softmax_matches_a_hand_count() -> None:
    cfg = EncoderConfig(**TINY)
    N, M = 10, 3  # tokens, MLM-decoded positions
    embedding = 2 * N * 8 * 16
    qkvo = 4 * (2 * N * 16 * 16)
    scores_and_mixing = 2 * (2 * N * N * 16)
    ffn = 2 * (2 * N * 16 * 32)
    layers = 3 * (qkvo + scores_and_mixing + ffn)
    pooler = 2 * 16 * 16
    mlm = 2 * M * 16 * 8 + 2 * M * 8 * 100
    sop = 2 * 16 * 2
    assert (embedding, layers, mlm) == (2560, 142080, 5568)  # the arithmetic above, spelled out
    assert forward_flops(cfg, N, heads=False) == embedding + layers + pooler
    total = embedding + layers + pooler + mlm + sop
    assert total == 150784
    assert forward_flops(cfg, N, masked_tokens=M) == total
    assert training_flops(cfg, N, masked_tokens=M) == 3 * total
    dense_mlm = 2 * N * 16 * 8 + 2 * N * 8 * 100  # no masked_tokens: every position decoded
    assert forward_flops(cfg, N) == embedding + layers + pooler + dense_mlm + sop


def test_sharing_does_not_reduce_compute_but_inner_layers_add_to_it() -> None:
    N = 12
    base = EncoderConfig(**TINY)
    unshared = EncoderConfig(**{**TINY, "num_hidden_groups": 3})
    inner = EncoderConfig(**{**TINY, "inner_group_num": 2})
    assert forward_flops(unshared, N) == forward_flops(base, N)
    assert forward_flops(inner, N) - forward_flops(base, N) == 3 * layer_flops(base, N)


def _counted(model: torch.nn.Module, batch: int, N: int, K: int | None, train: bool) -> int:
    """FlopCounterMode's total for one forward (and backward when `train`) of `batch` sequences."""
    ids = torch.randint(5, model.config.vocab_size, (batch, N))
    positions = None if K is None else torch.arange(K).expand(batch, K)
    counter = FlopCounterMode(display=False)
    # The MATH backend decomposes SDPA into bmm: the CPU's fused SDPA kernel is not registered
    # in FlopCounterMode (it would count 0 FLOPs for softmax attention on CPU; CUDA's flash and
    # memory-efficient kernels are registered).
    with counter, sdpa_kernel(SDPBackend.MATH):
        out = model(ids, masked_positions=positions)
        if train:
            loss = out.logits.float().square().mean() + out.sop_logits.float().square().mean()
            (loss + sum(out.aux_losses.values(), torch.zeros(()))).backward()
    return counter.get_total_flops()


FAMILIES = {
    "softmax": {"attention": "softmax"},
    "tisa": {"attention": "tisa"},
    "kernel-aoglu": {"attention": "kernel"},
    "kernel-glu-x2": {"attention": "kernel", "kernel": {"feature_map": "glu", "num_stacked": 2}},
    "kernel-elu": {"attention": "kernel", "kernel": {"feature_map": "elu"}},
    "transject": {"attention": "transject"},
    "transject-random": {"attention": "transject", "transject": {"eigenvalues": "random"}},
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_forward_matches_torch_flop_counter(name: str) -> None:
    cfg = EncoderConfig.preset("debug", **FAMILIES[name])
    model = EncoderForPretraining(cfg)
    N, K = 40, 7
    for masked in (None, K):
        # Per sequence = 2 sequences - 1 sequence: drops work that does not grow with the batch
        # (FlopCounterMode does not count the orthogonal maps' solves today anyway).
        per_sequence = _counted(model, 2, N, masked, False) - _counted(model, 1, N, masked, False)
        assert per_sequence == forward_flops(cfg, N, masked_tokens=masked)
    # Both count matrix products only (mm, addmm, bmm, SDPA), hence exact agreement; elementwise
    # work (softmax, LayerNorm, GELU, the kernel normaliser) is in neither.


@pytest.mark.parametrize("name", ["softmax", "kernel-aoglu"])
def test_training_step_is_three_forwards(name: str) -> None:
    cfg = EncoderConfig.preset("debug", **FAMILIES[name])
    model = EncoderForPretraining(cfg)
    N, K = 32, 5
    per_sequence = _counted(model, 2, N, K, True) - _counted(model, 1, N, K, True)
    assert per_sequence == training_flops(cfg, N, masked_tokens=K)


def test_linear_families_scale_linearly_softmax_quadratically() -> None:
    N = 512
    kernel = EncoderConfig.preset("albert-base", attention="kernel")
    assert layer_flops(kernel, 8 * N) == 8 * layer_flops(kernel, N)  # every term is O(N)
    assert forward_flops(kernel, 8 * N, heads=False) / forward_flops(
        kernel, N, heads=False
    ) == pytest.approx(8, rel=1e-4)  # the pooler's one token is the only O(1) term

    transject = EncoderConfig.preset("albert-base", attention="transject")
    # From N = d (768) on, the eigen-state's Gram matrix is X^T X (N d^2: linear in N; below,
    # X X^T, N^2 d, is the smaller); the O(E d) gates and the pooler are constant in N.
    n = 1024
    ratio = forward_flops(transject, 8 * n, heads=False) / forward_flops(transject, n, heads=False)
    assert 7.8 < ratio < 8.0
    assert layer_flops(transject, 8 * N) / layer_flops(transject, N) == pytest.approx(8, rel=1e-6)

    softmax = EncoderConfig.preset("albert-base")
    d = softmax.hidden_size
    assert softmax_mixing_flops(softmax, 8 * N) == 64 * softmax_mixing_flops(softmax, N)
    # f(2N) - 2 f(N) leaves only the quadratic term a (2N)^2 - 2 a N^2 = 2 a N^2, a = 4 d.
    assert layer_flops(softmax, 2 * N) - 2 * layer_flops(softmax, N) == 2 * (4 * d) * N**2
    ratio = forward_flops(softmax, 8 * N, heads=False) / forward_flops(softmax, N, heads=False)
    assert ratio > 13  # attention dominates at 4096 tokens on albert-base


def test_bad_arguments_raise() -> None:
    cfg = EncoderConfig(**TINY)
    with pytest.raises(ValueError, match="seq_len"):
        forward_flops(cfg, 0)
    with pytest.raises(ValueError, match="masked_tokens"):
        forward_flops(cfg, 10, masked_tokens=11)
    cfg.attention = "mystery"  # not registered at all
    with pytest.raises(ValueError, match="unknown attention 'mystery'"):
        forward_flops(cfg, 10)
