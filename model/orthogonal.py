"""Orthogonal parameterisation computed in fp32, and a Linear that accepts it; docs/methods.md.

We use torch's orthogonal parametrization (`torch.nn.utils.parametrizations.orthogonal`) with two
changes that matter for training at scale:

* The map is always evaluated in fp32 (fp64 for matrix_exp) with autocast off, and the
  orthogonal matrix is returned in fp32. Under bf16 the product drifts from orthogonal by ~1e-2;
  this way it stays below 1e-6 (cayley, fp32, d=768).
  Consumers (`Linear` below) cast it to the activation dtype at the point of use.
* Dynamic trivialisation is off (`use_trivialization=False`): with it torch keeps an orthogonal
  `base` buffer that `model.to(torch.bfloat16)` (or DeepSpeed's bf16 mode) would round to bf16,
  which alone breaks orthogonality at 1e-2. Without it, Q = map(original) is exactly orthogonal
  whatever the storage dtype of `original`.

Under cross-layer sharing a weight is used L times per forward: inside `orthogonal_cache()` each
map is evaluated once and the matrix reused (the models wrap their forward in it). We keep our
own cache rather than `torch.nn.utils.parametrize.cached()` because activation checkpointing
recomputes layers during backward, after that context has closed: the encoder hands each layer
the forward's cache (the `store`) so the recomputation sees the very same matrices.

In inference (eval mode and gradients off) a map also keeps its last result across forwards:
the weights do not change between two evaluation batches, and at ALBERT-base width the maps are
the largest fixed cost of a TransJect forward (docs/benchmarks.md#transjects-orthogonal-maps).
The stored matrix is reused only while the free
parameters are bit-for-bit those it was computed from (`torch.equal` against a copy, so an
update through `.data`, which leaves the version counter alone, is still seen), and `train()`
drops it.
Training, or any forward that records gradients, always evaluates the map.

The cache is the forward's cache of `model.forward_cache` (``orthogonal_cache`` and
``active_orthogonal_cache`` here are its `forward_cache` and `active_forward_cache`), keyed by
`forward_cache_key(module)`.

In a training step the maps may come from a step cache instead (`model.orthogonal_step`: once
per optimizer step across gradient accumulation, shared out over data-parallel ranks): the
step cache active around a training micro-batch (`step_cache_active`) hands `FP32Orthogonal`
and `evaluate_orthogonal_maps` the step's matrices, evaluated by `evaluate_grouped`. Nothing
here knows of ranks or collectives: a `MapSharding` is handed in.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Protocol, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from albatross import compat
from model.config import CayleyLeafInverse
from model.forward_cache import FORWARD_CACHE_KEY as FORWARD_CACHE_KEY  # re-exported
from model.forward_cache import active_forward_cache, forward_cache, forward_cache_key
from model.forward_cache import name_forward_cache_keys as name_forward_cache_keys

orthogonal_cache = forward_cache
"""The forward's cache (`model.forward_cache.forward_cache`): within the block each orthogonal
map is evaluated at most once (the models wrap their forward in it)."""

active_orthogonal_cache = active_forward_cache
"""The cache of the enclosing `orthogonal_cache()` block, or None outside one."""


class StepMatrices(Protocol):
    """A step cache (`model.orthogonal_step.OrthogonalStepCache`) as the maps read it."""

    def matrices(
        self, pairs: list[tuple[FP32Orthogonal, torch.Tensor]]
    ) -> dict[str | int, torch.Tensor]:
        """{forward_cache_key(map): matrix} of this micro-batch for the (map, free parameters)
        pairs."""
        ...


_STEPS: list[StepMatrices] = []
"""Active step caches (`step_cache_active`), innermost last."""


@contextlib.contextmanager
def step_cache_active(cache: StepMatrices) -> Iterator[None]:
    """Within the block, training forwards (gradients on) take their maps from ``cache``."""
    _STEPS.append(cache)
    try:
        yield
    finally:
        _STEPS.pop()


def active_step_cache() -> StepMatrices | None:
    """The step cache of the enclosing training micro-batch, or None: outside one, with
    gradients off (evaluation never touches the step's matrices) and while torch.compile
    traces (a compiled graph either finds the step's maps in the active cache, put there
    before the graph runs, or evaluates its own)."""
    if not _STEPS or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    return _STEPS[-1]


class MapSharding(Protocol):
    """How a batch of `total` maps is spread over data-parallel ranks
    (`model.orthogonal_step.DataParallelMapSharding`)."""

    def bounds(self, total: int, shape: tuple[int, int]) -> tuple[int, int] | None:
        """[lo, hi): the rows of a batch of `total` maps of free parameters of `shape` this rank
        evaluates, or None when the batch is not sharded (too few maps for the ranks, or maps
        too small to be worth the collectives): every rank evaluates all of it."""
        ...

    def gather(self, part: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's `part`, in rank order: the whole batch of `total` matrices, on every
        rank; its backward hands each rank the gradient of its part summed over the ranks."""
        ...


_Orthogonal, _OrthMaps = compat.orthogonal_parametrization()


class FP32Orthogonal(_Orthogonal):
    """torch's orthogonal map, evaluated in fp32 (autocast off); returns an fp32 matrix."""

    leaf_inverse: str = "lu"
    """How the Cayley map inverts the leaves of its block inverse (`block_inverse`):
    `EncoderConfig.cayley_leaf_inverse`, set by `make_orthogonal`."""

    _inference: tuple[torch.Tensor, torch.Tensor] | None = None
    """(copy of the free parameters, the matrix) of the last inference evaluation; not state."""

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        store = active_orthogonal_cache()
        key = forward_cache_key(self)
        Q = None if store is None else store.get(key)
        if Q is None:
            step = active_step_cache()
            if step is not None and not _zero3_partitioned(X):
                Q = step.matrices([(self, X)])[key]
            else:
                Q = self._evaluate_or_reuse(X)
            if store is not None:
                store[key] = Q
        return Q

    def train(self, mode: bool = True) -> FP32Orthogonal:
        self._inference = None  # entering (or leaving) training: the next eval starts afresh
        return super().train(mode)

    def _evaluate_or_reuse(self, X: torch.Tensor) -> torch.Tensor:
        """The map, reusing the last inference result while X is unchanged (module docstring)."""
        if self.training or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self.evaluate(X)
        kept = self._inference
        if (
            kept is not None
            and kept[0].dtype == X.dtype
            and kept[0].device == X.device
            and torch.equal(kept[0], X)
        ):
            return kept[1]
        Q = self.evaluate(X)
        self._inference = (X.detach().clone(), Q)
        return Q

    def evaluate(self, X: torch.Tensor) -> torch.Tensor:
        """The map itself: free parameters -> orthogonal matrix (or a batch), returned in fp32.

        cayley is `cayley` below (torch's map, by a block inverse: matrix products, no host
        sync). matrix_exp runs in fp64: its scaling-and-squaring in fp32 drifts to
        max|W^T W - I| of 2.6e-5 at d=768 (1.2e-8 in fp64). cayley and householder are
        accurate in fp32 (about 1e-6 at d=768) and cheaper, hence cayley is the default map.
        """
        dtype = torch.float64 if self.orthogonal_map == _OrthMaps.matrix_exp else torch.float32
        with torch.autocast(device_type=X.device.type, enabled=False):
            X = X.to(dtype)
            if self.orthogonal_map == _OrthMaps.cayley:
                return cayley(X, leaf_inverse=self.leaf_inverse).float()
            return super().forward(X).float()

    @torch.no_grad()
    def right_inverse(self, Q: torch.Tensor) -> torch.Tensor:
        return super().right_inverse(Q.float())


def _solve(B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """B^-1 C through an LU factorisation without a host sync: `solve_ex(check_errors=False)`
    (torch's `linalg.solve` checks the factorisation's status, which makes the host wait for
    the device). The Cayley map inside a graph torch.compile traces (`cayley`), and the
    reference its block inverse is measured against.

    A batch is one call (one batched factorisation) except on the CPU, where it is one solve per
    matrix: with torch 2.13's CPU build (oneMKL), a batched solve of (4, 256, 256) fails
    ("Pivots given to lu_solve...") or hangs once torch.set_num_threads() has been called;
    single solves are unaffected.
    """
    return _batched_on_device(lambda b, c: torch.linalg.solve_ex(b, c, check_errors=False)[0], B, C)


def _batched_on_device(fn, *mats: torch.Tensor) -> torch.Tensor:
    """fn over a batch of matrices (the batch dimensions of the first): one batched call, or on
    the CPU one call per matrix, since oneMKL's batched factorisation fails there (`_solve`)."""
    if mats[0].ndim == 2 or mats[0].device.type != "cpu":
        return fn(*mats)
    flat = [m.reshape(-1, *m.shape[-2:]) for m in mats]
    out = torch.stack([fn(*one) for one in zip(*flat)])
    return out.reshape(*mats[0].shape[:-2], *out.shape[-2:])


BLOCK_INVERSE_BASE = 128
"""Blocks up to this size are inverted by a factorisation (`torch.linalg.inv_ex`); larger ones
are split in two (`block_inverse`). 128 was the fastest of 32 / 64 / 128 on the CPU at
d = 768 (the blocks are then 96 x 96)."""


def check_leaf_inverse(leaf_inverse: str) -> str:
    """`leaf_inverse` if it is one of `EncoderConfig.cayley_leaf_inverse`'s values."""
    choices = get_args(CayleyLeafInverse)
    if leaf_inverse not in choices:
        raise ValueError(
            f"unknown Cayley leaf inverse {leaf_inverse!r}; choose one of {', '.join(choices)}"
        )
    return leaf_inverse


def _base_inverse(M: torch.Tensor, leaf_inverse: str = "lu") -> torch.Tensor:
    """M^-1 of small blocks: by LU (`inv_ex`: no status check, no host sync; one call per
    matrix on the CPU, where oneMKL's batched factorisation fails, see `_solve`), or with
    `gauss_jordan` on CUDA by `gauss_jordan_inverse` (off CUDA: LU)."""
    if leaf_inverse == "gauss_jordan" and M.is_cuda:
        return gauss_jordan_inverse(M)
    return _batched_on_device(lambda m: torch.linalg.inv_ex(m)[0], M)


GAUSS_JORDAN_WARPS = 8
"""Warps of a `gauss_jordan_inverse` program (its 128 x 128 tile over 256 threads: 64 fp32
values each). Compiled for the GPUs without one (`tests/triton_compile.py`), the 128-wide
kernel needs 202 registers a thread on an H100 and 171 on an A100 with 8 warps, 104-108 with
16, and spills none with either (4 warps: 255 and 12 bytes of spills on an H100). Not timed on
a GPU yet (`bench_fast_paths.py cayley` times 4, 8 and 16)."""


def gauss_jordan_inverse(M: torch.Tensor) -> torch.Tensor:
    """M^-1 (any batch of fp32 matrices up to 128 x 128) by ONE Triton kernel, a program per
    matrix doing Gauss-Jordan without pivoting in registers (`orthogonal_kernels`): for the
    leaves of `block_inverse`, whose symmetric parts are >= I. On a GPU, where a batched LU
    inverse of such small matrices is some twenty latency-bound kernels, this is one launch.
    Runs on CPU tensors only in Triton's interpreter (TRITON_INTERPRET=1; the tests)."""
    from model.orthogonal_kernels import gauss_jordan_inverse as kernel

    n = M.size(-1)
    if M.dtype != torch.float32 or n > 128 or M.size(-2) != n:
        raise ValueError(f"gauss_jordan_inverse takes fp32 matrices up to 128 x 128, got {M.shape}")
    flat = M.reshape(-1, n, n).contiguous()
    out = torch.empty_like(flat)
    if flat.size(0):
        NP = max(16, 1 << (n - 1).bit_length())
        grid = (flat.size(0),)
        kernel[grid](
            flat, out, n, flat.stride(0), flat.stride(1), NP=NP, num_warps=GAUSS_JORDAN_WARPS
        )
    return out.reshape(M.shape)


def block_inverse(
    M: torch.Tensor, base: int | None = None, leaf_inverse: str = "lu"
) -> torch.Tensor:
    """M^-1 (any batch) for a matrix whose symmetric part is positive definite, such as
    I - A/2 with A skew-symmetric (the Cayley map's), by recursive 2 x 2 blocks:

        M = [[P, Q], [R, S]],  T = S - R P^-1 Q (the Schur complement),
        M^-1 = [[P^-1 + P^-1 Q T^-1 R P^-1, -P^-1 Q T^-1], [-T^-1 R P^-1, T^-1]].

    All the work above the `base` size is batched matrix products (2 n^3 flops in all, like
    an LU inverse), which a GPU runs at its GEMM rate, where a batched LU of n = 768 is a loop
    of latency-bound factorisations. No pivoting is needed: x^T M x = |x|^2 when M = I + skew,
    and for any x, with y = -P^-1 Q x, x^T T x = [y; x]^T M [y; x] >= |x|^2, so every P and T
    on the way down again has a symmetric part >= I and singular values >= 1: no small pivot
    (the argument for LU without pivoting on such matrices). Accuracy, measured: closer to the
    fp64 map than the LU solve (docs/methods.md).
    `base`: None is `BLOCK_INVERSE_BASE`. `leaf_inverse`: how blocks up to `base` are inverted
    (`_base_inverse`: `lu`, or `gauss_jordan` on CUDA; the same argument shows that Gauss-Jordan
    needs no pivoting on them).

    Each block of the result is written in place into one output tensor, and the subtractions
    and signs ride on the products (`baddbmm`'s alpha and beta): no concatenation of the four
    blocks at every level, no separate pass to subtract or negate a product (`_inverse_into`).
    Not differentiable itself (the Cayley map's Function has its own backward).
    """
    base = BLOCK_INVERSE_BASE if base is None else base
    n = M.size(-1)
    if n <= base:
        return _base_inverse(M, leaf_inverse)
    flat = M.reshape(-1, n, n)
    out = torch.empty_like(flat)
    _inverse_into(flat, out, base, leaf_inverse)
    return out.view(M.shape)


def _inverse_into(M: torch.Tensor, out: torch.Tensor, base: int, leaf_inverse: str) -> None:
    """`block_inverse` of a (b, n, n) batch M into `out` (a (b, n, n) tensor or view of one):
    P^-1 is made in the upper-left block of `out` and updated there into the upper-left block
    of M^-1 once the lower-left one, -T^-1 R P^-1, is in place."""
    n = M.size(-1)
    if n <= base:
        out.copy_(_base_inverse(M, leaf_inverse))
        return
    h = n // 2
    P, Q = M[:, :h, :h], M[:, :h, h:]
    R, S = M[:, h:, :h], M[:, h:, h:]
    upper_left, upper_right = out[:, :h, :h], out[:, :h, h:]
    lower_left, lower_right = out[:, h:, :h], out[:, h:, h:]
    _inverse_into(P, upper_left, base, leaf_inverse)  # P^-1, for now
    P_inv_Q = torch.bmm(upper_left, Q)
    _inverse_into(torch.baddbmm(S, R, P_inv_Q, alpha=-1), lower_right, base, leaf_inverse)  # T^-1
    R_P_inv = torch.bmm(R, upper_left)
    torch.baddbmm(lower_left, lower_right, R_P_inv, beta=0, alpha=-1, out=lower_left)
    upper_left.baddbmm_(P_inv_Q, lower_left, alpha=-1)  # P^-1 - P^-1 Q (-T^-1 R P^-1)
    torch.baddbmm(upper_right, P_inv_Q, lower_right, beta=0, alpha=-1, out=upper_right)


@contextlib.contextmanager
def ieee_fp32_matmuls() -> Iterator[None]:
    """fp32 matrix products in full fp32 inside the block: a user's
    `torch.set_float32_matmul_precision("high")` (TF32 on CUDA) or `"medium"` (bf16 where the
    CPU has it) would otherwise leave the Cayley map orthogonal only to about
    the precision of those formats (TF32: 10 mantissa bits, bf16: 7), not fp32's 1e-6."""
    previous = torch.get_float32_matmul_precision()
    if previous == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class _CayleyOfSkew(torch.autograd.Function):
    """Q = (I - A/2)^-1 (I + A/2) = 2 (I - A/2)^-1 - I for A skew-symmetric (any batch).

    Forward: one `block_inverse`. Backward, from dQ = M^-1 dA M^-1 (M = I - A/2, and
    M^-1 = (Q + I) / 2): dL/dA = M^-T G M^-T = (Q + I)^T G (Q + I)^T / 4, two products whose
    epilogues add the identity's terms and the quarter; only Q is kept for it. (I + A/2 =
    2I - M gives the first identity.)
    """

    @staticmethod
    def forward(A: torch.Tensor, leaf_inverse: str = "lu") -> torch.Tensor:
        Id = torch.eye(A.size(-1), dtype=A.dtype, device=A.device)
        with ieee_fp32_matmuls():
            Q = block_inverse(torch.add(Id, A, alpha=-0.5), leaf_inverse=leaf_inverse)
        Q.mul_(2).diagonal(dim1=-2, dim2=-1).sub_(1)  # 2 M^-1 - I, in place (a fresh tensor)
        return Q

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, str], output: torch.Tensor) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (Q,) = ctx.saved_tensors
        n = Q.size(-1)
        Qt, G = Q.reshape(-1, n, n).mT, grad.reshape(-1, n, n)
        with ieee_fp32_matmuls():
            # W G W / 4 with W = Q^T + I = 2 M^-T, never formed: W G = Q^T G + G, then
            # (W G) W / 4 = (W G Q^T + W G) / 4, each sum and the quarter carried by the product
            WG = torch.baddbmm(G, Qt, G)
            out = torch.baddbmm(WG, WG, Qt, beta=0.25, alpha=0.25)
        return out.view(grad.shape), None


def cayley(X: torch.Tensor, method: str | None = None, leaf_inverse: str = "lu") -> torch.Tensor:
    """torch's Cayley map (`torch.nn.utils.parametrizations.orthogonal`, use_trivialization=False)
    of free parameters X (..., n, k), any batch: the same map, computed by products of matrices.

    A = tril(X) - tril(X)^T (X embedded in a square matrix when n != k; the wide case is
    transposed), Q = (I - A/2)^-1 (I + A/2), the first k columns. Torch solves the system by LU;
    here Q = 2 (I - A/2)^-1 - I with the inverse by `block_inverse` and a two-product backward
    (`_CayleyOfSkew`): the same matrix to about 1e-6 in fp32, closer to the fp64 map than the LU
    solve, and matrix products rather than factorisations on a GPU (docs/methods.md, "Fast
    paths"). Inside a graph torch.compile traces, the LU solve: a graph cannot read or switch
    the fp32 matmul precision that the block inverse needs in full (`ieee_fp32_matmuls`); the
    training engine evaluates the maps eagerly before a compiled encoder runs, so this applies
    only where a compiled graph maps them itself (`model.orthogonal_step_cache=false`, or an
    inference forward). `method`: "block" or "lu" to choose (benchmarks, tests); None: as above.
    `leaf_inverse`: how the block inverse inverts its leaves (`block_inverse`).
    """
    if method is None:
        method = "lu" if torch.compiler.is_compiling() else "block"
    if method not in ("block", "lu"):
        raise ValueError(f"unknown Cayley method {method!r}; choose block or lu")
    n, k = X.size(-2), X.size(-1)
    transposed = n < k
    if transposed:
        X = X.mT
        n, k = k, n
    X = X.tril()
    if n != k:
        X = torch.cat([X, X.new_zeros(n, n - k).expand(*X.shape[:-2], -1, -1)], dim=-1)
    A = X - X.mH
    if method == "lu":
        Id = torch.eye(n, dtype=A.dtype, device=A.device)
        Q = _solve(torch.add(Id, A, alpha=-0.5), torch.add(Id, A, alpha=0.5))
    else:
        Q = _CayleyOfSkew.apply(A, leaf_inverse)
    if n != k:
        Q = Q[..., :k]
    return Q.mT if transposed else Q


def _zero3_partitioned(t: torch.Tensor) -> bool:
    """Whether DeepSpeed ZeRO-3 owns this parameter (its data is gathered by module hooks)."""
    return hasattr(t, "ds_id")


def evaluate_orthogonal_maps(
    model: nn.Module, store: dict[str | int, Any] | None, required: bool = False
) -> None:
    """Evaluates every fp32-orthogonal map of `model` into `store` (the active cache), maps of
    one kind, shape, dtype and device in ONE evaluation: their free parameters are
    concatenated, mapped as one batch (for cayley: one batched factorisation on CUDA) and split.
    The gradient reaches each map's parameters through the concatenation, exactly as if each
    had been evaluated alone (tested to 1e-6).

    Maps already in `store` are skipped. Under DeepSpeed ZeRO-3 (parameters gathered only by
    module hooks) nothing is batched: with `required` (activation checkpointing needs every map
    before the first checkpointed region) each map is evaluated through its own module call,
    otherwise the maps are left to be evaluated where they are used.

    In a training micro-batch under an `OrthogonalStepCache` the matrices come from the step's
    cache (evaluated, batched as above, at their first use in the step).
    """
    if store is None:
        return
    pairs: list[tuple[FP32Orthogonal, torch.Tensor]] = []
    singles: list[tuple[nn.Module, str]] = []
    for _, module, name in orthogonal_modules(model):
        plist = module.parametrizations[name]
        orth = plist[0]
        if forward_cache_key(orth) in store:
            continue
        X = plist.original
        if _zero3_partitioned(X):
            if not required:
                return
            singles.append((module, name))
            continue
        pairs.append((orth, X))
    for module, name in singles:
        getattr(module, name)
    step = active_step_cache()
    store.update(step.matrices(pairs) if step is not None else _evaluate_grouped(pairs))


def _evaluate_grouped(
    pairs: list[tuple[FP32Orthogonal, torch.Tensor]],
) -> dict[str | int, torch.Tensor]:
    """{forward_cache_key(map): matrix} of (map, free parameters) pairs, maps of one kind,
    shape, dtype and device in one evaluation (`evaluate_orthogonal_maps`)."""
    return evaluate_grouped(pairs, None)[0]


def evaluate_grouped(
    pairs: list[tuple[FP32Orthogonal, torch.Tensor]], sharding: MapSharding | None
) -> tuple[dict[str | int, torch.Tensor], int]:
    """`_evaluate_grouped`, each group's batch spread over the ranks by `sharding` (module
    docstring) when given; also returns how many matrices this rank mapped."""
    groups: dict[tuple, list[tuple[FP32Orthogonal, torch.Tensor]]] = {}
    for orth, X in pairs:
        key = (orth.orthogonal_map, orth.leaf_inverse, tuple(X.shape[-2:]), X.dtype, X.device)
        groups.setdefault(key, []).append((orth, X))
    out: dict[str | int, torch.Tensor] = {}
    evaluated = 0
    for members in groups.values():
        shape = members[0][1].shape[-2:]
        flat = [X.reshape(-1, *shape) for _, X in members]
        total = sum(f.size(0) for f in flat)
        rows = None if sharding is None else sharding.bounds(total, tuple(shape))
        if rows is None and len(members) == 1:
            orth, X = members[0]
            out[forward_cache_key(orth)] = orth._evaluate_or_reuse(X)
            evaluated += total
            continue
        X_all = torch.cat(flat) if len(flat) > 1 else flat[0]
        evaluate = members[0][0].evaluate
        if rows is None:
            Q_all = evaluate(X_all)
            evaluated += total
        else:
            lo, hi = rows
            Q_all = sharding.gather(evaluate(X_all[lo:hi]), total)
            evaluated += hi - lo
        for (orth, X), Q in zip(members, Q_all.split([f.size(0) for f in flat])):
            out[forward_cache_key(orth)] = Q.reshape(X.shape)
    return out, evaluated


def make_orthogonal(
    module: nn.Module,
    name: str = "weight",
    orthogonal_map: str = "cayley",
    leaf_inverse: str = "lu",
) -> nn.Module:
    """Registers an fp32 orthogonal parametrization on `module.<name>` (matrices or batches of them).
    `leaf_inverse`: how the Cayley map inverts its leaf blocks (`EncoderConfig.cayley_leaf_inverse`).

    The starting point is a random orthogonal matrix: householder projects an orthogonal init;
    matrix_exp and cayley map unit-variance free parameters.
    """
    weight = getattr(module, name)
    if weight.ndim < 2:
        raise ValueError(
            f"orthogonal parametrization needs a matrix, got shape {tuple(weight.shape)}"
        )
    orth = FP32Orthogonal(weight, getattr(_OrthMaps, orthogonal_map), use_trivialization=False)
    orth.leaf_inverse = check_leaf_inverse(leaf_inverse)
    if orthogonal_map == "householder":
        with torch.no_grad():
            nn.init.orthogonal_(weight)
    # unsafe=True as in torch's own `orthogonal`: the map changes the dtype (always fp32 out).
    parametrize.register_parametrization(module, name, orth, unsafe=True)
    if orthogonal_map != "householder":
        # The skew matrix A = tril(W) - tril(W)^T has eigenvalues +-i*theta with |theta| up to
        # about 2 * std * sqrt(n): std = pi / (2 sqrt(n)) spreads the rotation angles over the
        # circle at any width (a random rotation), where the module's small default init would
        # start near the identity and unit variance would make A's norm (and the map's
        # rounding error) grow with sqrt(n).
        n = max(weight.shape[-2:])
        with torch.no_grad():
            nn.init.normal_(
                module.parametrizations[name].original, std=math.pi / (2 * math.sqrt(n))
            )
    return module


def is_orthogonal_parametrized(module: nn.Module, name: str = "weight") -> bool:
    return parametrize.is_parametrized(module, name) and isinstance(
        module.parametrizations[name][0], FP32Orthogonal
    )


def orthogonal_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, module, tensor name) of every fp32-orthogonal parametrized tensor."""
    found = []
    for qual, mod in model.named_modules():
        if parametrize.is_parametrized(mod):
            for tensor_name, plist in mod.parametrizations.items():
                if isinstance(plist[0], FP32Orthogonal):
                    found.append((qual, mod, tensor_name))
    return found


def orthogonality_error(weight: torch.Tensor) -> float:
    """max |W^T W - I| (over the smaller Gram matrix for rectangular or batched weights), in fp64."""
    w = weight.detach().double()
    if w.size(-2) < w.size(-1):
        w = w.mT
    gram = w.mT @ w
    eye = torch.eye(gram.size(-1), dtype=gram.dtype, device=gram.device)
    return (gram - eye).abs().max().item()


class Linear(nn.Linear):
    """nn.Linear that casts its weight to the input dtype (the orthogonal map returns fp32).

    Under autocast the cast is a no-op and autocast picks the compute dtype as usual.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            w = w.to(x.dtype)
        return F.linear(x, w, self.bias)
