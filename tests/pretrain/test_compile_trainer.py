"""`engine.compile=true` in the real trainer: the DeepSpeed engine (the shipped setting, ZeRO-0,
and ZeRO-2) around an encoder compiled in place, with the loss terms compiled beside it, for
every attention family.

The compiled runs use the ``aot_eager`` backend (Dynamo's capture and AOTAutograd's joint
graph, the parts where a model breaks) and, in the slow tier, ``inductor`` itself (its C++
code generation on the CPU, about 50 s for the four families; its Triton code generation on a
GPU is checked by ``tests/bench/test_gpu_fast_paths.py``, ``-m gpu``). In fp32 each step's loss and
gradient norm must equal the eager run's to round-off (1e-5 with aot_eager; 1e-4 with
inductor, whose fused kernels sum in another order: 2.4e-5 seen), with no graph break; under
``bf16-mixed`` the run must train to the eager run's losses within bf16 rounding. Masks: a batch without padding reaches
the model with no mask (``Engine.to_device``), a padded one with its mask, so a run sees both
kinds; the graph count stays bounded (mask or none, eval, one dynamic-shape recompile).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from pretrain_support import FAMILY, base_overrides, make_shards, one_process_rendezvous
from test_model_core import orthogonal_matrices
from torch._dynamo.utils import counters

import pretrain.train as train_module
from engine.metrics import read_jsonl
from engine.recipe import load_recipe
from model.orthogonal_step import OrthogonalMapHooks
from pretrain.config import pretrain_config
from pretrain.objective import objective_terms

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]
STEPS = 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("compile"))


def eager_runs(shards, tmp_path_factory):
    """`run`'s losses and gradient norms of the eager run of (family, overrides), run once
    per module: the reference that the aot_eager and the inductor cases of a family both
    compare with (a run is deterministic: the same numbers whichever test asks first)."""
    done: dict[tuple, list] = {}

    def eager(family: str, extra: list[str]) -> list:
        key = (family, tuple(extra))
        if key not in done:
            run_dir = tmp_path_factory.mktemp("eager")
            done[key] = run(shards, run_dir, family, extra, compiled=False)[0]
        return done[key]

    return eager


@pytest.fixture(scope="module")
def eager(shards, tmp_path_factory):
    return eager_runs(shards, tmp_path_factory)


def run(
    shards, run_dir, family, extra, compiled, backend="aot_eager", seen=None, check_compiled=True
):
    """(loss and gradient norm per step, graphs, graph breaks) of a STEPS-step run; `seen`, a
    dict, receives the trainer's engine; ``check_compiled``: that the encoder is compiled
    whole (the default ``engine.compile_scope``)."""
    torch._dynamo.reset()
    counters.clear()
    overrides = [
        *base_overrides(shards, run_dir, STEPS),
        *FAMILY[family],
        "model.hidden_dropout_prob=0.0",
        "model.attention_probs_dropout_prob=0.0",
        "data.verify_checksums=false",
        "train.export_at_end=false",
        f"engine.compile={'true' if compiled else 'false'}",
        f"engine.compile_backend={backend}",
        *extra,
    ]
    trainer = train_module.Trainer(pretrain_config(load_recipe(None, overrides)))
    if compiled and check_compiled:
        assert trainer.engine.module.encoder._compiled_call_impl is not None
    if compiled:
        # the loss terms too, compiled lazily (their graph is one of those counted below)
        assert trainer.objective_terms._torchdynamo_orig_callable is objective_terms
    if seen is not None:
        seen["engine"] = trainer.engine
    result = trainer.run()
    assert result.state == "completed" and result.step == STEPS
    rows = read_jsonl(run_dir / "tensorboard")
    losses = [[rows[s]["loss/total"], rows[s]["optim/grad_norm"]] for s in range(1, STEPS + 1)]
    graphs = counters["stats"]["unique_graphs"]
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    return losses, graphs, breaks


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", ["softmax", "tisa", "kernel", "transject"])
def test_compiled_trainer_equals_eager_zero0_fp32(
    shards, eager, tmp_path, monkeypatch, family, backend
):
    one_process_rendezvous(monkeypatch)
    extra = ["engine.zero_stage=0"]
    reference = eager(family, extra)
    compiled, graphs, breaks = run(
        shards, tmp_path / "compiled", family, extra, compiled=True, backend=backend
    )
    assert not breaks, breaks
    assert 2 <= graphs <= 5, graphs  # the encoder's, the loss terms'
    tol = 1e-5 if backend == "aot_eager" else 1e-4
    torch.testing.assert_close(compiled, reference, rtol=tol, atol=tol)


def test_compiled_trainer_zero2_bf16_mixed(shards, tmp_path, monkeypatch, capsys):
    one_process_rendezvous(monkeypatch)
    extra = ["engine.zero_stage=2", "engine.precision=bf16-mixed", "optimizer.name=lamb"]
    eager, _, _ = run(shards, tmp_path / "eager", "softmax", extra, compiled=False)
    assert "encoder compiled" not in capsys.readouterr().err
    compiled, graphs, breaks = run(shards, tmp_path / "compiled", "softmax", extra, compiled=True)
    # The run says that its first steps pay the compilation, and how to turn it off.
    said = capsys.readouterr().err
    assert (
        "pretrain: encoder and loss terms compiled (engine.compile=true, aot_eager, mode default, scope encoder)"
        in said
    )
    assert "engine.compile=false turns it off" in said
    assert not breaks, breaks
    assert 2 <= graphs <= 5, graphs  # the encoder's, the loss terms'
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)


def test_compiled_transject_keeps_its_maps_once_per_step(shards, tmp_path, monkeypatch):
    """TransJect compiled under DeepSpeed ZeRO-2 with gradient accumulation: the engine maps the
    orthogonal weights once per optimizer step, eagerly, before the compiled encoder (the step
    cache stays on under compile), and the run equals the eager run."""
    one_process_rendezvous(monkeypatch)
    extra = ["engine.zero_stage=2", "engine.gradient_accumulation_steps=2", "optimizer.name=lamb"]
    eager, _, _ = run(shards, tmp_path / "eager", "transject", extra, compiled=False)
    seen: dict = {}
    compiled, graphs, breaks = run(
        shards, tmp_path / "compiled", "transject", extra, compiled=True, seen=seen
    )
    (hooks,) = [h for h in seen["engine"].step_hooks if isinstance(h, OrthogonalMapHooks)]
    steps = hooks.steps
    assert steps is not None
    assert steps.evaluations == STEPS * orthogonal_matrices(seen["engine"].module)
    assert not breaks, breaks
    assert 2 <= graphs <= 5, graphs  # the encoder's, the loss terms'
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
