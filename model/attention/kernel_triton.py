"""Kernel attention in Triton kernels: the inference forward (`kernel.inference_backend: triton`)
and the training mixing (`kernel.training_backend: triton`).

Legend as in kernel.py: B batch, H heads, N tokens, h head width, U stacked units, c a unit's
product width (h, 2h or h + r), r the low-rank gate's rank.

The `torch` path runs the feature maps, the fp32 upcasts and the two sums as separate operators:
phi(Q) and phi(K) (and each unit's product and gate before them) go through memory, which at long
sequences costs more than the sums themselves (at 8 x 4096, albert-base width, the mixing took
about as long as flash attention does for softmax's O(N^2) scores). Without a gradient nothing
has to be kept for a backward, and the whole mixing fuses into two kernels:

* `key_summary`: one program per (slice of the keys, batch x head) computes phi on a tile of
  keys in registers, zeroes padding keys, and accumulates [KV | z] = sum_j phi(k_j) [v_j | 1]
  in fp32; the slices' partial sums are then added (one small `sum`);
* `query_output`: one program per (tile of queries, batch x head) computes phi on the tile and
  writes phi(q)^T KV / (phi(q)^T z + eps), directly in the (B, N, H, h) layout the output
  projection reads (the merge of the heads is then a view, not a copy).

Memory traffic: q, k, v read once and the output written once, plus the weights and the
summaries (kilobytes per head). Numerics: the kernels round to the compute dtype where the model
does (kernel_triton_kernels.py), so the result equals the `torch` path's up to the order of the
sums (tests/model/test_kernel_triton.py runs the kernels in Triton's interpreter against it). Only
forwards that need no gradient and no dropout take this path (`KernelAttention.forward`).

Training (`kernel.training_backend: triton`): the feature maps run as torch operators (their
dropout, their autograd), and the mixing after them is one operator with its own backward
(`kernel_attention_mixing`). Its forward is the two kernels above with the identity as feature
map; it keeps phi(q), phi(k), v and the fp32 summary [KV | z] for the backward, nothing else of
size N (the `torch` path keeps fp32 copies of the features and [V | 1] for its products). The
backward, with r_i = 1 / (phi(q_i)^T z + eps) and out_i = r_i phi(q_i)^T KV:

* `query_grad`, per tile of queries: dphi(q_i) = r_i KV dout_i - r_i^2 (dout_i . num_i) z,
  num_i recomputed from phi(q_i) and KV; writes r_i and the normaliser's gradient per row;
* `summary_grad`, per slice of queries: the partial [dKV | dz] = sum_i phi(q_i) [r_i dout_i |
  dden_i]; the slices' sums are then added;
* `key_grad`, per tile of keys: dphi(k_j) = dKV v_j + dz and dv_j = dKV^T phi(k_j), zero at
  padding keys.

The products of fp32 tiles (the summary, its gradient, the normaliser's) run at fp32 accuracy
(`_fp32_precision`), as the `torch` path's fp32 products; each gradient is rounded to the
compute dtype where the `torch` path rounds it. Tiles and launches: `GRAD_KERNEL_OPTIONS`.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

KERNEL_OPTIONS = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
"""Token tile and launch options of both kernels. Chosen by compiling for the GPUs without one
(`tests/triton_compile.py`: no register spills, every load pipelined;
docs/benchmarks.md#decisions-whose-measurements-are-in-the-history). Not timed on a GPU."""

GRAD_KERNEL_OPTIONS = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
"""Token tile and launch options of the training backward's three kernels (`query_grad` keeps
the fp32 h x h summary in registers, `summary_grad` its gradient). Chosen by compiling for the
GPUs without one (`tests/triton_compile.py`;
docs/benchmarks.md#decisions-whose-measurements-are-in-the-history): at head width 64 with
three TF32 products for each fp32 one,
these are the options among those compiled with which no kernel spills registers on an H100
or an A100 (64-token tiles spill on the A100). Not timed on a GPU yet."""

PROGRAMS_PER_LAUNCH = 512
"""`key_summary` splits each head's keys into slices until it has about this many programs (a
few per streaming multiprocessor); each slice's partial [KV | z] is then summed."""

MAX_HEAD_DIM = 128
"""Widest head the kernels take: a program keeps an fp32 h x h summary in registers."""

ROUND = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
"""The compute dtypes, as the kernels' ROUND argument names them."""


def interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter (on CPU tensors): TRITON_INTERPRET=1,
    read as Triton reads it, when the kernels are defined (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def importable() -> bool:
    """Whether Triton can be imported (a CUDA torch brings it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    """The Triton kernels, imported on first use (see kernel_triton_kernels.py): the two of
    the forward, the three of the training mixing's backward."""
    from model.attention import kernel_triton_kernels

    k = kernel_triton_kernels
    return k.key_summary, k.query_output, k.query_grad, k.summary_grad, k.key_grad


def _width(n: int) -> int:
    """A tile width for n columns: the next power of two, at least 16 (Triton's dot)."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _fp32_precision(upcast: bool) -> str:
    """Triton's precision for products of fp32 tiles, as torch's for fp32 matrix products:
    IEEE fp32 in the interpreter; on a GPU three TF32 products (fp32's accuracy on tensor cores)
    when torch's `float32_matmul_precision` is "highest", else one (TF32)."""
    if upcast:
        return "ieee"
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _launch(q: Tensor, options: dict) -> tuple[int, dict, bool]:
    """The token tile, the launch options and whether the interpreter runs the kernels."""
    launch = {"num_warps": options["num_warps"], "num_stages": options["num_stages"]}
    return options["BLOCK_N"], launch, not q.is_cuda  # the interpreter: fp32 tiles


def _slices(B: int, H: int, tiles: int) -> tuple[int, int]:
    """How many slices of a head's tiles one launch sums separately, and tiles per slice:
    about `PROGRAMS_PER_LAUNCH` programs in all."""
    slices = max(1, min(tiles, PROGRAMS_PER_LAUNCH // (B * H)))
    per_slice = -(-tiles // slices)
    return -(-tiles // per_slice), per_slice


def _key_mask(q: Tensor, key_valid: Tensor | None) -> Tensor:
    """The (B, N) key mask as int8 for the kernels (a dummy when there is no padding)."""
    valid = key_valid if key_valid is not None else q.new_ones(1, 1, dtype=torch.bool)
    return valid.to(torch.int8).contiguous()


def _mix(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    win: Tensor | None,
    bw: Tensor | None,
    key_valid: Tensor | None,
    eps: float,
    dtype: torch.dtype,
    given: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The two forward kernels: returns the (B, H, N, h) output (a view of a (B, N, H, h)
    tensor, in v's dtype) and the fp32 summary [KV | z] as (B H, D, D) and (B H, D).

    given: q and k are the features phi(q), phi(k) already (the training path: the kernels'
    feature map is the identity); else phi is computed in the kernels from win and bw (None:
    elu+1)."""
    B, H, N, h = q.shape
    if h > MAX_HEAD_DIM:
        raise ValueError(f"head width {h} > {MAX_HEAD_DIM}: the kernels keep h x h in registers")
    D = _width(h)
    if q.numel() == 0:  # nothing to launch
        out = v.new_zeros(B, N, H, h).transpose(1, 2)
        kv = q.new_zeros(B * H, D, D, dtype=torch.float32)
        return out, kv, q.new_zeros(B * H, D, dtype=torch.float32)
    key_summary, query_output = _kernels()[:2]
    block_n, launch, upcast = _launch(q, KERNEL_OPTIONS)
    out_dtype = v.dtype
    q, k, v = (x.to(dtype) if x.dtype != dtype else x for x in (q, k, v))
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    elu = win is None and not given
    if win is None:
        win = q.new_zeros(1)
        units, c, rank, gate = (1 if elu else 0), h, 0, 0
    else:
        win = win.to(dtype).contiguous()
        units, c = win.shape[0], win.shape[-1]
        gate = 0 if c == h else (2 if bw is not None else 1)
        rank = bw.shape[-2] if bw is not None else 0
    bw = bw.to(dtype).contiguous() if bw is not None else win.new_zeros(1)
    DG = _width(c - h)
    fp32 = _fp32_precision(upcast)
    flags = {
        "BLOCK_N": block_n, "D": D, "DG": DG, "U": units, "HEAD": h, "C": c, "R": rank,
        "GATE": gate, "ELU": elu, "ROUND": ROUND[dtype], "UPCAST": upcast,
        # bf16 / fp16 tiles: Triton's default (tensor cores, fp32 accumulation)
        "PRECISION": fp32 if (upcast or dtype == torch.float32) else None,
    }  # fmt: skip

    valid = _key_mask(q, key_valid)
    tiles = -(-N // block_n)
    slices, per_slice = _slices(B, H, tiles)
    kv = torch.empty(slices, B * H, D, D, dtype=torch.float32, device=q.device)
    z = torch.empty(slices, B * H, D, dtype=torch.float32, device=q.device)
    # (batch x head) on the grid's first axis, which allows 2^31 - 1 programs (the others 65535)
    key_summary[(B * H, slices)](
        k, v, valid, win, bw, kv, z,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        valid.stride(0), N, H, tiles, per_slice,
        HAS_MASK=key_valid is not None, **flags, **launch,
    )  # fmt: skip
    kv, z = kv.sum(0), z.sum(0)

    out = torch.empty(B, N, H, h, dtype=out_dtype, device=q.device)
    query_output[(B * H, tiles)](
        q, kv, z, win, bw, out,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(2), out.stride(1),
        N, H, eps,
        OUT_ROUND=ROUND[out_dtype], FP32_PRECISION=fp32, **flags, **launch,
    )  # fmt: skip
    return out.transpose(1, 2), kv, z


@torch.library.custom_op("albatross::kernel_attention_inference", mutates_args=())
def kernel_attention_inference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    win: Tensor | None,
    bw: Tensor | None,
    key_valid: Tensor | None,
    eps: float,
    dtype: torch.dtype,
) -> Tensor:
    """Non-causal kernel attention of (B, H, N, h) q, k, v by the two kernels, as one operator
    (opaque to torch.compile: the kernels' launches and the partial sums are not traced).

    win: the units' input weights (U, H, h, c) in `dtype` ([W | V], [W | A] or W per unit, as
    `FeatureMapUnit.input_weight`), None for the elu+1 map; bw: the low-rank gates' B (U, H, r,
    h) for aoglu, else None; key_valid: (B, N) bool, True at real keys, or None (no padding);
    dtype: the compute dtype (bf16 under autocast). Returns (B, H, N, h) in v's dtype, a view of
    a (B, N, H, h) tensor. Tiles and launches: `KERNEL_OPTIONS`."""
    return _mix(q, k, v, win, bw, key_valid, eps, dtype, given=False)[0]


@kernel_attention_inference.register_fake
def _(q, k, v, win, bw, key_valid, eps, dtype):
    B, H, N, h = q.shape
    return q.new_empty(B, N, H, h, dtype=v.dtype).transpose(1, 2)


@torch.library.custom_op("albatross::kernel_attention_mixing", mutates_args=())
def kernel_attention_mixing(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    key_valid: Tensor | None,
    eps: float,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """The mixing of a training forward (`kernel.training_backend: triton`): out_i =
    phi(q_i)^T KV / (phi(q_i)^T z + eps) from the (B, H, N, h) features phi(q), phi(k) (made
    by the feature map's operators, with its dropout) and v, by the inference kernels with the
    identity as their feature map. Returns the output ((B, H, N, h) in v's dtype, a view of a
    (B, N, H, h) tensor) and the fp32 summary KV (B H, D, D), z (B H, D) for the backward
    (`kernel_attention_mixing_backward`), which recomputes the rest from the features: nothing
    of size N beyond the inputs is kept."""
    return _mix(phi_q, phi_k, v, None, None, key_valid, eps, dtype, given=True)


@kernel_attention_mixing.register_fake
def _(phi_q, phi_k, v, key_valid, eps, dtype):
    B, H, N, h = phi_q.shape
    D = _width(h)
    out = phi_q.new_empty(B, N, H, h, dtype=v.dtype).transpose(1, 2)
    kv = phi_q.new_empty(B * H, D, D, dtype=torch.float32)
    return out, kv, phi_q.new_empty(B * H, D, dtype=torch.float32)


def _grad_like(x: Tensor, dtype: torch.dtype) -> Tensor:
    """An empty gradient for x, in `dtype`, laid out as x where x is contiguous or heads first
    (the features' memory), else as (B, N, H, h) (v, a view of the fused projection)."""
    if x.is_contiguous() or x.transpose(0, 1).is_contiguous():
        return torch.empty_like(x, dtype=dtype)  # the same strides
    B, H, N, h = x.shape
    return x.new_empty(B, N, H, h, dtype=dtype).transpose(1, 2)


@torch.library.custom_op("albatross::kernel_attention_mixing_backward", mutates_args=())
def kernel_attention_mixing_backward(
    grad_out: Tensor,
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    kv: Tensor,
    z: Tensor,
    key_valid: Tensor | None,
    eps: float,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of phi(q), phi(k) and v from the output's, each in its input's dtype:
    `query_grad` (phi(q)'s, per tile of queries), `summary_grad` (the summary's, per slice of
    the queries, then summed over the slices) and `key_grad` (phi(k)'s and v's, per tile of
    keys)."""
    B, H, N, h = phi_q.shape
    dq, dk, dv = (_grad_like(x, x.dtype) for x in (phi_q, phi_k, v))
    if phi_q.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    query_grad, summary_grad, key_grad = _kernels()[2:]
    block_n, launch, upcast = _launch(phi_q, GRAD_KERNEL_OPTIONS)
    # the output's gradient in its own dtype (read as fp32); the inputs as the forward read them
    q, k, vv = (x.to(dtype) if x.dtype != dtype else x for x in (phi_q, phi_k, v))
    q, k, vv, do = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, vv, grad_out))
    # written in the compute dtype; cast afterwards where an input had another dtype
    gq, gk, gv = (g if g.dtype == dtype else _grad_like(g, dtype) for g in (dq, dk, dv))
    D = kv.shape[-1]
    flags = {
        "BLOCK_N": block_n, "D": D, "HEAD": h, "UPCAST": upcast,
        "FP32_PRECISION": _fp32_precision(upcast),
    }  # fmt: skip
    tiles = -(-N // block_n)
    r = torch.empty(B * H, N, dtype=torch.float32, device=q.device)
    dden = torch.empty(B * H, N, dtype=torch.float32, device=q.device)
    query_grad[(B * H, tiles)](
        q, do, kv, z, gq, r, dden,
        q.stride(0), q.stride(1), q.stride(2), do.stride(0), do.stride(1), do.stride(2),
        gq.stride(0), gq.stride(1), gq.stride(2), N, H, eps,
        ROUND=ROUND[dtype], **flags, **launch,
    )  # fmt: skip
    slices, per_slice = _slices(B, H, tiles)
    dkv = torch.empty(slices, B * H, D, D, dtype=torch.float32, device=q.device)
    dz = torch.empty(slices, B * H, D, dtype=torch.float32, device=q.device)
    summary_grad[(B * H, slices)](
        q, do, r, dden, dkv, dz,
        q.stride(0), q.stride(1), q.stride(2), do.stride(0), do.stride(1), do.stride(2),
        N, H, tiles, per_slice,
        **flags, **launch,
    )  # fmt: skip
    dkv, dz = dkv.sum(0), dz.sum(0)
    valid = _key_mask(q, key_valid)
    key_grad[(B * H, tiles)](
        k, vv, valid, dkv, dz, gk, gv,
        k.stride(0), k.stride(1), k.stride(2), vv.stride(0), vv.stride(1), vv.stride(2),
        valid.stride(0), gk.stride(0), gk.stride(1), gk.stride(2),
        gv.stride(0), gv.stride(1), gv.stride(2), N, H,
        HAS_MASK=key_valid is not None, ROUND=ROUND[dtype], **flags, **launch,
    )  # fmt: skip
    for grad, written in ((dq, gq), (dk, gk), (dv, gv)):
        if written is not grad:
            grad.copy_(written)
    return dq, dk, dv


@kernel_attention_mixing_backward.register_fake
def _(grad_out, phi_q, phi_k, v, kv, z, key_valid, eps, dtype):
    return tuple(_grad_like(x, x.dtype) for x in (phi_q, phi_k, v))


def _mixing_setup(ctx, inputs, output) -> None:
    phi_q, phi_k, v, key_valid, eps, dtype = inputs
    _, kv, z = output
    ctx.save_for_backward(phi_q, phi_k, v, kv, z, key_valid)
    ctx.mark_non_differentiable(kv, z)
    ctx.eps, ctx.dtype = eps, dtype


def _mixing_backward(ctx, grad_out, grad_kv, grad_z):
    phi_q, phi_k, v, kv, z, key_valid = ctx.saved_tensors
    dq, dk, dv = kernel_attention_mixing_backward(
        grad_out, phi_q, phi_k, v, kv, z, key_valid, ctx.eps, ctx.dtype
    )
    return dq, dk, dv, None, None, None


kernel_attention_mixing.register_autograd(_mixing_backward, setup_context=_mixing_setup)


def kernel_attention_train(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, key_valid: Tensor | None, eps: float,
    dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    """The training mixing's output alone (`kernel_attention_mixing`, differentiable in phi(q),
    phi(k) and v; the summary it returns is for its backward only)."""
    return kernel_attention_mixing(phi_q, phi_k, v, key_valid, eps, dtype)[0]


__all__ = [
    "KERNEL_OPTIONS",
    "MAX_HEAD_DIM",
    "importable",
    "interpreting",
    "kernel_attention_inference",
    "kernel_attention_mixing",
    "kernel_attention_mixing_backward",
    "kernel_attention_train",
]
