"""Parity with HF `transformers` ALBERT through `model.hub.hf_import` (docs/methods.md, ALBERT).

Tiny random HF models with perturbed parameters (so LayerNorm ones and zero biases cannot hide a
mapping bug) are saved to disk, imported through the CLI or the API, and must give the same
outputs at real-token positions (max abs diff <= 1e-5, fp32).
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from model.hub.hf_import import (
    encoder_config_from_hf,
    import_hf_albert,
    main,
)
from model.hub.release import load_release, read_release_config, tokenizer_path

ATOL = 1e-5

TINY = dict(
    vocab_size=100,
    embedding_size=16,
    hidden_size=32,
    num_hidden_layers=4,
    num_hidden_groups=2,
    inner_group_num=2,
    num_attention_heads=4,
    intermediate_size=37,
    hidden_act="gelu_new",
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    classifier_dropout_prob=0.0,
    max_position_embeddings=64,
)


def perturb_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Adds N(0, 0.1^2) to every parameter: LayerNorm weights leave 1, biases leave 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def make_inputs(vocab_size: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """A padded batch (rows of 11, 7 and 4 real tokens) with both token types."""
    g = torch.Generator().manual_seed(seed)
    B, N = 3, 11
    lengths = torch.tensor([11, 7, 4])
    mask = (torch.arange(N)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, vocab_size, (B, N), generator=g) * mask  # pad id 0
    types = (torch.arange(N)[None, :] >= (lengths[:, None] // 2)).long() * mask
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape} vs {theirs.shape}"
    diff = (ours.double() - theirs.double()).abs().max().item()
    assert diff <= ATOL, f"{what}: max abs diff {diff:.3g} > {ATOL}"


def per_application(hf_hidden: tuple, num_layers: int, inner: int) -> tuple:
    """HF hidden states at our granularity (embeddings + one per group application).

    transformers 5.x records every ALBERT layer call (1 + L * inner states), 4.x every group
    application (1 + L)."""
    if len(hf_hidden) == 1 + num_layers * inner:
        return hf_hidden[::inner]
    assert len(hf_hidden) == 1 + num_layers, f"unexpected HF hidden-state count {len(hf_hidden)}"
    return hf_hidden


def compare_hidden(ours, theirs, mask: torch.Tensor, cfg: dict) -> None:
    theirs = per_application(theirs, cfg["num_hidden_layers"], cfg["inner_group_num"])
    assert len(ours) == len(theirs) == cfg["num_hidden_layers"] + 1
    m = mask.bool()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert_close(a[m], b[m], f"hidden state {i}")


@torch.no_grad()
def our_forward(model, inputs):
    return model(**inputs, output_hidden_states=True)


def save_bin(hf_model, path) -> None:
    """What older transformers wrote with safe_serialization=False: a pickled state dict
    (with the tied decoder weight and both MLM biases)."""
    path.mkdir()
    hf_model.config.to_json_file(str(path / "config.json"))
    torch.save(hf_model.state_dict(), path / "pytorch_model.bin")


@pytest.fixture(scope="module")
def hf_pretraining(tmp_path_factory):
    """A tiny perturbed AlbertForPreTraining, saved as safetensors (with a tokenizer.json) and .bin."""
    torch.manual_seed(0)
    hf = perturb_(transformers.AlbertForPreTraining(transformers.AlbertConfig(**TINY)))
    # HF ties predictions.decoder.bias to predictions.bias: the import uses the latter.
    assert torch.equal(hf.predictions.decoder.bias, hf.predictions.bias)
    root = tmp_path_factory.mktemp("hf_pretraining")
    hf.save_pretrained(str(root / "safetensors"))
    (root / "safetensors" / "tokenizer.json").write_text('{"model": "stand-in"}\n')
    save_bin(hf, root / "bin")
    return hf, root


def run_cli(hf_dir, out, *extra) -> None:
    assert main(["--hf-dir", str(hf_dir), "--out", str(out), *extra]) == 0


def assert_pretraining_parity(ours, hf):
    """MLM logits (real tokens), SOP logits and every hidden state agree with the HF model.
    Returns (our output, the inputs, the real-token mask) for further checks."""
    inputs = make_inputs(TINY["vocab_size"])
    with torch.no_grad():
        ref = hf(**inputs, output_hidden_states=True)
    out = our_forward(ours, inputs)
    m = inputs["attention_mask"].bool()
    assert_close(out.logits[m], ref.prediction_logits[m], "MLM logits")
    assert_close(out.sop_logits, ref.sop_logits, "SOP logits")
    compare_hidden(out.encoder.hidden_states, ref.hidden_states, m, TINY)
    return out, inputs, m


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_pretraining_parity(hf_pretraining, tmp_path, fmt):
    hf, root = hf_pretraining
    run_cli(root / fmt, tmp_path / "release")
    ours = load_release(tmp_path / "release").eval()
    assert ours.head_type == "pretraining"

    assert_pretraining_parity(ours, hf)

    if fmt == "safetensors":
        assert tokenizer_path(tmp_path / "release").read_text() == '{"model": "stand-in"}\n'
    else:
        assert tokenizer_path(tmp_path / "release") is None
    extra = read_release_config(tmp_path / "release")["extra"]["hf_import"]
    assert extra["architectures"] == ["AlbertForPreTraining"]
    assert extra["unused"] == [] and extra["initialised"] == []


def test_token_types_and_padding_matter(hf_pretraining, tmp_path):
    """The parity inputs exercise token types and padding: changing either changes outputs."""
    _, root = hf_pretraining
    run_cli(root / "safetensors", tmp_path / "release")
    ours = load_release(tmp_path / "release").eval()
    inputs = make_inputs(TINY["vocab_size"])
    m = inputs["attention_mask"].bool()
    base = our_forward(ours, inputs).logits
    no_types = our_forward(ours, {**inputs, "token_type_ids": None}).logits
    assert (base[m] - no_types[m]).abs().max() > 1e-3
    no_mask = our_forward(ours, {**inputs, "attention_mask": None}).logits
    assert (base[m] - no_mask[m]).abs().max() > 1e-3


@pytest.mark.parametrize("scope", ["shared", "per_layer"])
def test_tisa_zero_amplitude_parity(hf_pretraining, tmp_path, scope):
    hf, root = hf_pretraining
    run_cli(
        root / "safetensors", tmp_path / "release", "--attention", "tisa", "--tisa-scope", scope
    )
    config = read_release_config(tmp_path / "release")
    assert config["encoder"]["attention"] == "tisa"
    assert config["encoder"]["tisa"]["init"] == "zero_amplitude"
    assert config["encoder"]["tisa"]["scope"] == scope
    # Only the new TISA parameters are left at their initialisation.
    new = config["extra"]["hf_import"]["initialised"]
    assert new and all(k.startswith("encoder.family_state.") for k in new), new
    ours = load_release(tmp_path / "release").eval()

    out, inputs, m = assert_pretraining_parity(ours, hf)

    # The TISA scorer is live: moving its new parameters off their init changes the outputs.
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name in new:
                p.add_(0.5)
    moved = our_forward(ours, inputs).logits
    assert (moved[m] - out.logits[m]).abs().max() > 1e-3


def test_sequence_classification_parity(tmp_path):
    cfg = {**TINY, "num_hidden_layers": 3, "num_hidden_groups": 1, "inner_group_num": 1}
    hf = perturb_(
        transformers.AlbertForSequenceClassification(
            transformers.AlbertConfig(**{**cfg, "classifier_dropout_prob": 0.15}, num_labels=3)
        )
    )
    hf.save_pretrained(str(tmp_path / "hf"))
    run_cli(tmp_path / "hf", tmp_path / "release")
    ours = load_release(tmp_path / "release").eval()
    assert ours.head_type == "sequence_classification"
    assert ours.num_labels == 3 and ours.pooling == "cls"
    assert ours.dropout.p == 0.15  # HF's classifier_dropout_prob carries over to fine-tuning

    inputs = make_inputs(cfg["vocab_size"])
    with torch.no_grad():
        ref = hf(**inputs, output_hidden_states=True)
        out = ours(**inputs, output_hidden_states=True)
    assert_close(out.logits, ref.logits, "classifier logits")
    compare_hidden(out.encoder.hidden_states, ref.hidden_states, inputs["attention_mask"], cfg)


def test_albert_model_parity(tmp_path, caplog):
    """A bare AlbertModel (no `albert.` prefix, no heads): encoder equal, heads initialised."""
    cfg = {
        **TINY,
        "hidden_act": "gelu",
        "num_hidden_layers": 3,
        "num_hidden_groups": 3,
        "inner_group_num": 1,
    }
    hf = perturb_(transformers.AlbertModel(transformers.AlbertConfig(**cfg)))
    hf.save_pretrained(str(tmp_path / "hf"))
    assert not any(
        k.startswith("albert.") for k in load_file(str(tmp_path / "hf" / "model.safetensors"))
    )
    with caplog.at_level(logging.INFO, logger="model.hub.hf_import"):
        ours = import_hf_albert(tmp_path / "hf")
    assert ours.head_type == "pretraining"
    assert (
        "sop.weight" in caplog.text and "mlm.dense.weight" in caplog.text
    )  # logged as initialised

    inputs = make_inputs(cfg["vocab_size"])
    with torch.no_grad():
        ref = hf(**inputs, output_hidden_states=True)
        out = ours(**inputs, output_hidden_states=True)
    m = inputs["attention_mask"].bool()
    assert_close(out.encoder.last_hidden_state[m], ref.last_hidden_state[m], "last hidden state")
    assert_close(out.encoder.pooled_output, ref.pooler_output, "pooled output")
    compare_hidden(out.encoder.hidden_states, ref.hidden_states, m, cfg)


# ----------------------------------------------------------------------------- config mapping


def test_config_mapping():
    hf = {
        **transformers.AlbertConfig(**TINY).to_dict(),
        "layer_norm_eps": 1e-7,
        "initializer_range": 0.03,
        "type_vocab_size": 3,
        "pad_token_id": 5,
    }
    cfg = encoder_config_from_hf(hf, attention="tisa")
    for name in (
        "vocab_size",
        "embedding_size",
        "hidden_size",
        "num_hidden_layers",
        "num_hidden_groups",
        "inner_group_num",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
        "type_vocab_size",
        "layer_norm_eps",
        "initializer_range",
        "pad_token_id",
        "hidden_act",
    ):
        assert getattr(cfg, name) == hf[name], name
    assert cfg.attention == "tisa" and cfg.residual == "post_ln"
    assert (
        encoder_config_from_hf({**hf, "hidden_act": "gelu_pytorch_tanh"}).hidden_act == "gelu_new"
    )
    assert encoder_config_from_hf({**hf, "hidden_act": "swish"}).hidden_act == "silu"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"hidden_act": "quick_gelu"}, "hidden_act"),
        ({"model_type": "bert"}, "model_type"),
        ({"num_hidden_layers": 18, "num_hidden_groups": 14}, "HF runs groups"),
        ({"hidden_size": 30}, "divisible"),
    ],
)
def test_config_rejects_what_we_cannot_represent(change, message):
    hf = {**transformers.AlbertConfig(**TINY).to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        encoder_config_from_hf(hf)


# ----------------------------------------------------------------------------- errors


@pytest.fixture
def hf_small(tmp_path):
    """A tiny AlbertForPreTraining dir in tmp_path/hf (fresh per test, so tests may edit it)."""
    cfg = {**TINY, "num_hidden_layers": 2, "num_hidden_groups": 1, "inner_group_num": 1}
    hf = perturb_(transformers.AlbertForPreTraining(transformers.AlbertConfig(**cfg)))
    hf.save_pretrained(str(tmp_path / "hf"))
    return tmp_path / "hf"


def edit_weights(hf_dir, fn) -> None:
    path = hf_dir / "model.safetensors"
    state = load_file(str(path))
    fn(state)
    save_file(state, str(path), metadata={"format": "pt"})


def edit_config(hf_dir, **changes) -> None:
    path = hf_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_missing_dir_config_weights(tmp_path, hf_small, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        import_hf_albert(tmp_path / "nope")
    assert main(["--hf-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == 2
    assert "does not exist" in capsys.readouterr().err

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(hf_small / "config.json", no_weights)
    with pytest.raises(FileNotFoundError, match="no weights"):
        import_hf_albert(no_weights)
    assert main(["--hf-dir", str(no_weights), "--out", str(tmp_path / "r")]) == 2
    assert "no weights" in capsys.readouterr().err

    (hf_small / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        import_hf_albert(hf_small)
    assert not (tmp_path / "r").exists()


def test_cli_unsupported_config_exits_2(tmp_path, hf_small, capsys):
    edit_config(hf_small, position_embedding_type="relative_key_query")
    assert main(["--hf-dir", str(hf_small), "--out", str(tmp_path / "r")]) == 2
    assert "position_embedding_type" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_cli_bad_options_and_overwrite(tmp_path, hf_small, capsys):
    out = tmp_path / "r"
    assert main(["--hf-dir", str(hf_small), "--out", str(out), "--tisa-scope", "per_layer"]) == 2
    assert "--attention tisa" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--hf-dir", str(hf_small), "--out", str(out), "--attention", "kernel"])
    assert e.value.code == 2
    run_cli(hf_small, out)
    assert main(["--hf-dir", str(hf_small), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    run_cli(hf_small, out, "--overwrite")
    with pytest.raises(ValueError, match="cannot be imported"):
        import_hf_albert(hf_small, attention="transject")


def test_missing_encoder_tensor_is_listed(hf_small):
    def drop(state):
        del state["albert.encoder.albert_layer_groups.0.albert_layers.0.ffn.weight"]
        del state["albert.pooler.bias"]

    edit_weights(hf_small, drop)
    with pytest.raises(ValueError, match="lacks 2 encoder tensor") as e:
        import_hf_albert(hf_small)
    assert "encoder.groups.0.0.ffn_in.weight" in str(e.value)
    assert "encoder.pooler.bias" in str(e.value)


def test_unused_tensors_are_reported(hf_small, caplog):
    def add(state):
        state["albert.encoder.extra_adapter.weight"] = torch.zeros(3)
        state["albert.embeddings.position_ids"] = torch.arange(64)[None]  # ignorable buffer

    edit_weights(hf_small, add)
    with caplog.at_level(logging.WARNING, logger="model.hub.hf_import"):
        import_hf_albert(hf_small)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("encoder.extra_adapter.weight" in w for w in warnings), warnings
    assert not any("position_ids" in w for w in warnings), warnings


def test_untied_decoder_and_bad_shapes_are_rejected(hf_small):
    def untie(state):
        state["predictions.decoder.weight"] = state["albert.embeddings.word_embeddings.weight"] + 1

    edit_weights(hf_small, untie)
    with pytest.raises(ValueError, match="untied"):
        import_hf_albert(hf_small)

    edit_weights(hf_small, lambda s: s.pop("predictions.decoder.weight"))
    edit_config(hf_small, intermediate_size=40)  # the saved FFN weights are 37 wide
    with pytest.raises(ValueError, match=r"ffn.weight has shape \(37, 32\)"):
        import_hf_albert(hf_small)


def test_unsupported_architecture(hf_small):
    edit_config(hf_small, architectures=["AlbertForQuestionAnswering"])
    with pytest.raises(ValueError, match="AlbertForQuestionAnswering"):
        import_hf_albert(hf_small)
