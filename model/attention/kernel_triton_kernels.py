"""The Triton kernels of kernel attention's inference forward and of its training mixing's
backward (kernel_triton.py explains what they compute).

Imported on first use by `kernel_triton._kernels`: Triton is needed only on CUDA, and it reads
TRITON_INTERPRET when these are defined (tests run them on CPU tensors in its interpreter).

Rounding: the model rounds every tensor of the feature map to the compute dtype (bf16 under
autocast) after each product and each element-wise function; these kernels round at the same
points (`round_to`), so the features they sum equal the model's up to the order of the sums in
the products. Under UPCAST (Triton's interpreter, whose dots of bf16 tiles and whose conversions
to bf16, a truncation, are not the GPU's) the tiles are fp32 holding the rounded values, and the
rounding to bf16 (to nearest, ties to even, as on the GPU) is done on the bits.
"""

import triton
import triton.language as tl

from model.attention.triton_tiles import load_rows, load_summary, store_rows


@triton.jit
def round_to(x, ROUND: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 x rounded to the compute dtype ROUND ("bf16", "fp16" or "fp32"): a tile of that
    dtype, or under UPCAST an fp32 tile of the rounded values."""
    if ROUND == "fp32":
        y = x
    elif UPCAST:
        if ROUND == "bf16":
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            y = bits.to(tl.float32, bitcast=True)
        else:
            y = x.to(tl.float16).to(tl.float32)
    elif ROUND == "bf16":
        y = x.to(tl.bfloat16)
    else:
        y = x.to(tl.float16)
    return y


@triton.jit
def softplus(x):
    """torch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x)), with log1p by
    Kahan's identity (exact for tiny exp(x), where log(1 + e) would give 0)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    tiny = u == 1.0
    log1p = tl.where(tiny, e, tl.log(u) * (e / tl.where(tiny, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def load_matrix(ptr, offs_r, offs_c, stride_r, ROWS: tl.constexpr, COLS: tl.constexpr,
                UPCAST: tl.constexpr):  # fmt: skip
    """A (ROWS, COLS) row-major matrix at ptr, zero-padded to (len(offs_r), len(offs_c))."""
    mask = (offs_r[:, None] < ROWS) & (offs_c[None, :] < COLS)
    w = tl.load(ptr + offs_r[:, None] * stride_r + offs_c[None, :], mask=mask, other=0.0)
    if UPCAST:
        w = w.to(tl.float32)
    return w


@triton.jit
def feature_map(
    x, WIN, BW, head, H, offs_d, offs_g,
    U: tl.constexpr, HEAD: tl.constexpr, C: tl.constexpr, R: tl.constexpr, GATE: tl.constexpr,
    ELU: tl.constexpr, ROUND: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """phi of a (BLOCK_N, D) tile of one head, as `FeedForwardFeatureMap` (or `EluFeatureMap`)
    computes it. WIN: the units' input weights (U, H, HEAD, C), W in the first HEAD columns and
    the gate's V (GATE 1) or A (GATE 2) after them; BW: the low-rank gate's B (U, H, R, HEAD).
    The padded columns (HEAD < D) are left as they come out; the caller zeroes them."""
    if ELU:
        xf = x.to(tl.float32)
        e = round_to(tl.where(xf > 0, xf, tl.exp(xf) - 1.0), ROUND, UPCAST)
        y = round_to(e.to(tl.float32) + 1.0, ROUND, UPCAST)
    else:
        y = x
        for u in tl.static_range(U):
            base = WIN + (u * H + head) * HEAD * C
            w = load_matrix(base, offs_d, offs_d, C, HEAD, HEAD, UPCAST)
            pre = round_to(tl.dot(y, w, input_precision=PRECISION), ROUND, UPCAST)
            if u == U - 1:
                pre = round_to(softplus(pre.to(tl.float32)), ROUND, UPCAST)
            if GATE > 0:
                g_w = load_matrix(base + HEAD, offs_d, offs_g, C, HEAD, C - HEAD, UPCAST)
                gate = round_to(tl.dot(y, g_w, input_precision=PRECISION), ROUND, UPCAST)
                if GATE == 2:
                    b_ptr = BW + (u * H + head) * R * HEAD
                    b_w = load_matrix(b_ptr, offs_g, offs_d, HEAD, R, HEAD, UPCAST)
                    gate = round_to(tl.dot(gate, b_w, input_precision=PRECISION), ROUND, UPCAST)
                s = round_to(tl.sigmoid(gate.to(tl.float32)), ROUND, UPCAST)
                pre = round_to(pre.to(tl.float32) * s.to(tl.float32), ROUND, UPCAST)
            y = pre
    return y


@triton.jit
def key_summary(
    K, V, VALID, WIN, BW, KV, Z,
    skb, skh, skn, svb, svh, svn, s_valid, N, H, TILES, TILES_PER,
    HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DG: tl.constexpr,
    U: tl.constexpr, HEAD: tl.constexpr, C: tl.constexpr, R: tl.constexpr, GATE: tl.constexpr,
    ELU: tl.constexpr, ROUND: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Partial sums over one slice s of the keys of (batch, head) bh (grid: B H, slices):
    KV[s, bh] = sum_j phi(k_j) v_j^T (D, D) and Z[s, bh] = sum_j phi(k_j) (D), real keys only,
    in fp32 (products of the rounded features and values, fp32 accumulation)."""
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit offsets: a large batch passes 2^31 elements
    head = (bh % H).to(tl.int64)  # heads-first inputs: a head's offset may pass 2^31
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, DG)
    kv = tl.zeros([D, D], tl.float32)
    z = tl.zeros([D], tl.float32)
    for t in range(s * TILES_PER, tl.minimum((s + 1) * TILES_PER, TILES)):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        x = load_rows(K + b * skb + head * skh, offs_n, offs_d, skn, N, HEAD, D, UPCAST)
        f = feature_map(
            x, WIN, BW, head, H, offs_d, offs_g, U, HEAD, C, R, GATE, ELU, ROUND, UPCAST, PRECISION
        )
        keep = offs_n < N
        if HAS_MASK:
            keep = keep & (tl.load(VALID + b * s_valid + offs_n, mask=offs_n < N, other=0) != 0)
        keep = keep[:, None]
        if HEAD < D:
            keep = keep & (offs_d[None, :] < HEAD)
        f = tl.where(keep, f, tl.zeros_like(f))
        v = load_rows(V + b * svb + head * svh, offs_n, offs_d, svn, N, HEAD, D, UPCAST)
        kv += tl.dot(tl.trans(f), v, input_precision=PRECISION)
        z += tl.sum(f.to(tl.float32), 0)
    part = s.to(tl.int64) * tl.num_programs(0) + bh
    tl.store(KV + part * D * D + offs_d[:, None] * D + offs_d[None, :], kv)
    tl.store(Z + part * D + offs_d, z)


@triton.jit
def query_output(
    Q, KV, Z, WIN, BW, OUT,
    sqb, sqh, sqn, sob, soh, son, N, H, eps,
    BLOCK_N: tl.constexpr, D: tl.constexpr, DG: tl.constexpr,
    U: tl.constexpr, HEAD: tl.constexpr, C: tl.constexpr, R: tl.constexpr, GATE: tl.constexpr,
    ELU: tl.constexpr, ROUND: tl.constexpr, OUT_ROUND: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, FP32_PRECISION: tl.constexpr,
):  # fmt: skip
    """out_i = phi(q_i)^T KV / (phi(q_i)^T z + eps) for a tile of the queries of bh (grid: B H,
    tiles), the two products of the fp32 features (the model's `matmul_fp32`) and the summaries
    in FP32_PRECISION; rounded to the output's dtype."""
    bh = tl.program_id(0)
    pid = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit offsets: a large batch passes 2^31 elements
    head = (bh % H).to(tl.int64)  # heads-first inputs: a head's offset may pass 2^31
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, DG)
    x = load_rows(Q + b * sqb + head * sqh, offs_n, offs_d, sqn, N, HEAD, D, UPCAST)
    f = feature_map(
        x, WIN, BW, head, H, offs_d, offs_g, U, HEAD, C, R, GATE, ELU, ROUND, UPCAST, PRECISION
    ).to(tl.float32)
    if HEAD < D:
        f = tl.where(offs_d[None, :] < HEAD, f, 0.0)
    kv, z = load_summary(KV, Z, bh, offs_d, D)
    num = tl.dot(f, kv, input_precision=FP32_PRECISION)
    den = tl.sum(f * z[None, :], 1)
    out = round_to(num * (1.0 / (den + eps))[:, None], OUT_ROUND, UPCAST)
    store_rows(OUT + b * sob + head * soh, out, offs_n, offs_d, son, N, HEAD, D)


@triton.jit
def query_grad(
    Q, DO, KV, Z, DQ, R, DDEN,
    sqb, sqh, sqn, sdob, sdoh, sdon, sdqb, sdqh, sdqn, N, H, eps,
    BLOCK_N: tl.constexpr, D: tl.constexpr, HEAD: tl.constexpr, ROUND: tl.constexpr,
    UPCAST: tl.constexpr, FP32_PRECISION: tl.constexpr,
):  # fmt: skip
    """The training mixing's backward on the queries' side, for a tile of the queries of bh
    (grid: B H, tiles). With the features f_i = phi(q_i) given (Q), [KV | z] the forward's fp32
    summary, num_i = f_i KV, r_i = 1 / (f_i . z + eps) and out_i = num_i r_i:
    dnum_i = dout_i r_i, dden_i = -(dout_i . num_i) r_i^2 and
    DQ_i = dnum_i KV^T + dden_i z (rounded to the compute dtype ROUND); r_i and dden_i are
    written (fp32, (B H, N)) for `summary_grad`. The products of fp32 tiles in FP32_PRECISION,
    as the default path's fp32 products."""
    bh = tl.program_id(0)
    pid = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit offsets: a large batch passes 2^31 elements
    head = (bh % H).to(tl.int64)  # heads-first inputs: a head's offset may pass 2^31
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kv, z = load_summary(KV, Z, bh, offs_d, D)
    f = load_rows(Q + b * sqb + head * sqh, offs_n, offs_d, sqn, N, HEAD, D, UPCAST)
    f = f.to(tl.float32)
    do = load_rows(DO + b * sdob + head * sdoh, offs_n, offs_d, sdon, N, HEAD, D, UPCAST)
    do = do.to(tl.float32)
    num = tl.dot(f, kv, input_precision=FP32_PRECISION)
    r = 1.0 / (tl.sum(f * z[None, :], 1) + eps)
    dden = -tl.sum(do * num, 1) * r * r
    dq = tl.dot(do * r[:, None], tl.trans(kv), input_precision=FP32_PRECISION)
    dq += dden[:, None] * z[None, :]
    store_rows(DQ + b * sdqb + head * sdqh, round_to(dq, ROUND, UPCAST), offs_n, offs_d, sdqn, N,
               HEAD, D)  # fmt: skip
    row = bh.to(tl.int64) * N + offs_n
    tl.store(R + row, r, mask=offs_n < N)
    tl.store(DDEN + row, dden, mask=offs_n < N)


@triton.jit
def summary_grad(
    Q, DO, R, DDEN, DKV, DZ,
    sqb, sqh, sqn, sdob, sdoh, sdon, N, H, TILES, TILES_PER,
    BLOCK_N: tl.constexpr, D: tl.constexpr, HEAD: tl.constexpr, UPCAST: tl.constexpr,
    FP32_PRECISION: tl.constexpr,
):  # fmt: skip
    """The gradient of the summary [KV | z], partial sums over one slice s of the queries of bh
    (grid: B H, slices): DKV[s, bh] = sum_i f_i^T (dout_i r_i) and DZ[s, bh] = sum_i dden_i f_i
    in fp32, from `query_grad`'s r and dden. (A pass of its own: with the summary's h x h
    gradient accumulated beside KV and the tiles of `query_grad`, a program needs more
    registers than a thread has at the recipe's head width.)"""
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    head = (bh % H).to(tl.int64)  # heads-first inputs: a head's offset may pass 2^31
    offs_d = tl.arange(0, D)
    dkv = tl.zeros([D, D], tl.float32)
    dz = tl.zeros([D], tl.float32)
    for t in range(s * TILES_PER, tl.minimum((s + 1) * TILES_PER, TILES)):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        f = load_rows(Q + b * sqb + head * sqh, offs_n, offs_d, sqn, N, HEAD, D, UPCAST)
        f = f.to(tl.float32)
        do = load_rows(DO + b * sdob + head * sdoh, offs_n, offs_d, sdon, N, HEAD, D, UPCAST)
        row = bh.to(tl.int64) * N + offs_n
        r = tl.load(R + row, mask=offs_n < N, other=0.0)
        dden = tl.load(DDEN + row, mask=offs_n < N, other=0.0)
        dnum = do.to(tl.float32) * r[:, None]
        dkv += tl.dot(tl.trans(f), dnum, input_precision=FP32_PRECISION)
        dz += tl.sum(f * dden[:, None], 0)
    part = s.to(tl.int64) * tl.num_programs(0) + bh
    tl.store(DKV + part * D * D + offs_d[:, None] * D + offs_d[None, :], dkv)
    tl.store(DZ + part * D + offs_d, dz)


@triton.jit
def key_grad(
    K, V, VALID, DKV, DZ, DK, DV,
    skb, skh, skn, svb, svh, svn, s_valid, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, N, H,
    HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, HEAD: tl.constexpr,
    ROUND: tl.constexpr, UPCAST: tl.constexpr, FP32_PRECISION: tl.constexpr,
):  # fmt: skip
    """The training mixing's backward on the keys' side, for a tile of the keys of bh (grid:
    B H, tiles): with the features g_j = phi(k_j) given (K) and the summary's gradient [DKV |
    DZ] (fp32, summed over the queries), DK_j = DKV v_j + DZ and DV_j = DKV^T g_j at real keys,
    zero at padding keys (they contributed nothing), rounded to the compute dtype ROUND."""
    bh = tl.program_id(0)
    pid = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    head = (bh % H).to(tl.int64)  # heads-first inputs: a head's offset may pass 2^31
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    g = load_rows(K + b * skb + head * skh, offs_n, offs_d, skn, N, HEAD, D, UPCAST)
    v = load_rows(V + b * svb + head * svh, offs_n, offs_d, svn, N, HEAD, D, UPCAST)
    dkv, dz = load_summary(DKV, DZ, bh, offs_d, D)
    keep = offs_n < N
    if HAS_MASK:
        keep = keep & (tl.load(VALID + b * s_valid + offs_n, mask=offs_n < N, other=0) != 0)
    keep = keep[:, None]
    dk = tl.dot(v.to(tl.float32), tl.trans(dkv), input_precision=FP32_PRECISION) + dz[None, :]
    dk = tl.where(keep, dk, 0.0)
    g = tl.where(keep, g.to(tl.float32), 0.0)
    dv = tl.dot(g, dkv, input_precision=FP32_PRECISION)
    store_rows(DK + b * sdkb + head * sdkh, round_to(dk, ROUND, UPCAST), offs_n, offs_d, sdkn, N,
               HEAD, D)  # fmt: skip
    store_rows(DV + b * sdvb + head * sdvh, round_to(dv, ROUND, UPCAST), offs_n, offs_d, sdvn, N,
               HEAD, D)  # fmt: skip
