"""An LRA run keeps the counts of the records its loader read and skipped per split in its
results.json (a skipped image used to leave only a log line)."""

from __future__ import annotations

import json

import pytest
from test_lra_data import write_pathfinder
from test_lra_finetune import CPU_SMALL

from finetune.__main__ import main as finetune_main

pytestmark = pytest.mark.integration  # runs the stages end to end


def test_pathfinder_run_counts_the_skipped_empty_image(tmp_path):
    data = tmp_path / "lra_release"
    write_pathfinder(data / "pathfinder32", batches=1, per=20)  # sample 7 is an empty file
    run_dir = tmp_path / "run"
    args = ["lra", "--task", "pathfinder", "--data", str(data), "--protocol", "skyformer"]
    args += [*CPU_SMALL, "engine.micro_batch_size=4", "schedule.total_steps=2"]
    args += ["train.eval_every=2", f"train.run_dir={run_dir}"]
    assert finetune_main(args) == 0
    (row,) = json.loads((run_dir / "results.json").read_text())["runs"]
    # Pathfinder reads the whole difficulty's metadata before the 80/10/10 split: every split
    # saw the 20 images and skipped the empty one.
    counts = {"read": 20, "skipped": 1}
    assert row["rows"] == {"train": counts, "val": counts, "test": counts}
    per_seed = json.loads((run_dir / "seed_0" / "results.json").read_text())
    assert per_seed["summary"]["rows"] == row["rows"]
