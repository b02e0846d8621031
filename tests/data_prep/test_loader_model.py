"""data_prep output feeding the model: real tokenizer and shards, the training loader, the
pretraining model; dynamic and static-shape batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from data_prep.loader import PretrainingData, PretrainingLoader
from data_prep.masking import MaskingConfig
from data_prep.shards import ShardConfig, build_shards
from data_prep.tokenizer import write_tokenizer
from model import EncoderConfig, EncoderForPretraining


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    tok = write_tokenizer(root / "tok", inputs=["embedded:40"], vocab_size=500)
    build_shards(
        ShardConfig(inputs=("embedded:40",), num_shards=2, max_seq_length=48), tok, root / "shards"
    )
    return tok, root / "shards"


def test_static_shape_batches_through_the_model(shards):
    tok, shard_dir = shards
    masking = MaskingConfig(static_masked_positions=8)
    data = PretrainingData(shard_dir, max_seq_length=48, masking=masking, tokenizer_path=tok)
    batch = next(iter(PretrainingLoader(data, batch_size=4)))
    assert batch["input_ids"].shape == (4, 48) and batch["masked_positions"].shape == (4, 8)
    model = EncoderForPretraining(
        EncoderConfig.preset("debug", vocab_size=data.vocab_size, max_position_embeddings=48)
    )
    out = model(
        batch["input_ids"],
        batch["attention_mask"],
        batch["token_type_ids"],
        masked_positions=batch["masked_positions"],
    )
    assert out.logits.shape == (4, 8, data.vocab_size)
    # The static path equals the dense logits gathered at the same positions.
    dense = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).logits
    picked = dense.gather(1, batch["masked_positions"][..., None].expand(-1, -1, dense.shape[-1]))
    torch.testing.assert_close(out.logits, picked, atol=1e-5, rtol=1e-5)
    loss = F.cross_entropy(
        out.logits.flatten(0, 1), batch["masked_labels"].flatten(), ignore_index=-100
    )
    assert torch.isfinite(loss)
    # masked_labels are the original ids at the masked positions.
    real = batch["masked_weights"] > 0
    labels_at = batch["mlm_labels"].gather(1, batch["masked_positions"])
    assert torch.equal(labels_at[real], batch["masked_labels"][real])


def test_dynamic_batches_train(shards):
    tok, shard_dir = shards
    data = PretrainingData(shard_dir, max_seq_length=48, tokenizer_path=tok)
    loader = PretrainingLoader(data, batch_size=8)
    torch.manual_seed(0)
    model = EncoderForPretraining(
        EncoderConfig.preset("debug", vocab_size=data.vocab_size, max_position_embeddings=48)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _, batch in zip(range(12), loader):
        out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        loss = F.cross_entropy(
            out.logits.flatten(0, 1), batch["mlm_labels"].flatten(), ignore_index=-100
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
