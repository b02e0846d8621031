"""The keys under which a new process finds compiled graphs in the compiler's cache
(`engine.compile_cache_dir`): the same in every process for the same model and code, and
different when the code differs.

Entries of the forward's cache (orthogonal matrices, fused Q/K/V weights) are keyed by the
module's name in the model, not its id (`model.orthogonal.forward_cache_key`): a compiled graph
that reads an entry made before it runs records the key among its inputs' sources, which
AOTAutograd hashes, so id keys (memory addresses) made every new process miss. The engine also
lets AOTAutograd cache graphs holding custom autograd Functions (TransJect's); a Function whose
backward changed must then not be served from the cache. Both are checked across real
processes (the only place ids differ for sure), with Inductor on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.engine import compile_encoder
from model import EncoderConfig, EncoderForPretraining
from model.orthogonal import (
    evaluate_orthogonal_maps,
    forward_cache_key,
    name_forward_cache_keys,
    orthogonal_cache,
    orthogonal_modules,
)

REPO = Path(__file__).resolve().parents[2]


def tiny(attention: str, **kw) -> EncoderConfig:
    if attention == "transject":
        kw.setdefault("transject", {"num_experts": 2})
    return EncoderConfig.preset("debug", attention=attention, num_hidden_layers=2, **kw)


# ---------------------------------------------------------------- unit


@pytest.mark.unit
def test_keys_are_ids_until_named_then_names_unique_in_the_model():
    model = EncoderForPretraining(tiny("transject", num_hidden_groups=2))
    modules = list(model.modules())
    assert all(forward_cache_key(m) == id(m) for m in modules)
    name_forward_cache_keys(model)
    keys = [forward_cache_key(m) for m in modules]
    assert all(isinstance(k, str) for k in keys)
    assert len(set(keys)) == len(keys)  # never two modules on one entry
    assert forward_cache_key(model) == "<EncoderForPretraining>"
    (_, first, name), *_ = orthogonal_modules(model)
    assert forward_cache_key(first.parametrizations[name][0]) == (
        "encoder.groups.0.0.attention.parametrizations.expert_u.0"
    )
    # a second model of the same build has the same keys: what a new process would see
    again = EncoderForPretraining(tiny("transject", num_hidden_groups=2))
    name_forward_cache_keys(again)
    assert [forward_cache_key(m) for m in again.modules()] == keys


@pytest.mark.unit
def test_compiling_names_the_model_and_the_caches_use_the_names():
    torch.manual_seed(0)
    model = EncoderForPretraining(tiny("transject"))
    compile_encoder(model, "aot_eager")  # lazy: nothing compiles before a forward
    maps = [m.parametrizations[n][0] for _, m, n in orthogonal_modules(model)]
    with orthogonal_cache() as store:
        evaluate_orthogonal_maps(model, store)
    assert set(store) == {forward_cache_key(m) for m in maps}
    assert all(isinstance(k, str) for k in store)


# ---------------------------------------------------------------- across processes

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    from engine.engine import compile_encoder, use_compile_cache
    from model import EncoderConfig, EncoderForPretraining

    use_compile_cache(sys.argv[1])
    kind = sys.argv[2]
    torch.manual_seed(0)
    if kind == "layers":
        # the fused Q/K/V weights are made before each compiled layer: inputs read from the
        # forward's cache
        cfg = EncoderConfig.preset("debug", attention="softmax", num_hidden_layers=2,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = EncoderForPretraining(cfg)
        compile_encoder(model, "inductor", scope="layers")
        ids = torch.randint(4, 300, (2, 16))
        out = model.encoder(ids, torch.ones_like(ids, dtype=torch.bool))
        out.last_hidden_state.square().mean().backward()
        result = float(model.encoder.embeddings.word_embeddings.weight.grad.abs().sum())
    else:
        # a custom autograd Function whose backward's code is written per process
        from engine.compile import _widen_autograd_cache

        class Scaled(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2.0

            @staticmethod
            def backward(ctx, g):
                return g * __SCALE__

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.ones(8))

            def forward(self, x):
                return Scaled.apply(x * self.w).sum()

        net = Net()
        _widen_autograd_cache("inductor")  # as compile_encoder does
        net.compile(backend="inductor")
        net(torch.arange(8.0)).backward()  # d/dw = x * scale: sum 28 * scale
        result = float(net.w.grad.sum())
    print(json.dumps({"result": result, **counters["aot_autograd"]}))
    """
)


def run_process(tmp_path: Path, cache: Path, kind: str, scale: str = "1.0") -> dict:
    """Runs SCRIPT in a new process (its Function's backward scaling by ``scale``)."""
    script = tmp_path / "cache_key_process.py"
    script.write_text(SCRIPT.replace("__SCALE__", scale))
    done = subprocess.run(
        [sys.executable, str(script), str(cache), kind],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.integration
def test_a_new_process_finds_the_graphs_of_layers_reading_the_cache(tmp_path):
    cache = tmp_path / "cache"
    cold = run_process(tmp_path, cache, "layers")
    assert cold.get("autograd_cache_miss", 0) >= 1 and not cold.get("autograd_cache_hit"), cold
    warm = run_process(tmp_path, cache, "layers")
    assert warm.get("autograd_cache_hit", 0) == cold["autograd_cache_miss"], warm
    assert not warm.get("autograd_cache_miss") and not warm.get("autograd_cache_bypass"), warm
    assert warm["result"] == cold["result"]


@pytest.mark.integration
def test_a_changed_custom_function_is_not_served_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    one = run_process(tmp_path, cache, "function")
    assert one["result"] == 28.0 and one.get("autograd_cache_saved", 0) >= 1, one
    same = run_process(tmp_path, cache, "function")
    assert same["result"] == 28.0 and same.get("autograd_cache_hit", 0) >= 1, same
    changed = run_process(tmp_path, cache, "function", "3.0")
    assert changed["result"] == 84.0, changed  # the new backward ran, not the cached one
    assert not changed.get("autograd_cache_hit"), changed
