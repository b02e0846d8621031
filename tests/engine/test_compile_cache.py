"""`engine.compile_cache_dir`: the compiler's caches in a folder of the run's choosing, so that a
new process (a resumed or requeued job on another node, the next phase, another fine-tuning
task) loads the compiled graphs instead of compiling them again.

The trainer test runs the real trainer (DeepSpeed, one rank) with the real Inductor backend
(its C++ code generation on the CPU): a first run compiles into an empty folder, a second run
of the same model in a new run directory loads every graph from it and compiles none, and a
third run pointed at another empty folder compiles again (so the loads are the folder's doing,
not a cache kept in memory by the process). The other tests check the key itself: the
environment it sets, a path that cannot be used refused at once, naming the key.
"""

from __future__ import annotations

import os
import time

import pytest
import torch._dynamo
from pretrain_support import FAMILY, base_overrides, make_shards, one_process_rendezvous
from test_glue_finetune import tiny_release, tokenizer_file, write_sst2  # noqa: F401

import pretrain.train as train_module
from engine.engine import EngineConfig, use_compile_cache
from engine.metrics import read_jsonl
from engine.recipe import load_recipe
from finetune.__main__ import main as finetune_main
from pretrain.config import RESUMABLE_CHANGES, pretrain_config

CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@pytest.fixture
def cache_env(monkeypatch):
    """Restores the two variables after the test (the engine sets them for its process)."""
    for name in CACHE_VARS:
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)


@pytest.mark.unit
def test_the_folder_is_made_and_the_process_pointed_at_it(tmp_path, cache_env, monkeypatch):
    monkeypatch.setenv("ALBATROSS_TEST_ROOT", str(tmp_path))
    folder = use_compile_cache("$ALBATROSS_TEST_ROOT/shared/inductor")
    assert folder == tmp_path / "shared" / "inductor"
    assert (folder / "triton").is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")


@pytest.mark.unit
def test_null_leaves_torch_to_choose_and_creates_nothing(tmp_path, cache_env, monkeypatch):
    chosen = tmp_path / "users-own"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(chosen))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert use_compile_cache(None) == chosen
    assert not chosen.exists()
    assert "TRITON_CACHE_DIR" not in os.environ


@pytest.mark.unit
def test_an_unusable_path_is_refused_at_once_naming_the_key(tmp_path, cache_env):
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"engine\.compile_cache_dir=.*cannot create"):
        use_compile_cache(str(a_file / "cache"))
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        (locked / "triton").mkdir(mode=0o500)
        with pytest.raises(ValueError, match=r"engine\.compile_cache_dir=.*not writable"):
            use_compile_cache(str(locked))
    assert time.perf_counter() - started < 5
    assert a_file.read_text() == "x"  # nothing written over


@pytest.mark.unit
@pytest.mark.parametrize("value", ["", "  ", 3])
def test_an_empty_or_wrong_typed_value_is_a_config_error(value):
    with pytest.raises(ValueError, match=r"engine\.compile_cache_dir="):
        EngineConfig(compile_cache_dir=value)


@pytest.mark.unit
def test_a_resumed_run_may_change_it():
    from finetune.trainer import RESUMABLE_KEYS

    assert "engine.compile_cache_dir" in RESUMABLE_CHANGES
    assert "engine.compile_cache_dir" in RESUMABLE_KEYS


def _run(shards, run_dir, cache, capsys, family="softmax", extra=()) -> tuple[dict, str]:
    """A 2-step compiled run; (graphs loaded / compiled by Inductor, the cache line it logged)."""
    torch._dynamo.reset()
    overrides = [
        *base_overrides(shards, run_dir, 2),
        *FAMILY[family],
        *extra,
        "data.verify_checksums=false",
        "train.export_at_end=false",
        "engine.compile=true",
        "engine.compile_backend=inductor",
        f"engine.compile_cache_dir={cache}",
    ]
    trainer = train_module.Trainer(pretrain_config(load_recipe(None, overrides)))
    result = trainer.run()
    assert result.state == "completed"
    counts = trainer.engine.compile_cache_activity()
    rows = read_jsonl(run_dir / "tensorboard")
    counts["losses"] = [rows[step]["loss/total"] for step in sorted(rows)]
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "compiler cache" in line]
    torch._dynamo.reset()
    return counts, (lines[-1] if lines else "")


@pytest.mark.integration
@pytest.mark.slow
def test_a_second_run_loads_every_graph_from_the_folder(tmp_path, monkeypatch, cache_env, capsys):
    one_process_rendezvous(monkeypatch)
    shards = make_shards(tmp_path / "data")
    shared = tmp_path / "shared-cache"
    first, first_line = _run(shards, tmp_path / "run1", shared, capsys)
    assert first["compiled"] >= 1 and first["loaded"] == 0, first
    assert any((shared / "fxgraph").rglob("*")), "nothing written into the folder"
    assert f"compiler cache {shared}" in first_line and "0 graph(s) loaded" in first_line

    second, second_line = _run(shards, tmp_path / "run2", shared, capsys)
    assert second["loaded"] == first["compiled"] and second["compiled"] == 0, (first, second)
    assert second["losses"] == first["losses"]  # the same code
    # softmax's graphs switch autocast nowhere: AOTAutograd's joint graphs load too
    assert second["joint_loaded"] >= 1 and second["joint_traced"] == 0, second
    assert f"{second['loaded']} graph(s) loaded from it, 0 compiled" in second_line

    other = tmp_path / "other-cache"  # the control: the loads came from the folder
    third, _ = _run(shards, tmp_path / "run3", other, capsys)
    assert third["loaded"] == 0 and third["compiled"] == first["compiled"], third


@pytest.mark.integration
@pytest.mark.slow
def test_graphs_that_switch_autocast_inside_load_whole(tmp_path, monkeypatch, cache_env, capsys):
    """Kernel attention's fp32 products switch autocast off inside the graph, under the run's
    bf16 autocast: AOTAutograd's cache, which torch leaves such graphs out of, keeps them too
    (``engine.engine._widen_autograd_cache``), and the warm run computes what the cold one
    did."""
    one_process_rendezvous(monkeypatch)
    shards = make_shards(tmp_path / "data")
    shared, bf16 = tmp_path / "shared-cache", ["engine.precision=bf16-mixed"]
    cold, _ = _run(shards, tmp_path / "run1", shared, capsys, "kernel", bf16)
    assert cold["joint_traced"] >= 1 and cold["joint_loaded"] == 0, cold
    warm, _ = _run(shards, tmp_path / "run2", shared, capsys, "kernel", bf16)
    assert warm["compiled"] == 0 and warm["loaded"] == cold["compiled"], (cold, warm)
    assert warm["joint_traced"] == 0 and warm["joint_loaded"] == cold["joint_traced"], warm
    assert len(cold["losses"]) == 2 and warm["losses"] == cold["losses"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(
    "family, scope",
    [("transject", "encoder"), ("softmax", "layers")],
    ids=["transject-encoder", "softmax-layers"],
)
def test_graphs_reading_the_forward_cache_load_whole(
    tmp_path, monkeypatch, cache_env, capsys, family, scope
):
    """Graphs that take entries of the forward's cache as inputs (TransJect's orthogonal maps,
    evaluated by the engine before the compiled encoder; with ``compile_scope: layers`` the
    fused Q/K/V weights, made before each compiled layer), and TransJect's custom autograd
    Functions: the second run, a new model, loads AOTAutograd's joint graphs too. Before the
    cache's keys were module names (`model.orthogonal.forward_cache_key`) they were ids, part
    of the graph's key, and the joint graphs were traced again; TransJect's were also left out
    of the cache for their Functions (`engine.engine._widen_autograd_cache`)."""
    one_process_rendezvous(monkeypatch)
    shards = make_shards(tmp_path / "data")
    shared, extra = tmp_path / "shared-cache", [f"engine.compile_scope={scope}"]
    cold, _ = _run(shards, tmp_path / "run1", shared, capsys, family, extra)
    assert cold["joint_traced"] >= 1 and cold["joint_loaded"] == 0, cold
    warm, _ = _run(shards, tmp_path / "run2", shared, capsys, family, extra)
    assert warm["compiled"] == 0 and warm["loaded"] == cold["compiled"], (cold, warm)
    assert warm["joint_traced"] == 0 and warm["joint_loaded"] == cold["joint_traced"], warm
    assert len(cold["losses"]) == 2 and warm["losses"] == cold["losses"]


@pytest.mark.integration
def test_a_compiled_fine_tuning_run_logs_its_first_step_and_the_cache(
    tmp_path,
    cache_env,
    capsys,
    tokenizer_file,  # noqa: F811  (test_glue_finetune's fixture)
):
    release = tiny_release(tmp_path / "release", tokenizer_file)
    cache = tmp_path / "shared-cache"
    torch._dynamo.reset()
    args = ["glue", "--task", "sst2", "--data", str(write_sst2(tmp_path / "glue")),
            "--init", str(release)]  # fmt: skip
    overrides = [
        "schedule.warmup_steps=1",
        "schedule.total_steps=3",
        "train.eval_every=3",
        "engine.micro_batch_size=8",
        "engine.precision=fp32",
        "engine.compile=true",
        "engine.compile_backend=aot_eager",
        f"engine.compile_cache_dir={cache}",
        "data.max_length=32",
        f"train.run_dir={tmp_path / 'runs'}",
    ]
    assert finetune_main([*args, *overrides, "--seeds", "0", "--lrs", "0.002"]) == 0
    torch._dynamo.reset()
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("finetune: first step")]
    assert f"compiler cache {cache} (engine.compile_cache_dir)" in line, line
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
