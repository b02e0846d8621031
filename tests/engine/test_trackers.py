"""Experiment trackers (``engine/trackers.py``): TensorBoard, W&B and MLflow get the same scalars
at the same steps; W&B runs offline (``WANDB_MODE=offline``, its run files read back) and
MLflow writes to a local ``file:`` store read back with ``MlflowClient``; a resumed run goes on
in the same W&B run and the same MLflow run; a tracker whose package is missing is a config
error naming the pip extra. In-process, seconds."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
from tracker_support import assert_same_history, read_mlflow, read_wandb_offline, same

from engine.metrics import read_jsonl, read_scalars
from engine.trackers import (
    STATE_FILE,
    TRACKER_KEYS,
    TrackerConfig,
    default_run_name,
    flatten,
    open_trackers,
)

HAVE_WANDB = importlib.util.find_spec("wandb") is not None
HAVE_MLFLOW = importlib.util.find_spec("mlflow") is not None
needs_wandb = pytest.mark.skipif(
    not HAVE_WANDB, reason="wandb is not installed (pip install -e '.[wandb]')"
)
needs_mlflow = pytest.mark.skipif(
    not HAVE_MLFLOW, reason="mlflow is not installed (pip install -e '.[mlflow]')"
)
if not (HAVE_WANDB and HAVE_MLFLOW):  # say so in the log, not only in the skip summary
    print(
        "test_trackers: skipping the W&B / MLflow tests whose package is missing "
        f"(wandb: {HAVE_WANDB}, mlflow: {HAVE_MLFLOW}); scripts/setup.sh installs both",
        file=sys.stderr,
    )


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B offline and quiet, MLflow's local file store allowed, no tracker env leaking in."""
    for name in ("WANDB_PROJECT", "WANDB_ENTITY", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file:{tmp_path / 'mlruns'}"


def _all(uri: str, **kw) -> TrackerConfig:
    return TrackerConfig(trackers=["tensorboard", "wandb", "mlflow"], mlflow_tracking_uri=uri, **kw)


def _values(step: int, scale: float = 1.0) -> dict:
    return {
        "loss/mlm": scale * 7.5 / step,
        "optim/lr": 1e-3 * step,
        "accuracy/mlm": 0.01 * step,
        "optim/grad_norm": math.nan if step == 3 else 0.5,  # a blow-up stays visible
        "time/step": None,  # skipped everywhere
    }


def _by_tag(rows: dict[int, dict]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(rows):
        for tag, value in rows[step].items():
            if tag != "step":
                out.setdefault(tag, []).append((step, math.nan if value is None else value))
    return out


# ----------------------------------------------------------------------------- config


def test_default_is_tensorboard_and_every_key_is_resumable():
    assert TrackerConfig().trackers == ["tensorboard"]
    assert set(TRACKER_KEYS) == {
        "train.trackers",
        "train.run_name",
        "train.wandb_project",
        "train.wandb_entity",
        "train.mlflow_tracking_uri",
        "train.mlflow_experiment",
    }
    from finetune.trainer import RESUMABLE_KEYS
    from pretrain.config import RESUMABLE_CHANGES

    assert set(TRACKER_KEYS) <= set(RESUMABLE_CHANGES)
    assert set(TRACKER_KEYS) <= set(RESUMABLE_KEYS)


@pytest.mark.parametrize(
    ("trackers", "message"),
    [
        (["tensorbord"], "'tensorbord' is not a tracker"),
        (["wandb", "wandb"], "twice"),
        ("wandb", "a list of"),
    ],
)
def test_bad_tracker_lists_are_config_errors(trackers, message):
    with pytest.raises(ValueError, match=message):
        TrackerConfig(trackers=trackers)


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_package_is_a_config_error_naming_the_extra(monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a)
    )
    with pytest.raises(ValueError, match=rf"pip install -e '\.\[{name}\]'"):
        TrackerConfig(trackers=["tensorboard", name])
    TrackerConfig(trackers=["tensorboard"])  # not asked for: no error


def test_the_train_sections_take_the_tracker_keys(monkeypatch):
    from engine.recipe import build_config
    from finetune.lra.run import LraConfig
    from pretrain.config import pretrain_config

    cfg = pretrain_config({"data": {"shards": "x"}, "train": {"trackers": [], "run_name": "a"}})
    assert cfg.train.trackers == [] and cfg.train.run_name == "a"
    with pytest.raises(ValueError, match=r"train\.trackers"):
        pretrain_config({"data": {"shards": "x"}, "train": {"trackers": ["neptune"]}})
    with pytest.raises(ValueError, match=r"train\.wandb_project"):
        pretrain_config({"data": {"shards": "x"}, "train": {"wandb_project": ""}})
    lra = build_config(LraConfig, {"train": {"trackers": ["tensorboard"], "run_name": "b"}})
    assert lra.train.run_name == "b"


def test_default_run_names(tmp_path):
    assert default_run_name(tmp_path / "albert-base") == "albert-base"
    root = tmp_path / "glue"
    assert (
        default_run_name(root / "rte" / "lr_2e-05" / "seed_0", root) == "glue/rte/lr_2e-05/seed_0"
    )
    assert default_run_name(tmp_path / "elsewhere", root) == "elsewhere"
    assert flatten({"a": {"b": 1, "c": {}}, "d": [1, 2]}) == {"a.b": 1, "a.c": {}, "d": [1, 2]}


# ----------------------------------------------------------------------------- TensorBoard only


def test_tensorboard_alone_imports_and_writes_no_other_tracker(tmp_path):
    run_dir = tmp_path / "run"
    with open_trackers(TrackerConfig(), run_dir, enabled=True) as writer:
        assert writer.others == []
        writer.scalars(1, _values(1))
    assert sorted(read_scalars(run_dir / "tensorboard")) == [
        "accuracy/mlm",
        "loss/mlm",
        "optim/grad_norm",
        "optim/lr",
    ]
    assert not (run_dir / STATE_FILE).exists() and not (run_dir / "wandb").exists()


def test_no_tensorboard_still_writes_metrics_jsonl(tmp_path):
    run_dir = tmp_path / "run"
    with open_trackers(TrackerConfig(trackers=[]), run_dir, enabled=True) as writer:
        writer.scalars(1, _values(1))
        writer.text("config", "x", 1)  # TensorBoard's only: dropped
    assert read_jsonl(run_dir / "tensorboard")[1]["loss/mlm"] == 7.5
    assert not list((run_dir / "tensorboard").glob("events.out.tfevents*"))


def test_other_ranks_create_nothing(tmp_path, offline):
    run_dir = tmp_path / "run"
    writer = open_trackers(_all(offline), run_dir, enabled=False)
    writer.scalars(1, _values(1))
    writer.close()
    assert not run_dir.exists() and not (tmp_path / "mlruns").exists()


# ----------------------------------------------------------------------------- W&B and MLflow


@needs_wandb
@needs_mlflow
def test_wandb_and_mlflow_get_tensorboards_scalars(tmp_path, offline):
    run_dir = tmp_path / "runs" / "albert"
    config = {"model": {"attention": "tisa", "hidden_size": 64}, "train": {"steps": 5}}
    with open_trackers(_all(offline), run_dir, enabled=True, config=config) as writer:
        for step in range(1, 6):
            writer.scalars(step, _values(step))
        writer.scalars(5, {"eval/loss/mlm": 3.25})  # a second call at the same step
    tensorboard = read_scalars(run_dir / "tensorboard")
    jsonl = _by_tag(read_jsonl(run_dir / "tensorboard"))
    assert_same_history(jsonl, tensorboard, "metrics.jsonl")
    wandb = read_wandb_offline(run_dir)
    assert_same_history(wandb["history"], tensorboard, "W&B")
    assert wandb["names"] == ["albert"] and len(wandb["ids"]) == 1
    assert wandb["config"]["model"] == {"attention": "tisa", "hidden_size": 64}
    (run,) = read_mlflow(offline)
    assert_same_history(run["history"], tensorboard, "MLflow")
    assert run["name"] == "albert" and run["status"] == "FINISHED"
    assert run["params"]["model.attention"] == "tisa"
    assert run["params"]["train.steps"] == "5"
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert state["wandb"]["run_id"] == wandb["ids"][0]
    assert state["mlflow"]["run_id"] == run["id"]
    assert state["wandb"]["last_step"] == state["mlflow"]["last_step"] == 5


@needs_wandb
@needs_mlflow
def test_a_resumed_run_goes_on_in_the_same_wandb_and_mlflow_runs(tmp_path, offline):
    """An interruption after step 5 and a resume from a checkpoint at step 3: TensorBoard keeps
    the new values of steps 4-5 (purge), W&B and MLflow the first ones (they cannot delete), each
    step once; one W&B run id, one MLflow run."""
    run_dir = tmp_path / "run"
    cfg = _all(offline, run_name="mine", mlflow_experiment="exp")
    writer = open_trackers(cfg, run_dir, enabled=True, config={"a": 1})
    for step in range(1, 6):
        writer.scalars(step, _values(step))
    writer.close("failed")
    (first,) = read_mlflow(offline, "exp")
    assert first["status"] == "FAILED"
    writer = open_trackers(cfg, run_dir, enabled=True, purge_step=4, config={"a": 1})
    for step in range(4, 9):
        writer.scalars(step, _values(step, scale=2.0))
    writer.close()
    tensorboard = read_scalars(run_dir / "tensorboard")
    assert [s for s, _ in tensorboard["loss/mlm"]] == list(range(1, 9))
    assert same(dict(tensorboard["loss/mlm"])[4], 2 * 7.5 / 4)  # the resumed attempt's
    expected = {  # the first attempt's steps 1-5, then the resumed attempt's 6-8
        tag: [(s, v if s > 5 else dict(first["history"][tag])[s]) for s, v in history]
        for tag, history in tensorboard.items()
    }
    wandb = read_wandb_offline(run_dir)
    assert len(wandb["ids"]) == 2 and len(set(wandb["ids"])) == 1, wandb["ids"]
    assert wandb["names"] == ["mine", "mine"]
    assert_same_history(wandb["history"], expected, "W&B")
    (run,) = read_mlflow(offline, "exp")
    assert run["id"] == first["id"] and run["status"] == "FINISHED"
    assert_same_history(run["history"], expected, "MLflow")


@needs_mlflow
def test_a_failing_tracker_warns_and_training_goes_on(tmp_path, offline, monkeypatch):
    run_dir = tmp_path / "run"
    cfg = TrackerConfig(trackers=["tensorboard", "mlflow"], mlflow_tracking_uri=offline)
    writer = open_trackers(cfg, run_dir, enabled=True)
    mlflow = writer.tracker("mlflow")

    def down(*args, **kwargs):
        raise ConnectionError("server down")

    monkeypatch.setattr(mlflow.client, "log_batch", down)
    with pytest.warns(UserWarning, match="mlflow: logging step 1 failed.*server down"):
        writer.scalars(1, _values(1))
    writer.scalars(2, _values(2))  # the next failures are counted, not each reported
    monkeypatch.undo()
    writer.close()
    assert sorted(read_jsonl(run_dir / "tensorboard")) == [1, 2]


@needs_wandb
def test_wandb_project_from_the_environment(tmp_path, offline, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    run_dir = tmp_path / "run"
    with open_trackers(TrackerConfig(trackers=["wandb"]), run_dir, enabled=True) as writer:
        writer.scalars(1, {"loss/mlm": 1.0})
    assert json.loads((run_dir / STATE_FILE).read_text())["wandb"]["project"] == "from-env"


def test_a_writer_reopened_in_the_same_second_sorts_after_the_first(tmp_path):
    """TensorBoard reads event files in name order; the name's per-process counter is not
    zero-padded, so a second writer of the same second whose counter went from 9 to 10 sorted
    first, and a resumed run's scalars were read before the earlier ones (this test failed
    when the suite had opened 9 writers before it)."""
    writer_module = pytest.importorskip("tensorboard.summary.writer.event_file_writer")
    counter = getattr(writer_module, "_global_uid", None)
    if counter is None or not hasattr(counter, "_value"):
        pytest.skip("tensorboard's event-file counter is not where this test looks")
    from engine.metrics import MetricsWriter

    warm = tmp_path / "warm"
    while counter._value % 10 != 9:  # the next two files get counters ...9 and ...10
        with MetricsWriter(warm / str(counter._value)) as writer:
            writer.scalars(1, {"x": 1.0})
    run = tmp_path / "run"
    with MetricsWriter(run) as writer:
        writer.scalars(10, {"loss": 1.0})
    with MetricsWriter(run, purge_step=11) as writer:
        writer.scalars(20, {"loss": 0.5})
    assert read_scalars(run)["loss"] == [(10, 1.0), (20, 0.5)]
