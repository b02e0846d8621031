"""An attention family registered from outside the package is a first-class family: it
pretrains (no name test anywhere crashes it), logs its own diagnostics and figure, reports
its FLOPs when it gives them (and trains without an MFU figure when it does not), and its
release exports and loads. Everything a family does is in its `AttentionFamily` entry."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from pretrain_support import TINY_MODEL, base_overrides, make_shards
from torch import Tensor

from engine.metrics import read_image_tags, read_jsonl
from engine.recipe import load_recipe
from model import register_attention
from model.attention import ATTENTION_REGISTRY, AttentionFamily, LayerContext, ScoreKernel
from model.attention.base import matmul_flops
from model.config import EncoderConfig
from model.flops import FlopsNotCounted, counts_flops, forward_flops
from model.hub.release import load_release
from pretrain.config import pretrain_config
from pretrain.train import Trainer

REPO = Path(__file__).resolve().parents[2]


class MeanKernel(ScoreKernel):
    """Every query gets the mean of the real tokens' values: attention with uniform weights."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()

    def forward(self, q_BHNh: Tensor, k_BHNh: Tensor, v_BHNh: Tensor, ctx: LayerContext):
        w_B1N1 = ctx.mask_BN[:, None, :, None].to(v_BHNh.dtype)
        mean_BH1h = (v_BHNh * w_B1N1).sum(2, keepdim=True) / w_B1N1.sum(2, keepdim=True)
        return mean_BH1h.expand_as(q_BHNh), {}


def _diagnostics(encoder, input_ids: Tensor, mask: Tensor) -> dict[str, float]:
    return {"toy/real_tokens": float(mask.sum()), "toy/layers": float(len(encoder.groups))}


def _figures(encoder) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    return {"diagnostics/toy_line": fig}


def _register(name: str, **hooks) -> None:
    if name not in ATTENTION_REGISTRY:
        register_attention(
            AttentionFamily(
                name=name, description="a toy: uniform attention", kernel=MeanKernel, **hooks
            )
        )


_register(
    "toy-mean",
    mixing_flops=lambda cfg, n: 2 * matmul_flops(1, n, cfg.hidden_size),
    diagnostics=_diagnostics,
    figures=_figures,
)
_register("toy-uncounted")


def test_flops_come_from_the_family_entry():
    tiny = dict(vocab_size=50, embedding_size=8, hidden_size=16, num_hidden_layers=2)
    tiny |= dict(num_attention_heads=2, intermediate_size=32, max_position_embeddings=16)
    counted = EncoderConfig(**tiny, attention="toy-mean")
    softmax = EncoderConfig(**tiny)
    assert counts_flops(counted) and counts_flops(softmax)
    # Only the mixing step differs: the toy's 2 x 1 x N x d against softmax's 2 x 2 N N d.
    per_layer = 2 * 2 * 8 * 8 * 16 - 2 * 2 * 1 * 8 * 16
    assert forward_flops(softmax, 8) - forward_flops(counted, 8) == 2 * per_layer
    uncounted = EncoderConfig(**tiny, attention="toy-uncounted")
    assert not counts_flops(uncounted)
    with pytest.raises(FlopsNotCounted, match=r"toy-uncounted.*mixing_flops"):
        forward_flops(uncounted, 8)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("data"))


def _pretrain(shards: Path, run_dir: Path, attention: str, monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    overrides = [
        *base_overrides(shards, run_dir, 4),
        f"model.attention={attention}",
        "engine.backend=torch",
        "engine.zero_stage=0",
        "train.diagnostics_every=2",
    ]
    assert TINY_MODEL[0] in overrides
    cfg = pretrain_config(load_recipe(str(REPO / "configs/pretrain/debug.yaml"), overrides))
    result = Trainer(cfg).run()
    assert result.state == "completed" and result.step == 4


@pytest.mark.slow
def test_a_family_registered_outside_pretrains_logs_and_exports(shards, tmp_path, monkeypatch):
    run_dir = tmp_path / "toy"
    _pretrain(shards, run_dir, "toy-mean", monkeypatch)
    rows = read_jsonl(run_dir / "tensorboard")
    assert rows[2]["diagnostics/toy/real_tokens"] > 0 and rows[4]["diagnostics/toy/layers"] == 1
    assert "diagnostics/activation_factor/layer_00" in rows[2]  # the generic ones too
    assert "diagnostics/toy_line" in read_image_tags(run_dir / "tensorboard")
    assert all(math.isfinite(rows[s]["loss/mlm"]) for s in range(1, 5))
    model = load_release(run_dir / "release")
    assert model.encoder.config.attention == "toy-mean"
    ids = torch.randint(5, 50, (2, 8))
    assert torch.isfinite(model(ids, torch.ones_like(ids)).logits).all()


@pytest.mark.slow
def test_a_family_without_flops_trains_without_mfu(shards, tmp_path, monkeypatch):
    run_dir = tmp_path / "uncounted"
    with pytest.warns(UserWarning, match="no FLOP count"):
        _pretrain(shards, run_dir, "toy-uncounted", monkeypatch)
    rows = read_jsonl(run_dir / "tensorboard")
    assert "throughput/mfu" not in rows[4] and "loss/mlm" in rows[4]
