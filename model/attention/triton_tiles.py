"""Tile loads and stores shared by the attention families' Triton kernels (TISA's split
backend, kernel attention's kernels).

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


@triton.jit
def store_rows(ptr, x, offs_n, offs_d, stride_n, N, HEAD: tl.constexpr, D: tl.constexpr):
    """Stores the (len(offs_n), D) tile x as rows offs_n of an (N, h) head, in ptr's dtype: the
    rows past N and the padded columns (HEAD < D, masked only then, as in `load_rows`) left out.
    """
    if HEAD < D:
        mask = (offs_n[:, None] < N) & (offs_d[None, :] < HEAD)
    else:
        mask = offs_n[:, None] < N
    tl.store(ptr + offs_n[:, None] * stride_n + offs_d[None, :], x.to(ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


@triton.jit
def load_summary(KV, Z, bh, offs_d, D: tl.constexpr):
    """The (D, D) and (D,) fp32 per-head summaries (or their gradients) of batch x head bh."""
    kv = tl.load(KV + bh.to(tl.int64) * D * D + offs_d[:, None] * D + offs_d[None, :])
    return kv, tl.load(Z + bh.to(tl.int64) * D + offs_d)
