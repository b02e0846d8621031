"""The project's Triton kernels (TISA's split backend, the Cayley map's Gauss-Jordan leaves)
checked without a GPU: their arithmetic in Triton's interpreter on CPU tensors against the
references, and their compilation for an H100 (Triton's compiler and ptxas need no GPU), which
covers kernel attention's inference kernels too (their arithmetic: test_kernel_triton.py).

Integration tier: each test runs a subprocess or Triton's toolchain for seconds.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import triton_compile as check
from triton_support import InterpreterRuns

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreter(request):
    """The interpreter scripts of this module's selected tests, each in a process of its own,
    started while the first test compiles the kernels in this one (`InterpreterRuns`): the
    three share the runner's cores instead of taking turns."""
    runs = InterpreterRuns.of_selected(request, _scripts())
    yield runs
    runs.close()


def _scripts() -> list[tuple[str, str]]:
    """(test, script) of the interpreter tests, the longest first."""
    return [
        ("test_gauss_jordan_leaves_in_the_interpreter", GAUSS_JORDAN_CHECK),
        ("test_triton_kernels_equal_the_reference_in_the_interpreter", TRITON_CHECK),
    ]


def test_kernels_compile_for_an_h100_within_its_shared_memory(interpreter):
    """The shipped options of the split backend's kernels, of the Cayley map's Gauss-Jordan
    leaves and of kernel attention's inference and training kernels compile for sm_90 (Triton's
    compiler and ptxas run without a GPU), fit the H100's shared memory per block, and the split
    and kernel attention kernels spill no register and have their loops' loads pipelined; the
    training kernels spill none on an A100 (sm_80) either (tests/triton_compile.py)."""
    # (`interpreter`: the scripts of the tests below run meanwhile, in another process)
    rows = [check.check(config, 90) for config in check.all_configs()]
    assert all("error" not in row and row["fits"] for row in rows), rows
    training = ("query_grad", "summary_grad", "key_grad")
    assert {row["kernel"] for row in rows} == {
        "row_lse", "diagonal_grad", "gauss_jordan_inverse", "key_summary", "query_output",
        *training,
    }  # fmt: skip
    split = [row for row in rows if row["kernel"] in ("row_lse", "diagonal_grad")]
    linear = [row for row in rows if row["kernel"] in ("key_summary", "query_output", *training)]
    assert all(row["spill_bytes"] == 0 for row in split + linear), split + linear
    # kernel attention: the loads of keys and values in the loop over tiles are pipelined
    assert all(
        row["async_copies"] >= 2
        for row in linear
        if row["kernel"] in ("key_summary", "summary_grad")
    )
    a100 = [check.check(c, 80) for c in check.all_configs() if c["kernel"] in training]
    assert all("error" not in row and row["spill_bytes"] == 0 for row in a100), a100
    # Every load of Q, K, V, dO is pipelined (async copies): 4 a stage in the gradient kernel.
    assert all(row["async_copies"] >= 2 for row in split), split
    assert max(row["async_copies"] for row in split) >= 8, split


TRITON_CHECK = textwrap.dedent(
    """
    import torch
    from model.attention.tisa_split import reference_values_grad, triton_values_grad

    torch.manual_seed(0)
    cases = [  # B, H, N, head width, tile, padded, programs per launch
        (3, 2, 37, 24, 16, True, 1024),  # N not a multiple of the tile, width padded to 32
        (2, 3, 32, 16, 16, False, 1024),  # whole tiles, no padding mask
        (5, 2, 50, 64, 32, True, 6),  # batch in slices (5 samples over 2 slices)
        (4, 1, 17, 16, 16, True, 1),  # one slice: every sample in one program
    ]
    import model.attention.tisa_split as split
    for B, H, N, hd, block, padded, programs in cases:
        split.PROGRAMS_PER_LAUNCH = programs
        q, k, v, do = (torch.randn(B, H, N, hd) for _ in range(4))
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, h) memory, as QKV gives
        values = torch.randn(H, 2 * N - 1)
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[1, N - 7 :] = False
        mask[-1, 5:] = False
        mask = mask if padded else None
        index = torch.arange(N)[None, :] - torch.arange(N)[:, None] + N - 1
        scores = torch.einsum("bhid,bhjd->bhij", q, k) * hd**-0.5 + values[:, index]
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        o = torch.softmax(scores, -1) @ v
        want = reference_values_grad(q, k, v, o, do, values, mask)
        got = triton_values_grad(q, k, v, o, do, values, mask, block=block)
        err = (got - want).abs().max().item()
        scale = want.abs().max().item()
        assert err <= 2e-6 * max(scale, 1.0), (B, H, N, hd, block, padded, programs, err, scale)
        print("ok", B, H, N, hd, block, padded, programs, err)
    """
)


def test_triton_kernels_equal_the_reference_in_the_interpreter(interpreter):
    """The CUDA kernels' arithmetic, run by Triton's interpreter on CPU tensors (what the GPU
    path computes; its speed is a GPU measurement, bench_fast_paths tisa-backends)."""
    assert interpreter.output(TRITON_CHECK).count("ok ") == 4


GAUSS_JORDAN_CHECK = """
import torch
import model.orthogonal as orthogonal
from model.orthogonal import cayley, gauss_jordan_inverse

g = torch.Generator().manual_seed(0)
for n, batch, scale in ((5, 3, 1.0), (96, 2, 0.1), (96, 1, 2.0), (128, 1, 0.5)):
    X = torch.randn(batch, n, n, generator=g, dtype=torch.float64).tril() * scale
    M = torch.eye(n, dtype=torch.float64) - (X - X.mT) / 2
    ref = torch.linalg.inv(M)
    err = (gauss_jordan_inverse(M.float()).double() - ref).abs().max().item()
    lu = (torch.linalg.inv(M.float()).double() - ref).abs().max().item()
    assert err <= max(4 * lu, 1e-6), (n, scale, err, lu)
    print("leaf", n, scale, err, lu)

# The whole map at d = 768 with Gauss-Jordan leaves (96 x 96): routed here by hand, since on the
# CPU the model's `gauss_jordan` falls back to LU.
X = torch.randn(768, 768, generator=g) * 3.1416 / (2 * 768**0.5)
Q_lu, Q_ref = cayley(X), cayley(X.double())
orthogonal._base_inverse = lambda M, leaf_inverse="lu": gauss_jordan_inverse(M)
Q_gj = cayley(X)
for name, Q in (("lu", Q_lu), ("gauss_jordan", Q_gj)):
    gram = Q.double().mT @ Q.double() - torch.eye(768, dtype=torch.float64)
    print(name, (Q.double() - Q_ref).abs().max().item(), gram.abs().max().item())
err_gj = (Q_gj.double() - Q_ref).abs().max().item()
err_lu = (Q_lu.double() - Q_ref).abs().max().item()
assert err_gj <= max(4 * err_lu, 2e-6), (err_gj, err_lu)
print("ok")
"""


def test_gauss_jordan_leaves_in_the_interpreter(interpreter):
    """`cayley_leaf_inverse: gauss_jordan`'s Triton kernel, run by Triton's interpreter on CPU
    tensors: each leaf within 4x of LU's error against fp64 (Cayley-type matrices of small and
    large skew parts, 5 to 128 wide), and the whole d = 768 map with those leaves within 4x of
    the LU leaves' error (or 2e-6)."""
    assert interpreter.output(GAUSS_JORDAN_CHECK).rstrip().endswith("ok")
