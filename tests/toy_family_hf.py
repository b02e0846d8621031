"""The HF side of the toy family of tests/hub/test_hf_export.py ("toy-mean-hf": uniform attention over
the real tokens): what a new family ships beside its own file for `transformers` (torch only),
copied into an export as albatross_family.py."""

from torch import nn


class MeanKernel(nn.Module):
    def __init__(self, config):
        super().__init__()

    def forward(self, q_BHNh, k_BHNh, v_BHNh, ctx):
        w = ctx.mask_BN[:, None, :, None].to(v_BHNh.dtype)
        mean = (v_BHNh * w).sum(2, keepdim=True) / w.sum(2, keepdim=True)
        return mean.expand_as(q_BHNh), {}


PARTS = {"kernel": MeanKernel}
