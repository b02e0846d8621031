"""Shared by the study tests: a small spec of two LRA variants on two data sets of the user's
(so a test can break one data set without changing any identity), and helpers."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from study.spec import REPO
from study.tiny_data import write_lra

STUDIES = REPO / "configs" / "studies"

TINY_LRA = ["engine.device=cpu", "engine.precision=fp32", "engine.micro_batch_size=4",
            "schedule.total_steps=2", "schedule.warmup_steps=1", "train.eval_every=2",
            "train.log_every=1"]  # fmt: skip
TWO_DATA_SETS = {
    "name": "faults",
    "reference": "a",
    "stages": {"lra": {"recipe": "configs/finetune/lra/debug-{task}.yaml",
                       "pretrain_recipe": "configs/pretrain/debug-lra-{task}.yaml"}},
    "variants": {
        "a": {"stages": {"lra": {"tasks": ["listops"], "data": "lo"}}},
        "b": {"stages": {"lra": {"tasks": ["text"], "data": "tx", "init": "self-pretrained"}}},
    },
    "scales": {"tiny": {"device": "cpu",
                        "data": {"lo": {"setting": "lo"}, "tx": {"setting": "tx"}},
                        "stages": {
                            "lra": {"overrides": TINY_LRA,
                                    "task_overrides": {"listops": ["data.max_length=40"],
                                                       "text": ["data.max_length=128"]},
                                    "resources": {"gpus_per_node": 0, "cpus_per_task": 1,
                                                  "time": "00:20:00"}},
                            "lra-pretrain": {"overrides": ["schedule.total_steps=2",
                                                           "schedule.warmup_steps=1"],
                                             "task_overrides": {"text": [
                                                 "data.max_seq_length=129"]},
                                             "resources": {"gpus_per_node": 0,
                                                           "cpus_per_task": 1,
                                                           "time": "00:20:00"}}}}},
}  # fmt: skip
"""Variant a: ListOps from scratch (data ``lo``); variant b: Text self-pretrained (data ``tx``):
lra-shards.text -> b.lra-pretrain.text -> b.lra.text, and baselines.text, read ``tx``."""
TEXT_STAGES = {"lra-shards.text-128", "baselines.text", "b.lra-pretrain.text", "b.lra.text"}


def two_data_sets(root: Path) -> tuple[Path, dict[str, Path]]:
    """The spec file and the two data sets it reads."""
    data = {"lo": write_lra(root / "lo", ["listops"]), "tx": write_lra(root / "tx", ["text"])}
    spec = root / "faults.yaml"
    spec.write_text(yaml.safe_dump(TWO_DATA_SETS))
    return spec, data


def data_args(data: dict[str, Path]) -> list[str]:
    return [arg for name, path in data.items() for arg in ("--data", f"{name}={path}")]


def to_run(output: str) -> int:
    """The number of stages a ``study run`` said it had to run."""
    return int(re.search(r"(\d+) to run", output).group(1))


def markers(out: Path) -> dict[str, int]:
    """Every done marker under a study directory -> its mtime (ns)."""
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.glob("nodes/*/done/*.json")}
