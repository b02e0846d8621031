"""The Triton kernel of the Cayley map's `gauss_jordan` leaf inverse (model/orthogonal.py).

Imported on first use by `orthogonal._gauss_jordan_kernel`: Triton is needed only on CUDA, and it
reads TRITON_INTERPRET when the kernel is defined (tests run it on CPU tensors in its
interpreter).
"""

import triton
import triton.language as tl


@triton.jit
def gauss_jordan_inverse(M, OUT, n, stride_b, stride_r, NP: tl.constexpr):
    """OUT[b] = M[b]^-1 for the (n, n) matrix b of a batch, one program per matrix, held in
    registers as an NP x NP tile (NP a power of two >= n, the rest of it the identity), by n
    in-place Gauss-Jordan sweeps without pivoting: for pivot k, p = a_kk, every a_ij (i, j != k)
    loses a_ik a_kj / p, row k is divided by p, column k by -p, and a_kk becomes 1 / p. After
    the n sweeps the tile holds the inverse. Row and column k are written as such, not folded
    into the rank-one update (as a -= x y^T with x = (a[:, k] - e_k) / p, y = a[k, :] + e_k they
    would lose digits to cancellation when p is large). Needs no pivoting where every leading
    block has a symmetric part >= I (`orthogonal.block_inverse` explains why its blocks do)."""
    b = tl.program_id(0)
    r = tl.arange(0, NP)
    rows = r[:, None]
    cols = r[None, :]
    inside = (rows < n) & (cols < n)
    a = tl.load(M + b * stride_b + rows * stride_r + cols, mask=inside, other=0.0)
    a = tl.where(inside, a, tl.where(rows == cols, 1.0, 0.0))
    for k in range(0, n):
        row_k = tl.sum(tl.where(rows == k, a, 0.0), axis=0)  # a[k, :]
        col_k = tl.sum(tl.where(cols == k, a, 0.0), axis=1)  # a[:, k]
        inv_p = 1.0 / tl.sum(tl.where(r == k, row_k, 0.0), axis=0)
        row_k = row_k * inv_p
        new_row = tl.where(r == k, inv_p, row_k)  # row k: a[k, j] / p, and 1 / p at (k, k)
        new_col = -col_k * inv_p  # column k: -a[i, k] / p
        a = tl.where(
            rows == k,
            new_row[None, :],
            tl.where(cols == k, new_col[:, None], a - col_k[:, None] * row_k[None, :]),
        )
    tl.store(OUT + b * stride_b + rows * stride_r + cols, a, mask=inside)
