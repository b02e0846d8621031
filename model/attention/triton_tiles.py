"""Tile loads shared by the attention families' Triton kernels (TISA's split backend, kernel
attention's inference kernels).

Imported by those kernel modules, which are imported on first use: Triton is needed only on
CUDA, and it reads TRITON_INTERPRET when a kernel is defined.
"""

import triton
import triton.language as tl


@triton.jit
def load_rows(
    ptr, offs_n, offs_d, stride_n, N, HEAD: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr
):
    """Rows offs_n of an (N, h) head, zero outside, widths padded to the power of two D. The
    width is masked only when it is padded (HEAD < D): a mask that varies along the contiguous
    dimension stops Triton from vectorising the load and from pipelining it (async copies).
    UPCAST: returned in fp32 (Triton's interpreter, whose dots of bf16 tiles are not the GPU's)."""
    if HEAD < D:
        mask = (offs_n[:, None] < N) & (offs_d[None, :] < HEAD)
    else:
        mask = offs_n[:, None] < N
    x = tl.load(ptr + offs_n[:, None] * stride_n + offs_d[None, :], mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x
