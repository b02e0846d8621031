"""bench/gpu_pending.sh, planned without a GPU (``PLAN=1``): every pass names parts the GPU
suite has, families and benchmark configs that exist, and recipe overrides that the recipes
accept, so that a typo cannot waste a call on a GPU machine (it would show there only as a
part that runs nothing or a family that fails at start-up)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


def planned_passes(tmp_path: Path) -> dict[str, dict[str, str]]:
    """{pass: {VAR: value}} from ``PLAN=1 bash bench/gpu_pending.sh`` with budget for all."""
    env = {**os.environ, "PLAN": "1", "BUDGET": "100000", "OUT": str(tmp_path / "out")}
    proc = subprocess.run(
        ["bash", "bench/gpu_pending.sh"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    passes: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in proc.stdout.splitlines():
        started = re.match(r"=== pass (\S+) \(\d+ s left\)", line)
        if started:
            current = passes.setdefault(started.group(1), {})
        elif line.startswith("    ") and current is not None:
            var, _, value = line.strip().partition("=")
            current[var] = value
    assert "=== plan: at most" in proc.stdout
    return passes


def suite_parts() -> set[str]:
    text = (REPO / "bench" / "gpu_suite.sh").read_text()
    return set(re.findall(r"^\s*part ([a-z0-9_]+) ", text, flags=re.M))


def option_values(args: list[str], option: str) -> list[str]:
    """The values after ``option`` up to the next ``--`` option."""
    if option not in args:
        return []
    rest = args[args.index(option) + 1 :]
    end = next((i for i, arg in enumerate(rest) if arg.startswith("--")), len(rest))
    return rest[:end]


def test_every_pass_is_well_formed(tmp_path):
    from bench_attention_scaling import FAMILY_CONFIGS
    from bench_pretrain_throughput import FAMILIES, PRESETS, recipe_path

    from engine.recipe import build_config, load_recipe
    from pretrain.config import PretrainConfig

    passes = planned_passes(tmp_path)
    assert list(passes)[:3] == ["targets", "kernel_triton", "profile_targets"]
    assert len(passes) >= 15
    parts = suite_parts()
    base_of = {entry[0]: entry[1] for entries in PRESETS.values() for entry in entries}
    checked = 0
    for name, settings in passes.items():
        assert settings.get("PARTS"), name
        unknown = set(settings["PARTS"].split()) - parts
        assert not unknown, f"pass {name}: no such part of gpu_suite.sh: {unknown}"
        overrides = shlex.split(settings.get("EXTRA", ""))
        if settings.get("LAMB", "auto") not in ("auto", "torch", "deepspeed"):
            overrides.append(f"optimizer.implementation={settings['LAMB']}")
        scaling = option_values(shlex.split(settings.get("SCALING", "")), "--families")
        assert set(scaling) <= set(FAMILY_CONFIGS), f"pass {name}: scaling families {scaling}"
        families, bases = set(FAMILIES), {"albert-base"}
        for var in ("PRETRAIN", "PROFILE", "SYNCS"):
            args = shlex.split(settings.get(var, ""))
            overrides += option_values(args, "--override")
            if option_values(args, "--families"):
                families = set(option_values(args, "--families"))
                assert families <= set(FAMILIES), (name, families)
            configs = set(option_values(args, "--configs"))
            assert configs <= set(base_of), f"pass {name}: no such benchmark config {configs}"
            bases |= {base_of[config] for config in configs}
        for base in sorted(bases):
            for family in sorted(families):
                path = recipe_path(base, family)
                try:
                    build_config(PretrainConfig, load_recipe(path, overrides))
                except ValueError as e:
                    raise AssertionError(f"pass {name}, {path.name}: {overrides}: {e}") from e
                checked += 1
    assert checked >= 20
