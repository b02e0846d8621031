"""The `gpu` tier: tests that need a CUDA GPU (``pytest -m gpu`` on a GPU machine). Each such
module sets ``pytestmark = GPU`` (or a test carries both marks); without CUDA they are skipped,
with the reason."""

from __future__ import annotations

import pytest
import torch

from model import EncoderConfig

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = [pytest.mark.gpu, needs_gpu]
"""The marks of a module of GPU tests (``pytestmark = GPU``); one test: ``@pytest.mark.gpu``
and ``@needs_gpu``."""

FAMILY_SETTINGS = {
    "softmax": {},
    "tisa": {"position_embedding": "none"},
    "kernel": {"kernel": {"feature_map": "aoglu", "dropout": 0.0}},
    "transject": {"transject": {"num_experts": 4}},
}
"""Each family at the width below with its recipes' choices that matter to the checks."""


ALBERT_BASE_WIDTH = {"vocab_size": 8000, "embedding_size": 128, "hidden_size": 768,
                     "num_attention_heads": 12, "intermediate_size": 3072}  # fmt: skip
"""ALBERT-base's width (d 768, 12 heads, FFN 3072), a vocabulary of 8000."""


def albert_base_width(family: str, layers: int = 4, seq: int = 512, **extra) -> EncoderConfig:
    """`family` at ALBERT-base's width with `layers` applications of the shared layer, no
    dropout, positions for `seq` tokens (at least 512)."""
    settings = {**ALBERT_BASE_WIDTH, **FAMILY_SETTINGS[family], **extra}
    settings.update(num_hidden_layers=layers, max_position_embeddings=max(512, seq))
    return EncoderConfig.preset("debug", attention=family, hidden_dropout_prob=0.0, **settings)


def padded_batch(batch: int, seq: int, vocab: int = 8000, device: str = "cuda"):
    """(ids, mask): random tokens, a quarter of the rows padded to half length."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[: batch // 4, seq // 2 :] = False
    return ids.to(device), mask.to(device)


def pretraining_loss(out) -> torch.Tensor:
    """A loss over every output of `EncoderForPretraining`: the MLM logits' log-sum-exp, the
    SOP logits and the auxiliary losses."""
    loss = out.logits.float().logsumexp(-1).mean() + out.sop_logits.float().sum()
    return loss + sum(out.aux_losses.values(), torch.zeros((), device=out.logits.device))
