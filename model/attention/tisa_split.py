"""TISA's `split` backend: SDPA for the attention, a Triton kernel for the gradient of f.

Legend as in tisa.py: B batch, H heads, N tokens, h head width, M = 2N - 1 offsets.

With a float `attn_mask` that needs a gradient, `scaled_dot_product_attention` cannot use the
flash or cuDNN kernels (neither returns the mask's gradient) and falls back to the
memory-efficient ones, whose gradient is the (B, H, N, N) tensor dS that the indexing's backward
then reduces to the (H, 2N - 1) table of f. The `split` backend separates the two:

* the attention and the gradients of Q, K, V come from SDPA with the bias *detached*, so the
  fastest kernel the device has for a float mask (cuDNN on Hopper) stays eligible;
* the gradient of f's values, dF[h, k + N - 1] = sum over b and over i, j with j - i = k of
  dS[b, h, i, j], dS = P * (dO V^T - rowsum(dO * O)), comes from `tisa_values_grad`: on CUDA two
  Triton kernels (`_kernels`), on other devices the dense reference `reference_values_grad`.

The Triton kernels never write dS. The first gives each query row its log-sum-exp (one pass over
the keys, Q K^T only). The second gives one program to each (block diagonal, head, slice of the
batch): a Toeplitz bias is the same on every tile of a block diagonal, and so is the map from a
tile's entries to offsets, so the program sums dS over the tiles of its diagonal and its samples
in registers (no atomics) and writes one BLOCK x BLOCK tile; the tiles' diagonals are then
summed onto the 2N - 1 offsets by one `index_add_` over H (2 N / BLOCK) BLOCK^2 entries.
Deterministic, exact up to summation order (tests/model/test_triton_kernels.py runs the kernels in
Triton's interpreter against the reference; tests/model/test_tisa_split.py the model's gradients
against `sdpa`'s).
"""

import functools
import warnings

import torch
from torch import Tensor

SPLIT_KERNEL_OPTIONS = {"BLOCK": 64, "num_warps": 8, "num_stages": 2}
"""Tile size and launch options of the Triton kernels (BLOCK x BLOCK score tiles). Chosen by
compiling for the GPUs without one (`tests/triton_compile.py`, at the
recipe's shape): with 64 x 64 tiles, 8 warps and 2 stages the gradient kernel's four loads are
pipelined (async copies, 64 KB of shared memory) and it needs 100-106 registers a thread on an
H100 (234-244 on an A100), no spills; with 4 warps 183 (255 on an A100); 128 x 128 tiles spill
on both (164 and 760 bytes). Not timed on a GPU yet: `bench_fast_paths.py tisa-backends
--split-options` times alternatives."""


PROGRAMS_PER_LAUNCH = 1024
"""The gradient kernel splits the batch into slices until it has about this many programs (a few
per streaming multiprocessor), each summing its slice's tiles of one block diagonal."""


def offset_index(N: int, device: torch.device | str | None = None) -> Tensor:
    """(N, N) index of the offset table: [i, j] -> (j - i) + N - 1, for keys j and queries i."""
    pos_N = torch.arange(N, device=device)
    return pos_N[None, :] - pos_N[:, None] + N - 1


def reference_values_grad(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    do: Tensor,
    values: Tensor,
    key_valid: Tensor | None = None,
    chunk: int = 8,
) -> Tensor:
    """The gradient of f's (H, 2N - 1) values, densely: dS per chunk of samples, summed over the
    batch and then over each diagonal. q, k, v, o, do: (B, H, N, h); key_valid: (B, N) bool, True
    at real keys, or None (no padding). fp32 result with `values`' shape."""
    B, H, N, hd = q.shape
    scale = hd**-0.5
    dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    q, k, v, o, do = (x.to(dtype) for x in (q, k, v, o, do))
    index = offset_index(N, q.device).reshape(-1)
    bias_HNN = values.to(dtype)[:, index].view(H, N, N)
    dS_HNN = torch.zeros(H, N, N, dtype=dtype, device=q.device)
    for start in range(0, B, chunk):
        part = slice(start, start + chunk)
        scores = torch.einsum("bhid,bhjd->bhij", q[part], k[part]) * scale
        scores = scores + bias_HNN
        if key_valid is not None:
            scores = scores.masked_fill(~key_valid[part, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        dprobs = torch.einsum("bhid,bhjd->bhij", do[part], v[part])
        delta = (do[part] * o[part]).sum(-1, keepdim=True)
        dS_HNN += (probs * (dprobs - delta)).sum(0)
    out = torch.zeros(H, 2 * N - 1, dtype=dtype, device=q.device)
    return out.index_add_(1, index, dS_HNN.reshape(H, N * N)).to(values.dtype)


@functools.cache
def _kernels():
    """The two Triton kernels, imported on first use: Triton is only needed on CUDA, and it
    reads TRITON_INTERPRET when a kernel is defined (tests run them on CPU tensors in its
    interpreter)."""
    from model.attention import tisa_split_kernels

    return tisa_split_kernels.row_lse, tisa_split_kernels.diagonal_grad


@functools.cache
def _tile_offsets(N: int, block: int, device: torch.device) -> Tensor:
    """(2 NB - 1, BLOCK, BLOCK) index of each entry of a block diagonal's tile in the offset
    table, M (a spill slot) where it lies outside the table."""
    NB = -(-N // block)
    shift = torch.arange(-(NB - 1), NB, device=device)[:, None, None]
    r = torch.arange(block, device=device)
    index = shift * block + r[None, None, :] - r[None, :, None] + N - 1
    return torch.where((index >= 0) & (index < 2 * N - 1), index, 2 * N - 1).reshape(-1)


def triton_values_grad(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    do: Tensor,
    values: Tensor,
    key_valid: Tensor | None = None,
    block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """`reference_values_grad` by the Triton kernels (see the module's docstring). Options left
    None come from `SPLIT_KERNEL_OPTIONS`."""
    B, H, N, hd = q.shape
    block = block or SPLIT_KERNEL_OPTIONS["BLOCK"]
    launch = {
        "num_warps": num_warps or SPLIT_KERNEL_OPTIONS["num_warps"],
        "num_stages": num_stages or SPLIT_KERNEL_OPTIONS["num_stages"],
    }
    row_lse, diagonal_grad = _kernels()
    D = max(16, 1 << (hd - 1).bit_length())
    # fp32 inputs: IEEE fp32 products (not TF32); off CUDA (Triton's interpreter) fp32 products
    # too, whose dots of bf16 tiles are not right.
    upcast = q.dtype == torch.float32 or not q.is_cuda
    q, k, v, do = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, do))
    scale = hd**-0.5
    vals = values.detach().float().contiguous()
    has_mask = key_valid is not None
    valid = (key_valid if has_mask else q.new_ones(1, 1, dtype=torch.bool)).to(torch.int8)
    valid = valid.contiguous()
    flags = {
        "HAS_MASK": has_mask,
        "BLOCK": block,
        "D": D,
        "HEAD": hd,
        "UPCAST": upcast,
        "PRECISION": "ieee" if upcast else None,  # None: Triton's default for bf16 / fp16
    }
    NB = -(-N // block)

    lse = torch.empty(B, H, N, dtype=torch.float32, device=q.device)
    row_lse[(NB, B * H)](
        q, k, vals, valid, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        vals.stride(0), valid.stride(0), N, H, scale,
        **flags, **launch,
    )  # fmt: skip
    delta = (do.float() * o.float()).sum(-1).contiguous()  # (B, H, N): rowsum(P * dP)

    slices = max(1, min(B, PROGRAMS_PER_LAUNCH // (H * (2 * NB - 1))))
    part = torch.empty(slices, H, 2 * NB - 1, block, block, dtype=torch.float32, device=q.device)
    diagonal_grad[(2 * NB - 1, H, slices)](
        q, k, v, do, lse, delta, vals, valid, part,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        vals.stride(0), valid.stride(0), B, N, H, NB, slices, scale,
        **flags, **launch,
    )  # fmt: skip
    out = torch.zeros(H, 2 * N, dtype=torch.float32, device=q.device)  # + the spill slot
    out.index_add_(1, _tile_offsets(N, block, q.device), part.sum(0).reshape(H, -1))
    return out[:, : 2 * N - 1].to(values.dtype)


@functools.cache
def _triton_usable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        warnings.warn(
            "tisa.backend='split' on CUDA without Triton: the gradient of f falls back to the "
            "dense reference (materialises the scores); install the triton that matches torch",
            stacklevel=3,
        )
        return False
    return True


@torch.library.custom_op("albatross::tisa_values_grad", mutates_args=())
def tisa_values_grad(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    do: Tensor,
    values: Tensor,
    key_valid: Tensor | None,
) -> Tensor:
    """The gradient of f's (H, 2N - 1) values given the attention's inputs, output and output
    gradient: the Triton kernels on CUDA, the dense reference elsewhere. An opaque operator to
    torch.compile."""
    if q.is_cuda and _triton_usable():
        return triton_values_grad(q, k, v, o, do, values, key_valid)
    return reference_values_grad(q, k, v, o, do, values, key_valid)


@tisa_values_grad.register_fake
def _(q, k, v, o, do, values, key_valid):
    return torch.empty_like(values)


class _ValuesGradTap(torch.autograd.Function):
    """Identity on the attention's output; its backward adds the gradient of f's values."""

    @staticmethod
    def forward(ctx, out, q, k, v, values, key_valid):
        ctx.save_for_backward(out, q, k, v, values, key_valid)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        out, q, k, v, values, key_valid = ctx.saved_tensors
        dvalues = None
        if ctx.needs_input_grad[4]:
            dvalues = tisa_values_grad(q, k, v, out, dout, values, key_valid)
        return dout, None, None, None, dvalues, None


def split_attention(
    q_BHNh: Tensor,
    k_BHNh: Tensor,
    v_BHNh: Tensor,
    values_HM: Tensor,
    bias: Tensor,
    mask_BN: Tensor | None,
) -> Tensor:
    """softmax(Q K^T / sqrt(h) + bias) V by SDPA, `bias` (F_P from `values_HM`, plus the key
    padding of `mask_BN` when given) without a gradient; the gradient of `values_HM` (H, 2N-1)
    from `tisa_values_grad`."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q_BHNh, k_BHNh, v_BHNh, attn_mask=bias.detach()
    )
    if torch.is_grad_enabled() and values_HM.requires_grad:
        out = _ValuesGradTap.apply(out, q_BHNh, k_BHNh, v_BHNh, values_HM, mask_BN)
    return out
