"""TransJect for the Hugging Face side of an export (`torch` only; see `model/hub/hf_remote/`).
Copied into an export as ``albatross_family.py``: the same computation as
`model/attention/transject.py` in inference, with its orthogonal maps (experts U_e, V_e, the
eigenbasis U, the FFN maps, an orthogonal token embedding) stored as the matrices themselves,
so no parametrisation is needed here.

    embeddings   x_i = [ sqrt(P) E(t_i) ; PE(i) ], P = d/2 (sinusoidal PE; token types ignored)
    state        M = X0^T X0 over real tokens; lambda = diag(U^T M U) / max|diag(U^T M U)|
                 (or a learned diagonal, Random-TransJect), plus the reconstruction loss
    attention    A_e(X) = ELU((X U_e + b_e) diag(lambda) V_e^T), mixed by a per-sample gate
                 softmax_e(g(masked max_n (X + alpha A_e(X))))
    layer        X <- X + alpha Attn(X); X <- X + alpha ELU(W2 Drop(ELU(W1 X + b1)) + b2),
                 alpha = tanh(r_l) / L
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

EPS = 1e-12


def sinusoidal_encoding(num_positions, width, device=None):
    """(N, width) sinusoidal position encoding, sin and cos interleaved."""
    positions = torch.arange(num_positions, device=device, dtype=torch.float32)[:, None]
    k = torch.arange(0, width, 2, device=device, dtype=torch.float32)
    angles = positions * torch.exp(-math.log(10000.0) * k / width)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)[:, :width]


class TransJectEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.half = config.hidden_size // 2
        self.word_embeddings = nn.Embedding(config.vocab_size, self.half)
        self.scale = math.sqrt(self.half)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def init_parameters(self):
        nn.init.normal_(self.word_embeddings.weight, std=1.0 / math.sqrt(self.half))

    @property
    def token_embedding_weight(self):
        return self.word_embeddings.weight

    def forward(self, input_ids, token_type_ids=None):
        B, N = input_ids.shape
        weight = self.word_embeddings.weight
        tok = F.embedding(input_ids, weight) * self.scale
        pos = sinusoidal_encoding(N, self.half, input_ids.device).to(weight.dtype)
        return self.dropout(torch.cat([tok, pos.expand(B, N, -1)], dim=-1))


class EigenState(nn.Module):
    """lambda (B, d) from the eigenbasis U, or (1, d) from a learned diagonal."""

    def __init__(self, config):
        super().__init__()
        tc = config.transject
        d = config.hidden_size
        self.mode = tc.get("eigenvalues", "approx")
        self.weight = tc.get("reconstruction_weight", 1e-3)
        self.reconstruction = tc.get("reconstruction", "scale_free")
        if self.mode == "approx":
            self.eigenbasis = nn.Parameter(torch.eye(d))
        else:
            self.eigenvalues = nn.Parameter(torch.ones(d))

    def forward(self, x0_BND, mask_BN):
        if self.mode != "approx":
            lam = self.eigenvalues.float()[None, :]
            lam = lam / lam.abs().amax(dim=-1, keepdim=True).clamp_min(EPS)
            return {"transject_lambda": lam}, {}
        x = x0_BND.float() * mask_BN.unsqueeze(-1).float()
        M = x.mT @ x
        U = self.eigenbasis.float()
        lam_raw = (U * (M @ U)).sum(dim=-2)
        s = lam_raw.abs().amax(dim=-1, keepdim=True).clamp_min(EPS)
        lam = lam_raw / s
        aux = {}
        if self.weight > 0:
            recon = (U * lam[:, None, :]) @ U.mT
            target = M if self.reconstruction == "authors" else M / s[:, :, None]
            loss = ((target - recon) ** 2).mean(dim=(-2, -1)).mean()
            aux["transject_reconstruction"] = self.weight * loss
        return {"transject_lambda": lam}, aux


class ExpertBias(nn.Module):
    def __init__(self, num_experts, width):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(num_experts, width))

    def forward(self, y, scale=None, experts_first=False):
        b = self.bias.to(y.dtype)
        if experts_first:  # y (E, T, d), else (..., E, d)
            b = b[:, None, :]
        return y + (b if scale is None else scale * b)


class TransJectAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        tc = config.transject
        d, E = config.hidden_size, tc.get("num_experts", 4)
        self.applications = config.num_hidden_layers * config.inner_group_num
        self.gate_input = tc.get("gate_input", "sublayer")
        self.expert_u = nn.Parameter(torch.eye(d).repeat(E, 1, 1))
        self.expert_v = nn.Parameter(torch.eye(d).repeat(E, 1, 1))
        bias = tc.get("bias", "lipschitz")
        self.expert_u_bias = ExpertBias(E, d) if bias != "none" else None
        self.expert_v_bias = ExpertBias(E, d) if bias == "authors" else None
        self.gate = nn.Linear(d, 1, bias=False)

    def forward(self, x_BND, ctx):
        # The tokens of the batch as one matrix: X U_e of all experts in one product with
        # [U_1 ... U_E], (X U_e Lambda) V_e^T in one batched product over the experts.
        B, N, d = x_BND.shape
        E = self.expert_u.size(0)
        U = self.expert_u.permute(1, 0, 2).reshape(d, E * d)
        xu = (x_BND.reshape(B * N, d) @ U.to(x_BND.dtype)).view(B, N, E, d)
        if self.expert_u_bias is not None:
            xu = self.expert_u_bias(xu)
        lam = ctx.extras["transject_lambda"].to(xu.dtype)[:, None, None, :]
        scaled = (xu * lam).view(B * N, E, d).transpose(0, 1)
        pre = torch.bmm(scaled, self.expert_v.to(xu.dtype).mT)  # (E, B N, d)
        if self.expert_v_bias is not None:
            pre = self.expert_v_bias(pre, xu.sum(dim=-1).view(B * N, E).T[:, :, None], True)
        a = F.elu(pre).view(E, B, N, d)
        padding = ~ctx.mask_BN[:, :, None]
        if self.gate_input == "sublayer":
            alpha = (torch.tanh(ctx.residual_gate) / self.applications).to(a.dtype)
            gated = x_BND.masked_fill(padding, torch.finfo(x_BND.dtype).min)[None] + alpha * a
        else:
            gated = a.masked_fill(padding[None], torch.finfo(a.dtype).min)
        pooled = gated.amax(dim=2)  # (E, B, d)
        pooled = pooled.masked_fill(~ctx.mask_BN.any(dim=1)[None, :, None], 0.0)
        w = self.gate(pooled).squeeze(-1).T.float().softmax(dim=-1)
        return torch.einsum("be,ebnd->bnd", w.to(a.dtype), a)


class TransJectLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.applications = config.num_hidden_layers * config.inner_group_num
        self.attention = TransJectAttention(config)
        bias = config.transject.get("bias", "lipschitz") != "none"
        self.ffn_in = nn.Linear(d, d, bias=bias)
        self.ffn_out = nn.Linear(d, d, bias=bias)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    @staticmethod
    def residual_gate_init(config):
        return config.transject.get("residual_init", 0.0)

    def forward(self, x_BND, ctx):
        alpha = torch.tanh(ctx.residual_gate) / self.applications
        x_BND = x_BND + alpha * self.attention(x_BND, ctx)
        ffn = F.elu(self.ffn_out(self.dropout(F.elu(self.ffn_in(x_BND)))))
        return x_BND + alpha * ffn, {}


PARTS = {"layer": TransJectLayer, "embeddings": TransJectEmbeddings, "state": EigenState}
