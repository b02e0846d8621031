"""Every shipped model config parses into a valid EncoderConfig; package imports work."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import yaml

from model import EncoderConfig, EncoderForPretraining

CONFIGS = sorted((Path(__file__).parents[1] / "configs" / "model").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert len(CONFIGS) >= 8


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_model_config_parses(path):
    data = yaml.safe_load(path.read_text())
    cfg = EncoderConfig.from_dict(data)
    assert EncoderConfig.from_dict(cfg.to_dict()) == cfg
    for key, value in data.items():
        if key != "preset" and not isinstance(value, dict):
            assert getattr(cfg, key) == value, key
    # Build it at a tiny width to check the whole combination constructs and runs.
    small = EncoderConfig.from_dict(
        {
            **data,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "embedding_size": 16,
            "vocab_size": 100,
            "num_hidden_layers": 2,
        }
    )
    out = EncoderForPretraining(small)(torch.randint(0, 100, (2, 6)))
    assert torch.isfinite(out.logits).all()


def test_preset_key_with_a_typo_fails():
    with pytest.raises(ValueError, match="did you mean 'attention'"):
        EncoderConfig.from_dict({"preset": "albert-base", "atention": "tisa"})


@pytest.mark.parametrize(
    "module",
    [
        "model",
        "model.hf_import",
        "model.diagnostics",
        "model.release",
        "pretrain.smoke",
        "data_prep.corpus",
        "engine",
        "finetune",
        "slurm",
    ],
)
def test_imports(module):
    importlib.import_module(module)
