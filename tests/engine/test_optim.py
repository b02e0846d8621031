"""engine.optim: optimizer configs, parameter groups, LAMB/AdamW steps, LR schedules."""

import doctest
import math
import sys
import types

import pytest
import torch
from torch import nn

import model
from engine import optim
from engine.optim import (
    OptimizerConfig,
    ScheduleConfig,
    build_optimizer,
    build_scheduler,
    lr_multiplier,
)

# ----------------------------------------------------------------------------- schedules


def _sched(decay: str, **kw) -> ScheduleConfig:
    return ScheduleConfig(warmup_steps=10, total_steps=110, decay=decay, **kw)


@pytest.mark.parametrize("decay", ["linear", "polynomial", "cosine", "constant"])
def test_schedule_warmup_and_ends(decay):
    cfg = _sched(decay, min_lr_ratio=0.0)
    assert lr_multiplier(0, cfg) == 0.0
    assert lr_multiplier(5, cfg) == pytest.approx(0.5)
    assert lr_multiplier(10, cfg) == pytest.approx(1.0)  # peak at the end of warmup
    end = 1.0 if decay == "constant" else 0.0
    assert lr_multiplier(110, cfg) == pytest.approx(end, abs=1e-12)
    assert lr_multiplier(10_000, cfg) == pytest.approx(end, abs=1e-12)  # held after


@pytest.mark.parametrize(
    ("decay", "power", "expected"),
    [
        # progress at step 35 = (35 - 10) / 100 = 0.25; min_lr_ratio 0.1
        ("linear", 1.0, 0.1 + 0.9 * 0.75),
        ("polynomial", 2.0, 0.1 + 0.9 * 0.75**2),
        ("cosine", 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25))),
        ("constant", 1.0, 1.0),
    ],
)
def test_schedule_mid_decay_closed_form(decay, power, expected):
    with pytest.warns(UserWarning) if decay == "constant" else _nothing():
        cfg = _sched(decay, power=power, min_lr_ratio=0.1)
    assert lr_multiplier(35, cfg) == pytest.approx(expected, rel=1e-12)
    if decay != "constant":
        assert lr_multiplier(110, cfg) == pytest.approx(0.1)
        assert lr_multiplier(500, cfg) == pytest.approx(0.1)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_polynomial_power_one_equals_linear():
    lin, poly = _sched("linear"), _sched("polynomial", power=1.0)
    for s in (0, 3, 10, 47, 99, 110, 200):
        assert lr_multiplier(s, poly) == pytest.approx(lr_multiplier(s, lin))


def test_scheduler_drives_optimizer_lr():
    net = nn.Linear(3, 3)
    opt = build_optimizer(net, OptimizerConfig(name="adamw", lr=0.5), "cpu")
    sched = build_scheduler(opt, _sched("linear"))
    lrs = []
    for _ in range(111):
        lrs.append(opt.param_groups[0]["lr"])
        assert opt.param_groups[1]["lr"] == lrs[-1]
        opt.step()
        sched.step()
    assert lrs[0] == 0.0
    assert lrs[10] == pytest.approx(0.5)
    assert lrs[60] == pytest.approx(0.25)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    # Only counters in the state dict: loadable with weights_only.
    state = sched.state_dict()
    assert state["last_epoch"] == 111
    assert all(fn is None for fn in state["lr_lambdas"])


# ----------------------------------------------------------------------------- param groups


def test_param_groups_decay_split_on_albert_model():
    net = model.EncoderForPretraining(model.EncoderConfig.preset("debug"))
    opt = build_optimizer(net, OptimizerConfig(name="adamw", weight_decay=0.01), "cpu")
    by_id = {id(p): g for g in opt.param_groups for p in g["params"]}
    names = dict(net.named_parameters())
    assert len(by_id) == len(names)  # every trainable parameter exactly once
    decay_group, no_decay_group = opt.param_groups
    assert (decay_group["name"], decay_group["weight_decay"]) == ("decay", 0.01)
    assert (no_decay_group["name"], no_decay_group["weight_decay"]) == ("no_decay", 0.0)
    for name, p in names.items():
        wd = by_id[id(p)]["weight_decay"]
        if name.endswith("bias") or "norm" in name or p.ndim < 2:
            assert wd == 0.0, name
        else:
            assert wd == 0.01, name
    assert by_id[id(names["encoder.groups.0.0.attention.query.weight"])]["weight_decay"] == 0.01
    assert by_id[id(names["encoder.embeddings.word_embeddings.weight"])]["weight_decay"] == 0.01
    assert by_id[id(names["encoder.groups.0.0.attn_norm.weight"])]["weight_decay"] == 0.0


def test_param_groups_norm_modules_and_1d_and_patterns():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, 3))
            self.scale = nn.Parameter(torch.ones(3))  # 1-D, name matches no pattern
            self.ln = nn.LayerNorm(3, bias=False)  # norm module, name 'ln.weight'
            self.frozen = nn.Parameter(torch.ones(3, 3), requires_grad=False)
            self.special_table = nn.Parameter(torch.ones(2, 2))

    net = Net()
    groups = optim.param_groups(net, OptimizerConfig(no_decay=("special",)))
    names = {id(p): n for n, p in net.named_parameters()}
    assert [names[id(p)] for p in groups[0]["params"]] == ["w"]
    assert sorted(names[id(p)] for p in groups[1]["params"]) == [
        "ln.weight",
        "scale",
        "special_table",
    ]


# ----------------------------------------------------------------------------- optimizer steps


def _mlm_loss(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, labels = batch
    out = net(ids)
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize(
    "cfg",
    [
        OptimizerConfig(name="lamb", implementation="torch", lr=0.01),
        OptimizerConfig(name="lamb", implementation="auto", lr=0.01),
        OptimizerConfig(name="adamw", lr=0.01),
    ],
    ids=["lamb-torch", "lamb-auto", "adamw"],
)
def test_steps_lower_loss_of_tiny_encoder(cfg):
    net = model.EncoderForPretraining(model.EncoderConfig.preset("debug")).eval()
    ids = torch.randint(5, 100, (4, 12))
    batch = (ids, ids.roll(1, dims=1))
    opt = build_optimizer(net, cfg, "cpu")
    before = _mlm_loss(net, batch).item()
    for _ in range(5):
        opt.zero_grad()
        _mlm_loss(net, batch).backward()
        opt.step()
    after = _mlm_loss(net, batch).item()
    assert after < before - 0.05, (before, after)


def test_auto_is_the_foreach_lamb_on_every_device():
    opt = build_optimizer(nn.Linear(2, 2), OptimizerConfig(implementation="auto"), "cpu")
    assert type(opt).__module__ == "engine.lamb" and type(opt).__name__ == "Lamb"
    ref = build_optimizer(nn.Linear(2, 2), OptimizerConfig(implementation="torch"), "cpu")
    assert type(ref).__module__.startswith("pytorch_optimizer")
    for device in ("cpu", "cuda"):
        assert optim.resolve_lamb_implementation("auto", device) == "foreach"


def test_compiled_is_the_foreach_lamb_with_its_arithmetic_compiled():
    """`optimizer.implementation: compiled` builds the project's LAMB with `compiled` on (the
    compiled step itself: tests/engine/test_lamb.py, integration tier); exact on ZeRO 1-2 like it."""
    from engine.engine import EngineConfig, lamb_exactness

    opt = build_optimizer(nn.Linear(2, 2), OptimizerConfig(implementation="compiled"), "cpu")
    assert type(opt).__module__ == "engine.lamb" and opt.compiled
    assert not build_optimizer(nn.Linear(2, 2), OptimizerConfig(), "cpu").compiled
    for device in ("cpu", "cuda"):
        assert optim.resolve_lamb_implementation("compiled", device) == "compiled"
    zero2 = EngineConfig(backend="deepspeed", zero_stage=2, precision="bf16", device="cpu")
    assert lamb_exactness(zero2, OptimizerConfig(implementation="compiled")) == (True, "")


def test_adamw_is_torch_adamw_not_fused_on_cpu():
    opt = build_optimizer(nn.Linear(2, 2), OptimizerConfig(name="adamw"), "cpu")
    assert type(opt) is torch.optim.AdamW
    assert not opt.defaults["fused"]


def _hand_lamb_step(x, g, lr, betas, eps, wd):
    """One LAMB step from zero moments (You et al. 2019, Alg. 2, without bias correction as in
    ALBERT's LAMB), with pytorch_optimizer's weight-norm clamp phi(z) = min(z, 10)."""
    b1, b2 = betas
    m = (1 - b1) * g
    v = (1 - b2) * g * g
    r = m / (v.sqrt() + eps) + wd * x
    w_norm = min(x.norm().item(), 10.0)
    trust = w_norm / (r.norm().item() + eps)
    return x - lr * trust * r, trust


@pytest.mark.parametrize("impl", ["torch", "foreach"])
@pytest.mark.parametrize("scale", [0.5, 3.0, 50.0])  # 50 exercises the clamp at 10
def test_lamb_single_step_matches_hand_computed(scale, impl):
    x0 = torch.randn(4, 5, dtype=torch.float64) * scale
    g = torch.randn(4, 5, dtype=torch.float64)
    cfg = OptimizerConfig(name="lamb", implementation=impl, lr=0.01, weight_decay=0.1, eps=1e-6)
    holder = nn.Module()
    holder.w = nn.Parameter(x0.clone())
    opt = build_optimizer(holder, cfg, "cpu")
    holder.w.grad = g.clone()
    opt.step()
    expected, trust = _hand_lamb_step(x0, g, cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay)
    torch.testing.assert_close(holder.w.detach(), expected, rtol=1e-10, atol=1e-12)
    # The trust ratio makes the update norm lr * min(||x||, 10), whatever the gradient scale.
    delta = (holder.w.detach() - x0).norm().item()
    assert delta == pytest.approx(cfg.lr * min(x0.norm().item(), 10.0), rel=1e-5)
    assert trust > 0


@pytest.mark.parametrize("impl", ["torch", "foreach"])
def test_lamb_update_norm_independent_of_gradient_scale(impl):
    def delta(grad_scale: float) -> torch.Tensor:
        torch.manual_seed(1)
        lin = nn.Linear(6, 6, bias=False)
        x0 = lin.weight.detach().clone()
        opt = build_optimizer(lin, OptimizerConfig(implementation=impl, lr=0.02), "cpu")
        lin.weight.grad = torch.randn(6, 6) * grad_scale
        opt.step()
        return lin.weight.detach() - x0, x0

    (d_small, x0), (d_big, _) = delta(1e-2), delta(1e3)
    for d in (d_small, d_big):
        assert d.norm().item() / x0.norm().item() == pytest.approx(0.02, rel=1e-3)


# ----------------------------------------------------------------------------- backends


@pytest.mark.parametrize("impl", ["apex", "deepspeed"])
def test_explicit_fused_lamb_on_cpu_is_a_clear_error(impl):
    cfg = OptimizerConfig(implementation=impl)
    with pytest.raises(RuntimeError, match=rf"implementation='{impl}' needs CUDA"):
        build_optimizer(nn.Linear(2, 2), cfg, "cpu")


def test_explicit_deepspeed_without_deepspeed_is_a_clear_error(monkeypatch):
    for name in ("deepspeed", "deepspeed.ops", "deepspeed.ops.lamb"):  # even if imported before
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    with pytest.raises(RuntimeError, match=r"FusedLamb is not importable.*pip install deepspeed"):
        optim.resolve_lamb_implementation("deepspeed", "cuda")


def test_pypi_apex_web_toolkit_is_not_nvidia_apex(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))  # no .optimizers
    for name in ("deepspeed", "deepspeed.ops", "deepspeed.ops.lamb"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(RuntimeError, match=r"NVIDIA apex .* not importable.*unrelated"):
        optim.resolve_lamb_implementation("apex", "cuda")


def test_explicit_fused_lamb_that_does_not_build_says_why(monkeypatch):
    # Seen on an H100 image with TORCH_CUDA_ARCH_LIST=9.0a: FusedLamb imports, then its JIT
    # build fails when the optimizer is constructed ('auto' is the foreach LAMB: no build).
    class Unbuildable:
        def __init__(self, *args, **kwargs):
            raise ValueError("invalid literal for int() with base 10: '0a'")

    fake_ds = types.ModuleType("deepspeed.ops.lamb")
    fake_ds.FusedLamb = Unbuildable
    monkeypatch.setitem(sys.modules, "deepspeed.ops.lamb", fake_ds)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(RuntimeError, match=r"could not be built.*TORCH_CUDA_ARCH_LIST"):
        build_optimizer(nn.Linear(2, 2), OptimizerConfig(implementation="deepspeed"), "cuda")


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "sgd"}, r"optimizer\.name='sgd'.*'lamb', 'adamw'"),
        ({"lr": 0.0}, r"optimizer\.lr=0\.0.*> 0"),
        ({"betas": (0.9, 1.0)}, r"optimizer\.betas.*\[0, 1\)"),
        ({"betas": (0.9,)}, r"optimizer\.betas"),
        ({"eps": -1.0}, r"optimizer\.eps"),
        ({"weight_decay": -0.1}, r"optimizer\.weight_decay.*>= 0"),
        ({"no_decay": "bias"}, r"optimizer\.no_decay"),
        ({"implementation": "cuda"}, r"optimizer\.implementation='cuda'.*'auto'.*'foreach'"),
    ],
)
def test_optimizer_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": 200, "total_steps": 100}, r"schedule\.warmup_steps=200.*total_steps=100"),
        ({"warmup_steps": -1}, r"schedule\.warmup_steps=-1"),
        ({"total_steps": 0, "warmup_steps": 0}, r"schedule\.total_steps=0.*>= 1"),
        ({"total_steps": 10.5}, r"schedule\.total_steps=10\.5.*integer"),
        ({"decay": "step"}, r"schedule\.decay='step'.*'linear'.*'cosine'"),
        ({"decay": "polynomial", "power": 0.0}, r"schedule\.power=0\.0.*> 0"),
        ({"min_lr_ratio": 1.5}, r"schedule\.min_lr_ratio=1\.5.*\[0, 1\]"),
    ],
)
def test_schedule_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScheduleConfig(**kwargs)


def test_yaml_lists_become_tuples_and_ignored_settings_warn():
    cfg = OptimizerConfig(betas=[0.8, 0.99], no_decay=["bias"])
    assert cfg.betas == (0.8, 0.99) and cfg.no_decay == ("bias",)
    with pytest.warns(UserWarning, match="implementation='apex' is ignored"):
        OptimizerConfig(name="adamw", implementation="apex")
    with pytest.warns(UserWarning, match="power is ignored"):
        ScheduleConfig(decay="cosine", power=2.0)


def test_albert_recipe_defaults_and_docstring_example():
    opt_cfg, sched_cfg = OptimizerConfig(), ScheduleConfig()
    assert (opt_cfg.name, opt_cfg.lr, opt_cfg.betas, opt_cfg.eps) == (
        "lamb",
        0.00176,
        (0.9, 0.999),
        1e-6,
    )
    assert (sched_cfg.warmup_steps, sched_cfg.total_steps, sched_cfg.decay) == (
        3125,
        125_000,
        "linear",
    )
    result = doctest.testmod(optim, raise_on_error=False)
    assert result.attempted >= 5 and result.failed == 0
