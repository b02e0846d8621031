"""Trainable feed-forward kernels for the Hugging Face side of an export (`torch` only; see
`model/hub/hf_remote/`). Copied into an export as ``albatross_family.py``: the same computation as
`model/attention/kernel.py` in inference (fp32 sums).

out_i = phi(q_i)^T sum_j phi(k_j) v_j^T / (phi(q_i)^T sum_j phi(k_j) + eps), phi learned per
head and shared by queries and keys: ``num_stacked`` units g(x W) [* sigmoid(gate(x))], softplus
in the last (ffn, glu, oglu, aoglu), or the parameter-free elu(x) + 1.
"""

import torch
import torch.nn.functional as F
from torch import nn

ORTHOGONAL_MAPS = ("ffn", "oglu", "aoglu")


class FeatureMapUnit(nn.Module):
    """One unit: g(Drop(x) W) [* sigmoid(Drop(x) V) or sigmoid(Drop(x) A B)], per head."""

    def __init__(self, feature_map, num_heads, head_dim, rank, last, dropout):
        super().__init__()
        H, h = num_heads, head_dim
        self.feature_map = feature_map
        self.last = last
        self.dropout = nn.Dropout(dropout)
        self.w_Hhh = nn.Parameter(torch.zeros(H, h, h))
        if feature_map in ("glu", "oglu"):
            self.v_Hhh = nn.Parameter(torch.zeros(H, h, h))
        elif feature_map == "aoglu":
            self.a_Hhr = nn.Parameter(torch.zeros(H, h, rank))
            self.b_Hrh = nn.Parameter(torch.zeros(H, rank, h))

    def forward(self, x_BHNh):
        x_BHNh = self.dropout(x_BHNh)
        y = x_BHNh @ self.w_Hhh
        if self.last:
            y = F.softplus(y)
        if self.feature_map in ("glu", "oglu"):
            y = y * torch.sigmoid(x_BHNh @ self.v_Hhh)
        elif self.feature_map == "aoglu":
            y = y * torch.sigmoid((x_BHNh @ self.a_Hhr) @ self.b_Hrh)
        return y

    def orthogonality_error(self):
        w = self.w_Hhh.float()
        eye = torch.eye(w.size(-1), device=w.device)
        return (w @ w.mT - eye).pow(2).mean()


class FeedForwardFeatureMap(nn.Module):
    def __init__(self, config, kc):
        super().__init__()
        h = config.hidden_size // config.num_attention_heads
        stacked = kc.get("num_stacked", 1)
        self.units = nn.ModuleList(
            FeatureMapUnit(
                kc.get("feature_map", "aoglu"),
                config.num_attention_heads,
                h,
                h // kc.get("gate_rank_divisor", 4),
                last=i == stacked - 1,
                dropout=kc.get("dropout", 0.1),
            )
            for i in range(stacked)
        )

    def forward(self, x_BHNh):
        for unit in self.units:
            x_BHNh = unit(x_BHNh)
        return x_BHNh

    def orthogonality_error(self):
        errors = [u.orthogonality_error() for u in self.units if u.feature_map in ORTHOGONAL_MAPS]
        return torch.stack(errors).sum() if errors else None


class EluFeatureMap(nn.Module):
    def forward(self, x_BHNh):
        return F.elu(x_BHNh) + 1.0

    def orthogonality_error(self):
        return None


class KernelAttention(nn.Module):
    """Non-causal linear attention with the trainable feature map phi."""

    def __init__(self, config):
        super().__init__()
        kc = config.kernel
        self.eps = kc.get("eps", 1e-6)
        self.penalty = kc.get("orthogonality_penalty", 0.0)
        elu = kc.get("feature_map", "aoglu") == "elu"
        self.phi = EluFeatureMap() if elu else FeedForwardFeatureMap(config, kc)

    def forward(self, q_BHNh, k_BHNh, v_BHNh, ctx):
        phi_q = self.phi(q_BHNh).float()
        phi_k = self.phi(k_BHNh).float()
        phi_k = phi_k.masked_fill(~ctx.mask_BN[:, None, :, None], 0.0)  # padding keys: nothing
        kv = phi_k.mT @ v_BHNh.float()  # (B, H, h, h): sum_j phi(k_j) v_j^T
        z = phi_k.sum(dim=-2)[..., None]  # (B, H, h, 1): sum_j phi(k_j)
        out = (phi_q @ kv) / (phi_q @ z + self.eps)
        aux = {}
        if self.penalty > 0 and ctx.first_use:
            error = self.phi.orthogonality_error()
            if error is not None:  # the authors count it for the queries' and the keys' call
                aux["kernel_orthogonality"] = 2 * self.penalty * error
        return out.to(v_BHNh.dtype), aux


PARTS = {"kernel": KernelAttention}
