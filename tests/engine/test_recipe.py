"""engine.recipe (YAML recipes, defaults chains, dotted overrides) and pretrain.config."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.recipe import config_dict, diff_keys, load_recipe, to_yaml
from pretrain.config import PretrainConfig, pretrain_config

DEBUG = Path(__file__).parents[2] / "configs" / "pretrain" / "debug.yaml"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def minimal(**sections) -> dict:
    """The smallest valid pretraining recipe (data.shards is only a path string here)."""
    return {"data": {"shards": "shards", "max_seq_length": 64}, **sections}


# ----------------------------------------------------------------------------- load_recipe


def test_overrides_are_yaml_values(tmp_path):
    recipe = write(
        tmp_path / "r.yaml",
        "optimizer:\n  lr: 0.5\n  name: lamb\ntrain:\n  steps: 3\n  seed: 1\n",
    )
    data = load_recipe(
        recipe,
        [
            "optimizer.lr=1e-3",
            "train.steps=7",
            "train.progress=false",
            "optimizer.betas=[0.8, 0.95]",
            "train.time_budget_minutes=null",
            "new.nested.key=3",
            "engine.deepspeed.zero_optimization.offload_optimizer.device=cpu",
        ],
    )
    assert data["optimizer"] == {"lr": 1e-3, "name": "lamb", "betas": [0.8, 0.95]}
    assert isinstance(data["optimizer"]["lr"], float)
    assert data["train"] == {"steps": 7, "seed": 1, "progress": False, "time_budget_minutes": None}
    assert isinstance(data["train"]["steps"], int)
    assert data["new"] == {"nested": {"key": 3}}
    assert data["engine"]["deepspeed"] == {
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}}
    }


def test_no_recipe_is_only_overrides():
    assert load_recipe(None) == {}
    assert load_recipe(None, ["a.b=1", "a.c=x"]) == {"a": {"b": 1, "c": "x"}}
    assert load_recipe(None, ["a=1", "a=2"]) == {"a": 2}  # the last override wins


def test_later_override_of_a_section_replaces_a_value(tmp_path):
    recipe = write(tmp_path / "r.yaml", "model:\n  preset: debug\n  hidden_size: 64\n")
    data = load_recipe(recipe, ["model.hidden_size=32", "model.attention=tisa"])
    assert data["model"] == {"preset": "debug", "hidden_size": 32, "attention": "tisa"}


def test_defaults_chain(tmp_path):
    write(
        tmp_path / "base" / "grand.yaml",
        "optimizer:\n  lr: 1.0\n  eps: 1.0e-8\ntrain:\n  seed: 5\n",
    )
    # The parent's defaults path is relative to the parent, not to the child or the cwd.
    write(
        tmp_path / "base" / "parent.yaml",
        "defaults: grand.yaml\noptimizer:\n  lr: 2.0\n  name: adamw\ntrain:\n  log_every: 3\n",
    )
    child = write(
        tmp_path / "recipes" / "child.yaml",
        "defaults: ../base/parent.yaml\noptimizer:\n  lr: 3.0\ntrain:\n  seed: 6\n",
    )
    data = load_recipe(child)
    assert "defaults" not in data
    assert data["optimizer"] == {"lr": 3.0, "eps": 1e-8, "name": "adamw"}
    assert data["train"] == {"seed": 6, "log_every": 3}
    assert load_recipe(child, ["optimizer.lr=4.0"])["optimizer"]["lr"] == 4.0


def test_defaults_cycle_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", "defaults: b.yaml\nx: 1\n")
    write(tmp_path / "b.yaml", "defaults: a.yaml\ny: 1\n")
    with pytest.raises(ValueError, match="defaults"):
        load_recipe(tmp_path / "a.yaml")


def test_defaults_must_be_a_path(tmp_path):
    recipe = write(tmp_path / "r.yaml", "defaults: [a.yaml, b.yaml]\n")
    with pytest.raises(ValueError, match="defaults"):
        load_recipe(recipe)


def test_section_given_as_a_file(tmp_path):
    write(tmp_path / "model" / "x.yaml", "preset: debug\nattention: tisa\n")
    recipe = write(
        tmp_path / "pretrain" / "r.yaml",
        "model: ../model/x.yaml\ntrain:\n  run_dir: runs/x\n",
    )
    data = load_recipe(recipe, ["model.hidden_size=64"])
    assert data["model"] == {"preset": "debug", "attention": "tisa", "hidden_size": 64}
    assert data["train"] == {"run_dir": "runs/x"}


def test_section_file_of_a_parent_is_relative_to_the_parent(tmp_path):
    write(tmp_path / "model" / "x.yaml", "preset: debug\n")
    write(tmp_path / "pretrain" / "base.yaml", "model: ../model/x.yaml\n")
    child = write(
        tmp_path / "pretrain" / "variants" / "child.yaml",
        "defaults: ../base.yaml\nmodel:\n  attention: kernel\n",
    )
    assert load_recipe(child)["model"] == {"preset": "debug", "attention": "kernel"}


def test_missing_section_file_names_it(tmp_path):
    recipe = write(tmp_path / "r.yaml", "model: ../model/nope.yaml\n")
    with pytest.raises(ValueError, match=r"nope\.yaml"):
        load_recipe(recipe)


@pytest.mark.parametrize("override", ["foo", "=1", "=", "optimizer.lr"])
def test_bad_override_syntax(override):
    with pytest.raises(ValueError, match=r"dotted\.key=value"):
        load_recipe(None, [override])


@pytest.mark.parametrize("override", ["optimizer.betas=[0.9,", "model.kernel={a: 1"])
def test_malformed_override_value_is_a_value_error(override):
    with pytest.raises(ValueError):
        load_recipe(None, [override])


def test_missing_file_names_it(tmp_path):
    with pytest.raises(ValueError, match=r"absent\.yaml.*not found"):
        load_recipe(tmp_path / "absent.yaml")


@pytest.mark.parametrize("text", ["a: [1, 2\n", "a: b: c\n", "a:\n  - 1\n b: 2\n"])
def test_invalid_yaml_names_the_file(tmp_path, text):
    recipe = write(tmp_path / "broken.yaml", text)
    with pytest.raises(ValueError, match=r"broken\.yaml.*not valid YAML"):
        load_recipe(recipe)


def test_top_level_must_be_a_mapping(tmp_path):
    recipe = write(tmp_path / "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"list\.yaml.*mapping"):
        load_recipe(recipe)
    assert load_recipe(write(tmp_path / "empty.yaml", "")) == {}


def test_interpolation_is_resolved(tmp_path):
    recipe = write(
        tmp_path / "r.yaml",
        "model:\n  attention: softmax\n"
        "schedule:\n  total_steps: 100\n"
        "train:\n  run_dir: runs/${model.attention}\n  steps: ${schedule.total_steps}\n",
    )
    data = load_recipe(recipe)
    assert data["train"] == {"run_dir": "runs/softmax", "steps": 100}
    # Resolved after the overrides: an override changes what the interpolation gives.
    data = load_recipe(recipe, ["model.attention=tisa", "schedule.total_steps=7"])
    assert data["train"] == {"run_dir": "runs/tisa", "steps": 7}


def test_interpolation_across_defaults(tmp_path):
    write(tmp_path / "base.yaml", "train:\n  run_dir: runs/${name}\nname: base\n")
    child = write(tmp_path / "child.yaml", "defaults: base.yaml\nname: child\n")
    assert load_recipe(child)["train"]["run_dir"] == "runs/child"


def test_unresolvable_interpolation_is_a_value_error(tmp_path):
    recipe = write(tmp_path / "r.yaml", "a: ${nowhere.to.be.found}\n")
    with pytest.raises(ValueError, match="nowhere"):
        load_recipe(recipe)


# ----------------------------------------------------------------------------- PretrainConfig


def test_debug_recipe_with_overrides():
    cfg = pretrain_config(
        load_recipe(DEBUG, ["optimizer.lr=1e-3", "engine.zero_stage=2", "train.steps=5"])
    )
    assert isinstance(cfg, PretrainConfig)
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.name == "adamw"
    assert cfg.engine.zero_stage == 2 and cfg.engine.backend == "deepspeed"
    assert cfg.total_steps == 5
    assert cfg.data.shards == "runs/embedded/shards"


def test_steps_default_to_the_schedule():
    cfg = pretrain_config(minimal(schedule={"warmup_steps": 1, "total_steps": 42}))
    assert cfg.train.steps == cfg.total_steps == 42


def test_int_is_accepted_for_a_float_and_tuples_from_lists():
    cfg = pretrain_config(minimal(optimizer={"lr": 1, "betas": [0.8, 0.9]}))
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.betas == (0.8, 0.9)


@pytest.mark.parametrize(
    ("section", "key", "suggestion"),
    [
        ("optimizer", "lrr", "lr"),
        ("train", "stepz", "steps"),
        ("engine", "zero_stge", "zero_stage"),
        ("schedule", "warmup_step", "warmup_steps"),
        ("data", "shardz", "shards"),
        ("model", "hiden_size", "hidden_size"),
    ],
)
def test_unknown_key_suggests_the_close_one(section, key, suggestion):
    data = minimal()
    data.setdefault(section, {})[key] = 1
    with pytest.raises(ValueError, match=f"did you mean '{suggestion}'"):
        pretrain_config(data)


def test_unknown_section_and_nested_key():
    with pytest.raises(ValueError, match="did you mean 'optimizer'"):
        pretrain_config(minimal(optimiser={"lr": 1.0}))
    with pytest.raises(
        ValueError, match=r"data\.masking\.mlm_probabilty.*did you mean 'mlm_probability'"
    ):
        pretrain_config({"data": {"shards": "s", "masking": {"mlm_probabilty": 0.1}}})


@pytest.mark.parametrize(
    ("section", "key", "value", "where"),
    [
        ("engine", "zero_stage", "two", "engine.zero_stage"),
        ("engine", "zero_stage", 2.0, "engine.zero_stage"),
        ("engine", "activation_checkpointing", "yes", "engine.activation_checkpointing"),
        ("optimizer", "lr", "fast", "optimizer.lr"),
        ("train", "steps", [1], "train.steps"),
        ("data", "max_seq_length", True, "data.max_seq_length"),
    ],
)
def test_wrong_types(section, key, value, where):
    data = minimal()
    data.setdefault(section, {})[key] = value
    with pytest.raises(ValueError, match=where.replace(".", r"\.")):
        pretrain_config(data)


@pytest.mark.parametrize("value", [3, "offload", ["zero_optimization"]])
def test_engine_deepspeed_must_be_a_mapping(value):
    with pytest.raises(ValueError, match=r"engine\.deepspeed"):
        pretrain_config(minimal(engine={"deepspeed": value}))


def test_bad_values_are_value_errors():
    with pytest.raises(ValueError, match=r"engine\.zero_stage"):
        pretrain_config(minimal(engine={"zero_stage": 5}))
    with pytest.raises(ValueError, match=r"optimizer\.betas"):
        pretrain_config(minimal(optimizer={"betas": [0.9]}))
    with pytest.raises(ValueError, match="model:"):
        pretrain_config(minimal(model={"preset": "debug", "attention": "nope"}))
    with pytest.raises(ValueError, match=r"section|mapping"):
        pretrain_config(minimal(engine=3))


def test_missing_shards():
    with pytest.raises(ValueError, match=r"data\.shards"):
        pretrain_config({})
    with pytest.raises(ValueError, match=r"data\.shards"):
        pretrain_config({"data": {"max_seq_length": 64}, "optimizer": {"lr": 1.0}})


def test_encoder_config_takes_vocab_and_pad_from_the_tokenizer():
    cfg = pretrain_config(minimal(model={"preset": "debug"}))
    enc = cfg.encoder_config(vocab_size=300, pad_token_id=3)
    assert (enc.vocab_size, enc.pad_token_id) == (300, 3)
    assert enc.hidden_size == 32  # the rest is the preset
    assert cfg.model == {"preset": "debug"}  # the section itself is not modified


@pytest.mark.parametrize(("key", "value"), [("vocab_size", 512), ("pad_token_id", 1)])
def test_encoder_config_refuses_a_conflicting_explicit_value(key, value):
    cfg = pretrain_config(minimal(model={"preset": "debug", key: value}))
    with pytest.raises(ValueError, match=f"model\\.{key}"):
        cfg.encoder_config(vocab_size=300, pad_token_id=0)


def test_encoder_config_accepts_an_agreeing_explicit_value():
    cfg = pretrain_config(minimal(model={"preset": "debug", "vocab_size": 300, "pad_token_id": 0}))
    assert cfg.encoder_config(vocab_size=300, pad_token_id=0).vocab_size == 300


def test_sequence_longer_than_the_position_table():
    model = {"preset": "debug", "max_position_embeddings": 64}
    cfg = pretrain_config({"data": {"shards": "s", "max_seq_length": 128}, "model": model})
    with pytest.raises(ValueError, match=r"data\.max_seq_length=128.*max_position_embeddings=64"):
        cfg.encoder_config(vocab_size=300, pad_token_id=0)
    ok = pretrain_config({"data": {"shards": "s", "max_seq_length": 64}, "model": model})
    assert ok.encoder_config(vocab_size=300, pad_token_id=0).max_position_embeddings == 64


def test_config_round_trips_through_yaml(tmp_path):
    cfg = pretrain_config(load_recipe(DEBUG, ["optimizer.betas=[0.8, 0.9]"]))
    assert pretrain_config(config_dict(cfg)) == cfg
    saved = write(tmp_path / "config.yaml", to_yaml(cfg.to_dict()))
    assert pretrain_config(load_recipe(saved)) == cfg
    assert diff_keys(load_recipe(saved), cfg.to_dict()) == []


# ----------------------------------------------------------------------------- diff_keys


def test_diff_keys_nested():
    a = {"x": 1, "s": {"a": 1, "b": {"c": 2, "d": [1, 2]}}, "gone": None}
    b = {"x": 1, "s": {"a": 1, "b": {"c": 3, "d": [1, 2], "e": 0}}, "new": {"k": 1}}
    assert diff_keys(a, b) == ["gone", "new.k", "s.b.c", "s.b.e"]  # a new section's leaves
    assert diff_keys(b, a) == diff_keys(a, b)
    assert diff_keys(a, a) == []
    assert diff_keys({"s": {"a": 1}}, {"s": 1}) == ["s"]  # a section against a value
    assert diff_keys({"l": [1, 2]}, {"l": [1, 3]}) == ["l"]  # lists compare whole
    assert diff_keys({"a": None}, {}) == ["a"]  # missing differs from None
    assert diff_keys({"a": {}}, {}) == []  # an empty section holds no key
    assert diff_keys({"a": 1}, {"a": 1.0}) == []


def test_diff_keys_between_recipes():
    base = load_recipe(DEBUG)
    changed = load_recipe(DEBUG, ["optimizer.lr=1e-3", "train.run_dir=x", "engine.device=cpu"])
    assert diff_keys(base, changed) == ["optimizer.lr", "train.run_dir"]


# ----------------------------------------------------------------------------- moved keys

MOVED = "run_dir is now train.run_dir; the top-level key is accepted for now"


def _glue_config():
    from finetune.glue.run import GlueConfig

    return GlueConfig


def test_moved_override_lands_in_train_and_warns(tmp_path):
    recipe = write(tmp_path / "r.yaml", "train:\n  run_dir: runs/recipe\n  eval_every: 5\n")
    with pytest.warns(FutureWarning, match=MOVED) as caught:
        data = load_recipe(recipe, ["run_dir=runs/override"])
    assert "run_dir" not in data
    assert data["train"] == {"run_dir": "runs/override", "eval_every": 5}  # the override wins
    assert "write train.run_dir=runs/override" in str(caught[0].message)


def test_new_key_gives_no_warning(tmp_path, recwarn):
    data = load_recipe(None, ["train.run_dir=runs/x"])
    assert data == {"train": {"run_dir": "runs/x"}}
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_moved_key_in_a_recipe_file_overrides_as_it_did(tmp_path):
    """An old-style recipe (top-level run_dir) over a new-style base (train.run_dir): the
    child's value still wins, and its train section is merged, not replaced."""
    write(tmp_path / "base.yaml", "train:\n  run_dir: runs/base\n  eval_every: 5\n")
    child = write(tmp_path / "child.yaml", "defaults: base.yaml\nrun_dir: runs/child\n")
    with pytest.warns(FutureWarning, match=f"config file .*child.yaml: {MOVED}"):
        data = load_recipe(child)
    assert data == {"train": {"run_dir": "runs/child", "eval_every": 5}}
    # ...and a new-style override still beats the old-style file
    with pytest.warns(FutureWarning):
        assert load_recipe(child, ["train.run_dir=x"])["train"]["run_dir"] == "x"


def test_moved_key_with_interpolation(tmp_path):
    recipe = write(tmp_path / "r.yaml", "task: rte\nrun_dir: runs/${task}\n")
    with pytest.warns(FutureWarning):
        assert load_recipe(recipe)["train"] == {"run_dir": "runs/rte"}


def test_old_and_new_key_in_one_file_must_agree(tmp_path):
    same = write(tmp_path / "same.yaml", "run_dir: a\ntrain:\n  run_dir: a\n")
    with pytest.warns(FutureWarning):
        assert load_recipe(same)["train"] == {"run_dir": "a"}
    clash = write(tmp_path / "clash.yaml", "run_dir: a\ntrain:\n  run_dir: b\n")
    with pytest.raises(ValueError, match=r"both run_dir='a' and train.run_dir='b' are given"):
        load_recipe(clash)


def test_build_config_moves_the_key_of_a_plain_dict():
    from engine.recipe import build_config

    with pytest.warns(FutureWarning, match=f"GlueConfig: {MOVED}"):
        cfg = build_config(_glue_config(), {"run_dir": "runs/x", "train": {"eval_every": 3}})
    assert (cfg.train.run_dir, cfg.train.eval_every) == ("runs/x", 3)


ENGINE_MOVED = "engine.orthogonal_step_cache is now model.orthogonal_step_cache"


def test_old_engine_orthogonal_keys_load_onto_the_model_keys(tmp_path):
    """``engine.orthogonal_*`` (now settings of the model's orthogonal maps) in a recipe file
    and as overrides: a FutureWarning naming the new key, the value under ``model``, the
    engine section without them; an old key at its old default says nothing and is dropped."""
    from model.config import EncoderConfig

    recipe = write(
        tmp_path / "r.yaml",
        "model:\n  preset: debug\nengine:\n  orthogonal_step_cache: false\n  micro_batch_size: 4\n",
    )
    with pytest.warns(FutureWarning, match=ENGINE_MOVED) as caught:
        data = load_recipe(
            recipe, ["engine.orthogonal_shard_min_size=0", "engine.orthogonal_shard_maps=true"]
        )
    said = " ".join(str(w.message) for w in caught)
    assert "engine.orthogonal_shard_min_size is now model.orthogonal_shard_min_size" in said
    assert "engine.orthogonal_shard_maps is now model.orthogonal_shard_maps" in said
    assert data["engine"] == {"micro_batch_size": 4}
    assert data["model"] == {
        "preset": "debug",
        "orthogonal_step_cache": False,
        "orthogonal_shard_min_size": 0,
    }
    cfg = pretrain_config({**data, "data": {"shards": "s"}})
    model = EncoderConfig.from_dict(cfg.model)
    assert (model.orthogonal_step_cache, model.orthogonal_shard_maps) == (False, True)
    assert model.orthogonal_shard_min_size == 0
    assert "orthogonal_step_cache" not in cfg.to_dict()["engine"]


def test_saved_config_with_the_old_engine_keys_still_resumes(tmp_path, recwarn):
    """A run directory whose config.yaml was saved with ``engine.orthogonal_*`` (every engine
    key written, the defaults too) resumes with today's recipe; a non-default old value is
    compared where it now lives."""
    from engine.recipe import move_saved_keys
    from pretrain.setup import check_run_dir

    current = config_dict(pretrain_config(load_recipe(DEBUG, [f"train.run_dir={tmp_path}"])))
    old = {**current, "engine": {**current["engine"], "orthogonal_step_cache": True}}
    old["engine"] |= {"orthogonal_shard_maps": True, "orthogonal_shard_min_size": 256}
    (tmp_path / "config.yaml").write_text(to_yaml(old))
    assert check_run_dir(tmp_path, current)
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]
    off = {**old, "engine": {**old["engine"], "orthogonal_shard_maps": False}}
    moved = move_saved_keys(off)
    assert "orthogonal_shard_maps" not in moved["engine"]
    assert moved["model"]["orthogonal_shard_maps"] is False
    (tmp_path / "config.yaml").write_text(to_yaml(off))
    with pytest.raises(ValueError, match=r"model\.orthogonal_shard_maps"):
        check_run_dir(tmp_path, current)
    resumed = {**current, "model": {**current["model"], "orthogonal_shard_maps": False}}
    assert check_run_dir(tmp_path, resumed)


@pytest.mark.parametrize("suite", ["glue", "lra"])
def test_finetune_configs_have_the_pretraining_shape(suite):
    """train.run_dir in all three run configs, no top-level run_dir."""
    from engine.recipe import build_config
    from finetune.glue.run import GlueConfig
    from finetune.lra.run import LraConfig

    cls = {"glue": GlueConfig, "lra": LraConfig}[suite]
    assert "run_dir" not in {f for f in cls.__dataclass_fields__}
    assert cls().train.run_dir == f"runs/{suite}"
    assert build_config(cls, {"train": {"run_dir": "r"}}).train.run_dir == "r"
    assert PretrainConfig(data={"shards": "s"}).train.run_dir == "runs/pretrain"


def test_typed_config_imports_nothing_of_the_project():
    """model.typed_config is the bottom of the import graph: both model.config and
    engine.recipe import it, so it may import only the standard library."""
    import ast
    import sys

    import model.typed_config as typed

    tree = ast.parse(Path(typed.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {n.split(".")[0] for n in names} <= set(sys.stdlib_module_names) | {"__future__"}


def test_defaults_may_be_a_list_merged_in_order(tmp_path):
    (tmp_path / "a.yaml").write_text("model:\n  hidden_size: 8\n  attention: softmax\n")
    (tmp_path / "b.yaml").write_text("model:\n  attention: tisa\n")
    (tmp_path / "r.yaml").write_text("defaults: [a.yaml, b.yaml]\nmodel:\n  hidden_size: 16\n")
    assert load_recipe(tmp_path / "r.yaml")["model"] == {"hidden_size": 16, "attention": "tisa"}
    (tmp_path / "bad.yaml").write_text("defaults: [a.yaml, 3]\n")
    with pytest.raises(ValueError, match="'defaults' must be a path"):
        load_recipe(tmp_path / "bad.yaml")


def test_each_familys_settings_have_one_source():
    """configs/families/<family>.yaml: the debug recipes start from it, the mini-LRA and the
    tests read it as overrides; nothing else spells a family's settings."""
    import sys

    from engine.recipe import recipe_overrides
    from finetune.lra import mini

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "tests"))
    from pretrain_support import FAMILY

    for family in ("tisa", "kernel", "transject"):
        source = recipe_overrides(repo / "configs" / "families" / f"{family}.yaml")
        assert mini.FAMILY_OVERRIDES[family] == FAMILY[family] == source
        recipe = load_recipe(repo / "configs" / "pretrain" / f"debug-{family}.yaml")
        assert set(source) <= set(recipe_overrides_of(recipe)), family


def recipe_overrides_of(data: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.extend(recipe_overrides_of(value, where))
        else:
            out.append(f"{where}={value}")
    return out


def test_an_override_reaches_into_a_list_and_a_bad_index_is_named():
    """``phases.1.shards=...`` sets one phase's shards (it used to crash the merge with a
    TypeError); an index past the list's end is a clear error."""
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[2] / "configs" / "pretrain" / "debug-2phase.yaml"
    data = load_recipe(recipe, ["phases.1.shards=/elsewhere", "optimizer.lr=1e-3"])
    assert data["phases"][1]["shards"] == "/elsewhere" and data["optimizer"]["lr"] == 1e-3
    assert data["phases"][0].get("shards") != "/elsewhere"
    with pytest.raises(ValueError, match=r"override 'phases\.7\.shards=x': phases\.7\.shards"):
        load_recipe(recipe, ["phases.7.shards=x"])
