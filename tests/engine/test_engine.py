"""engine.engine (in process, one rank, torch backend on CPU) and engine.signals.

No process group is created here: the torch backend with a world size of 1 skips
``init_distributed``. The DeepSpeed backend is exercised by the multi-process tests in
tests/multiproc; here only its config dict and start-up checks are tested (one DeepSpeed
engine starts in a subprocess, against a stale torch-extensions lock).
"""

from __future__ import annotations

import copy
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import engine.engine as engine_module
import engine.extensions as extensions
from engine.checkpoint import CheckpointError
from engine.distributed import DistEnv
from engine.engine import Engine, EngineConfig, check_compatible
from engine.extensions import (
    StaleExtensionLockError,
    check_extension_locks,
    torch_extensions_root,
    use_environment_extensions_dir,
)
from engine.optim import OptimizerConfig, ScheduleConfig
from engine.signals import StopWatch
from model.config import EncoderConfig
from model.heads import EncoderForPretraining

ONE = DistEnv.single()
CPU = torch.device("cpu")
ADAMW = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.01)
# No warmup: the first update already uses the peak lr, and the lr changes at every step.
SCHEDULE = ScheduleConfig(warmup_steps=0, total_steps=10, decay="linear")


def make_engine(
    model: nn.Module,
    optimizer: OptimizerConfig = ADAMW,
    schedule: ScheduleConfig = SCHEDULE,
    **kw,
) -> Engine:
    kw.setdefault("precision", "fp32")
    cfg = EngineConfig(backend="torch", device="cpu", **kw)
    return Engine(model, cfg, optimizer, schedule, dist=ONE)


def mlp() -> nn.Module:
    """No dropout, no normalization over the batch: per-example losses are independent."""
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def data(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def mse(engine: Engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (engine.forward(x).float() - y).pow(2).mean()  # mean over the micro-batch


def params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def opt_state(engine: Engine) -> list[dict[str, torch.Tensor]]:
    return [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in engine.optimizer.state[p].items()}
        for p in engine.module.parameters()
    ]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 0.0) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=atol, rtol=0.0)


def train_step(engine: Engine, x: torch.Tensor, y: torch.Tensor):
    """One optimizer step over (x, y) split into gradient_accumulation_steps micro-batches."""
    for xb, yb in zip(
        x.chunk(engine.cfg.gradient_accumulation_steps),
        y.chunk(engine.cfg.gradient_accumulation_steps),
    ):
        engine.backward(mse(engine, xb, yb))
    return engine.step()


# ----------------------------------------------------------------------------- EngineConfig


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"backend": "jax"}, "engine.backend"),
        ({"precision": "fp8"}, "engine.precision"),
        ({"precision": "bf16-MIXED"}, "engine.precision"),
        ({"device": "tpu"}, "engine.device"),
        ({"zero_stage": 4}, "engine.zero_stage"),
        ({"zero_stage": -1}, "engine.zero_stage"),
        ({"backend": "torch", "zero_stage": 2}, "engine.zero_stage"),
        ({"backend": "torch", "precision": "bf16"}, "engine.precision"),
        ({"deepspeed": {"train_batch_size": 8}}, "train_batch_size"),
        ({"deepspeed": {"fp16": {"enabled": True}}}, "fp16"),
        ({"deepspeed": {"zero_optimization": {"stage": 2}}}, "zero_optimization.stage"),
        ({"micro_batch_size": 0}, "engine.micro_batch_size"),
        ({"micro_batch_size": 2.0}, "engine.micro_batch_size"),
        ({"gradient_accumulation_steps": True}, "engine.gradient_accumulation_steps"),
        ({"gradient_clipping": -1}, "engine.gradient_clipping"),
        ({"dist_timeout_minutes": 0}, "engine.dist_timeout_minutes"),
    ],
)
def test_engine_config_rejects(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        EngineConfig(**kwargs)


def test_engine_config_accepts_valid_combinations():
    EngineConfig(backend="deepspeed", zero_stage=3, precision="bf16")
    EngineConfig(backend="torch", zero_stage=0, precision="fp16", gradient_clipping=0)
    # Extras that do not clash (offload, other zero_optimization keys) are allowed.
    EngineConfig(deepspeed={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})


@pytest.mark.parametrize(
    ("backend", "precision", "dtype"),
    [
        ("torch", "fp32", None),
        ("torch", "bf16-mixed", torch.bfloat16),
        ("deepspeed", "bf16-mixed", torch.bfloat16),
        ("torch", "fp16", torch.float16),  # autocast + GradScaler
        ("deepspeed", "fp16", None),  # DeepSpeed's own fp16 weights
        ("deepspeed", "bf16", None),
    ],
)
def test_autocast_dtype(backend, precision, dtype):
    assert EngineConfig(backend=backend, precision=precision).autocast_dtype == dtype


# ----------------------------------------------------------------------------- the backend


class _NoBackendReads:
    """An engine config whose ``backend`` may not be read (every other field reads through)."""

    def __init__(self, cfg: EngineConfig) -> None:
        object.__setattr__(self, "_cfg", cfg)

    def __getattr__(self, name: str):
        if name == "backend":
            raise AssertionError("the engine read engine.backend after choosing its backend")
        return getattr(object.__getattribute__(self, "_cfg"), name)


def test_the_backend_is_picked_once_and_used_throughout(monkeypatch, tmp_path):
    """The engine asks for its backend class once, at start-up; training steps, save and load
    then go through that backend without reading ``engine.backend`` again."""
    from engine.backends.torch import TorchBackend

    picked = []
    real = engine_module.backend_class
    monkeypatch.setattr(
        engine_module, "backend_class", lambda cfg: picked.append(cfg.backend) or real(cfg)
    )
    engine = make_engine(mlp(), gradient_accumulation_steps=2)
    assert picked == ["torch"]
    assert type(engine.backend) is TorchBackend and engine.backend.name == "torch"
    engine.cfg = _NoBackendReads(engine.cfg)
    x, y = data()
    for xs, ys in zip((x[:4], x[4:]), (y[:4], y[4:]), strict=True):
        engine.backward(mse(engine, xs, ys))
    assert not engine.step().skipped
    (tmp_path / "ckpt").mkdir()
    engine.save(tmp_path / "ckpt")
    engine.load(tmp_path / "ckpt")
    assert engine.layout()["backend"] == "torch"
    assert picked == ["torch"]


# ----------------------------------------------------------------------------- start-up checks


def test_fp16_on_cpu_fails_before_any_work(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the engine did work before rejecting fp16 on CPU")

    monkeypatch.setattr(engine_module, "init_distributed", must_not_run)
    monkeypatch.setattr(engine_module, "build_optimizer", must_not_run)
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="CUDA"):
        make_engine(model, precision="fp16")
    with pytest.raises(ValueError, match="CUDA"):
        check_compatible(EngineConfig(backend="deepspeed", precision="fp16"), ADAMW, CPU)


@pytest.mark.parametrize(
    ("zero_stage", "precision", "implementation"),
    [
        (3, "bf16-mixed", "auto"),  # no layout read on ZeRO-3
        (0, "bf16", "auto"),  # DeepSpeed's bf16 mode on ZeRO-0: flat buffers, no layout
        (1, "bf16", "auto"),  # ... and on ZeRO-1 (BF16_Optimizer)
        (1, "bf16-mixed", "torch"),  # pytorch_optimizer's LAMB knows no layout
        (2, "fp32", "torch"),
    ],
)
def test_lamb_with_flattened_buffers_warns(zero_stage, precision, implementation):
    cfg = EngineConfig(backend="deepspeed", zero_stage=zero_stage, precision=precision)
    with pytest.warns(UserWarning, match="trust ratio"):
        check_compatible(cfg, OptimizerConfig(name="lamb", implementation=implementation), CPU)


def test_fused_lamb_on_flattened_buffers_is_refused():
    cfg = EngineConfig(backend="deepspeed", zero_stage=2, precision="bf16-mixed")
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"per flat buffer.*'foreach'"):
        check_compatible(cfg, OptimizerConfig(name="lamb", implementation="deepspeed"), cuda)


@pytest.mark.parametrize(
    ("backend", "optimizer", "zero_stage", "precision"),
    [
        ("deepspeed", "lamb", 0, "bf16-mixed"),  # the ALBERT recipes
        ("deepspeed", "lamb", 0, "fp32"),
        ("deepspeed", "lamb", 1, "bf16-mixed"),  # the foreach LAMB reads ZeRO's layout
        ("deepspeed", "lamb", 2, "fp32"),
        ("deepspeed", "lamb", 2, "bf16"),
        ("deepspeed", "adamw", 2, "bf16"),  # AdamW is elementwise: flattening is harmless
        ("torch", "lamb", 0, "bf16-mixed"),
    ],
)
def test_exact_combinations_do_not_warn(backend, optimizer, zero_stage, precision):
    cfg = EngineConfig(backend=backend, zero_stage=zero_stage, precision=precision)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_compatible(cfg, OptimizerConfig(name=optimizer), CPU)


def test_deepspeed_backend_without_deepspeed_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    with pytest.raises(RuntimeError, match="backend='torch'"):
        check_compatible(EngineConfig(backend="deepspeed"), ADAMW, CPU)
    check_compatible(EngineConfig(backend="torch"), ADAMW, CPU)  # the torch backend needs none


def test_activation_checkpointing_needs_an_encoder():
    with pytest.raises(ValueError, match="enable_activation_checkpointing"):
        make_engine(nn.Linear(2, 2), activation_checkpointing=True)


# ----------------------------------------------------------------------------- DeepSpeed config


@pytest.fixture
def torch_engine() -> Engine:
    return make_engine(nn.Linear(2, 2))


def ds_config(engine: Engine, **kw) -> dict:
    """``deepspeed_config()`` only reads ``engine.cfg``: an engine built with the torch backend
    (no DeepSpeed initialisation, no process group) is given a DeepSpeed EngineConfig."""
    engine.cfg = EngineConfig(backend="deepspeed", **kw)
    return engine.deepspeed_config()


def test_deepspeed_config_batch_and_clipping(torch_engine):
    cfg = ds_config(
        torch_engine, micro_batch_size=4, gradient_accumulation_steps=3, gradient_clipping=2
    )
    assert cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["gradient_accumulation_steps"] == 3
    # ZeRO-0 in fp32 / bf16-mixed: the engine clips the gradients itself (one norm, on the
    # device), so DeepSpeed's clipping is off; elsewhere DeepSpeed clips at the engine's value.
    assert cfg["gradient_clipping"] == 0.0
    cfg = ds_config(torch_engine, zero_stage=2, gradient_clipping=2)
    assert cfg["gradient_clipping"] == 2.0 and isinstance(cfg["gradient_clipping"], float)
    cfg = ds_config(torch_engine, precision="bf16", gradient_clipping=2)
    assert cfg["gradient_clipping"] == 2.0
    assert "train_batch_size" not in cfg  # DeepSpeed derives it from the world size
    assert "optimizer" not in cfg and "scheduler" not in cfg  # ours are passed as objects
    assert cfg["zero_allow_untested_optimizer"] is True
    # Its throughput timer would synchronise the device twice per step.
    assert cfg["timers"] == {"throughput": {"enabled": False}}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_config_zero_stage(torch_engine, stage):
    assert ds_config(torch_engine, zero_stage=stage)["zero_optimization"] == {"stage": stage}


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_deepspeed_config_without_deepspeed_precision(torch_engine, precision):
    # bf16-mixed is our autocast over fp32 weights: DeepSpeed must not switch to bf16 weights.
    cfg = ds_config(torch_engine, precision=precision)
    assert "bf16" not in cfg and "fp16" not in cfg


def test_deepspeed_config_bf16(torch_engine):
    cfg = ds_config(torch_engine, precision="bf16", zero_stage=1)
    assert cfg["bf16"] == {"enabled": True}
    assert "fp16" not in cfg


def test_deepspeed_config_fp16(torch_engine):
    cfg = ds_config(
        torch_engine,
        precision="fp16",
        fp16_initial_scale_power=12,
        fp16_loss_scale_window=50,
        fp16_hysteresis=3,
        fp16_min_loss_scale=0.5,
    )
    assert cfg["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 50,
        "hysteresis": 3,
        "min_loss_scale": 0.5,
    }
    assert "bf16" not in cfg


def test_deepspeed_config_extras_merge_deeply(torch_engine):
    extra = {
        "zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "activation_checkpointing": {"partition_activations": False},
    }
    cfg = ds_config(torch_engine, zero_stage=2, deepspeed=copy.deepcopy(extra))
    assert cfg["zero_optimization"] == {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }
    assert cfg["activation_checkpointing"] == {"partition_activations": False}
    assert cfg["train_micro_batch_size_per_gpu"] == 32  # generated keys survive the merge
    cfg["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
    assert torch_engine.cfg.deepspeed == extra  # the result does not alias the config


# ----------------------------------------------------------------------------- accumulation


def test_gradient_accumulation_matches_one_big_batch():
    x, y = data(8)
    model = mlp()
    big = make_engine(copy.deepcopy(model), micro_batch_size=8, gradient_accumulation_steps=1)
    acc = make_engine(copy.deepcopy(model), micro_batch_size=4, gradient_accumulation_steps=2)
    r_big = train_step(big, x, y)
    r_acc = train_step(acc, x, y)
    assert not r_big.skipped and not r_acc.skipped
    assert r_acc.grad_norm == pytest.approx(r_big.grad_norm, rel=1e-5)
    assert_same(params(acc.module), params(big.module), atol=1e-6)
    assert not torch.equal(params(acc.module)[0], params(model)[0])  # an update happened
    assert acc.global_batch_size == big.global_batch_size == 8


def test_at_boundary_and_early_step():
    x, y = data(8)
    engine = make_engine(mlp(), micro_batch_size=4, gradient_accumulation_steps=2)
    assert not engine.at_boundary
    with pytest.raises(RuntimeError, match=r"backward\(\) calls"):
        engine.step()  # nothing accumulated yet
    engine.backward(mse(engine, x[:4], y[:4]))
    assert not engine.at_boundary
    with pytest.raises(RuntimeError, match="every 2 backward"):
        engine.step()
    engine.backward(mse(engine, x[4:], y[4:]))
    assert engine.at_boundary
    assert not engine.step().skipped
    engine.backward(mse(engine, x[:4], y[:4]))
    assert not engine.at_boundary
    with pytest.raises(RuntimeError):
        engine.step()
    engine.backward(mse(engine, x[4:], y[4:]))
    assert engine.at_boundary
    assert engine.scheduler.last_epoch == 1  # the early calls did not touch the schedule
    engine.step()
    assert engine.scheduler.last_epoch == 2


def test_step_twice_without_backward_raises():
    x, y = data(4)
    engine = make_engine(mlp(), micro_batch_size=4)
    engine.backward(mse(engine, x, y))
    engine.step()
    assert not engine.at_boundary  # no micro-batch since the last step
    with pytest.raises(RuntimeError):
        engine.step()


# ----------------------------------------------------------------------------- non-finite


def test_nonfinite_loss_skips_the_update_and_keeps_the_schedule():
    x, y = data(8)
    engine = make_engine(mlp(), micro_batch_size=4, gradient_accumulation_steps=2)
    train_step(engine, x, y)  # one real step: the optimizer has state, the lr has moved
    before, state = params(engine.module), opt_state(engine)
    epoch, lr = engine.scheduler.last_epoch, engine.lr
    assert state[0] and epoch == 1

    bad = x[4:].clone()
    bad[0, 0] = float("nan")  # NaN input: NaN loss and NaN gradients
    assert engine.backward(mse(engine, x[:4], y[:4])) is True
    assert engine.backward(mse(engine, bad, y[4:])) is False
    result = engine.step()
    assert result.skipped and result.nonfinite_loss
    assert result.lr == lr
    assert_same(params(engine.module), before)
    after = opt_state(engine)
    for s0, s1 in zip(state, after):
        assert s0.keys() == s1.keys()
        for k in s0:
            torch.testing.assert_close(s1[k], s0[k], rtol=0, atol=0)
    assert engine.scheduler.last_epoch == epoch
    assert engine.lr == lr
    assert all(p.grad is None for p in engine.module.parameters())  # NaN grads are dropped

    result = train_step(engine, x, y)
    assert not result.skipped and not result.nonfinite_loss
    assert result.lr == lr  # the step after the skip uses the lr the skipped one would have
    assert engine.scheduler.last_epoch == epoch + 1 and engine.lr < lr
    now = params(engine.module)
    assert all(torch.isfinite(p).all() for p in now)
    assert any(not torch.equal(a, b) for a, b in zip(now, before))


def test_infinite_loss_is_skipped_too():
    x, y = data(4)
    engine = make_engine(mlp(), micro_batch_size=4)
    before = params(engine.module)
    assert engine.backward(mse(engine, x, y) * float("inf")) is False
    result = engine.step()
    assert result.skipped and result.nonfinite_loss
    assert_same(params(engine.module), before)
    assert engine.scheduler.last_epoch == 0


# ----------------------------------------------------------------------------- clipping


def test_grad_norm_is_the_pre_clip_norm_and_clipping_shrinks_the_update():
    x, y = data(8)
    model = mlp()
    reference = copy.deepcopy(model)
    (reference(x) - y).pow(2).mean().backward()
    grads = [p.grad for p in reference.parameters()]
    norm = float(torch.nn.utils.get_total_norm(grads))
    assert norm > 0.1  # far above the clipping threshold below

    # AdamW's first update (bias-corrected, no weight decay) is exactly -lr * g / (|g| + eps);
    # with eps = 1 it grows with |g|, so it shows whether the gradient was clipped.
    lr, eps = 1.0, 1.0  # a large lr: the clipped update stays far above fp32 rounding
    opt = OptimizerConfig(name="adamw", lr=lr, eps=eps, weight_decay=0.0)

    def expected_update(scale: float) -> float:
        return float(
            torch.nn.utils.get_total_norm(
                [lr * g * scale / ((g * scale).abs() + eps) for g in grads]
            )
        )

    runs = {}
    for clip in (1e-3, 0.0):
        engine = make_engine(copy.deepcopy(model), optimizer=opt, gradient_clipping=clip)
        result = train_step(engine, x, y)
        assert result.grad_norm == pytest.approx(norm, rel=1e-5)  # before clipping, both runs
        delta = [a - b for a, b in zip(params(engine.module), params(model))]
        runs[clip] = float(torch.nn.utils.get_total_norm(delta))
    assert runs[1e-3] == pytest.approx(expected_update(1e-3 / (norm + 1e-6)), rel=1e-3)
    assert runs[0.0] == pytest.approx(expected_update(1.0), rel=1e-3)
    assert runs[1e-3] < runs[0.0] / 50


# ----------------------------------------------------------------------------- precision


def test_bf16_mixed_autocasts_forward_and_keeps_fp32_weights():
    x, y = data(4)
    engine = make_engine(mlp(), precision="bf16-mixed", micro_batch_size=4)
    out = engine.forward(x)
    assert out.dtype == torch.bfloat16  # the matmuls ran under autocast
    assert engine.module(x).dtype == torch.float32  # outside the engine: plain fp32
    engine.backward((out.float() - y).pow(2).mean())
    assert all(p.grad.dtype == torch.float32 for p in engine.module.parameters())
    assert not engine.step().skipped
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    for s in opt_state(engine):
        assert s["exp_avg"].dtype == torch.float32


def test_activation_checkpointing_gives_the_same_step():
    enc = EncoderConfig.preset("debug", num_hidden_layers=3)
    model = EncoderForPretraining(enc)
    ids = torch.randint(0, enc.vocab_size, (2, 8))
    labels = torch.randint(0, enc.vocab_size, (2, 8))
    results = []
    for checkpointing in (False, True):
        engine = make_engine(
            copy.deepcopy(model), micro_batch_size=2, activation_checkpointing=checkpointing
        )
        logits = engine.forward(ids).logits
        engine.backward(nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))
        results.append((engine.step().grad_norm, params(engine.module)))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    assert_same(results[1][1], results[0][1], atol=1e-6)


# ----------------------------------------------------------------------------- save / load


def test_save_load_round_trip(tmp_path):
    x, y = data(8)
    engine = make_engine(mlp(), micro_batch_size=4, gradient_accumulation_steps=2)
    for _ in range(3):
        train_step(engine, x, y)
    ckpt = tmp_path / "step_3"
    ckpt.mkdir()
    engine.save(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["engine.pt"]  # no temp file left

    torch.manual_seed(123)
    other = make_engine(mlp(), micro_batch_size=4, gradient_accumulation_steps=2)
    assert other.lr != engine.lr and other.scheduler.last_epoch == 0
    other.load(ckpt)
    assert_same(params(other.module), params(engine.module))
    for s0, s1 in zip(opt_state(engine), opt_state(other)):
        assert s0.keys() == s1.keys()
        for k in s0:
            torch.testing.assert_close(s1[k], s0[k], rtol=0, atol=0)
    assert other.scheduler.last_epoch == engine.scheduler.last_epoch == 3
    assert [g["lr"] for g in other.optimizer.param_groups] == [
        g["lr"] for g in engine.optimizer.param_groups
    ]
    assert other.lr == pytest.approx(1e-2 * 0.7)  # step 3 of 10, linear decay, no warmup
    assert other.micro_step == engine.micro_step == 6

    # Training on from the checkpoint is the same as training on without it.
    r0, r1 = train_step(engine, x, y), train_step(other, x, y)
    assert r1.lr == r0.lr
    assert_same(params(other.module), params(engine.module))


def test_load_restores_the_lr_from_the_schedule(tmp_path):
    """The optimizer's saved param-group lr is not trusted: the schedule's lr is put back."""
    x, y = data(4)
    engine = make_engine(mlp(), micro_batch_size=4)
    train_step(engine, x, y)
    for group in engine.optimizer.param_groups:
        group["lr"] = 123.0  # e.g. a DeepSpeed wrapper that did not keep it
    engine.save(tmp_path)
    other = make_engine(mlp(), micro_batch_size=4)
    other.load(tmp_path)
    assert other.lr == pytest.approx(1e-2 * 0.9)
    assert [g["lr"] for g in other.optimizer.param_groups] == other.scheduler.get_last_lr()


class RunsCodeWhenUnpickled:
    """What a tampered checkpoint could hold: unpickling it calls os.mkdir(path)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def test_load_refuses_a_pickle_that_would_run_code(tmp_path):
    x, y = data(4)
    engine = make_engine(mlp(), micro_batch_size=4)
    train_step(engine, x, y)
    engine.save(tmp_path)
    state = torch.load(tmp_path / "engine.pt", weights_only=True)  # what save wrote is plain
    marker = tmp_path / "code_ran"
    state["albatross"]["micro_step"] = RunsCodeWhenUnpickled(marker)
    torch.save(state, tmp_path / "engine.pt")

    other = make_engine(mlp(), micro_batch_size=4)
    before = params(other.module)
    with pytest.raises(
        CheckpointError,
        match=re.escape(str(tmp_path / "engine.pt"))
        + r": refused: .*weights_only=True.*arbitrary code.*posix\.mkdir",
    ):
        other.load(tmp_path)
    assert not marker.exists()  # nothing ran
    assert_same(params(other.module), before)  # and nothing was loaded

    (tmp_path / "engine.pt").unlink()
    with pytest.raises(CheckpointError, match=r"engine\.pt: is missing"):
        other.load(tmp_path)
    (tmp_path / "engine.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=r"engine\.pt: cannot be read"):
        other.load(tmp_path)


class ScheduleWithAPath:
    """A schedule multiplier object: LambdaLR saves its __dict__, here a Path (not plain)."""

    def __init__(self) -> None:
        self.where = Path("schedules") / "linear.yaml"

    def __call__(self, step: int) -> float:
        return 1.0


def test_save_refuses_state_that_would_not_load_weights_only(tmp_path):
    engine = make_engine(mlp(), micro_batch_size=4)
    engine.scheduler.lr_lambdas = [ScheduleWithAPath() for _ in engine.optimizer.param_groups]
    with pytest.raises(TypeError, match=r"'albatross' state .*weights_only=True.*PosixPath"):
        engine.save(tmp_path)
    assert list(tmp_path.iterdir()) == []  # failed at the save, not at the resume


# ----------------------------------------------------------------------------- extension locks


def make_lock(root: Path, op: str = "deepspeed_shm_comm", age_s: float = 0.0) -> Path:
    """A torch FileBaton lock file as a build of ``op`` leaves it, ``age_s`` seconds old."""
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_stale_extension_lock_fails_fast_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("ALBATROSS_EXTENSION_LOCK_MINUTES", raising=False)
    (tmp_path / "cpu_adam").mkdir()  # a finished build: no lock
    lock = make_lock(tmp_path, age_s=3600)
    start = time.monotonic()
    with pytest.raises(StaleExtensionLockError) as caught:
        check_extension_locks()
    assert time.monotonic() - start < 5
    assert isinstance(caught.value, ValueError)  # the CLIs exit 2
    message = str(caught.value)
    assert message.startswith(f"{lock}: a torch-extensions build lock 60.0 minutes old")
    assert "'deepspeed_shm_comm' op" in message and f"rm {lock}" in message
    assert lock.exists()  # never deleted for the user

    monkeypatch.setenv("ALBATROSS_EXTENSION_LOCK_MINUTES", "90")
    with pytest.raises(StaleExtensionLockError):
        check_extension_locks(max_age_s=60)  # the argument wins over the variable
    threading.Timer(0.3, lock.unlink).start()
    check_extension_locks(poll_s=0.05)  # younger than 90 minutes: waited for, then gone
    make_lock(tmp_path, age_s=3600)
    monkeypatch.setenv("ALBATROSS_EXTENSION_LOCK_MINUTES", "0")
    check_extension_locks()  # turned off
    monkeypatch.setenv("ALBATROSS_EXTENSION_LOCK_MINUTES", "soon")
    with pytest.raises(ValueError, match="ALBATROSS_EXTENSION_LOCK_MINUTES='soon'"):
        check_extension_locks()


def test_young_lock_is_waited_for_and_goes_stale_at_the_limit(tmp_path, caplog):
    lock = make_lock(tmp_path, age_s=0)
    threading.Timer(0.3, lock.unlink).start()  # a build that finishes
    with caplog.at_level(logging.WARNING, logger="engine.engine"):
        check_extension_locks(tmp_path, max_age_s=60, poll_s=0.05)
    assert f"waiting for the torch-extensions build lock {lock}" in caplog.text
    assert not lock.exists()

    make_lock(tmp_path, age_s=0)  # a build killed a moment ago: bounded wait, then the error
    start = time.monotonic()
    with pytest.raises(StaleExtensionLockError):
        check_extension_locks(tmp_path, max_age_s=0.5, poll_s=0.05)
    assert 0.4 < time.monotonic() - start < 5


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds holders through /proc")
def test_old_lock_held_open_by_a_live_process_is_not_stale(tmp_path):
    lock = make_lock(tmp_path, age_s=3600)
    fd = os.open(lock, os.O_RDONLY)  # as torch's FileBaton holds it while it builds

    def release() -> None:
        # Removed, then closed: never an old lock that nobody holds. (FileBaton closes first;
        # the check takes a second look before it calls a lock stale.)
        lock.unlink()
        os.close(fd)

    assert extensions._lock_holders(lock) == [os.getpid()]
    threading.Timer(0.5, release).start()
    check_extension_locks(tmp_path, max_age_s=60, poll_s=0.05)  # waits, does not raise
    assert not lock.exists()
    assert extensions._lock_holders(tmp_path / "nothing") == []


def test_deepspeed_engine_start_up_fails_fast_on_a_stale_lock(tmp_path):
    """Before: DeepSpeed's start-up (building its shm op on CPU) waited on the lock forever."""
    pytest.importorskip("deepspeed")
    lock = make_lock(tmp_path / "extensions", age_s=3600)
    code = (
        "from torch import nn\n"
        "from engine.distributed import DistEnv\n"
        "from engine.engine import Engine, EngineConfig\n"
        "from engine.optim import OptimizerConfig, ScheduleConfig\n"
        "dist = DistEnv(0, 0, 1, 1, 0, '127.0.0.1', 29500, 'single')\n"
        "cfg = EngineConfig(backend='deepspeed', device='cpu', precision='fp32')\n"
        "Engine(nn.Linear(2, 2), cfg, OptimizerConfig(name='adamw'), ScheduleConfig(), dist)\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    env.pop("ALBATROSS_EXTENSION_LOCK_MINUTES", None)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert f"StaleExtensionLockError: {lock}: a torch-extensions build lock" in done.stderr
    assert time.monotonic() - start < 120


def test_torch_extensions_root_is_where_torch_builds(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    if not hasattr(cpp_extension, "_get_build_directory"):
        pytest.skip("this torch has no _get_build_directory to compare with")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # torch's default root
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "unset below")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert torch_extensions_root() / "some_op" == Path(
        cpp_extension._get_build_directory("some_op", False)
    )
    assert str(torch_extensions_root()).startswith(os.path.realpath(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "explicit"))
    assert torch_extensions_root() / "some_op" == Path(
        cpp_extension._get_build_directory("some_op", False)
    )


def test_extensions_dir_defaults_into_the_virtual_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "explicit"))
    assert use_environment_extensions_dir(tmp_path / "venv", tmp_path / "base") is None
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "explicit")  # kept

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    (tmp_path / "venv").mkdir()
    assert use_environment_extensions_dir(tmp_path / "base", tmp_path / "base") is None
    assert "TORCH_EXTENSIONS_DIR" not in os.environ  # not a virtual environment
    chosen = use_environment_extensions_dir(tmp_path / "venv", tmp_path / "base")
    assert chosen is not None and chosen.parent == tmp_path / "venv" / "torch_extensions"
    accelerator = (
        "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    )
    if torch.version.hip is None:
        tag = f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}_{accelerator}"
        assert chosen.name == tag  # torch's own per-Python, per-accelerator folder name
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(chosen)
    assert torch_extensions_root() == chosen  # where the lock check looks, too

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):  # this test run's venv
        assert use_environment_extensions_dir() == torch_extensions_root()
        assert torch_extensions_root().parent == Path(sys.prefix) / "torch_extensions"


# ----------------------------------------------------------------------------- StopWatch


def wait_for(condition, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def test_stopwatch_records_sigusr1_and_restores_the_handler():
    def previous(signum, frame):
        raise AssertionError("the previous handler must not run while the StopWatch is active")

    original = signal.signal(signal.SIGUSR1, previous)
    try:
        watch = StopWatch()
        try:
            assert watch.received is None
            assert watch.local_flags() == [0.0, 0.0]
            assert signal.getsignal(signal.SIGUSR1) != previous
            os.kill(os.getpid(), signal.SIGUSR1)
            assert wait_for(lambda: watch.received is not None)
            assert watch.received == "SIGUSR1"
            assert watch.local_flags()[0] == 1.0
        finally:
            watch.restore()
        assert signal.getsignal(signal.SIGUSR1) is previous
        assert signal.getsignal(signal.SIGTERM) is not watch._handle
    finally:
        signal.signal(signal.SIGUSR1, original)


def test_stopwatch_records_sigterm():
    watch = StopWatch()
    try:
        # Checked first: without the handler, SIGTERM would end the whole test run.
        assert signal.getsignal(signal.SIGTERM) == watch._handle
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_for(lambda: watch.received is not None)
        assert watch.received == "SIGTERM"
    finally:
        watch.restore()


def test_stopwatch_budget():
    tiny, none, large = StopWatch(1e-3), StopWatch(None), StopWatch(3600.0)
    try:
        time.sleep(0.01)
        assert tiny.budget_exceeded and tiny.elapsed >= 1e-3
        assert tiny.local_flags() == [0.0, 1.0]
        assert not none.budget_exceeded and not large.budget_exceeded
        assert large.local_flags() == [0.0, 0.0]
    finally:
        for watch in (large, none, tiny):  # restore in reverse order of installation
            watch.restore()


@pytest.mark.integration  # two interpreters importing DeepSpeed: 5 s
def test_deepspeed_is_imported_without_mlflow():
    """import_deepspeed: DeepSpeed's autotuner does not import MLflow (0.8 s of every rank's
    start-up), MLflow stays importable for the tracker, and a process that has already imported
    MLflow keeps it."""
    check = textwrap.dedent(
        """
        import sys
        from engine.extensions import import_deepspeed
        if sys.argv[1] == "preloaded":
            import mlflow
        import_deepspeed()
        from deepspeed.autotuning import autotuner
        print(autotuner.has_mlflow, "mlflow" in sys.modules)
        import mlflow
        from mlflow.tracking import MlflowClient
        print(type(mlflow).__name__, MlflowClient.__name__)
        """
    )
    for case, expected in (("fresh", "False False"), ("preloaded", "True True")):
        proc = subprocess.run(
            [sys.executable, "-c", check, case],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines = [line for line in proc.stdout.splitlines() if "[WARNING]" not in line]
        assert lines == [expected, "module MlflowClient"], proc.stdout
