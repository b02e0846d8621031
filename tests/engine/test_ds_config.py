"""Bring your own DeepSpeed config (``engine.deepspeed_config: ds_config.json``,
``engine/ds_config.py``): merged over the generated config with ``engine.deepspeed`` over it;
``"auto"`` takes the recipe's value; every key that contradicts the recipe is listed in one
error with both values (exit 2 at start-up); a missing or invalid file is an error naming it.
The config-level tests run in process (the DeepSpeed config dict is built without starting
DeepSpeed); one pretraining run hands a file to DeepSpeed for real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from data_prep.format import sha256_file
from engine.distributed import DistEnv
from engine.engine import Engine, EngineConfig
from engine.optim import OptimizerConfig, ScheduleConfig

REPO = Path(__file__).resolve().parents[2]
ONE = DistEnv.single()

# A tuned file in the style users bring (Hugging Face's "auto" placeholders included).
TUNED = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": "auto",
        "overlap_comm": True,
        "reduce_bucket_size": "auto",
        "allgather_bucket_size": 50000000,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
}


def write(tmp_path: Path, data, name: str = "ds_config.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data, indent=2))
    return str(path)


def generated(**kw) -> dict:
    """The DeepSpeed config an engine with ``EngineConfig(backend="deepspeed", **kw)`` passes
    to ``deepspeed.initialize`` (built on a torch-backend engine: no DeepSpeed start)."""
    engine = Engine(
        nn.Linear(2, 2),
        EngineConfig(backend="torch", device="cpu", precision="fp32"),
        OptimizerConfig(name="adamw", lr=1e-3),
        ScheduleConfig(warmup_steps=0, total_steps=10),
        dist=ONE,
    )
    engine.cfg = EngineConfig(backend="deepspeed", **kw)
    return engine.deepspeed_config()


# ----------------------------------------------------------------------------- merge and auto


def test_a_tuned_file_is_merged_and_auto_takes_the_recipes_values(tmp_path):
    path = write(tmp_path, TUNED)
    recipe = {"zero_stage": 2, "micro_batch_size": 8, "gradient_accumulation_steps": 2}
    without = generated(**recipe)
    cfg = generated(**recipe, deepspeed_config=path)
    for key in (
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    ):
        assert cfg[key] == without[key], key  # "auto": the recipe's (the generated) value
    assert cfg["zero_optimization"]["stage"] == 2
    assert "reduce_bucket_size" not in cfg["zero_optimization"]  # "auto": DeepSpeed's default
    assert cfg["zero_optimization"]["overlap_comm"] is True  # the file's own keys merged
    assert cfg["zero_optimization"]["allgather_bucket_size"] == 50000000
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert cfg["steps_per_print"] == 100
    # ours are objects; precision sections of another precision dropped; no train_batch_size
    for key in ("optimizer", "scheduler", "bf16", "fp16", "train_batch_size"):
        assert key not in cfg, key
    assert cfg["torch_autocast"]["enabled"] is True  # bf16-mixed: the engine's section stands


def test_values_that_agree_with_the_recipe_are_accepted(tmp_path):
    path = write(
        tmp_path,
        {
            "train_batch_size": 16,  # 8 x 2 x 1 process
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 1},
            "bf16": {"enabled": True},
            "fp16": {"enabled": False, "loss_scale": 128},  # disabled: its keys are moot
            "torch_autocast": {"enabled": False},
        },
    )
    kw = {"zero_stage": 1, "precision": "bf16", "micro_batch_size": 8}
    cfg = generated(**kw, gradient_accumulation_steps=2, deepspeed_config=path)
    assert cfg["bf16"] == {"enabled": True}
    assert cfg["gradient_clipping"] == 1.0 and cfg["zero_optimization"]["stage"] == 1
    assert "fp16" not in cfg and "torch_autocast" not in cfg
    config = EngineConfig(backend="deepspeed", **kw, gradient_accumulation_steps=2)
    assert config.deepspeed_overrides() == {}
    # the given train_batch_size is checked against the number of processes at start-up
    with_file = EngineConfig(
        backend="deepspeed", **kw, gradient_accumulation_steps=2, deepspeed_config=path
    )
    assert with_file.deepspeed_overrides(world_size=1) == {}
    with pytest.raises(ValueError, match=r"train_batch_size=16 vs .* 8 x 2 x 2 = 32"):
        with_file.deepspeed_overrides(world_size=2)


def test_fp16_settings_that_agree_are_accepted(tmp_path):
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 2}
    path = write(tmp_path, {"fp16": {**fp16, "consecutive_hysteresis": True}})
    cfg = generated(precision="fp16", fp16_initial_scale_power=12, deepspeed_config=path)
    assert cfg["fp16"]["initial_scale_power"] == 12
    assert cfg["fp16"]["consecutive_hysteresis"] is True  # not the recipe's: merged


def test_the_inline_section_goes_over_the_file(tmp_path):
    path = write(
        tmp_path, {"zero_optimization": {"overlap_comm": True, "round_robin_gradients": True}}
    )
    cfg = generated(
        zero_stage=2,
        deepspeed_config=path,
        deepspeed={"zero_optimization": {"overlap_comm": False}, "gradient_clipping": "auto"},
    )
    assert cfg["zero_optimization"] == {
        "stage": 2,
        "overlap_comm": False,
        "round_robin_gradients": True,
    }


def test_resolved_reads_the_file_once_and_allows_another_accumulation(tmp_path):
    """A resume on another number of processes keeps the global batch by changing the
    accumulation: the file (checked against the recipe's) must not be checked again."""
    path = write(tmp_path, {"gradient_accumulation_steps": 2, "train_batch_size": 32})
    cfg = EngineConfig(
        backend="deepspeed", micro_batch_size=8, gradient_accumulation_steps=2,
        deepspeed_config=path,
    )  # fmt: skip
    resolved = cfg.resolved()
    assert resolved.deepspeed_config is None
    Path(path).unlink()  # not read again
    import dataclasses

    four = dataclasses.replace(resolved, gradient_accumulation_steps=4)
    assert four.deepspeed_overrides(world_size=1) == {}  # 8 x 4 x 1 = 32


# ----------------------------------------------------------------------------- conflicts


@pytest.mark.parametrize(
    ("content", "recipe", "expected"),
    [
        ({"train_micro_batch_size_per_gpu": 16}, {}, "train_micro_batch_size_per_gpu=16 vs engine.micro_batch_size=32"),
        ({"gradient_accumulation_steps": 4}, {}, "gradient_accumulation_steps=4 vs engine.gradient_accumulation_steps=1"),
        ({"train_batch_size": 48}, {}, "train_batch_size=48 vs engine.micro_batch_size x engine.gradient_accumulation_steps x processes = 32 x 1 x N"),
        ({"gradient_clipping": 0.5}, {}, "gradient_clipping=0.5 vs engine.gradient_clipping=1.0"),
        ({"zero_optimization": {"stage": 3}}, {"zero_stage": 2}, "zero_optimization.stage=3 vs engine.zero_stage=2"),
        ({"bf16": {"enabled": True}}, {}, "bf16.enabled=true vs engine.precision='bf16-mixed'"),
        ({"bf16": {"enabled": False}}, {"precision": "bf16"}, "bf16.enabled=false vs engine.precision='bf16'"),
        ({"fp16": {"enabled": True}}, {"precision": "fp32"}, "fp16.enabled=true vs engine.precision='fp32'"),
        ({"fp16": {"loss_scale": 1024}}, {"precision": "fp16"}, "fp16.loss_scale=1024 vs 0"),
        ({"fp16": {"loss_scale_window": 500}}, {"precision": "fp16"}, "fp16.loss_scale_window=500 vs engine.fp16_loss_scale_window=1000"),
        ({"amp": {"enabled": True}}, {}, "amp.enabled=true vs engine.precision"),
        ({"torch_autocast": {"enabled": True}}, {"precision": "fp32"}, "torch_autocast.enabled=true vs engine.precision='fp32'"),
        ({"torch_autocast": {"dtype": "float16"}}, {}, "torch_autocast.dtype=\"float16\" vs engine.precision='bf16-mixed'"),
        ({"optimizer": {"type": "Adam", "params": {"lr": 0.001}}}, {}, "optimizer.params.lr=0.001 vs the recipe's optimizer.lr"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}, {}, "scheduler.params.warmup_num_steps=100 vs the recipe's schedule.warmup_steps"),
    ],
)  # fmt: skip
def test_each_conflict_is_named_with_both_values(tmp_path, content, recipe, expected):
    path = write(tmp_path, content)
    with pytest.raises(ValueError) as error:
        EngineConfig(backend="deepspeed", deepspeed_config=path, **recipe)
    message = str(error.value)
    assert expected in message, message
    assert path in message  # which file


def test_every_conflict_is_listed_in_one_error(tmp_path):
    path = write(
        tmp_path,
        {
            "train_micro_batch_size_per_gpu": 16,
            "gradient_clipping": 0.5,
            "zero_optimization": {"stage": 3, "overlap_comm": True},
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": "auto"}},
        },
    )
    with pytest.raises(ValueError, match=r"in 6 key\(s\)") as error:
        EngineConfig(
            backend="deepspeed",
            zero_stage=2,
            deepspeed_config=path,
            deepspeed={"gradient_accumulation_steps": 3},
        )
    message = str(error.value)
    for key in (
        "train_micro_batch_size_per_gpu=16",
        "gradient_clipping=0.5",
        "zero_optimization.stage=3",
        "bf16.enabled=true",
        "optimizer.params.lr=3e-05",
        "engine.deepspeed: gradient_accumulation_steps=3",
    ):
        assert key in message, (key, message)
    assert "betas" not in message  # "auto"


# ----------------------------------------------------------------------------- bad files


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no such file"),
        ('{"train_batch_size": 8,}', "not valid JSON (Expecting property name"),
        ('{"zero_optimization": {"stage": 1}, "zero_optimization": {}}', "'zero_optimization' appears twice"),
        ("[1, 2]", "a DeepSpeed config is a JSON object"),
        ("", "not valid JSON"),
    ],
)  # fmt: skip
def test_a_missing_or_invalid_file_is_an_error_naming_it(tmp_path, content, expected):
    path = str(tmp_path / "ds_config.json") if content is None else write(tmp_path, content)
    with pytest.raises(ValueError, match=r"engine\.deepspeed_config") as error:
        EngineConfig(backend="deepspeed", deepspeed_config=path)
    assert path in str(error.value) and expected in str(error.value), str(error.value)


def test_a_directory_and_the_torch_backend_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        EngineConfig(backend="deepspeed", deepspeed_config=str(tmp_path))
    path = write(tmp_path, {})
    with pytest.raises(ValueError, match=r"needs engine\.backend='deepspeed'"):
        EngineConfig(backend="torch", deepspeed_config=path)


@pytest.mark.integration
def test_the_cli_exits_2_at_start_up(tmp_path):
    path = write(tmp_path, {"gradient_clipping": 3.0, "zero_optimization": {"stage": 3}})
    base = [sys.executable, "-m", "pretrain", "--config", str(REPO / "configs/pretrain/debug.yaml")]
    for bad, expected in (
        (path, ["gradient_clipping=3.0 vs engine.gradient_clipping=1.0", "zero_optimization.stage=3"]),
        (str(tmp_path / "missing.json"), ["missing.json", "no such file"]),
    ):  # fmt: skip
        proc = subprocess.run(
            [*base, f"engine.deepspeed_config={bad}", "--print-config"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        for text in expected:
            assert text in proc.stderr, proc.stderr[-2000:]


@pytest.mark.integration
def test_deepspeed_trains_with_the_file(tmp_path):
    """One DeepSpeed process, ZeRO-1, with a file of "auto" values, a bucket size and a
    train_batch_size: it trains, and DeepSpeed's own record of its config (saved in the
    checkpoint) holds the file's values merged with the recipe's."""
    from pretrain_support import base_overrides, env, make_shards

    shards = make_shards(tmp_path / "data")
    path = write(
        tmp_path,
        {
            "train_batch_size": 4,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 123456},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        },
    )
    run_dir = tmp_path / "run"
    overrides = [
        *base_overrides(shards, run_dir, 2),
        "engine.zero_stage=1",
        f"engine.deepspeed_config={path}",
        "train.checkpoint_every=2",
    ]
    run_env = {k: v for k, v in env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "pretrain", "--config", str(REPO / "configs/pretrain/debug.yaml")]
    proc = subprocess.run(
        [*cmd, *overrides], cwd=REPO, env=run_env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    states = next((run_dir / "checkpoints").glob("step_*/mp_rank_00_model_states.pt"))
    saved = torch.load(states, map_location="cpu", weights_only=False)["ds_config"]
    assert saved["zero_optimization"]["reduce_bucket_size"] == 123456
    assert saved["zero_optimization"]["stage"] == 1
    assert saved["train_micro_batch_size_per_gpu"] == 4
    assert "optimizer" not in saved


def test_run_directories_from_before_the_new_keys_still_resume(tmp_path):
    """A pretraining run dir whose config.yaml has neither engine.deepspeed_config nor the
    tracker keys nor engine.compile_options resumes, and may set kernel attention's backends
    (model.kernel.inference_backend, training_backend); a fine-tuning run's identity without a
    file or Inductor options is what it was."""
    import copy

    from engine.recipe import to_yaml
    from engine.trackers import TRACKER_KEYS
    from finetune.trainer import run_identity
    from pretrain.config import pretrain_config
    from pretrain.train import check_run_dir

    resolved = pretrain_config({"data": {"shards": "x"}}).to_dict()
    saved = copy.deepcopy(resolved)
    del saved["engine"]["deepspeed_config"]
    del saved["engine"]["compile_options"]
    for key in TRACKER_KEYS:
        del saved["train"][key.split(".", 1)[1]]
    (tmp_path / "config.yaml").write_text(to_yaml(saved))
    assert check_run_dir(tmp_path, resolved) is True
    # Inductor's options change no result: a resumed run may set them (keys under a listed one)
    tuned = copy.deepcopy(resolved)
    tuned["engine"]["compile_options"] = {"max_autotune_gemm": True}
    assert check_run_dir(tmp_path, tuned) is True
    # nor do kernel attention's backends change the training trajectory (beyond rounding)
    tuned["model"]["kernel"] = {"inference_backend": "triton", "training_backend": "triton"}
    assert check_run_dir(tmp_path, tuned) is True
    tuned["model"]["kernel"]["feature_map"] = "glu"  # but the model's other keys do
    with pytest.raises(ValueError, match=r"model\.kernel\.feature_map"):
        check_run_dir(tmp_path, tuned)
    with_file = copy.deepcopy(resolved)
    with_file["engine"]["deepspeed_config"] = "ds_config.json"
    with pytest.raises(ValueError, match=r"engine\.deepspeed_config"):
        check_run_dir(tmp_path, with_file)
    old = {"engine": {"backend": "torch"}, "train": {"steps": 3}}
    new = {"engine": {"backend": "torch", "deepspeed_config": None}, "train": {"steps": 3}}
    assert run_identity(new, seed=0) == run_identity(old, seed=0)
    new["engine"]["compile_options"] = {}
    assert run_identity(new, seed=0) == run_identity(old, seed=0)
    new["engine"]["deepspeed_config"] = "ds_config.json"
    assert run_identity(new, seed=0) != run_identity(old, seed=0)


def test_a_file_edited_between_attempts_is_refused(tmp_path):
    """The run directory records the content of engine.deepspeed_config's file: an edited file
    is refused on resume (pretraining and fine-tuning), naming it; a run directory written
    before the content was recorded still resumes."""
    import copy

    from engine.recipe import to_yaml
    from finetune.trainer import check_run_identity, run_identity
    from pretrain.config import pretrain_config
    from pretrain.train import check_run_dir

    path = Path(write(tmp_path, {"zero_optimization": {"reduce_bucket_size": 1000}}))
    resolved = pretrain_config({"data": {"shards": "x"}}).to_dict()
    resolved["engine"]["deepspeed_config"] = str(path)
    resolved["data_identity"] = {"shards_sha256": "s", "tokenizer_sha256": "t"}
    older = copy.deepcopy(resolved)  # written before the file's content was recorded
    resolved["data_identity"]["deepspeed_config_sha256"] = sha256_file(path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(resolved))
    assert check_run_dir(run, resolved) is True
    edited = copy.deepcopy(resolved)
    edited["data_identity"]["deepspeed_config_sha256"] = "0" * 64
    with pytest.raises(ValueError, match=r"engine\.deepspeed_config names was edited"):
        check_run_dir(run, edited)
    (run / "config.yaml").write_text(to_yaml(older))
    assert check_run_dir(run, edited) is True

    config = {"engine": {"backend": "deepspeed", "deepspeed_config": str(path)}}
    identity = run_identity(config, seed=0)
    assert identity["engine"]["deepspeed_config_sha256"] == sha256_file(path)
    (run / "run.json").write_text(json.dumps(identity))
    assert check_run_identity(run, run_identity(config, seed=0)) is True
    path.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 2000}}))
    with pytest.raises(ValueError, match=r"engine\.deepspeed_config names was edited"):
        check_run_identity(run, run_identity(config, seed=0))
    del identity["engine"]["deepspeed_config_sha256"]  # a run from before: resumes
    (run / "run.json").write_text(json.dumps(identity))
    assert check_run_identity(run, run_identity(config, seed=0)) is True
