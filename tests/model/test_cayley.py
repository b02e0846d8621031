"""The Cayley map by block inverse (`model.orthogonal.cayley`): the same matrices and gradients
as torch's own orthogonal parametrization, closer to fp64 than the LU solve, full fp32 whatever
the matmul precision a user set, and no factorisation of a full-size matrix."""

import pytest
import torch
from op_log import OpLog
from torch.nn.utils.parametrizations import _OrthMaps, _Orthogonal

import model.orthogonal as orthogonal_module
from model.orthogonal import block_inverse, cayley

pytestmark = [pytest.mark.unit, pytest.mark.numerics]


def skew(b: int, n: int, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(b, n, n, generator=g, dtype=dtype).tril()
    return X - X.mT


def reference_inverse(M: torch.Tensor) -> torch.Tensor:
    """torch's inverse, one matrix at a time: its batched LU on the CPU (oneMKL, torch 2.13)
    fails or returns wrong values once any test of the process has called
    torch.set_num_threads() (pytorch/pytorch#141358), as model/orthogonal.py's solves avoid."""
    return torch.stack([torch.linalg.inv(m) for m in M.reshape(-1, *M.shape[-2:])]).view(M.shape)


def torch_cayley(X: torch.Tensor) -> torch.Tensor:
    """torch's parametrization (cayley, no trivialisation; its LU solve) of free parameters X."""
    return _Orthogonal(X, _OrthMaps.cayley, use_trivialization=False)(X)


@pytest.mark.parametrize("n", [1, 5, 17, 64, 100])
def test_block_inverse_is_the_inverse(n):
    """Recursion down to 1 x 1 blocks (base 1), odd splits included, in fp64."""
    M = torch.eye(n, dtype=torch.float64) - skew(3, n) / 2
    for base in (1, 3, 16):
        inv = block_inverse(M, base=base)
        torch.testing.assert_close(inv, reference_inverse(M), rtol=1e-10, atol=1e-12)


def test_block_inverse_with_a_positive_definite_symmetric_part():
    """Any M with M + M^T positive definite (not only I + skew): the Schur complements stay
    invertible without pivoting."""
    g = torch.Generator().manual_seed(1)
    B = torch.randn(2, 40, 40, generator=g, dtype=torch.float64)
    M = B @ B.mT + 0.1 * torch.eye(40, dtype=torch.float64) + skew(2, 40, seed=2)
    torch.testing.assert_close(
        block_inverse(M, base=4), reference_inverse(M), rtol=1e-9, atol=1e-10
    )


@pytest.mark.parametrize("shape", [(3, 24, 24), (2, 30, 12), (2, 12, 30)])
def test_equals_torch_map_values_and_gradients(shape):
    """Square, tall (embedded in a square) and wide (transposed) free parameters, fp64."""
    g = torch.Generator().manual_seed(3)
    X = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    G = torch.randn(*shape, generator=g, dtype=torch.float64)
    ours, ref = cayley(X), torch_cayley(X)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    (grad_ours,) = torch.autograd.grad((ours * G).sum(), X)
    (grad_ref,) = torch.autograd.grad((ref * G).sum(), X)
    torch.testing.assert_close(grad_ours, grad_ref, rtol=1e-9, atol=1e-11)


def test_gradcheck_through_the_recursion(monkeypatch):
    monkeypatch.setattr(orthogonal_module, "BLOCK_INVERSE_BASE", 2)
    X = torch.randn(2, 7, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(cayley, (X,))


def test_closer_to_fp64_than_the_lu_solve_at_width_256():
    X = torch.randn(4, 256, 256, generator=torch.Generator().manual_seed(4))
    exact = cayley(X.double())
    lu, block = cayley(X, method="lu"), cayley(X)
    Id = torch.eye(256)
    err_block = (block.double() - exact).abs().max().item()
    err_lu = (lu.double() - exact).abs().max().item()
    assert err_block < 2e-6 and err_block < err_lu, (err_block, err_lu)
    assert (block.mT @ block - Id).abs().max().item() < 2e-6


def test_full_fp32_whatever_the_matmul_precision():
    """After `torch.set_float32_matmul_precision("high")` (TF32 on CUDA) or `"medium"` (bf16 on
    a CPU that has it) every product of the map, forward and backward, runs at "highest", and
    the user's setting is back afterwards. (This CPU computes "medium" products nearly in full
    precision, so the guard is checked by what is in force, not by the error it prevents.)"""
    X = torch.randn(2, 256, 256, generator=torch.Generator().manual_seed(5), requires_grad=True)
    previous = torch.get_float32_matmul_precision()
    for setting in ("high", "medium"):
        torch.set_float32_matmul_precision(setting)
        try:
            with OpLog() as recorder:
                cayley(X).sum().backward()
            with OpLog() as unguarded:
                block_inverse(torch.eye(256) - X.detach())
            assert torch.get_float32_matmul_precision() == setting
        finally:
            torch.set_float32_matmul_precision(previous)
        # 256 = 128 + 128: one split, six products; the backward's two
        seen = [op.matmul_precision for op in recorder.matmuls()]
        assert seen == ["highest"] * 8, seen
        # what the guard is there for
        assert {op.matmul_precision for op in unguarded.matmuls()} == {setting}


def test_no_factorisation_of_a_full_size_matrix(monkeypatch):
    """Only blocks up to the base size are factorised; no LU solve is called."""
    sizes = []
    inv_ex = torch.linalg.inv_ex
    monkeypatch.setattr(torch.linalg, "inv_ex", lambda m: sizes.append(m.size(-1)) or inv_ex(m))

    def no_solve(*args, **kwargs):
        raise AssertionError("the Cayley map solved a full-size system")

    monkeypatch.setattr(torch.linalg, "solve_ex", no_solve)
    monkeypatch.setattr(torch.linalg, "solve", no_solve)
    X = torch.randn(3, 300, 300, requires_grad=True)
    cayley(X).sum().backward()
    assert sizes and max(sizes) <= orthogonal_module.BLOCK_INVERSE_BASE, sizes
    assert X.grad is not None and torch.isfinite(X.grad).all()


def test_compiled_graph_maps_by_lu_with_the_same_result():
    """Inside a graph torch.compile traces (which cannot read the matmul precision) the map is
    the LU solve; its values and gradients equal the eager block inverse."""
    X = torch.randn(3, 48, 48, generator=torch.Generator().manual_seed(6), requires_grad=True)
    eager = cayley(X)
    (grad_eager,) = torch.autograd.grad(eager.sum(), X)
    compiled = torch.compile(cayley, backend="aot_eager", fullgraph=True)(X)
    (grad_compiled,) = torch.autograd.grad(compiled.sum(), X)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=2e-6)
    torch.testing.assert_close(grad_compiled, grad_eager, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown Cayley method 'qr'"):
        cayley(X, method="qr")


def test_leaf_inverse_option_reaches_every_map_and_is_checked():
    from model.config import EncoderConfig
    from model.encoder import Encoder
    from model.orthogonal import FP32Orthogonal, gauss_jordan_inverse

    cfg = EncoderConfig.preset("debug", attention="transject", cayley_leaf_inverse="gauss_jordan")
    maps = [m for m in Encoder(cfg).modules() if isinstance(m, FP32Orthogonal)]
    assert maps and all(m.leaf_inverse == "gauss_jordan" for m in maps)
    torch.manual_seed(0)
    X = torch.randn(2, 40, 40)
    # Off CUDA the option is LU: the same matrices as the default.
    torch.testing.assert_close(cayley(X, leaf_inverse="gauss_jordan"), cayley(X), rtol=0, atol=0)
    with pytest.raises(ValueError, match="cayley_leaf_inverse"):
        EncoderConfig.preset("debug", cayley_leaf_inverse="cholesky")
    with pytest.raises(ValueError, match="up to 128 x 128"):
        gauss_jordan_inverse(torch.eye(200))


def test_block_inverse_and_backward_make_no_extra_passes():
    """The block inverse writes each block of its result in place: no concatenation of the
    blocks, no subtraction or negation of a product as a pass of its own (the products' alpha
    and beta carry them); the map's backward forms no (Q + I) and scales by no separate pass.
    Counted with the operators' log; the values are the inverse's (fp64)."""
    n, base = 300, orthogonal_module.BLOCK_INVERSE_BASE  # 300 = 150 + 150, then 75s: two levels
    M = torch.eye(n, dtype=torch.float64) - skew(2, n) / 2
    with OpLog() as log:
        inv = block_inverse(M, base=base)
    torch.testing.assert_close(inv, reference_inverse(M), rtol=1e-10, atol=1e-12)
    names = log.counts()
    assert not {"cat", "sub", "neg", "rsub", "mul", "add"} & set(names), names
    X = torch.randn(2, n, n, dtype=torch.float64, requires_grad=True)
    Q = cayley(X)
    grad = torch.randn_like(Q)
    with OpLog() as log:
        Q.backward(grad)
    full = [
        op.name
        for op in log.ops
        if not op.is_view and op.name != "detach" and max(op.output_numels, default=0) >= n * n
    ]
    # the two products, then what autograd does for A = tril(X) - tril(X)^T (the negation, the
    # sum, the tril) and nothing else of the matrices' size
    assert sorted(full) == sorted(["baddbmm", "baddbmm", "neg", "add", "tril"]), full
