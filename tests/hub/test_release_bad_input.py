"""A release that cannot be what it claims is refused with an error naming the file and the fault.

Found by a hostile-user sweep: a release holding another vocabulary's tokenizer.json loaded (and
fine-tuned) without a word; a truncated model.safetensors, a config.json that is not a release
config, and weights of another shape all raised errors that named no file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from data_prep.tokenizer import load_tokenizer, write_tokenizer
from model.config import EncoderConfig
from model.heads import EncoderForPretraining
from model.hub.release import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    check_tokenizer,
    load_release,
    read_release_config,
    save_release,
)

VOCAB = 300  # the release's tokenizer
OTHER_VOCAB = 200  # a tokenizer of another vocabulary


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[int, Path]:
    """Two trained tokenizers (the project's own kind: <pad>=0 ... [MASK]=4), 300 and 200 tokens."""
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for size in (VOCAB, OTHER_VOCAB):
        path = write_tokenizer(root / f"tok{size}", inputs=["embedded:40"], vocab_size=size)
        assert load_tokenizer(path).get_vocab_size(with_added_tokens=True) == size
        out[size] = path
    return out


def tiny_model(vocab_size: int = VOCAB, **overrides) -> EncoderForPretraining:
    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "max_position_embeddings": 64}
    cfg = EncoderConfig.preset("debug", vocab_size=vocab_size, **{**sizes, **overrides})
    return EncoderForPretraining(cfg)


@pytest.fixture()
def release(tmp_path, tokenizers) -> Path:
    """A good release: 300-token model, its own 300-token tokenizer."""
    return save_release(tmp_path / "release", tiny_model(), tokenizer_file=tokenizers[VOCAB])


def swap_tokenizer(release: Path, tokenizer: Path) -> None:
    """What a user does by hand: copies another tokenizer.json into a release."""
    shutil.copyfile(tokenizer, release / TOKENIZER_FILE)


# ------------------------------------------------------------------ tokenizer vs vocabulary


def test_release_with_its_own_tokenizer_loads(release, tokenizers):
    model = load_release(release)
    assert model.config.vocab_size == VOCAB
    tok = check_tokenizer(release)
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    # The public check also takes a tokenizer.json and a config (EncoderConfig or a dict).
    check_tokenizer(tokenizers[VOCAB], model.config)
    check_tokenizer(release / TOKENIZER_FILE, read_release_config(release))


@pytest.mark.parametrize("other", ["smaller", "larger"])
def test_release_with_another_vocabularys_tokenizer_is_refused(tmp_path, tokenizers, other):
    """A tokenizer of another size maps text to ids of another vocabulary: the model would be
    fine-tuned on wrong embeddings (smaller), or index past its embedding table (larger)."""
    if other == "smaller":
        release = save_release(tmp_path / "r", tiny_model(), tokenizer_file=tokenizers[VOCAB])
        swap_tokenizer(release, tokenizers[OTHER_VOCAB])
        tok_n, model_n = OTHER_VOCAB, VOCAB
    else:
        release = save_release(
            tmp_path / "r", tiny_model(OTHER_VOCAB), tokenizer_file=tokenizers[OTHER_VOCAB]
        )
        swap_tokenizer(release, tokenizers[VOCAB])
        tok_n, model_n = VOCAB, OTHER_VOCAB
    with pytest.raises(ValueError) as err:
        load_release(release)
    msg = str(err.value)
    assert str(release) in msg and str(release / TOKENIZER_FILE) in msg, msg
    assert f"{tok_n} tokens" in msg and f"vocabulary has {model_n}" in msg, msg
    assert "vocab_size" in msg and "does not belong to these weights" in msg, msg
    # The same refusal with a new head (what GLUE / LRA fine-tuning asks for).
    with pytest.raises(ValueError, match="does not belong"):
        load_release(release, head={"type": "sequence_classification", "num_labels": 2})
    with pytest.raises(ValueError, match="does not belong"):
        check_tokenizer(release)


def test_release_whose_pad_id_is_not_the_tokenizers_is_refused(tmp_path, tokenizers):
    """Same size, but the model pads with id 1 where the tokenizer's <pad> is 0."""
    release = save_release(tmp_path / "r", tiny_model(pad_token_id=1))
    swap_tokenizer(release, tokenizers[VOCAB])
    with pytest.raises(ValueError) as err:
        load_release(release)
    msg = str(err.value)
    assert str(release) in msg and str(release / TOKENIZER_FILE) in msg, msg
    assert "pad_token_id" in msg and "'<pad>' is id 0" in msg and "1" in msg, msg


def test_check_tokenizer_on_a_tokenizer_file_and_a_config(tokenizers):
    """Fine-tuning can call the check on its own, before loading any weights."""
    cfg = tiny_model().config
    with pytest.raises(ValueError) as err:
        check_tokenizer(tokenizers[OTHER_VOCAB], cfg)
    assert str(tokenizers[OTHER_VOCAB]) in str(err.value)
    assert f"{OTHER_VOCAB} tokens" in str(err.value)
    with pytest.raises(ValueError, match="pad_token_id"):
        check_tokenizer(tokenizers[VOCAB], {**cfg.to_dict(), "pad_token_id": 2})


def test_save_release_refuses_a_tokenizer_of_another_vocabulary(tmp_path, tokenizers):
    """Refused when written, not only when read: nothing is left behind."""
    out = tmp_path / "r"
    with pytest.raises(ValueError, match="does not belong") as err:
        save_release(out, tiny_model(), tokenizer_file=tokenizers[OTHER_VOCAB])
    assert str(tokenizers[OTHER_VOCAB]) in str(err.value)
    assert not out.exists() and os.listdir(tmp_path) == []


def test_unreadable_tokenizer(release, caplog):
    """A tokenizer.json that `tokenizers` cannot read: load_release loads the weights and warns
    (the tokenizer is not needed to use them); check_tokenizer refuses, naming the file."""
    (release / TOKENIZER_FILE).write_text('{"model": "stand-in"}\n')
    with caplog.at_level(logging.WARNING, logger="model.hub.release"):
        load_release(release)
    assert str(release / TOKENIZER_FILE) in caplog.text
    with pytest.raises(ValueError, match="not a readable tokenizer") as err:
        check_tokenizer(release)
    assert str(release / TOKENIZER_FILE) in str(err.value)


def test_check_tokenizer_without_a_tokenizer(tmp_path):
    release = save_release(tmp_path / "r", tiny_model())
    load_release(release)  # a release need not ship a tokenizer
    with pytest.raises(FileNotFoundError, match=str(release / TOKENIZER_FILE)):
        check_tokenizer(release)


# ------------------------------------------------------------------ weights


@pytest.mark.parametrize("keep", [0, 5, 100, "half", -4])
def test_truncated_weights_name_the_file(release, keep):
    weights = release / WEIGHTS_FILE
    data = weights.read_bytes()
    size = len(data) // 2 if keep == "half" else keep if keep >= 0 else len(data) + keep
    weights.write_bytes(data[:size])
    with pytest.raises(ValueError) as err:
        load_release(release)
    msg = str(err.value)
    assert str(weights) in msg and "truncated or corrupt" in msg, msg


def test_missing_weights_name_the_file(release):
    (release / WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_release(release)
    assert str(release / WEIGHTS_FILE) in str(err.value)


def test_weights_of_another_model_name_both_files(tmp_path, release):
    """model.safetensors of another config (here a wider model) copied into the release."""
    other = save_release(tmp_path / "other", tiny_model(hidden_size=64))
    shutil.copyfile(other / WEIGHTS_FILE, release / WEIGHTS_FILE)
    for head in (None, {"type": "sequence_classification", "num_labels": 2}):
        with pytest.raises(ValueError) as err:
            load_release(release, head=head)
        msg = str(err.value)
        assert str(release / WEIGHTS_FILE) in msg and str(release / CONFIG_FILE) in msg, msg
        assert "encoder.embeddings.projection.weight" in msg, msg


# ------------------------------------------------------------------ config.json


def edit_config(release: Path, edit) -> None:
    path = release / CONFIG_FILE
    config = json.loads(path.read_text())
    path.write_text(json.dumps(edit(config)))


CORRUPT_CONFIGS = {
    "truncated": lambda p: p.write_text(p.read_text()[:40]),
    "empty": lambda p: p.write_text(""),
    "not utf-8": lambda p: p.write_bytes(b"\xff\xfe\x00garbage"),
    "a list": lambda p: p.write_text("[1, 2]"),
    "no encoder": lambda p: edit_config(p.parent, lambda c: {**c, "encoder": None}),
    "no head": lambda p: edit_config(
        p.parent, lambda c: {k: v for k, v in c.items() if k != "head"}
    ),
    "bad encoder value": lambda p: edit_config(
        p.parent, lambda c: {**c, "encoder": {**c["encoder"], "num_attention_heads": 5}}
    ),
    "unknown encoder key": lambda p: edit_config(
        p.parent, lambda c: {**c, "encoder": {**c["encoder"], "hiden_size": 32}}
    ),
    "unknown head": lambda p: edit_config(p.parent, lambda c: {**c, "head": {"type": "nope"}}),
}


@pytest.mark.parametrize("fault", list(CORRUPT_CONFIGS))
def test_corrupt_config_names_the_file(release, fault):
    path = release / CONFIG_FILE
    CORRUPT_CONFIGS[fault](path)
    with pytest.raises(ValueError) as err:
        load_release(release)
    assert str(path) in str(err.value), str(err.value)


@pytest.mark.parametrize("fault", ["truncated", "not utf-8", "a list", "no encoder", "no head"])
def test_read_release_config_names_the_file(release, fault):
    path = release / CONFIG_FILE
    CORRUPT_CONFIGS[fault](path)
    with pytest.raises(ValueError) as err:
        read_release_config(release)
    assert str(path) in str(err.value), str(err.value)


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / CONFIG_FILE)):
        load_release(tmp_path)
