"""``bf16-mixed`` on DeepSpeed: the forward really runs under bf16 autocast.

DeepSpeed's engine forward switches an autocast it was not configured for OFF
(``deepspeed.runtime.torch_autocast.autocast_if_enabled``: "torch.autocast is enabled outside
DeepSpeed but disabled within the DeepSpeed engine"), checking ``torch.is_autocast_enabled()``,
which asks about CUDA. On a GPU the "mixed" forward therefore ran in fp32 (measured on an H100:
6x slower, twice the activation memory). On a CPU the check does not see a CPU autocast, so the
test makes it see one, as it sees a CUDA autocast on a GPU, and looks inside the forward."""

from __future__ import annotations

import pytest
import torch
from pretrain_support import one_process_rendezvous
from test_engine import ADAMW, SCHEDULE, data, mlp

from engine.distributed import detect
from engine.engine import Engine, EngineConfig


@pytest.fixture
def one_process(monkeypatch):
    one_process_rendezvous(monkeypatch)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_bf16_mixed_forward_runs_in_bf16_inside_deepspeed(one_process, monkeypatch, zero_stage):
    pytest.importorskip("deepspeed")
    original = torch.is_autocast_enabled

    def as_on_a_gpu(device_type=None):  # the argument-less call answers for this device
        return original("cpu") if device_type is None else original(device_type)

    monkeypatch.setattr(torch, "is_autocast_enabled", as_on_a_gpu)
    cfg = EngineConfig(
        backend="deepspeed", device="cpu", precision="bf16-mixed", zero_stage=zero_stage
    )
    engine = Engine(mlp(), cfg, ADAMW, SCHEDULE, detect())
    seen = []
    first = next(m for m in engine.module.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(
        lambda mod, inp, out: seen.append(
            (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), out.dtype)
        )
    )
    x, _ = data()
    out = engine.forward(x)
    assert seen == [(True, torch.bfloat16, torch.bfloat16)], seen
    assert out.dtype == torch.bfloat16
    # The weights (and so the optimizer and the gradient reduction) stay fp32.
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    assert engine.deepspeed_config()["torch_autocast"]["lower_precision_safe_modules"] == []
