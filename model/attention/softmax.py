"""Softmax attention through PyTorch's scaled_dot_product_attention, with a key-padding mask.

SDPA picks the fastest kernel it can (cuDNN / flash / memory-efficient on GPU, a fused C++
kernel on CPU). What decides which CUDA kernels are eligible is the mask (torch 2.x,
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp): flash attention takes **no** mask at
all; cuDNN (first in line on H100-class GPUs with a recent cuDNN) takes a float or boolean mask
of shape (1 or B, 1 or H, 1 or N, N) that does not require grad; the memory-efficient kernel
takes any mask; a boolean mask is turned into a float one (-inf at False) before the kernel.
So an unpadded batch passes `attn_mask=None` (the flash kernel stays eligible; an all-zero
float bias, what this kernel passed before, ruled it out) and a padded one the additive
(B, 1, 1, N) key-padding bias (a boolean mask measured no faster: `base.sdpa_key_mask`).
Whether the batch is padded is known on the host without a device sync (`LayerContext.padded`,
see `base.batch_is_padded`). `naive_softmax_attention` is the O(N^2) reference every softmax-based
kernel is tested against.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor

from model.attention.base import (
    AttentionFamily,
    AuxLosses,
    LayerContext,
    ScoreKernel,
    matmul_flops,
    sdpa_key_mask,
)
from model.attention.hf_export import HFExport, NativeModel, family_code
from model.config import EncoderConfig


def naive_softmax_attention(
    q_BHNh: Tensor, k_BHNh: Tensor, v_BHNh: Tensor, mask_BN: Tensor, bias_HNN: Tensor | None = None
) -> Tensor:
    """softmax(Q K^T / sqrt(h) + bias + mask) V, written out. The reference for tests."""
    scores_BHNN = q_BHNh @ k_BHNh.transpose(-1, -2) / math.sqrt(q_BHNh.size(-1))
    if bias_HNN is not None:
        scores_BHNN = scores_BHNN + bias_HNN
    scores_BHNN = scores_BHNN.masked_fill(~mask_BN[:, None, None, :], float("-inf"))
    return scores_BHNN.softmax(dim=-1) @ v_BHNh


class SoftmaxKernel(ScoreKernel):
    """Scaled dot-product softmax attention with a key-padding mask."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dropout_p = cfg.attention_probs_dropout_prob

    def forward(
        self, q_BHNh: Tensor, k_BHNh: Tensor, v_BHNh: Tensor, ctx: LayerContext
    ) -> tuple[Tensor, AuxLosses]:
        out_BHNh = F.scaled_dot_product_attention(
            q_BHNh,
            k_BHNh,
            v_BHNh,
            attn_mask=sdpa_key_mask(ctx, q_BHNh.dtype),  # None when unpadded
            dropout_p=self.dropout_p if self.training else 0.0,
        )
        return out_BHNh, {}


def softmax_mixing_flops(cfg: EncoderConfig, seq_len: int) -> int:
    """Q K^T and softmax(.) V over all heads: 2 x 2 N N d (a bias added to the logits, as
    TISA's, is elementwise and not counted)."""
    return 2 * matmul_flops(seq_len, cfg.hidden_size, seq_len)


def native_albert(cfg: EncoderConfig, head: dict, state: dict) -> NativeModel:
    """The export as a native `transformers` ALBERT (`model.hub.albert_names.albert_export`)."""
    from model.hub.albert_names import albert_export

    return albert_export(cfg, head, state)


FAMILY = AttentionFamily(
    name="softmax",
    description="softmax attention (PyTorch SDPA) with a key-padding mask",
    kernel=SoftmaxKernel,
    mixing_flops=softmax_mixing_flops,
    hf_export=HFExport(code=family_code(__file__, "softmax_hf.py"), native=native_albert),
    # Compiled, the shipped recipe's training step was measured faster on a GPU
    # (docs/benchmarks.md#compiled-against-eager); equal to eager (tests/bench/test_gpu_fast_paths.py).
    compile_auto=True,
)

__all__ = ["FAMILY", "SoftmaxKernel", "naive_softmax_attention", "softmax_mixing_flops"]
