"""`engine.compile_scope`: the encoder compiled as one unrolled graph (``encoder``, the default)
or each distinct layer compiled once and reused by all its applications (``layers``), so that
compiling a deep ALBERT (one layer applied 48 or 96 times) costs what compiling one layer does.

What must hold: the layers compile and the rest stays eager; the traced work does not grow with
the number of applications (it does for ``encoder``: the control); distinct layers beyond
TorchDynamo's own limit of 8 compiled entries are all compiled, none left eager; compiled
equals eager, alone and in the real trainer on DeepSpeed (``aot_eager`` in the integration
tier, Inductor in the slow one); and the key is checked, logged and resumable.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from pretrain_support import make_shards, one_process_rendezvous
from test_compile_trainer import eager_runs
from test_compile_trainer import run as run_trainer
from test_fast_paths import batch
from test_fast_paths import tiny as fast_paths_tiny
from torch._dynamo.utils import counters

from engine.engine import (
    COMPILE_SCOPES,
    COMPILES_PER_LAYER,
    EngineConfig,
    compile_encoder,
    distinct_layers,
)
from model import EncoderConfig, EncoderForPretraining
from pretrain.config import RESUMABLE_CHANGES

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def tiny(attention: str = "softmax", **kw) -> EncoderConfig:
    """The fast-path tests' tiny model, attention dropout off too (compiled == eager)."""
    return fast_paths_tiny(attention, attention_probs_dropout_prob=0.0, **kw)


def forward_backward(model, ids, mask):
    """(last hidden state, gradients by name) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model.encoder(ids, mask)
    out.last_hidden_state.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.last_hidden_state.detach(), grads


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------- unit


@pytest.mark.unit
def test_scope_is_checked_and_named():
    assert EngineConfig().compile_scope == "encoder"
    assert COMPILE_SCOPES == ("encoder", "layers")
    with pytest.raises(ValueError, match=r"engine\.compile_scope='layer' is invalid; valid: "):
        EngineConfig(compile_scope="layer")
    assert "engine.compile_scope" in RESUMABLE_CHANGES


@pytest.mark.unit
@pytest.mark.parametrize("groups, distinct", [(1, 1), (2, 2), (4, 4)])
def test_layers_scope_compiles_each_distinct_layer_not_the_encoder(groups, distinct):
    torch.manual_seed(0)
    cfg = tiny(num_hidden_layers=4, num_hidden_groups=groups)
    model = EncoderForPretraining(cfg)
    layers = distinct_layers(model.encoder)
    assert len(layers) == distinct
    assert len(list(model.encoder.layer_applications())) == 4
    names = list(model.state_dict())
    compile_encoder(model, "aot_eager", scope="layers")
    assert model.encoder._compiled_call_impl is None  # embeddings, maps, pooler: eager
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert list(model.state_dict()) == names  # checkpoints and releases see the same keys


@pytest.mark.unit
def test_layers_scope_needs_layers():
    with pytest.raises(ValueError, match=r"engine\.compile_scope=layers: Linear has no layer"):
        compile_encoder(torch.nn.Linear(2, 2), "aot_eager", scope="layers")
    with pytest.raises(ValueError, match=r"engine\.compile_scope='all' is invalid"):
        compile_encoder(EncoderForPretraining(tiny()), "aot_eager", scope="all")


# ---------------------------------------------------------------- integration


def traced_work(applications: int, scope: str) -> tuple[int, int]:
    """(graphs, operators captured) by TorchDynamo for one forward and backward of an encoder
    of one shared layer applied ``applications`` times."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny(num_hidden_layers=applications))
    compile_encoder(model, "aot_eager", scope=scope)
    forward_backward(model, *batch())
    forward_backward(model, *batch(seed=1))
    return counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]


@pytest.mark.integration
def test_layers_scope_traces_one_layer_whatever_the_depth(fresh_dynamo):
    graphs_2, captured_2 = traced_work(2, "layers")
    graphs_8, captured_8 = traced_work(8, "layers")
    assert graphs_2 == graphs_8 == 1
    assert captured_2 == captured_8
    # The control: the unrolled encoder traces every application.
    _, whole_2 = traced_work(2, "encoder")
    _, whole_8 = traced_work(8, "encoder")
    assert whole_8 > whole_2 + 5 * (captured_2 // 2)


@pytest.mark.integration
@pytest.mark.parametrize("family", ["softmax", "transject"])
def test_checkpointed_layer_compiles_once(fresh_dynamo, family):
    """Activation checkpointing recomputes each application in the backward, re-entering the
    forward's caches (orthogonal maps, fused Q/K/V weights) from outside the forward: the
    compiled layer must not be guarded on how deep those caches nest (it was compiled twice),
    and equals the eager checkpointed model."""
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny(family, num_hidden_layers=3))
    model.encoder.enable_activation_checkpointing()
    ids, mask = batch()

    def step(ids, mask):  # the whole model, as the trainer runs it (the heads nest a cache)
        model.zero_grad(set_to_none=True)
        model(ids, mask).logits.square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager = step(ids, mask)
    compile_encoder(model, "aot_eager", scope="layers")
    compiled = step(ids, mask)
    step(*batch(seed=1))
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.integration
def test_distinct_layers_beyond_the_recompile_limit_all_compile(fresh_dynamo):
    from torch._dynamo import config as dynamo_config

    layers = 10  # more than TorchDynamo's 8 compiled entries of one function
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny(num_hidden_layers=layers, num_hidden_groups=layers))
    ids, mask = batch()
    eager = forward_backward(model, ids, mask)
    # torch's defaults, restored after the test (the engine raises them for the process)
    with dynamo_config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        compile_encoder(model, "aot_eager", scope="layers")
        assert dynamo_config.recompile_limit == COMPILES_PER_LAYER * layers
        compiled = forward_backward(model, ids, mask)
    assert counters["stats"]["unique_graphs"] == layers  # none fell back to eager
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.integration
@pytest.mark.parametrize("family", ["softmax", "tisa", "kernel", "transject"])
def test_layers_scope_equals_eager_every_family(fresh_dynamo, family):
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny(family, num_hidden_layers=3))
    ids, mask = batch()
    eager = forward_backward(model, ids, mask)
    compile_encoder(model, "aot_eager", scope="layers")
    compiled = forward_backward(model, ids, mask)
    assert not dict(counters["graph_break"]), dict(counters["graph_break"])
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("compile_scope"))


@pytest.fixture(scope="module")
def eager(shards, tmp_path_factory):
    """The eager reference runs, once per (family, overrides) (softmax's serves both its
    backends)."""
    return eager_runs(shards, tmp_path_factory)


@pytest.mark.integration
@pytest.mark.parametrize(
    "family, backend",
    [
        ("softmax", "aot_eager"),
        ("transject", "aot_eager"),
        pytest.param("softmax", "inductor", marks=pytest.mark.slow),
        pytest.param("kernel", "inductor", marks=pytest.mark.slow),
    ],
)
def test_trainer_with_layers_scope_equals_eager(
    shards, eager, tmp_path, monkeypatch, capsys, family, backend
):
    """The real trainer on DeepSpeed (ZeRO-0, fp32, activation checkpointing on, so that the
    checkpointed applications call the compiled layer), 4 steps: the same losses and gradient
    norms as eager, no graph break, and the start-up line names the scope."""
    one_process_rendezvous(monkeypatch)
    extra = ["engine.zero_stage=0", "engine.activation_checkpointing=true"]
    reference = eager(family, extra)
    seen: dict = {}
    compiled, graphs, breaks = run_trainer(
        shards,
        tmp_path / "layers",
        family,
        [*extra, "engine.compile_scope=layers"],
        compiled=True,
        backend=backend,
        seen=seen,
        check_compiled=False,
    )
    encoder = seen["engine"].module.encoder
    assert encoder._compiled_call_impl is None
    assert all(layer._compiled_call_impl is not None for layer in distinct_layers(encoder))
    assert "mode default, scope layers)" in capsys.readouterr().err
    assert not breaks, breaks
    assert 2 <= graphs <= 5, graphs  # the layer's, the loss terms'
    tol = 1e-5 if backend == "aot_eager" else 1e-4
    torch.testing.assert_close(compiled, reference, rtol=tol, atol=tol)
