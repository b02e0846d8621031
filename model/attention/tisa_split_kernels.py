"""The Triton kernels of TISA's `split` backend (tisa_split.py explains what they compute).

Imported on first use by `tisa_split._kernels`: Triton is needed only on CUDA, and it reads
TRITON_INTERPRET when these are defined (tests run them on CPU tensors in its interpreter).
"""

import triton
import triton.language as tl

from model.attention.triton_tiles import load_rows


@triton.jit
def row_lse(
    Q, K, VALS, VALID, LSE,
    sqb, sqh, sqn, skb, skh, skn, s_vals, s_valid, N, H, scale,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, HEAD: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """LSE[b, h, i] = logsumexp_j(scale q_i . k_j + f(j - i)), real keys j only."""
    pid_i = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit offsets: B N 3 d may pass 2^31 elements
    h = bh % H
    offs_i = pid_i * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    q = load_rows(Q + b * sqb + h * sqh, offs_i, offs_d, sqn, N, HEAD, D, UPCAST)
    m = tl.full([BLOCK], -1.0e30, tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for j0 in range(0, N, BLOCK):
        offs_j = j0 + tl.arange(0, BLOCK)
        kt = load_rows(K + b * skb + h * skh, offs_j, offs_d, skn, N, HEAD, D, UPCAST)
        index = offs_j[None, :] - offs_i[:, None] + N - 1
        bias = tl.load(
            VALS + h * s_vals + index, mask=(index >= 0) & (index < 2 * N - 1), other=0.0
        )
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale + bias
        real = offs_j < N
        if HAS_MASK:
            real = real & (tl.load(VALID + b * s_valid + offs_j, mask=offs_j < N, other=0) != 0)
        s = tl.where(real[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        acc = acc * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
    tl.store(LSE + bh * N + offs_i, m + tl.log(acc), mask=offs_i < N)


@triton.jit
def diagonal_grad(
    Q, K, V, DO, LSE, DELTA, VALS, VALID, PART,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn, s_vals, s_valid,
    B, N, H, NB, SLICES, scale,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, HEAD: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """PART[slice, h, diag] = sum of dS over the tiles (bi, bi + diag - NB + 1) of head h and
    the samples slice, slice + SLICES, ... (dS of the padding and past N is zero)."""
    diag = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    shift = diag - (NB - 1)  # key block minus query block
    r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    index = shift * BLOCK + r[None, :] - r[:, None] + N - 1  # the same on every tile
    bias = tl.load(VALS + h * s_vals + index, mask=(index >= 0) & (index < 2 * N - 1), other=0.0)
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    first = tl.maximum(0, -shift)
    last = tl.minimum(NB, NB - shift)
    tiles = last - first  # tiles of this diagonal per sample
    samples = (B - part + SLICES - 1) // SLICES  # samples part, part + SLICES, ...
    for t in range(0, samples * tiles):  # one loop, so that Triton pipelines its loads
        b = (part + (t // tiles) * SLICES).to(tl.int64)  # 64-bit offsets, as in row_lse
        bi = first + t % tiles
        offs_i = bi * BLOCK + r
        offs_j = offs_i + shift * BLOCK
        q = load_rows(Q + b * sqb + h * sqh, offs_i, offs_d, sqn, N, HEAD, D, UPCAST)
        kt = load_rows(K + b * skb + h * skh, offs_j, offs_d, skn, N, HEAD, D, UPCAST)
        do = load_rows(DO + b * sdb + h * sdh, offs_i, offs_d, sdn, N, HEAD, D, UPCAST)
        vt = load_rows(V + b * svb + h * svh, offs_j, offs_d, svn, N, HEAD, D, UPCAST)
        lse = tl.load(LSE + (b * H + h) * N + offs_i, mask=offs_i < N, other=0.0)
        delta = tl.load(DELTA + (b * H + h) * N + offs_i, mask=offs_i < N, other=0.0)
        real = offs_j < N
        if HAS_MASK:
            real = real & (tl.load(VALID + b * s_valid + offs_j, mask=offs_j < N, other=0) != 0)
        real = (offs_i < N)[:, None] & real[None, :]
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale + bias
        p = tl.where(real, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(vt), input_precision=PRECISION)
        acc += p * (dp - delta[:, None])
    base = ((part * H + h) * (2 * NB - 1) + diag) * BLOCK * BLOCK
    tl.store(PART + base + r[:, None] * BLOCK + r[None, :], acc)
