"""Fast paths agree with the reference paths: torch.compile of the encoder (every
family, with activation checkpointing, through the engine), TISA's FlexAttention score_mod
(no recompilation per step), batched kernel and TransJect products, orthogonal maps once per
micro-batch under accumulation and checkpointing, the apex LayerNorm choice, and the
length-grouped fine-tuning sampler.

Compiled models use the ``aot_eager`` backend: it traces forward and backward exactly as
inductor does (graph capture, AOTAutograd) but skips code generation, whose C++ build takes
about a minute per model on a CPU runner. Inductor itself is exercised by
bench/bench_fast_paths.py and on GPU.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from op_log import OpLog
from test_engine import ONE  # the one-process DistEnv
from test_model_core import count_map_evaluations, orthogonal_matrices
from torch import nn
from torch._dynamo.utils import counters

import model.norm as norm_module
from engine.compile import _compile_kwargs
from engine.engine import (
    Engine,
    EngineConfig,
    compile_encoder,
    compile_wanted,
    inductor_options,
)
from engine.optim import OptimizerConfig, ScheduleConfig
from finetune.batching import LengthGroupedBatchSampler, collate, example_lengths
from finetune.trainer import FinetuneConfig, FinetuneData, Finetuner
from model import EncoderConfig, EncoderForPretraining, EncoderForSequenceClassification
from model.attention import ATTENTION_REGISTRY, LayerContext
from model.attention.base import key_padding_bias
from model.attention.kernel import KernelAttention, naive_kernel_attention
from model.attention.tisa import (
    PositionScorer,
    key_padding_block_mask,
    tisa_score_mod,
    toeplitz_bias,
)
from model.attention.transject import LAMBDA_KEY, TransJectAttention
from model.norm import LayerNorm, apex_layer_norm_fn, layer_norm_backend
from model.orthogonal import orthogonal_cache

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def tiny(attention: str, **kw) -> EncoderConfig:
    kw.setdefault("hidden_dropout_prob", 0.0)
    if attention == "kernel":
        kw.setdefault("kernel", {"dropout": 0.0})
    if attention == "transject":
        kw.setdefault("transject", {"num_experts": 2})
    return EncoderConfig.preset("debug", attention=attention, **kw)


def batch(B=3, N=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 512, (B, N), generator=g)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, N - 4 :] = False
    mask[2, N - 7 :] = False
    return ids, mask


def loss_of(out) -> torch.Tensor:
    aux = sum(out.aux_losses.values(), torch.zeros(()))
    return out.logits.square().mean() + out.sop_logits.square().mean() + aux


# ------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize(
    ("family", "overrides", "checkpointing"),
    [  # softmax: through the engine, below
        ("tisa", {"num_hidden_layers": 1}, False),
        ("kernel", {"num_hidden_layers": 1}, False),
        ("transject", {}, True),  # shared orthogonal maps + the checkpoint HOP
    ],
)
def test_compiled_encoder_equals_eager_in_one_graph(family, overrides, checkpointing):
    """Loss and every gradient of the compiled encoder match eager, and Dynamo captures the
    encoder as ONE graph (no graph break: a ContextVar-based orthogonal cache, einsum backward
    or a side effect inside the checkpointed region used to split or fail it)."""
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny(family, **overrides))
    if checkpointing:
        model.encoder.enable_activation_checkpointing()
    ids, mask = batch()
    loss_of(model(ids, mask)).backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    counters.clear()
    compile_encoder(model, "aot_eager")
    loss = loss_of(model(ids, mask))
    loss.backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["graph_break"])
    for name, want in eager.items():
        torch.testing.assert_close(model.get_parameter(name).grad, want, msg=name)
    assert set(model.state_dict()) == set(EncoderForPretraining(model.config).state_dict())
    torch._dynamo.reset()


def accumulating_engine(model, lr: float, total_steps: int, **engine_options) -> Engine:
    """A one-process torch engine on CPU: micro-batches of 2, gradient accumulation 2,
    activation checkpointing, AdamW."""
    cfg = EngineConfig(
        backend="torch",
        device="cpu",
        precision="fp32",
        micro_batch_size=2,
        gradient_accumulation_steps=2,
        activation_checkpointing=True,
        **engine_options,
    )
    return Engine(
        model,
        cfg,
        OptimizerConfig(name="adamw", lr=lr),
        ScheduleConfig(warmup_steps=0, total_steps=total_steps),
        dist=ONE,
    )


def step_in_two_micro_batches(engine: Engine, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """One optimizer step over a batch of 4 as two accumulated micro-batches of 2."""
    for half in (slice(0, 2), slice(2, 4)):
        engine.backward(loss_of(engine.forward(ids[half], mask[half])))
    engine.step()


def test_engine_compile_option_trains_like_eager():
    """engine.compile=true (with activation checkpointing): an optimizer step of gradient
    accumulation 2 gives the eager engine's weights, from one compiled graph; the encoder is
    compiled in place."""
    ids, mask = batch(B=4)
    finals = []
    for compile_ in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = EncoderForPretraining(tiny("softmax"))
        engine = accumulating_engine(
            model, lr=1e-2, total_steps=4, compile=compile_, compile_backend="aot_eager"
        )
        assert (model.encoder._compiled_call_impl is not None) == compile_
        step_in_two_micro_batches(engine, ids, mask)
        finals.append({n: p.detach().clone() for n, p in model.named_parameters()})
        assert counters["stats"]["unique_graphs"] == int(compile_), dict(counters["graph_break"])
    torch._dynamo.reset()
    assert finals[0].keys() == finals[1].keys()
    for name in finals[0]:
        torch.testing.assert_close(finals[1][name], finals[0][name], rtol=1e-5, atol=1e-6)


def test_compile_config_errors():
    with pytest.raises(ValueError, match="zero_stage=3"):
        EngineConfig(backend="deepspeed", zero_stage=3, compile=True)
    with pytest.raises(ValueError, match=r"engine\.compile_backend"):
        compile_encoder(nn.Linear(2, 2), "no_such_backend")
    with pytest.raises(ValueError, match=r"engine\.compile="):
        EngineConfig(compile="yes")  # type: ignore[arg-type]
    EngineConfig(backend="deepspeed", zero_stage=3, compile="auto")  # auto: just not compiled
    with pytest.raises(ValueError, match=r"engine\.compile_mode='fast'.*max-autotune"):
        EngineConfig(compile=True, compile_mode="fast")
    with pytest.raises(ValueError, match=r"compile_mode.*needs engine\.compile_backend=inductor"):
        EngineConfig(compile=True, compile_mode="max-autotune", compile_backend="aot_eager")


def test_compile_options_are_checked_and_merged_over_the_mode():
    """engine.compile_options: nested keys are Inductor's dotted names; an unknown key (with
    the nearest known ones), a value of the wrong type, a non-mapping or another backend than
    Inductor is refused naming the option; the options go over the mode's, as torch merges
    them (torch.compile takes a mode or options, not both)."""
    cfg = EngineConfig(
        compile=True,
        compile_options={"max_autotune_gemm": True, "triton": {"cudagraphs": False}},
    )
    assert inductor_options(cfg) == {"max_autotune_gemm": True, "triton.cudagraphs": False}
    assert inductor_options(EngineConfig()) == {}
    assert _compile_kwargs("default", {}) == {"mode": None}
    assert _compile_kwargs("reduce-overhead", {}) == {"mode": "reduce-overhead"}
    merged = _compile_kwargs("max-autotune", {"triton.cudagraphs": False})["options"]
    assert merged["max_autotune"] is True and merged["triton.cudagraphs"] is False
    with pytest.raises(
        ValueError, match=r"'max_autotune_gem' is not an Inductor.*max_autotune_gemm"
    ):
        EngineConfig(compile_options={"max_autotune_gem": True})
    with pytest.raises(ValueError, match=r"'triton\.cudagrafs'.*triton\.cudagraphs"):
        EngineConfig(compile_options={"triton": {"cudagrafs": True}})
    with pytest.raises(ValueError, match=r"max_autotune_gemm='yes' is a str.*bool"):
        EngineConfig(compile_options={"max_autotune_gemm": "yes"})
    with pytest.raises(ValueError, match=r"engine\.compile_options=\[1\] is invalid"):
        EngineConfig(compile_options=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"compile_options needs engine\.compile_backend"):
        EngineConfig(compile_options={"max_autotune_gemm": True}, compile_backend="aot_eager")


@pytest.mark.integration  # three Inductor compilations of the step: about 30 s
def test_engine_compile_mode_reaches_inductor():
    """engine.compile_mode and compile_options are what Inductor compiles the encoder and the
    functions beside it with (max-autotune turns on all of its autotuning; the option
    max_autotune_gemm only that of the products), and the engine compiled so takes a step."""
    cases = (
        ("default", {}, False, False),
        ("max-autotune-no-cudagraphs", {}, True, True),
        ("default", {"max_autotune_gemm": True}, False, True),
    )
    for mode, options, autotune, gemm in cases:
        torch._dynamo.reset()
        model = EncoderForPretraining(tiny("softmax"))
        engine = accumulating_engine(
            model, lr=1e-2, total_steps=4, compile=True, compile_mode=mode, compile_options=options
        )
        beside = engine.compile_beside(lambda x: x + 1)
        for config in (
            model.encoder._compiled_call_impl.get_compiler_config(),
            beside.get_compiler_config(),
        ):
            assert config["max_autotune"] is autotune, mode
            assert config["coordinate_descent_tuning"] is autotune, mode
            assert (config["max_autotune_gemm"] or config["max_autotune"]) is gemm, options
        assert engine.cfg.compile_mode == mode
        ids, mask = batch(B=4)
        step_in_two_micro_batches(engine, ids, mask)
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["softmax", "tisa", "kernel", "transject", "unmeasured"])
def test_compile_auto_compiles_on_a_gpu_where_the_family_gains(family, monkeypatch):
    """engine.compile=auto: on CUDA for the families measured faster there compiled (every
    shipped one), not for a family that does not say so (softmax's entry with compile_auto at
    its default, for this test), never on CPU nor under ZeRO-3; true and false are taken as
    they are; a model that does not say is not compiled."""
    gains = family != "unmeasured"
    if not gains:
        family = "softmax"
        entry = dataclasses.replace(ATTENTION_REGISTRY.get(family), compile_auto=False)
        monkeypatch.setitem(ATTENTION_REGISTRY._families, family, entry)
    model = EncoderForPretraining(tiny(family))
    assert model.compile_auto is gains and model.encoder.compile_auto is gains
    auto = EngineConfig(compile="auto")
    assert compile_wanted(auto, model, "cuda") is gains
    assert compile_wanted(auto, model, "cpu") is False
    assert compile_wanted(EngineConfig(backend="deepspeed", zero_stage=3, compile="auto"),
                          model, "cuda") is False  # fmt: skip
    for explicit in (True, False):
        assert compile_wanted(EngineConfig(compile=explicit), model, "cpu") is explicit
    assert compile_wanted(auto, nn.Linear(2, 2), "cuda") is False


def test_compile_auto_leaves_a_cpu_engine_eager():
    model = EncoderForPretraining(tiny("softmax"))
    engine = Engine(model, EngineConfig(backend="torch", device="cpu", compile="auto"),
                    OptimizerConfig(name="adamw"), ScheduleConfig(warmup_steps=0, total_steps=2), ONE)  # fmt: skip
    assert engine.compiled is False
    assert model.encoder._compiled_call_impl is None


# ------------------------------------------------------------------------- TISA flex


def test_flex_score_mod_compiles_once_and_equals_the_sdpa_bias():
    """A new score_mod closure and a new key-padding block mask over new tensors at every call
    (every layer and step) reuse the compiled graph; only a new sequence length compiles again (once, then dynamic). Compiled
    with Dynamo's eager backend: the recompilation decision is Dynamo's, whatever the backend
    (FlexAttention has no CPU backward and inductor's CPU flex template fails to build this
    score_mod in torch 2.13, so the CUDA kernel itself is checked on GPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    counters.clear()
    attend = torch.compile(flex_attention, backend="eager")
    B, H, h = 2, 4, 8
    scorer = PositionScorer(3, H)
    with torch.no_grad():
        for step, N in enumerate((16, 16, 16, 24, 32, 40)):
            q, k, v = torch.randn(3, B, H, N, h).unbind(0)
            mask = torch.rand(B, N) > 0.3
            mask[:, 0] = True
            values = scorer.values(N) * (1 + step)  # new values every "step"
            block_mask = key_padding_block_mask(mask)  # new mask tensors every "step" too
            out = attend(q, k, v, score_mod=tisa_score_mod(values), block_mask=block_mask)
            bias = toeplitz_bias(values) + key_padding_bias(mask, q.dtype)
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # one graph for N = 16 (three calls), one dynamic-shape graph for 24, 32, 40
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


# ------------------------------------------------------------------------- batched products


def test_kernel_attention_products_are_batched_whatever_the_heads():
    """[KV | z] = phi(K)^T [V | 1] and phi(Q) [KV | z] (numerator and normaliser together) are
    one batched product each over all batches and heads (the count does not grow with H), in
    fp32 also under bf16 autocast (the feature maps before them run in bf16)."""
    counts = {}
    for autocast in (False, True):
        for heads in (2, 8):
            # elu: a parameter-free phi, so only the core products remain
            kernel_cfg = {"dropout": 0.0, "feature_map": "elu"}
            cfg = tiny("kernel", hidden_size=32, num_attention_heads=heads, kernel=kernel_cfg)
            kernel = KernelAttention(cfg)
            q, k, v = torch.randn(3, 2, heads, 10, 32 // heads).unbind(0)
            log = OpLog()
            with log, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                kernel(q, k, v, LayerContext(mask_BN=torch.ones(2, 10, dtype=torch.bool)))
            products = log.matmuls()
            counts[autocast, heads] = len(products)
            assert all(dt == torch.float32 for op in products for dt in op.input_dtypes), products
    assert set(counts.values()) == {2}, counts


@pytest.mark.parametrize(
    ("feature_map", "stacked", "products_per_unit", "copies"),
    [("aoglu", 1, 2, 0), ("aoglu", 2, 2, 0), ("oglu", 1, 1, 0), ("ffn", 2, 1, 0), ("elu", 1, 0, 2)],
)
def test_kernel_attention_copies_nothing_and_fuses_the_gate(
    feature_map, stacked, products_per_unit, copies
):
    """On q, k, v sliced out of the fused (B, N, 3, H, h) projection, as the encoder passes
    them, kernel attention in fp32 inference copies no activation: the per-head products of
    the feature maps run heads first as one (H, B N, h) product, a view of the strided input
    (the (B, H, N, h) batched product copied q and k for each product, 4 copies per aoglu
    unit, and broadcast each weight B times). A unit reads its input in one product: x [W | V]
    or x [W | A] (then B for aoglu). The parameter-free elu(x) + 1 keeps the projection's
    (B, N, H, h) order in its element-wise output, which the sums over the keys (batched over
    B and H) copy once per call. Outputs equal the explicit O(N^2) form."""
    B, N, H, h = 3, 10, 4, 8
    kernel_cfg = {"dropout": 0.0, "feature_map": feature_map, "num_stacked": stacked}
    cfg = tiny("kernel", hidden_size=H * h, num_attention_heads=H, kernel=kernel_cfg)
    kernel = KernelAttention(cfg).eval()
    qkv = torch.randn(B, N, 3, H, h)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    ctx = LayerContext(mask_BN=torch.ones(B, N, dtype=torch.bool), padded=False)
    log = OpLog()
    with log, torch.no_grad():
        out, _ = kernel(q, k, v, ctx)
    activation = B * N * h  # the smallest activation of one head
    assert len([c for c in log.copies() if c[1] >= activation]) == copies, log.copies()
    assert len(log.matmuls()) == 2 * stacked * products_per_unit + 2, log.matmuls()
    with torch.no_grad():
        phi_q, phi_k = kernel.phi(q), kernel.phi(k)
    ref = naive_kernel_attention(phi_q, phi_k, v, ctx.mask_BN, cfg.kernel.eps)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_transject_experts_are_batched_not_looped():
    """The expert products are one batched product per factor (U_e, then V_e^T) for any E
    (E = 1 is left out: its mixture is an elementwise product, one matmul fewer)."""
    counts = []
    for experts in (2, 4):
        cfg = tiny("transject", transject={"num_experts": experts})
        attn = TransJectAttention(cfg)
        x = torch.randn(2, 7, cfg.hidden_size)
        ctx = LayerContext(
            mask_BN=torch.ones(2, 7, dtype=torch.bool),
            residual_gate=torch.tensor(0.5),
            extras={LAMBDA_KEY: torch.rand(2, cfg.hidden_size)},
        )
        log = OpLog()
        with torch.no_grad(), orthogonal_cache():
            U, V = attn.expert_u, attn.expert_v  # the maps, cached before the log starts
            with log:
                out = attn(x, ctx).hidden_BND
        counts.append(len(log.matmuls()))
        # equals the per-expert loop it replaces
        lam_B1d = ctx.extras[LAMBDA_KEY][:, None, :]
        b = attn.expert_u_bias.bias
        a = torch.stack(
            [F.elu(((x @ U[e] + b[e]) * lam_B1d) @ V[e].T) for e in range(experts)], dim=1
        )
        with torch.no_grad():
            w = attn.expert_weights(x, ctx)
        torch.testing.assert_close(out, torch.einsum("be,bend->bnd", w, a), rtol=1e-5, atol=1e-6)
    assert counts[0] == counts[1], counts


def test_transject_experts_write_five_expert_sized_tensors():
    """The forward of TransJect's expert block writes five (E, B, N, d)-sized tensors: X U + b
    (the bias added by the product, `torch.addmm`), its scaling by lambda, the V products, the
    ELU, and the gate's X + alpha A_e in one `addcmul` (an add over X U's result and
    alpha A_e then a sum wrote two more; a step's memory traffic: bench/traffic_per_token.py)."""
    E, B, N = 3, 2, 96  # B N > d: the expert-sized tensors outgrow the (E, d, d) maps
    cfg = tiny("transject", transject={"num_experts": E}, max_position_embeddings=N)
    attn = TransJectAttention(cfg)
    d = cfg.hidden_size
    x = torch.randn(B, N, d)
    ctx = LayerContext(
        mask_BN=torch.ones(B, N, dtype=torch.bool),
        residual_gate=torch.tensor(0.5),
        extras={LAMBDA_KEY: torch.rand(B, d)},
    )
    with torch.no_grad(), orthogonal_cache():
        assert attn.expert_u is not None and attn.expert_v is not None  # the maps, cached
        log = OpLog()
        with log:
            attn(x, ctx)
    expert_sized = [name for name, n in log.writes() if n >= E * B * N * d]
    assert expert_sized == ["addmm", "mul", "bmm", "elu", "addcmul"], log.writes()


@pytest.mark.parametrize("step_cache", [False, True])
def test_orthogonal_maps_once_per_micro_batch_with_accumulation_and_checkpointing(
    monkeypatch, step_cache
):
    """Through the engine (gradient accumulation 2, activation checkpointing), each orthogonal
    map is evaluated once per micro-batch (forward + checkpoint recompute), never per layer
    application: 4 layer applications share one layer's maps; with the step cache
    (`model.orthogonal_step_cache`, the default) once per optimizer step
    (tests/model/test_orthogonal_step_cache.py)."""
    calls = count_map_evaluations(monkeypatch)
    torch.manual_seed(0)
    cfg = tiny("transject", num_hidden_layers=4, orthogonal_step_cache=step_cache)
    model = EncoderForPretraining(cfg)
    engine = accumulating_engine(model, lr=1e-3, total_steps=2)
    ids, mask = batch(B=4)
    step_in_two_micro_batches(engine, ids, mask)
    maps = orthogonal_matrices(model)
    per_step = 1 if step_cache else 2
    assert maps > 0 and len(calls) == per_step * maps, (len(calls), maps)


# ------------------------------------------------------------------------- apex LayerNorm


def _fake_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


@pytest.fixture
def fresh_apex_lookup():
    apex_layer_norm_fn.cache_clear()
    yield
    apex_layer_norm_fn.cache_clear()


def _install(monkeypatch, modules: dict[str, types.ModuleType | None]) -> None:
    for name in ("apex", "apex.normalization", "apex.normalization.fused_layer_norm"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delitem(sys.modules, "fused_layer_norm_cuda", raising=False)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_layer_norm_backend_choice(monkeypatch, fresh_apex_lookup):
    calls = []

    def fused(x, w, b, shape, eps):
        calls.append((x.dtype, w.dtype, b.dtype, torch.is_autocast_enabled("cpu")))
        return F.layer_norm(x, shape, w, b, eps)

    nvidia = {
        "apex": _fake_module("apex"),
        "apex.normalization": _fake_module("apex.normalization", FusedLayerNorm=object),
        "apex.normalization.fused_layer_norm": _fake_module(
            "apex.normalization.fused_layer_norm", fused_layer_norm_affine=fused
        ),
        "fused_layer_norm_cuda": _fake_module("fused_layer_norm_cuda"),
    }
    # Not installed here: torch's kernel everywhere.
    _install(monkeypatch, {})
    assert apex_layer_norm_fn() is None
    assert layer_norm_backend("cuda", compiling=False) == "torch"
    # The PyPI `apex` web toolkit (no apex.normalization) is not NVIDIA apex.
    apex_layer_norm_fn.cache_clear()
    _install(monkeypatch, {"apex": _fake_module("apex", App=object)})
    assert apex_layer_norm_fn() is None
    # NVIDIA apex built without its CUDA extension: not usable.
    apex_layer_norm_fn.cache_clear()
    _install(monkeypatch, {k: v for k, v in nvidia.items() if k != "fused_layer_norm_cuda"})
    assert apex_layer_norm_fn() is None
    # NVIDIA apex: on CUDA only, and not while torch.compile traces.
    apex_layer_norm_fn.cache_clear()
    _install(monkeypatch, nvidia)
    assert apex_layer_norm_fn() is fused
    assert layer_norm_backend("cuda", compiling=False) == "apex"
    assert layer_norm_backend("cuda", compiling=True) == "torch"
    assert layer_norm_backend("cpu", compiling=False) == "torch"

    # The module's apex path (forced on CPU): same result; under autocast apex computes in
    # fp32 (input and parameters upcast, autocast off), and the module returns what its
    # autocast_output says (apex only runs on CUDA).
    ln = LayerNorm(8, eps=1e-5, autocast_output="fp32")
    nn.init.normal_(ln.weight)
    nn.init.normal_(ln.bias)
    x = torch.randn(3, 8)
    want = F.layer_norm(x, (8,), ln.weight, ln.bias, 1e-5)
    monkeypatch.setattr(norm_module, "layer_norm_backend", lambda device, compiling: "apex")
    torch.testing.assert_close(ln(x), want)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ln(x.bfloat16())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.layer_norm(x.bfloat16().float(), (8,), ln.weight, ln.bias))
    ln.autocast_output = "compute"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ln(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got, F.layer_norm(x.bfloat16().float(), (8,), ln.weight, ln.bias).bfloat16()
    )
    assert calls == [(torch.float32,) * 3 + (False,)] * 3
    # parameters of another dtype than the input (no autocast): torch's kernel, not apex's
    calls.clear()
    assert ln(x.bfloat16()).dtype == torch.bfloat16 and calls == []


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_autocast_output(input_dtype):
    """Under autocast a LayerNorm computes in fp32 and returns the autocast dtype (`compute`)
    or fp32 (`fp32`, CUDA autocast's rule, applied on the CPU too, where torch's autocast keeps
    the input's dtype); its value and gradients are the fp32 layer norm's, the first rounded
    once. Outside autocast: the input's dtype, whatever the option."""
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 5, 16, generator=g) + 1).to(input_dtype)
    dy = torch.randn(4, 5, 16, generator=g)
    weight, bias = 1 + torch.randn(16, generator=g), torch.randn(16, generator=g)

    def reference(dy):  # fp32 layer norm of the same input, and its gradients
        leaves = [x.float().clone(), weight.clone(), bias.clone()]
        for leaf in leaves:
            leaf.requires_grad_()
        y = F.layer_norm(leaves[0], (16,), leaves[1], leaves[2], 1e-12)
        y.backward(dy)
        return y.detach(), [t.grad for t in leaves]

    for output, dtype in (("compute", torch.bfloat16), ("fp32", torch.float32)):
        want, want_grads = reference(dy.to(dtype).float())  # dy as the option's output gets it
        ln = LayerNorm(16, eps=1e-12, autocast_output=output)
        with torch.no_grad():
            ln.weight.copy_(weight)
            ln.bias.copy_(bias)
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = ln(xi)
        assert y.dtype == dtype, output
        # one rounding of the fp32 result (CPU, bf16 input: torch's mixed-dtype kernel, which
        # may round a value the other way)
        torch.testing.assert_close(y.float(), want.to(dtype).float(), rtol=8e-3, atol=1e-6)
        y.backward(dy.to(dtype))
        grads = [xi.grad, ln.weight.grad, ln.bias.grad]
        assert grads[0].dtype == input_dtype
        for got_grad, want_grad in zip(grads, want_grads, strict=True):
            # relative to the gradient's norm; bf16 rounding where the input is bf16 (the CPU's
            # mixed-dtype kernel rounds inside its sums) or x's gradient is bf16
            rounded = torch.bfloat16 in (input_dtype, got_grad.dtype)
            error = (got_grad.float() - want_grad).norm() / want_grad.norm()
            assert error < (2e-2 if rounded else 1e-5), (output, error)
        assert ln(x).dtype == input_dtype  # no autocast: the input's dtype


def test_norm_output_config_and_residual_stream_dtype():
    """`model.norm_output` reaches every LayerNorm; under autocast the post-LN residual stream
    between layers is bf16 with `compute`, fp32 with `fp32`; both give the same logits to
    bf16 rounding; a typo is refused with the field's name."""
    with pytest.raises(ValueError, match="norm_output"):
        tiny("softmax", norm_output="bf16")
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny("softmax", norm_output="fp32"))
    ids, mask = batch()
    logits, stream = {}, {}
    for output in ("fp32", "compute"):
        norms = [m for m in model.modules() if isinstance(m, LayerNorm)]
        assert len(norms) == 4  # embeddings, attention, feed-forward, MLM head
        for m in norms:
            m.autocast_output = output
        seen = []
        hooks = [
            m.register_forward_hook(lambda mod, args, out, seen=seen: seen.append(out.dtype))
            for m in (model.encoder.groups[0][0].attn_norm, model.encoder.groups[0][0].ffn_norm)
        ]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits[output] = model(ids, mask).logits.float()
        for hook in hooks:
            hook.remove()
        stream[output] = set(seen)
    assert stream == {"fp32": {torch.float32}, "compute": {torch.bfloat16}}
    torch.testing.assert_close(logits["compute"], logits["fp32"], rtol=0.05, atol=0.05)
    assert not torch.equal(logits["compute"], logits["fp32"])  # the option took effect
    compute_model = EncoderForPretraining(tiny("softmax", residual="pre_ln"))
    assert {m.autocast_output for m in compute_model.modules() if isinstance(m, LayerNorm)} == {
        "compute"
    }


def test_models_use_the_layer_norm_factory_with_unchanged_keys():
    model = EncoderForPretraining(tiny("softmax", residual="pre_ln"))
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert norms and all(type(m) is LayerNorm for m in norms)  # embeddings, layers, final, MLM
    assert len(norms) == 5
    keys = [k for k in model.state_dict() if "norm" in k]
    assert keys and all(k.endswith((".weight", ".bias")) for k in keys)
    ids, mask = batch()
    out = model(ids, mask)  # CPU: torch's kernel, numerically nn.LayerNorm
    assert torch.isfinite(out.logits).all()


# ------------------------------------------------------------------------- length grouping


def glue_like_lengths(n: int, seed: int = 0) -> np.ndarray:
    """A long-tailed length distribution like GLUE's (SST-2/MNLI: median ~25, tail to 128)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=3.2, sigma=0.55, size=n).astype(np.int64), 4, 128)


def padding_fraction(batches, lengths) -> float:
    padded = sum(len(b) * lengths[b].max() for b in batches)
    return 1.0 - sum(lengths[b].sum() for b in batches) / padded


def test_length_grouped_sampler_is_a_deterministic_partition_with_less_padding():
    lengths = glue_like_lengths(1000)
    B, W = 8, 2
    samplers = [LengthGroupedBatchSampler(lengths, B, rank=r, world_size=W, seed=3) for r in (0, 1)]
    per_rank = [list(s) for s in samplers]
    assert len(per_rank[0]) == len(per_rank[1]) == len(samplers[0]) == 1000 // (B * W)
    flat = [i for rank in per_rank for b in rank for i in b]
    assert all(len(b) == B for rank in per_rank for b in rank)
    assert len(flat) == len(set(flat))  # each example at most once per epoch, across ranks
    assert per_rank[0] == list(LengthGroupedBatchSampler(lengths, B, 0, W, seed=3))  # seeded
    samplers[0].set_epoch(1)
    assert list(samplers[0]) != per_rank[0]  # reshuffled every epoch
    # The ranks' i-th batches come from one global batch: similar lengths on every rank.
    for b0, b1 in zip(*per_rank):
        assert lengths[b0].min() >= lengths[b1].max() or lengths[b1].min() >= lengths[b0].max()
    grouped = padding_fraction(per_rank[0] + per_rank[1], lengths)
    perm = np.random.default_rng(0).permutation(1000)[: len(flat)]
    random_batches = [perm[i : i + B] for i in range(0, len(perm), B)]
    baseline = padding_fraction(random_batches, lengths)
    assert grouped < 0.1 < 0.3 < baseline, (grouped, baseline)


def test_finetuner_group_by_length_trains_on_grouped_batches(tmp_path):
    lengths = glue_like_lengths(64, seed=1)
    rng = np.random.default_rng(0)
    train = [
        {"input_ids": rng.integers(4, 512, n).tolist(), "token_type_ids": [0] * n, "label": i % 2}
        for i, n in enumerate(lengths)
    ]
    assert (example_lengths(train) == lengths).all()
    widths: list[tuple[int, int]] = []

    def recording_collate(batch, pad_id):
        out = collate(batch, pad_id)
        widths.append((out["input_ids"].shape[1], int(out["attention_mask"].sum())))
        return out

    torch.manual_seed(0)
    model = EncoderForSequenceClassification(tiny("softmax", max_position_embeddings=128))
    data = FinetuneData(
        train,
        {"dev": train[:8]},
        lambda p, y: {"score": float((p == y).mean())},
        pad_id=0,
        collate_fn=recording_collate,
    )
    result = Finetuner(
        model,
        data,
        FinetuneConfig(steps=4, log_every=2, save_best=False, group_by_length=True),
        tmp_path,
        engine=EngineConfig(backend="torch", device="cpu", precision="fp32", micro_batch_size=8),
        optimizer=OptimizerConfig(name="adamw", lr=1e-3),
        schedule=ScheduleConfig(warmup_steps=0, total_steps=4),
    ).run()
    assert result.best_step == 4
    train_widths = widths[:4]  # then the evaluation batch
    computed = sum(8 * w for w, _ in train_widths)
    real = sum(r for _, r in train_widths)
    random_batches = np.random.default_rng(0).permutation(64).reshape(8, 8)
    assert 1 - real / computed < 0.3 < padding_fraction(random_batches, lengths), train_widths
