"""The training loop both stages run (``engine.loop.RunLoop``), on a toy stage in this process:
cadences of logging, evaluation and checkpoints, a stop signal (checkpoint, "stopped", the
handler given back), an exact resume, the status file; and that pretraining and fine-tuning
are both stages that loop drives."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import checkpoint as ckpt
from engine.loop import LoopConfig, RunLoop, Stage
from engine.metrics import read_jsonl
from engine.trackers import TENSORBOARD_DIR, TrackerConfig

TOTAL = 10


class OneProcess:
    """The collectives of a job of one process."""

    def barrier(self) -> None:
        pass

    def any_rank(self, flag: bool) -> bool:
        return flag

    def all_reduce_max(self, values: list[float]) -> list[float]:
        return [float(v) for v in values]

    def first_step_report(self, seconds: float) -> str | None:
        return None


class ToyStage(Stage):
    """A random walk: each step adds a draw of its own generator (its state is checkpointed,
    so a resumed walk equals an uninterrupted one). ``signal_at``: raises SIGTERM in that step."""

    def __init__(self, run_dir: Path, signal_at: int | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)  # the stage's run() makes it
        self.engine = OneProcess()
        self.store = ckpt.CheckpointStore(run_dir / "checkpoints", keep_last=2)
        self.step = 0
        self.is_main = True
        self.signal_at = signal_at
        self.rng = np.random.default_rng(0)
        self.x = 0.0
        self.walk: dict[int, float] = {}
        self.evaluated: list[int] = []
        self.checked: list[tuple[int, bool]] = []
        self.completed_with: Path | None = None

    def train_step(self, loop: RunLoop) -> None:
        self.x += float(self.rng.standard_normal())
        self.step += 1
        self.walk[self.step] = self.x
        if self.step == self.signal_at:
            signal.raise_signal(signal.SIGTERM)  # the loop's handler only records it

    def log_step(self, loop: RunLoop) -> dict[str, float]:
        assert loop.trackers is not None
        loop.trackers.scalars(self.step, {"toy/x": self.x})
        return {"x": self.x}

    def evaluate_now(self, loop: RunLoop) -> None:
        self.evaluated.append(self.step)

    def after_step(self, loop: RunLoop, checkpoint_due: bool) -> None:
        self.checked.append((self.step, checkpoint_due))

    def save_state(self, staging: Path, reason: str) -> dict[str, Any]:
        state = {"step": self.step, "x": self.x, "rng": self.rng.bit_generator.state}
        (staging / "toy.json").write_text(json.dumps(state))
        return {"reason": reason}

    def restore_state(self, path: Path, record: dict[str, Any]) -> None:
        state = json.loads((path / "toy.json").read_text())
        self.step, self.x = state["step"], state["x"]
        self.rng.bit_generator.state = state["rng"]

    def complete(self, loop: RunLoop, checkpoint: Path | None) -> None:
        self.completed_with = checkpoint

    def status(self) -> dict[str, Any]:
        return {"x": self.x}


def loop_config(run_dir: Path, **changes: Any) -> LoopConfig:
    cfg = LoopConfig(
        name="toy",
        run_dir=run_dir,
        total_steps=TOTAL,
        trackers=TrackerConfig(trackers=[]),  # metrics.jsonl only
        log_every=3,
        eval_every=4,
        eval_at_end=True,
        checkpoint_every=4,
        checkpoint_at_end=True,
        status_file="status.json",
    )
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def status(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "status.json").read_text())


def test_cadences_of_an_uninterrupted_run(tmp_path):
    stage = ToyStage(tmp_path)
    outcome = RunLoop(stage, loop_config(tmp_path)).run()
    assert (outcome.state, outcome.reason, outcome.step) == ("completed", "", TOTAL)
    assert outcome.resumed_from is None
    assert sorted(read_jsonl(tmp_path / TENSORBOARD_DIR)) == [3, 6, 9, 10]  # log_every, last
    assert stage.evaluated == [4, 8, 10]  # eval_every, and the last step
    assert [s for s, due in stage.checked if due] == [4, 8]
    # The interval checkpoints and the one at the end (keep_last=2 keeps the newest two).
    assert stage.store.complete_steps() == [8, 10]
    assert stage.completed_with == tmp_path / "checkpoints" / ckpt.tag_for(TOTAL)
    assert stage.store.read_complete(ckpt.tag_for(TOTAL))["meta"]["reason"] == "end"
    assert status(tmp_path) == {
        "state": "completed",
        "reason": "",
        "step": TOTAL,
        "total_steps": TOTAL,
        "x": stage.x,
    }


def test_without_checkpoint_at_end_the_last_step_has_none(tmp_path):
    stage = ToyStage(tmp_path)
    cfg = loop_config(tmp_path, checkpoint_every=5, checkpoint_at_end=False, status_file=None)
    assert RunLoop(stage, cfg).run().state == "completed"
    assert stage.store.complete_steps() == [5]  # not 10: the last step has no checkpoint
    assert stage.completed_with is None and not (tmp_path / "status.json").exists()


def test_stop_signal_checkpoints_and_the_resume_is_exact(tmp_path):
    straight = ToyStage(tmp_path / "straight")
    RunLoop(straight, loop_config(tmp_path / "straight")).run()

    run_dir = tmp_path / "stopped"
    handler = signal.getsignal(signal.SIGTERM)
    first = ToyStage(run_dir, signal_at=6)
    stopped = RunLoop(first, loop_config(run_dir)).run()
    assert (stopped.state, stopped.reason, stopped.step) == ("stopped", "signal SIGTERM", 6)
    assert signal.getsignal(signal.SIGTERM) == handler  # the loop's handler is gone
    record = first.store.read_complete(ckpt.tag_for(6))
    assert record["meta"]["reason"] == "signal SIGTERM"
    assert first.completed_with is None and 10 not in first.walk
    assert status(run_dir)["state"] == "stopped" and status(run_dir)["step"] == 6

    second = ToyStage(run_dir)
    resumed = RunLoop(second, loop_config(run_dir)).run()
    assert resumed.resumed_from == run_dir / "checkpoints" / ckpt.tag_for(6)
    assert (resumed.state, resumed.step) == ("completed", TOTAL)
    assert sorted(second.walk) == [7, 8, 9, 10]  # from the checkpoint on
    assert {**first.walk, **second.walk} == straight.walk  # the same walk, draw for draw
    assert second.evaluated == [8, 10]
    assert status(run_dir)["x"] == straight.x
    # The logged points of both attempts: each step once.
    rows = read_jsonl(run_dir / TENSORBOARD_DIR)
    assert sorted(rows) == [3, 6, 9, 10]
    assert rows[9]["toy/x"] == pytest.approx(straight.walk[9])


def test_a_crash_leaves_the_running_status_and_the_trackers_closed(tmp_path):
    class Crashing(ToyStage):
        def after_step(self, loop: RunLoop, checkpoint_due: bool) -> None:
            if self.step == 5:
                raise RuntimeError("on purpose")

    with pytest.raises(RuntimeError, match="on purpose"):
        RunLoop(Crashing(tmp_path), loop_config(tmp_path)).run()
    assert status(tmp_path) == {"state": "running", "step": 0}
    # A re-run resumes from the interval checkpoint before the crash.
    stage = ToyStage(tmp_path)
    outcome = RunLoop(stage, loop_config(tmp_path)).run()
    assert outcome.resumed_from is not None and outcome.resumed_from.name == ckpt.tag_for(4)
    assert status(tmp_path)["state"] == "completed"


def test_eval_at_start_only_on_a_fresh_run(tmp_path):
    stage = ToyStage(tmp_path, signal_at=2)
    cfg = loop_config(tmp_path, eval_at_start=True, eval_every=0, eval_at_end=False)
    assert RunLoop(stage, cfg).run().state == "stopped"
    assert stage.evaluated == [0]
    again = ToyStage(tmp_path)
    assert RunLoop(again, cfg).run().state == "completed"
    assert again.evaluated == []


class Driven(Exception):
    """What the patched ``RunLoop.run`` raises: the loop it was called on."""


def test_pretraining_and_finetuning_are_stages_of_the_one_loop(tmp_path, monkeypatch):
    """Both stages' ``run`` hand themselves to ``engine.loop.RunLoop`` (and neither keeps a
    loop of its own: no stop signals or trackers of their own)."""
    import finetune.trainer as finetune_trainer
    import pretrain.train as pretrain_train
    from engine.recipe import load_recipe
    from pretrain.config import pretrain_config

    def run(self: RunLoop):
        raise Driven(self)

    monkeypatch.setattr(RunLoop, "run", run)
    # Instances without their engines and data: only what run() reads before the loop.
    trainer = object.__new__(pretrain_train.Trainer)  # abstract methods left: TypeError
    overrides = [f"data.shards={tmp_path}", f"train.run_dir={tmp_path}"]  # not opened here
    cfg = pretrain_config(load_recipe(None, overrides))
    trainer.__dict__.update(
        cfg=cfg, is_main=False, resuming=True, engine=OneProcess(), run_dir=tmp_path, resolved={}
    )
    with pytest.raises(Driven) as pre:
        trainer.run()
    finetuner = object.__new__(finetune_trainer.Finetuner)
    finetuner.__dict__.update(
        cfg=finetune_trainer.FinetuneConfig(),
        is_main=False,
        engine=OneProcess(),
        run_dir=tmp_path,
        identity={},
        total_steps=5,
    )
    with pytest.raises(Driven) as fine:
        finetuner.run()
    pre_loop, fine_loop = pre.value.args[0], fine.value.args[0]
    assert type(pre_loop) is type(fine_loop) is RunLoop
    assert pre_loop.stage is trainer and fine_loop.stage is finetuner
    assert pre_loop.cfg.status_file == "status.json" and fine_loop.cfg.status_file is None
    for module in (pretrain_train, finetune_trainer):
        assert not hasattr(module, "StopWatch") and not hasattr(module, "open_trackers")
