"""Kernel attention's fused inference kernels (`kernel.inference_backend: triton`).

Their arithmetic runs in Triton's interpreter on CPU tensors against the `torch` path (the same
module, the same weights), alone and inside the encoder, eager and compiled; which forwards take
them is checked in-process. Their compilation for an H100 is in test_triton_kernels.py; their
speed is a GPU measurement (bench/bench_attention_scaling.py, family `kernel-triton`).
"""

from __future__ import annotations

import pytest
import torch
from triton_support import run_in_triton_interpreter

from model import EncoderConfig
from model.attention.kernel import KernelAttention

INTERPRETER_CHECK = """
import torch
import model.attention.kernel_triton as kt
from model.attention.base import LayerContext
from model.attention.kernel import KernelAttention
from model import EncoderConfig

torch.manual_seed(0)
cases = [  # feature map, units, head width, padded, bf16, tile, programs per launch
    ("aoglu", 1, 64, True, True, 64, 512),  # the albert-base recipe's map
    ("aoglu", 3, 24, False, True, 32, 4),  # LRA's 3 units; width padded to 32; key slices
    ("ffn", 1, 64, True, True, 32, 1),  # one slice: a program sums all its head's keys
    ("glu", 2, 32, True, True, 32, 512),
    ("oglu", 1, 16, False, True, 16, 512),
    ("elu", 1, 64, True, True, 32, 8),
    ("aoglu", 2, 64, True, False, 32, 512),  # fp32: IEEE products in the interpreter
    ("ffn", 1, 40, True, False, 32, 512),
]
for fm, units, h, padded, bf16, block, programs in cases:
    kt.KERNEL_OPTIONS["BLOCK_N"] = block
    kt.PROGRAMS_PER_LAUNCH = programs
    B, H, N = 3, 2, 100
    cfg = EncoderConfig.preset(
        "debug", hidden_size=H * h, num_attention_heads=H, intermediate_size=64,
        attention="kernel", kernel={"feature_map": fm, "num_stacked": units,
                                    "inference_backend": "triton"},
    )
    att = KernelAttention(cfg).eval()
    # q, k, v as views of one (B, N, 3, H, h) projection, as the model gives them
    qkv = torch.randn(B, N, 3, H, h) * 2
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 61:] = False
    mask[2, 3:] = False
    ctx = LayerContext(mask_BN=mask, padded=padded)
    if not padded:
        ctx = LayerContext(mask_BN=torch.ones(B, N, dtype=torch.bool), padded=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if bf16:
            q, k, v = (x.bfloat16() for x in (q, k, v))
        assert att.fused_inference(q, k, v)
        got, aux = att(q, k, v, ctx)
        att.inference_backend = "torch"
        want, aux_want = att(q, k, v, ctx)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    assert got.transpose(1, 2).is_contiguous()  # (B, N, H, h) memory: the heads merge as a view
    assert aux.keys() == aux_want.keys()
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    tol = (2**-7 if bf16 else 1e-5) * scale  # two bf16 ulps at the largest output
    assert err <= tol, (fm, units, h, padded, bf16, block, programs, err, scale)
    print("ok", fm, units, h, padded, bf16, block, programs, f"{err:.3g}", f"{scale:.3g}")

# The element-wise helpers against torch, on values from -40 to 40 (log1p's tiny range
# included) and bf16's rounding ties: softplus within an fp32 ulp or two, the rounding exact.
import triton
import triton.language as tl
from model.attention.kernel_triton_kernels import round_to, softplus

@triton.jit
def helpers(X, SP, RB, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(SP + offs, softplus(x), mask=offs < n)
    tl.store(RB + offs, round_to(x, "bf16", True), mask=offs < n)

x = torch.cat([torch.linspace(-40, 40, 1001), torch.randn(1000) * 3])
ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-9])  # halfway cases
x = torch.cat([x, ties])
sp, rb = torch.empty_like(x), torch.empty_like(x)
helpers[(1,)](x, sp, rb, x.numel(), BLOCK=4096)
want = torch.nn.functional.softplus(x.double())
assert ((sp.double() - want).abs() <= 3e-7 * want.abs().clamp_min(1e-30)).all(), (sp, want)
assert torch.equal(rb, x.bfloat16().float())
print("ok helpers")

# An empty batch launches nothing.
empty = torch.empty(0, 2, 40, 32).bfloat16()
out = kt.kernel_attention_inference(empty, empty, empty, None, None, None, 1e-6, torch.bfloat16)
assert out.shape == (0, 2, 40, 32)
print("ok empty")

# The operator as torch.compile sees it: schema, fake tensor (shape, strides), dispatch.
q, k, v = (torch.randn(2, 2, 40, 32).bfloat16() for _ in range(3))
win = torch.randn(1, 2, 32, 40).bfloat16()
bw = torch.randn(1, 2, 8, 32).bfloat16()
torch.library.opcheck(
    kt.kernel_attention_inference, (q, k, v, win, bw, None, 1e-6, torch.bfloat16),
    test_utils=("test_schema", "test_faketensor"),
)
print("ok opcheck")
"""


ENCODER_CHECK = """
import copy
import torch
from model import Encoder, EncoderConfig

torch.manual_seed(0)
cfg = EncoderConfig.preset(
    "debug", attention="kernel", num_hidden_layers=2, vocab_size=300,
    kernel={"feature_map": "aoglu", "num_stacked": 1, "inference_backend": "triton"},
)
fused = Encoder(cfg).eval()
plain = copy.deepcopy(fused)
for module in plain.modules():
    if hasattr(module, "inference_backend"):
        module.inference_backend = "torch"
ids = torch.randint(5, 300, (2, 48))
mask = torch.ones(2, 48, dtype=torch.long)
mask[1, 30:] = 0
calls = []
import model.attention.kernel_triton as kt
real = kt._kernels  # looked up by the operator at each call
kt._kernels = lambda: calls.append(1) or real()
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    want = plain(ids, mask).last_hidden_state.float()
    got = fused(ids, mask).last_hidden_state.float()
    assert len(calls) == cfg.num_hidden_layers, calls
    compiled = torch.compile(fused, backend="inductor")
    got_compiled = compiled(ids, mask).last_hidden_state.float()
    assert len(calls) == 2 * cfg.num_hidden_layers, calls  # the compiled forward runs them too
scale = want.abs().max().item()
for name, out in (("eager", got), ("compiled", got_compiled)):
    err = (out - want).abs().max().item()
    assert err <= 0.05 * scale, (name, err, scale)  # bf16 through 2 layers and their LayerNorms
    print("ok", name, f"{err:.3g}", f"{scale:.3g}")
# A training step of the same module takes the torch path (gradients, dropout) and trains.
fused.train()
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = fused(ids, mask).last_hidden_state
out.float().pow(2).mean().backward()
assert len(calls) == 2 * cfg.num_hidden_layers, calls
print("ok train")
"""


@pytest.mark.integration
def test_fused_kernels_equal_the_torch_path_in_the_interpreter():
    """Every feature map (1-3 units, head widths 16-64 and padded ones), padded and unpadded
    keys, bf16 autocast and fp32, whole and partial tiles, the keys in one slice or several:
    the fused kernels' output within two bf16 ulps (fp32: 1e-5) of the torch path's; their
    softplus and bf16 rounding against torch's; an empty batch launches nothing; the
    operator's schema and fake tensor pass torch's opcheck."""
    out = run_in_triton_interpreter(INTERPRETER_CHECK)
    assert out.count("ok ") == 11, out


@pytest.mark.integration
def test_encoder_inference_runs_the_fused_kernels_eager_and_compiled():
    """An encoder with `kernel.inference_backend: triton`: its no-grad forward (eval) calls the
    kernels once per layer, eagerly and compiled, and its output matches the torch path's; a
    training forward and backward of the same module do not call them."""
    out = run_in_triton_interpreter(ENCODER_CHECK, timeout=600)
    assert out.count("ok ") == 3, out


def _attention(**kernel) -> KernelAttention:
    cfg = EncoderConfig.preset(
        "debug",
        attention="kernel",
        kernel={"feature_map": "aoglu", "inference_backend": "triton", **kernel},
    )
    return KernelAttention(cfg)


def test_only_forwards_without_gradient_or_dropout_take_the_fused_kernels():
    """`fused_inference`: eval under no_grad, or a training-mode module without dropout under
    no_grad, on a device the kernels run on; never with a gradient to compute, with the
    feature maps' dropout active, with `inference_backend: torch`, in fp64, or on the CPU
    outside Triton's interpreter."""
    att = _attention(dropout=0.1)
    att.fused_on_cpu = True  # as in Triton's interpreter
    q, k, v = (torch.randn(2, 4, 16, 32) for _ in range(3))
    with torch.no_grad():
        assert not att.train().fused_inference(q, k, v)  # dropout on
        assert att.eval().fused_inference(q, k, v)
    assert not att.eval().fused_inference(q, k, v)  # parameters need gradients
    att.requires_grad_(False)
    assert att.fused_inference(q, k, v)  # a frozen module: nothing needs a gradient
    assert not att.fused_inference(q.requires_grad_(), k, v)
    no_dropout = _attention(dropout=0.0)
    no_dropout.fused_on_cpu = True
    with torch.no_grad():
        assert no_dropout.train().fused_inference(q, k, v)
        no_dropout.fused_on_cpu = False  # the CPU, not the interpreter
        assert not no_dropout.fused_inference(q, k, v)
        plain = _attention(inference_backend="torch")
        plain.fused_on_cpu = True
        assert not plain.eval().fused_inference(q, k, v)
        no_dropout.fused_on_cpu = True
        assert not no_dropout.fused_inference(*(x.double() for x in (q, k, v)))  # fp64: torch


def test_the_fused_backend_is_checked_in_the_config():
    """A misspelt backend, or the fused one with heads wider than the kernels take, is refused
    when the config is built, naming the key."""
    with pytest.raises(ValueError, match=r"kernel\.inference_backend"):
        _attention(inference_backend="trition")
    with pytest.raises(ValueError, match="head_dim=256"):
        EncoderConfig.preset(
            "debug",
            attention="kernel",
            hidden_size=512,
            num_attention_heads=2,
            kernel={"inference_backend": "triton"},
        )
    EncoderConfig.preset("debug", attention="kernel", kernel={"inference_backend": "triton"})
