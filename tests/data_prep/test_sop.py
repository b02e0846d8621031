"""Sentence-order prediction (SOP) end to end: the labels of real batches match the swap, the
shard builder keeps the A|B junction SOP is about, and the project's model + objective learn
SOP where the order is learnable
(docs/benchmarks.md#decisions-whose-measurements-are-in-the-history)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from data_prep import format as fmt
from data_prep.format import truncated_pair_lengths
from data_prep.loader import PretrainingData, PretrainingLoader
from data_prep.masking import IGNORE_INDEX, MaskingConfig
from data_prep.shards import ShardConfig, build_examples, build_shards
from data_prep.tokenizer import write_tokenizer

SEQ = 32


@pytest.fixture(scope="module")
def embedded_shards(tmp_path_factory):
    """Tokenizer (vocab 300) + shards of 32-token pairs from the first 20 embedded documents."""
    root = tmp_path_factory.mktemp("sop_embedded")
    tok = write_tokenizer(root / "tokenizer", inputs=["embedded:20"], vocab_size=300)
    cfg = ShardConfig(inputs=("embedded:20",), num_shards=2, max_seq_length=SEQ, seed=0)
    build_shards(cfg, tok, root / "shards", workers=1)
    return root / "shards"


def test_sop_labels_match_the_swap_in_real_batches(embedded_shards):
    """Collated loader batches over two epochs: sop_labels[i] == 1 exactly when the first segment
    is B and the second A (ids recovered under the MLM masking), token types 0 up to the first
    [SEP], [CLS] first; both labels occur in about equal numbers, and pairs flip across epochs."""
    data = PretrainingData(embedded_shards, max_seq_length=SEQ, seed=3)
    special = data.special
    loader = PretrainingLoader(data, batch_size=16, num_epochs=2)
    labels_by_index: dict[int, list[int]] = {}
    checked = 0
    for b, batch in enumerate(loader):
        epoch, k = divmod(b, loader.batches_per_epoch)
        indices = loader.plan.batch_indices(epoch, k).tolist()
        for row, index in enumerate(indices):
            n = int(batch["attention_mask"][row].sum())
            ids = batch["input_ids"][row, :n].numpy()
            mlm = batch["mlm_labels"][row, :n].numpy()
            types = batch["token_type_ids"][row, :n].numpy()
            original = np.where(mlm != IGNORE_INDEX, mlm, ids)
            sep = np.flatnonzero(original == special.sep)
            assert original[0] == special.cls and len(sep) == 2 and sep[1] == n - 1
            first, second = original[1 : sep[0]], original[sep[0] + 1 : sep[1]]
            np.testing.assert_array_equal(types, (np.arange(n) > sep[0]).astype(np.int64))
            a, b_ = data.segments(index)
            la, lb = truncated_pair_lengths(len(a), len(b_), SEQ - 3)
            a, b_ = a[len(a) - la :], b_[:lb]
            label = int(batch["sop_labels"][row])
            expected = (b_, a) if label == 1 else (a, b_)
            assert label in (0, 1)
            np.testing.assert_array_equal(first, expected[0])
            np.testing.assert_array_equal(second, expected[1])
            labels_by_index.setdefault(index, []).append(label)
            checked += 1
    assert checked >= 2 * 200
    labels = [v for vs in labels_by_index.values() for v in vs]
    assert abs(np.mean(labels) - 0.5) < 0.06, np.mean(labels)
    flipped = np.mean([len(set(vs)) == 2 for vs in labels_by_index.values() if len(vs) == 2])
    assert 0.35 < flipped < 0.65  # the swap is drawn again every epoch


def test_shard_pairs_keep_the_a_b_junction():
    """With `truncation="junction"`, B starts right where A ends in the document, also when a
    chunk overshoots the target and is truncated; ALBERT's random-end truncation (the default)
    cuts it in most truncated pairs. Tokens are consecutive integers, so the junction is intact
    iff b[0] == a[-1] + 1."""
    rng = random.Random(0)
    start, sentences = 0, []
    for _ in range(400):  # lines of 5-20 tokens, as the embedded corpus's wrapped lines
        n = rng.randint(5, 20)
        sentences.append(list(range(start, start + n)))
        start += n
    examples, dropped = build_examples(sentences, 61, 0.1, random.Random(1), "junction")
    assert dropped > 0  # the truncation path ran
    broken = [a[-1] + 1 != b[0] for a, b in examples]
    assert not any(broken), f"{sum(broken)} of {len(examples)} pairs lost their A|B junction"
    albert, _ = build_examples(sentences, 61, 0.1, random.Random(1))
    assert sum(a[-1] + 1 != b[0] for a, b in albert) > len(albert) // 4


# --------------------------------------------------------------------------------------------
# Learnability on a synthetic corpus where the order is visible in the words


BANDS, WORDS_PER_BAND = 10, 4


def _synthetic_corpus(path, documents: int, seed: int) -> None:
    """Documents of 6 lines; line k uses the words of band s + k (s random per document), so
    any band occurs early in some documents and late in others: the order is in which of the
    two segments holds the higher bands, not in any one word."""
    rng = random.Random(seed)
    rows = []
    for _ in range(documents):
        s = rng.randint(0, BANDS - 6)
        lines = [
            " ".join(f"b{s + k}w{rng.randrange(WORDS_PER_BAND)}" for _ in range(rng.randint(3, 6)))
            for k in range(6)
        ]
        rows.append(json.dumps({"text": "\n".join(lines)}))
    path.write_text("\n".join(rows) + "\n")


def _word_level_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = list(fmt.ALBERT_SPECIAL_TOKENS)
    vocab += [f"b{b}w{w}" for b in range(BANDS) for w in range(WORDS_PER_BAND)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(fmt.ALBERT_SPECIAL_TOKENS))
    tok.save(str(path))


def test_sop_is_learnable_by_the_model_and_objective(tmp_path):
    """Shards from a synthetic corpus (the real builder), the real loader (MLM + SOP masking),
    EncoderForPretraining and pretraining_loss (MLM + SOP): held-out SOP accuracy over both
    orders of fresh pairs (chance exactly 0.5) goes above 0.9 within 300 steps (< 10 s)."""
    from model.config import EncoderConfig
    from model.heads import EncoderForPretraining
    from pretrain.objective import model_inputs, pretraining_loss

    torch.set_num_threads(1)
    tok = tmp_path / "tokenizer.json"
    _word_level_tokenizer(tok)
    dirs = {}
    for part, docs, seed in (("train", 600, 0), ("heldout", 100, 1)):
        _synthetic_corpus(tmp_path / f"{part}.jsonl", docs, seed)
        cfg = ShardConfig(
            inputs=(str(tmp_path / f"{part}.jsonl"),), num_shards=1, max_seq_length=SEQ
        )
        build_shards(cfg, tok, tmp_path / part, workers=1)
        dirs[part] = tmp_path / part
    masking = MaskingConfig(whole_word=False)
    data = PretrainingData(dirs["train"], max_seq_length=SEQ, masking=masking, seed=0)
    model = EncoderForPretraining(
        EncoderConfig.preset(
            "debug",
            vocab_size=data.vocab_size,
            hidden_size=32,
            embedding_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ,
        )
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    batches = iter(PretrainingLoader(data, batch_size=32))
    model.train()
    for _ in range(300):
        batch = next(batches)
        loss = pretraining_loss(model(**model_inputs(batch)), batch)
        opt.zero_grad()
        loss.total.backward()
        opt.step()

    held = PretrainingData(dirs["heldout"], max_seq_length=SEQ, masking=masking)
    sp = held.special
    rows, labels = [], []
    for i in range(len(held)):
        a, b = held.segments(i)
        for x, y, label in ((a, b, 0), (b, a, 1)):
            rows.append([sp.cls, *x.tolist(), sp.sep, *y.tolist(), sp.sep, len(x)])
            labels.append(label)
    assert len(rows) >= 200
    width = max(len(r) - 1 for r in rows)
    ids = torch.full((len(rows), width), sp.pad)
    types = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        seq, la = row[:-1], row[-1]
        ids[r, : len(seq)] = torch.tensor(seq)
        types[r, la + 2 : len(seq)] = 1
    model.eval()
    with torch.no_grad():
        out = model(ids, (ids != sp.pad).long(), types, masked_positions=ids < 0)
    accuracy = (out.sop_logits.argmax(-1) == torch.tensor(labels)).float().mean().item()
    assert accuracy > 0.9, accuracy


def test_truncation_option_is_checked_and_recorded():
    with pytest.raises(ValueError, match="--truncation"):
        ShardConfig(inputs=("embedded:2",), num_shards=1, truncation="middle")
    default = ShardConfig(inputs=("embedded:2",), num_shards=1)
    junction = ShardConfig(inputs=("embedded:2",), num_shards=1, truncation="junction")
    assert "truncation" not in default.to_dict()  # manifests from before the option still match
    assert junction.to_dict()["truncation"] == "junction"
