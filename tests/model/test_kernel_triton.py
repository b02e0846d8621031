"""Kernel attention's fused kernels: the inference kernels (`kernel.inference_backend: triton`)
and the training mixing (`kernel.training_backend: triton`).

Their arithmetic runs in Triton's interpreter on CPU tensors against the `torch` path (the same
module, the same weights, the same dropout masks) and, for gradients, an fp64 copy of it, alone
and inside the encoder, eager and compiled; which forwards take them is checked in-process. Their compilation for an H100 is in test_triton_kernels.py; their
speed is a GPU measurement (bench/bench_attention_scaling.py, family `kernel-triton`).
"""

from __future__ import annotations

import pytest
import torch
from triton_support import InterpreterRuns

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


@pytest.fixture(scope="module")
def interpreter(request):
    """The interpreter scripts of this module's selected tests, started together, two at a
    time, the longest first (`InterpreterRuns`): the module takes about what its longest
    runs do instead of the sum of all."""
    runs = InterpreterRuns.of_selected(request, _scripts())
    yield runs
    runs.close()


def _scripts() -> list[tuple[str, str]]:
    """(test, script) of every interpreter test, the longest first."""
    return [
        ("test_the_fused_mixing_moves_fewer_bytes_per_training_step", TRAFFIC_CHECK),
        ("test_compiled_step_is_counted_from_inductors_kernels", TRAFFIC_CHECK),
        ("test_encoder_training_runs_the_fused_mixing_eager_and_compiled", ENCODER_TRAINING_CHECK),
        ("test_the_trainer_runs_the_fused_mixing_on_deepspeed", TRAINER_CHECK),
        ("test_encoder_inference_runs_the_fused_kernels_eager_and_compiled", ENCODER_CHECK),
        ("test_training_mixing_equals_the_torch_path_in_the_interpreter", TRAINING_CHECK),
        ("test_fused_kernels_equal_the_torch_path_in_the_interpreter", INTERPRETER_CHECK),
    ]


@pytest.mark.integration
def test_fused_kernels_equal_the_torch_path_in_the_interpreter(interpreter):
    """Every feature map (1-3 units, head widths 16-64 and padded ones), padded and unpadded
    keys, bf16 autocast and fp32, whole and partial tiles, the keys in one slice or several:
    the fused kernels' output within two bf16 ulps (fp32: 1e-5) of the torch path's; their
    softplus and bf16 rounding against torch's; an empty batch launches nothing; the
    operator's schema and fake tensor pass torch's opcheck."""
    out = interpreter.output(INTERPRETER_CHECK)
    assert out.count("ok ") == 11, out


@pytest.mark.integration
def test_encoder_inference_runs_the_fused_kernels_eager_and_compiled(interpreter):
    """An encoder with `kernel.inference_backend: triton`: its no-grad forward (eval) calls the
    kernels once per layer, eagerly and compiled, and its output matches the torch path's; a
    training forward and backward of the same module do not call them."""
    out = interpreter.output(ENCODER_CHECK)
    assert out.count("ok ") == 3, out


TRAINING_CHECK = """
import copy
import torch
import model.attention.kernel_triton as kt
from model.attention.base import LayerContext
from model.attention.kernel import KernelAttention
from model import EncoderConfig

def rel(a, b):
    return ((a - b).norm() / b.norm()).item()

torch.manual_seed(0)
cases = [  # feature map, units, head width, padded, bf16 inputs, tile, programs per launch
    ("aoglu", 1, 64, True, True, 64, 512),  # the albert-base recipe's map
    ("aoglu", 3, 24, False, True, 32, 4),  # LRA's 3 units; width padded to 32; query slices
    ("ffn", 1, 64, True, False, 32, 1),  # one slice; fp32 q, k, v under bf16 autocast
    ("glu", 2, 32, True, None, 32, 512),  # fp32, no autocast
    ("elu", 1, 16, True, True, 16, 8),
]
for fm, units, h, padded, bf16, block, programs in cases:
    kt.KERNEL_OPTIONS["BLOCK_N"] = block
    kt.GRAD_KERNEL_OPTIONS["BLOCK_N"] = 2 * block if block < 64 else block // 2
    kt.PROGRAMS_PER_LAUNCH = programs
    B, H, N = 3, 2, 100
    cfg = EncoderConfig.preset(
        "debug", hidden_size=H * h, num_attention_heads=H, intermediate_size=64,
        attention="kernel", kernel={"feature_map": fm, "num_stacked": units, "dropout": 0.1,
                                    "training_backend": "triton"},
    )
    fused = KernelAttention(cfg).train()
    plain = copy.deepcopy(fused)
    plain.training_backend = "torch"
    exact = copy.deepcopy(plain).double()
    qkv = torch.randn(B, N, 3, H, h) * 2
    mask = torch.ones(B, N, dtype=torch.bool)
    if padded:
        mask[1, 61:] = False
        mask[2, 3:] = False
    ctx = LayerContext(mask_BN=mask, padded=padded)
    grad = torch.randn(B, N, H, h, dtype=torch.float64)
    results = []
    for att in (fused, plain, exact):
        x = qkv.double() if att is exact else qkv.bfloat16() if bf16 else qkv.clone()
        x.requires_grad_()
        # q, k, v as views of one (B, N, 3, H, h) projection, as the model gives them
        q, k, v = (t.transpose(1, 2) for t in x.unbind(2))
        torch.manual_seed(1)  # the same dropout masks in all three
        autocast = bf16 is not None and att is not exact
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            assert att.fused_training(q, v) == (att is fused)
            out, aux = att(q, k, v, ctx)
        assert out.dtype == x.dtype and out.shape == (B, H, N, h)
        (out.double().transpose(1, 2) * grad).sum().backward()
        res = {"out": out.detach().double(), "qkv": x.grad.double()}
        res.update({n: p.grad.double() for n, p in att.named_parameters()})
        results.append(res)
    got, want, ref = results
    assert got.keys() == want.keys() == ref.keys()
    for name in ref:
        # as far from fp64 as the torch path (the same roundings), and close to it
        err, err_plain = rel(got[name], ref[name]), rel(want[name], ref[name])
        assert err <= 1.02 * err_plain + 1e-6, (fm, units, h, padded, bf16, name, err, err_plain)
        diff = rel(got[name], want[name])
        assert diff <= (2**-12 if bf16 is not None else 1e-6), (fm, name, diff)
    print("ok", fm, units, h, padded, bf16, block, programs, f"{err:.3g}", f"{err_plain:.3g}")

# The operators as torch.compile sees them: schema, fake tensors, autograd registration and
# AOT dispatch (the backward through the backward operator).
fq, fk = ((torch.rand(2, 2, 40, 32) + 0.1).bfloat16().requires_grad_() for _ in range(2))
v = torch.randn(2, 40, 3, 2, 32).bfloat16().unbind(2)[2].transpose(1, 2).detach()
v.requires_grad_()
mask = torch.ones(2, 40, dtype=torch.bool)
mask[1, 20:] = False
torch.library.opcheck(kt.kernel_attention_mixing, (fq, fk, v, mask, 1e-6, torch.bfloat16))
out, kv, z = kt.kernel_attention_mixing(fq, fk, v, mask, 1e-6, torch.bfloat16)
args = (torch.randn_like(out), fq.detach(), fk.detach(), v.detach(), kv, z, mask, 1e-6,
        torch.bfloat16)
torch.library.opcheck(kt.kernel_attention_mixing_backward, args)
print("ok opcheck")

# An empty batch launches nothing, forward or backward.
empty = torch.empty(0, 2, 40, 32).bfloat16().requires_grad_()
kt.kernel_attention_train(empty, empty, empty, None, 1e-6, torch.bfloat16).sum().backward()
assert empty.grad.shape == empty.shape
print("ok empty")
"""


ENCODER_TRAINING_CHECK = """
import copy
import torch
from model import Encoder, EncoderConfig
import model.attention.kernel_triton as kt

torch.manual_seed(0)
cfg = EncoderConfig.preset(
    "debug", attention="kernel", num_hidden_layers=2, vocab_size=300,
    kernel={"feature_map": "aoglu", "num_stacked": 1, "training_backend": "triton"},
)
fused = Encoder(cfg).train()
plain = copy.deepcopy(fused)
for module in plain.modules():
    if hasattr(module, "training_backend"):
        module.training_backend = "torch"
ids = torch.randint(5, 300, (2, 48))
mask = torch.ones(2, 48, dtype=torch.long)
mask[1, 30:] = 0
weights = torch.randn(2, 48, cfg.hidden_size, dtype=torch.float64)
calls = []
real = kt._kernels  # looked up by the operators at each call
kt._kernels = lambda: calls.append(1) or real()

def step(model, autocast=True):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, mask).last_hidden_state
    (out.double() * weights).sum().backward()
    return {n.removeprefix("_orig_mod."): p.grad.double()
            for n, p in model.named_parameters() if p.grad is not None}

def worst(a, b):  # (a compiled step also gives the unused pooler zero gradients)
    assert a.keys() >= b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)

L = cfg.num_hidden_layers
# Training mode, dropout on: the same masks, the same gradients up to rounding.
want, got = step(plain), step(fused)
assert len(calls) == 2 * L, calls  # a forward and a backward operator per layer
diff = worst(got, want)
assert diff <= 2**-10, diff
print("ok train", f"{diff:.3g}")
# Compiled (Inductor draws its own dropout masks): eval mode, the parameters still need
# gradients, so the training operator runs; every result against an fp64 copy.
fused.eval()
plain.eval()
exact = step(copy.deepcopy(plain).double(), autocast=False)
errs = {
    "torch": worst(step(plain), exact),
    "triton": worst(step(fused), exact),
    "torch compiled": worst(step(torch.compile(plain)), exact),
    "triton compiled": worst(step(torch.compile(fused)), exact),
}
assert len(calls) == 6 * L, calls  # the compiled step runs the operators too
assert errs["triton"] <= 1.02 * errs["torch"], errs
assert errs["triton compiled"] <= 1.1 * max(errs["torch"], errs["torch compiled"]), errs
print("ok compiled", errs)
"""


@pytest.mark.integration
def test_training_mixing_equals_the_torch_path_in_the_interpreter(interpreter):
    """The training mixing (`kernel.training_backend: triton`) in one layer: every feature map
    (1-3 units, head widths 16-64 and padded ones), padded and unpadded keys, bf16 and fp32 q, k,
    v under bf16 autocast and fp32 without, the recipe's dropout, one or several query slices:
    the output and every gradient (q, k, v and the feature maps' weights) as far from an fp64
    copy as the torch path's and within 2^-12 of it (fp32: 1e-6); both operators pass torch's
    opcheck (schema, fake tensors, autograd registration, AOT dispatch); an empty batch."""
    out = interpreter.output(TRAINING_CHECK)
    assert out.count("ok ") == 7, out


@pytest.mark.integration
def test_encoder_training_runs_the_fused_mixing_eager_and_compiled(interpreter):
    """An encoder with `kernel.training_backend: triton`: a training step (dropout on) calls
    the forward and backward operators once per layer and gives the torch path's gradients up
    to rounding; eager and compiled, its gradients are as close to an fp64 copy's as the torch
    path's."""
    out = interpreter.output(ENCODER_TRAINING_CHECK)
    assert out.count("ok ") == 2, out


TRAINER_CHECK = """
import os, shutil, sys, tempfile
from pathlib import Path
sys.path.insert(0, "tests")
from pretrain_support import FAMILY, base_overrides, free_port, make_shards
import model.attention.kernel_triton as kt
from engine.metrics import read_jsonl
from pretrain.__main__ import main

tmp = Path(tempfile.mkdtemp())
shards = make_shards(tmp / "data")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
calls = []
real = kt._kernels  # looked up by the operators at each call
kt._kernels = lambda: calls.append(1) or real()
losses = {}
runs = {  # the compiled run without dropout (a compiled graph draws its own masks)
    "torch": [], "triton": [], "torch nodrop": ["model.kernel.dropout=0"],
    "triton compiled": ["model.kernel.dropout=0", "engine.compile=true",
                        "engine.compile_backend=aot_eager"],
}
for name, extra in runs.items():
    run_dir = tmp / name.replace(" ", "_")
    backend = name.split()[0]
    args = ["--config", "configs/pretrain/debug.yaml", *base_overrides(shards, run_dir, 3),
            *FAMILY["kernel"], f"model.kernel.training_backend={backend}", *extra]
    assert main(args) == 0, name
    rows = read_jsonl(run_dir / "tensorboard")
    losses[name] = [rows[step]["loss/total"] for step in (1, 2, 3)]
    print(name, len(calls), losses[name])
# 3 steps x 2 layers x (forward, backward), in the triton runs only
assert len(calls) == 2 * 3 * 2 * 2, calls
for got, want in (("triton", "torch"), ("triton compiled", "torch nodrop")):
    for a, b in zip(losses[got], losses[want]):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want, losses)
shutil.rmtree(tmp)
print("ok trainer")
"""


@pytest.mark.integration
def test_the_trainer_runs_the_fused_mixing_on_deepspeed(interpreter):
    """`python -m pretrain` (in-process, the DeepSpeed engine, one rank) with the kernel
    recipe and `model.kernel.training_backend=triton`, in Triton's interpreter: each step calls
    the operator's forward and backward once per layer, and the losses of 3 steps (the recipe's
    dropout on, fp32) equal those of the torch path to 1e-5; so do those of the engine's
    compiled step (`engine.compile=true`, without dropout) against the eager torch path. The
    compiled run uses the `aot_eager` backend: Dynamo and AOTAutograd trace the operators in
    the engine's graph as Inductor receives them. Inductor's code around the operators is
    checked by the encoder test above, and the engine's Inductor step for this family by
    test_compile_trainer.py; Inductor here would add a minute of CPU to this script."""
    out = interpreter.output(TRAINER_CHECK)
    assert "ok trainer" in out, out


TRAFFIC_CHECK = """
import argparse
from bench.traffic_per_token import measure

base = dict(base="debug", seq=64, batches=[2, 4], target_batch=6, bandwidth=1e12, vocab=2000,
            padding="none", top=5, zero_stage=0, forward_only=False, precision="fp32",
            accumulation=1, device="cpu")
count = {}
for compiled in (False, True):
    for backend in ("torch", "triton"):
        override = ["model.num_hidden_layers=1", f"model.kernel.training_backend={backend}"]
        args = argparse.Namespace(**base, compiled=compiled, override=override)
        count[compiled, backend] = measure("kernel", args)
    torch_, triton_ = count[compiled, "torch"], count[compiled, "triton"]
    assert triton_["per_token_kb"] < 0.9 * torch_["per_token_kb"], (compiled, count)
    assert triton_["memory_ops_per_step"] < torch_["memory_ops_per_step"], (compiled, count)
    print("ok", compiled, torch_["per_token_kb"], triton_["per_token_kb"])
# The torch path's step, compiled against eager: fewer kernels, fewer bytes; the kernels of
# both graphs named.
eager, compiled = count[False, "torch"], count[True, "torch"]
assert 0 < compiled["memory_ops_per_step"] < eager["memory_ops_per_step"], count
assert 0 < compiled["per_token_kb"] < eager["per_token_kb"], count
names = list(compiled["top_per_token_kb"])
assert any(n.startswith("forward: ") for n in names), names
assert any(n.startswith("backward: ") for n in names), names
print("compiled", compiled["memory_ops_per_step"], eager["memory_ops_per_step"])
"""


@pytest.mark.integration
def test_the_fused_mixing_moves_fewer_bytes_per_training_step(interpreter):
    """bench/traffic_per_token.py on a one-layer kernel-attention training step (debug width,
    64 tokens), eager and compiled: with `training_backend: triton` the step moves at least 10%
    fewer bytes per token outside its products and attention kernels, in fewer memory-bound
    operators (the operator's inputs and output only, where the torch path writes fp32 copies
    and intermediate results)."""
    out = interpreter.output(TRAFFIC_CHECK)
    assert out.count("ok ") == 2, out


@pytest.mark.integration
def test_compiled_step_is_counted_from_inductors_kernels(interpreter):
    """bench/traffic_per_token.py's `--compiled` counts the kernels Inductor generates for the
    step, forward and backward: for the torch path's one-layer step above, fewer kernels and
    fewer bytes than the eager operators (element-wise chains fuse). (The same script as the
    test above: its four counts are one compilation each.)"""
    out = interpreter.output(TRAFFIC_CHECK)
    assert "\ncompiled " in out, out


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


def test_training_forwards_take_the_fused_mixing_only_where_it_runs():
    """`fused_training`: with `training_backend: triton`, on a device the kernels run on, in
    bf16 / fp32; not with `torch`, in fp64, or on the CPU outside Triton's interpreter; a
    forward that can take the inference kernels takes those first."""
    att = _attention(inference_backend="torch", training_backend="triton")
    att.fused_on_cpu = True  # as in Triton's interpreter
    q, v = torch.randn(2, 4, 16, 32), torch.randn(2, 4, 16, 32)
    assert att.fused_training(q, v)
    assert att.fused_training(q.bfloat16(), v.bfloat16())
    assert not att.fused_training(q.double(), v.double())
    att.fused_on_cpu = False
    assert not att.fused_training(q, v)
    plain = _attention(training_backend="torch")
    plain.fused_on_cpu = True
    assert not plain.fused_training(q, v)
    both = _attention(inference_backend="triton", training_backend="triton", dropout=0.0)
    both.fused_on_cpu = True
    with torch.no_grad():
        assert both.eval().fused_inference(q, q, v)


def test_the_fused_backend_is_checked_in_the_config():
    """A misspelt backend, or a fused one with heads wider than the kernels take, is refused
    when the config is built, naming the key."""
    for option in ("inference_backend", "training_backend"):
        with pytest.raises(ValueError, match=rf"kernel\.{option}"):
            _attention(**{option: "trition"})
        with pytest.raises(ValueError, match=rf"kernel\.{option}='triton'.*head_dim=256"):
            EncoderConfig.preset(
                "debug",
                attention="kernel",
                hidden_size=512,
                num_attention_heads=2,
                kernel={option: "triton"},
            )
        EncoderConfig.preset("debug", attention="kernel", kernel={option: "triton"})
