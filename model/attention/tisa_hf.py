"""TISA for the Hugging Face side of an export (`torch` only; see `model/hub/hf_remote/`). Copied
into an export as ``albatross_family.py``: the same computation as `model/attention/tisa.py`
(its SDPA path) in inference.

Each head adds f(j - i) = sum_s a_s exp(-|b_s| (j - i - c_s)^2) to its attention logits; the
scorers (one, or one per layer application) are evaluated once per forward at the 2N - 1
offsets, and each layer expands its scorer's values into the (H, N, N) Toeplitz bias.
"""

import torch
import torch.nn.functional as F
from torch import nn


class PositionScorer(nn.Module):
    """f(k) = sum_s a_s exp(-|b_s| (k - c_s)^2) for every head; a, b, c are (S, H)."""

    def __init__(self, num_kernels, num_heads):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(num_kernels, num_heads))
        self.b = nn.Parameter(torch.zeros(num_kernels, num_heads))
        self.c = nn.Parameter(torch.zeros(num_kernels, num_heads))

    def values(self, N):
        """f at k = -(N-1) .. N-1: (H, 2N - 1), offset k at index k + N - 1."""
        k = torch.arange(-(N - 1), N, device=self.a.device).to(self.a.dtype)
        a, b, c = (p.unsqueeze(-1) for p in (self.a, self.b, self.c))
        return (a * torch.exp(-b.abs() * (k - c) ** 2)).sum(0)


class TISAState(nn.Module):
    """The scorers, evaluated once per forward: extras ``tisa_values`` (P, H, 2N - 1)."""

    def __init__(self, config):
        super().__init__()
        tisa = config.tisa
        per_layer = tisa.get("scope", "shared") == "per_layer"
        count = config.num_hidden_layers * config.inner_group_num if per_layer else 1
        self.scorers = nn.ModuleList(
            PositionScorer(tisa.get("num_kernels", 5), config.num_attention_heads)
            for _ in range(count)
        )

    def forward(self, x0_BND, mask_BN):
        N = x0_BND.size(1)
        return {"tisa_values": torch.stack([s.values(N) for s in self.scorers])}, {}


def toeplitz_bias(values_HM):
    """(H, 2N - 1) values of f -> the (H, N, N) bias F[h, i, j] = f_h(j - i)."""
    N = (values_HM.size(-1) + 1) // 2
    pos = torch.arange(N, device=values_HM.device)
    return values_HM[:, pos[None, :] - pos[:, None] + N - 1]


class TISAKernel(nn.Module):
    """softmax(Q K^T / sqrt(h) + F + key padding) V."""

    def __init__(self, config):
        super().__init__()
        self.per_layer = config.tisa.get("scope", "shared") == "per_layer"
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, q_BHNh, k_BHNh, v_BHNh, ctx):
        values = ctx.extras["tisa_values"][ctx.layer_index if self.per_layer else 0]
        dtype = q_BHNh.dtype
        padding = torch.zeros(ctx.mask_BN.shape, dtype=dtype, device=q_BHNh.device)
        padding = padding.masked_fill(~ctx.mask_BN, torch.finfo(dtype).min)
        bias = toeplitz_bias(values).to(dtype) + padding[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q_BHNh,
            k_BHNh,
            v_BHNh,
            attn_mask=bias,
            dropout_p=self.dropout_p if self.training else 0.0,
        )
        return out, {}


PARTS = {"kernel": TISAKernel, "state": TISAState}
