"""Softmax attention for the Hugging Face side of an export (`torch` only; see
`model/hub/hf_remote/`). Copied into an export as ``albatross_family.py`` when a softmax model is not
a native ALBERT (pre-LN or ReZero residuals, no absolute positions, orthogonal projections):
the same computation as `model/attention/softmax.py` in inference."""

import torch
import torch.nn.functional as F
from torch import nn


def key_padding_bias(mask_BN, dtype):
    """Additive (B, 1, 1, N) bias: 0 at real keys, the dtype's min at padding keys."""
    bias = torch.zeros(mask_BN.shape, dtype=dtype, device=mask_BN.device)
    return bias.masked_fill(~mask_BN, torch.finfo(dtype).min)[:, None, None, :]


class SoftmaxKernel(nn.Module):
    """softmax(Q K^T / sqrt(h) + key padding) V."""

    def __init__(self, config):
        super().__init__()
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, q_BHNh, k_BHNh, v_BHNh, ctx):
        out = F.scaled_dot_product_attention(
            q_BHNh,
            k_BHNh,
            v_BHNh,
            attn_mask=key_padding_bias(ctx.mask_BN, q_BHNh.dtype),
            dropout_p=self.dropout_p if self.training else 0.0,
        )
        return out, {}


PARTS = {"kernel": SoftmaxKernel}
