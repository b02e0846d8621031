"""Shared test setup: no network, deterministic torch."""

import os

# Before anything imports transformers / huggingface_hub: tests never download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same torch RNG state."""
    torch.manual_seed(0)
