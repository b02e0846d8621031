"""``python -m bench.traffic_per_token``, the memory traffic of a training step counted on the
CPU: views move nothing, products and attention kernels are counted apart from the memory-bound
rest, and the split into a fixed part and a part per token predicts the count at a third batch
size. The count of a compiled step: tests/model/test_kernel_triton.py, beside the fused
kernels' count (one script, one compilation per count)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "op, kind",
    [
        ("view", None),
        ("transpose", None),
        ("empty_like", None),
        ("mm", "compute"),
        ("bmm", "compute"),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", "compute"),
        ("_efficient_attention_forward", "compute"),
        ("add", "memory"),
        ("_to_copy", "memory"),
        ("clone", "memory"),
    ],
)
def test_operators_are_sorted(op, kind):
    from bench.traffic_per_token import kind_of

    assert kind_of(op) == kind


def args_for(**kw) -> argparse.Namespace:
    base = dict(
        base="debug", seq=32, batches=[2, 4], target_batch=6, bandwidth=1e12, vocab=2000,
        padding="none", top=5, override=[], forward_only=False, compiled=False, zero_stage=0,
        precision="fp32", accumulation=1, device="cpu",
    )  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("family", ["softmax", "kernel"])
def test_projection_predicts_a_third_batch(monkeypatch, family):
    """The fit on batches 2 and 4 projects batch 6 to its own count: the traffic grows linearly
    with the batch (the MLM head's slots per row are the trainer's fixed budget)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from bench.traffic_per_token import measure

    projected = measure(family, args_for())
    counted = measure(family, args_for(batches=[6, 8], target_batch=6))
    assert projected["per_token_kb"] > 0 and projected["ops_per_step"] > 0
    assert projected["target_gb"] == pytest.approx(counted["target_gb"], rel=1e-3)
    assert projected["top_per_token_kb"]  # the operators behind the figure are named


def test_forward_only_moves_less_than_a_training_step(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from bench.traffic_per_token import measure

    step = measure("softmax", args_for())
    forward = measure("softmax", args_for(forward_only=True))
    assert 0 < forward["per_token_kb"] < step["per_token_kb"] / 2
    assert forward["ops_per_step"] < step["ops_per_step"] / 2
