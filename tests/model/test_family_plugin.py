"""An attention family from another installed package (entry-point group
``albatross.attention``) is in every process that imports ``model``: it pretrains through
``albatross pretrain`` and as a Slurm job with no registration call anywhere. A broken or
duplicate entry point is left out with a warning, the other families still work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from pretrain_support import REPO, base_overrides, make_shards

from model.attention import registry
from model.attention.registry import AttentionRegistry, load_installed_families

NAME = "plugin-mean"
PACKAGE = '''
"""A uniform-attention family in a package of its own (the test's plugin), with its settings."""
from dataclasses import dataclass

from model.attention import AttentionFamily, ScoreKernel


@dataclass
class MeanOptions:
    scale: float = 1.0
    """Multiplies the mean of the values."""


class MeanKernel(ScoreKernel):
    def __init__(self, cfg):
        super().__init__()
        self.scale = cfg.mean.scale

    def forward(self, q, k, v, ctx):
        w = ctx.mask_BN[:, None, :, None].to(v.dtype)
        mean = (v * w).sum(2, keepdim=True) / w.sum(2, keepdim=True)
        return (self.scale * mean).expand_as(q), {}


FAMILY = AttentionFamily(name="plugin-mean", description="uniform attention", kernel=MeanKernel,
                         options=MeanOptions, options_key="mean")
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """The plugin package installed with pip into a folder of its own (put on PYTHONPATH, as a
    second site-packages), leaving the project's environment as it is."""
    root = tmp_path_factory.mktemp("plugin")
    src = root / "src"
    (src / "albatross_plugin_mean").mkdir(parents=True)
    (src / "albatross_plugin_mean" / "__init__.py").write_text(PACKAGE)
    (src / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "albatross-plugin-mean"
        version = "0.1"
        [project.entry-points."albatross.attention"]
        {NAME} = "albatross_plugin_mean:FAMILY"
    """))  # fmt: skip
    site = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(src)], check=True, capture_output=True,
    )  # fmt: skip
    return site


def plugin_env(site: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    return env


def pretrain_args(tmp_path: Path, run_dir: Path) -> list[str]:
    shards = make_shards(tmp_path / "data")
    return ["--config", str(REPO / "configs" / "pretrain" / "debug.yaml"),
            *base_overrides(shards, run_dir, 3), "engine.backend=torch", "engine.zero_stage=0",
            f"model.attention={NAME}"]  # fmt: skip


@pytest.mark.integration
def test_an_installed_family_pretrains_through_the_command_line(plugin_site, tmp_path):
    run_dir = tmp_path / "run"
    exe = Path(sys.executable).parent / "albatross"
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "albatross"]
    proc = subprocess.run([*cmd, "pretrain", *pretrain_args(tmp_path, run_dir),
                           "model.mean.scale=0.5"], env=plugin_env(plugin_site),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"
    release = json.loads((run_dir / "release" / "config.json").read_text())
    assert release["encoder"]["attention"] == NAME
    assert release["encoder"]["mean"] == {"scale": 0.5}  # the plugin's own settings
    # without the plugin on the path, the name is unknown: a clear error, exit 2
    bare = dict(plugin_env(plugin_site), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "pretrain",
                           *pretrain_args(tmp_path / "b", tmp_path / "run2")], env=bare,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2 and f"unknown attention '{NAME}'" in proc.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_an_installed_family_pretrains_as_a_slurm_job(plugin_site, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "slurm", "pretrain", "--gpus-per-node", "0",
           "--tasks-per-node", "1", "--time", "00:10:00", "--log-dir", str(tmp_path / "logs"),
           "--wait", "--", *pretrain_args(tmp_path, run_dir)]  # fmt: skip
    proc = subprocess.run(cmd, env=plugin_env(plugin_site), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "completed" in proc.stdout
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"


def test_a_broken_or_duplicate_entry_point_is_left_out_with_a_warning(monkeypatch):
    from model.attention import softmax

    points = [
        EntryPoint("broken", "albatross_no_such_module:FAMILY", registry.ENTRY_POINT_GROUP),
        EntryPoint("again", "model.attention.softmax:FAMILY", registry.ENTRY_POINT_GROUP),
        EntryPoint("module", "model.attention.tisa", registry.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(registry, "entry_points", lambda group: points)
    fresh = AttentionRegistry()
    fresh.register(softmax.FAMILY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        added = load_installed_families(fresh)
    assert added == ["tisa"]  # a module holding FAMILY works too
    messages = [str(w.message) for w in caught]
    assert any("broken" in m and "albatross_no_such_module" in m for m in messages)
    assert any("again" in m and "already registered" in m for m in messages)
    assert fresh.names() == ["softmax", "tisa"]


@dataclass
class _Toy:
    """Settings of a family registered by the test."""

    width: int = 2
    """A setting."""


def test_a_familys_settings_are_a_section_of_the_encoder_config(monkeypatch):
    """A family registered from outside (entry point or register_attention) brings its settings
    class: the encoder config takes, checks, saves and reads them under the family's key, and
    every config has the section, with its defaults (ignored by the other families)."""
    from model.attention import ATTENTION_REGISTRY, AttentionFamily, softmax
    from model.config import EncoderConfig
    from model.typed_config import config_keys

    family = AttentionFamily(
        name="toy-options", description="softmax", kernel=softmax.SoftmaxKernel, options=_Toy
    )
    monkeypatch.setitem(ATTENTION_REGISTRY._families, family.name, family)  # undone after
    cfg = EncoderConfig.preset("debug", attention="toy-options", **{"toy-options": {"width": 3}})
    assert getattr(cfg, "toy-options") == _Toy(width=3)
    assert EncoderConfig().family_options["toy-options"] == _Toy()
    assert cfg.to_dict()["toy-options"] == {"width": 3}
    assert EncoderConfig.from_dict(cfg.to_dict()) == cfg
    assert "toy-options" in config_keys(EncoderConfig) and cfg.tisa.num_kernels == 5
    with pytest.raises(ValueError, match=r"unknown config key 'toy-options.widht'.*'width'"):
        EncoderConfig.from_dict({"toy-options": {"widht": 3}})
    with pytest.raises(ValueError, match="must be an integer"):
        EncoderConfig(**{"toy-options": {"width": "3"}})
    clash = AttentionFamily(name="other", description="x", kernel=softmax.SoftmaxKernel,
                            options=_Toy, options_key="tisa")  # fmt: skip
    with pytest.raises(ValueError, match=r"'tisa' of its options is taken by .*TISAConfig"):
        ATTENTION_REGISTRY.register(clash)
