"""The Hugging Face export in-process (the fresh-process loading is in test_hf_export_fresh.py):
the Cayley inverse, export -> import round trips of every family (its orthogonal maps as
matrices and back), the native ALBERT against `transformers`, the tokenizer files and the model
card, and bad input: a family without an HF mapping, a directory that is not a release, a head
with no `transformers` counterpart, a matrix trained out of orthogonality."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from hf_export_support import (
    ATOL,
    BASE,
    FAMILIES,
    build,
    make_inputs,
    make_release,
    max_diff,
    perturb_,
)
from safetensors.torch import load_file, save_file

from data_prep.tokenizer import write_tokenizer
from model.attention import ATTENTION_REGISTRY
from model.config import EncoderConfig
from model.heads import build_model
from model.hub.hf_export import (
    FAMILY_FILE,
    ExportError,
    cayley_inverse,
    export_hf,
    import_export,
    materialised_state_dict,
)
from model.hub.hf_import import import_hf_albert
from model.hub.release import load_release, save_release
from model.orthogonal import cayley
from pretrain.export import main as export_main

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    write_tokenizer(root / "tok", inputs=["embedded:40"], vocab_size=300)
    return root / "tok" / "tokenizer.json"


@pytest.mark.parametrize("shape", [(8, 8), (3, 8, 8), (5, 12), (12, 5), (2, 4, 9)])
def test_cayley_inverse_gives_back_the_matrix(shape):
    """Square, tall, wide (the orthogonal token embedding) and batched (TransJect's experts)."""
    X = 0.4 * torch.randn(shape)
    Q = cayley(X)
    assert max_diff(cayley(cayley_inverse(Q)), Q) < 1e-6


def _forward(model, inputs):
    with torch.no_grad():
        return model(**inputs, output_hidden_states=True)


def _assert_same_outputs(a, b, inputs):
    m = inputs["attention_mask"].bool()
    assert max_diff(a.logits[m], b.logits[m]) <= ATOL
    for x, y in zip(a.encoder.hidden_states, b.encoder.hidden_states, strict=True):
        assert max_diff(x[m], y[m]) <= ATOL
    if a.sop_logits is not None:
        assert max_diff(a.sop_logits, b.sop_logits) <= ATOL


@pytest.mark.parametrize("name", [*FAMILIES, "transject_orthogonal_embedding"])
def test_export_then_import_computes_the_release(tmp_path, name):
    """Weights as matrices (no `parametrizations` key), back through the importer (the Cayley
    inverse for orthogonal maps): the same outputs. TransJect with V <= d/2 has an orthogonal
    (wide) token embedding."""
    if name == "transject_orthogonal_embedding":
        torch.manual_seed(0)
        cfg = EncoderConfig.from_dict({**BASE, **FAMILIES["transject"], "vocab_size": 16})
        model = perturb_(build_model(cfg), 1)
        assert model.encoder.embeddings.orthogonal
        inputs = make_inputs(vocab_size=16)
    else:
        model, inputs = build(name), make_inputs()
    release = save_release(tmp_path / "release", model)
    out = export_hf(release, tmp_path / "hf")
    weights = load_file(str(out / "model.safetensors"))
    assert not any("parametrizations" in k for k in weights)
    imported = import_hf_albert(out)  # the importer recognises our exports, any family
    _assert_same_outputs(_forward(model, inputs), _forward(imported, inputs), inputs)
    assert imported.config.attention == model.config.attention


def test_softmax_is_a_native_albert(tmp_path, tokenizer):
    """AlbertForPreTraining loads it with no remote code and computes our MLM and SOP logits."""
    release = make_release("softmax", tmp_path, tokenizer)
    out = export_hf(release, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "albert" and config["architectures"] == ["AlbertForPreTraining"]
    assert not list(out.glob("*.py"))
    hf = transformers.AlbertForPreTraining.from_pretrained(out).eval()
    ours = load_release(release).eval()
    inputs = make_inputs()
    m = inputs["attention_mask"].bool()
    with torch.no_grad():
        theirs = hf(**inputs)
    mine = _forward(ours, inputs)
    assert max_diff(mine.logits[m], theirs.prediction_logits[m]) <= ATOL
    assert max_diff(mine.sop_logits, theirs.sop_logits) <= ATOL
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.is_fast
    assert (tok.cls_token, tok.sep_token, tok.mask_token) == ("[CLS]", "[SEP]", "[MASK]")
    assert (tok.pad_token, tok.unk_token) == ("<pad>", "<unk>")
    assert tok.pad_token_id == ours.config.pad_token_id == 0


@pytest.mark.parametrize("name", ["softmax", "transject"])
def test_a_classifier_release_exports(tmp_path, name):
    """cls pooling -> AlbertForSequenceClassification (native); TransJect's mean pooling ->
    AlbatrossForSequenceClassification, whose import gives back the same classifier."""
    pooling = "cls" if name == "softmax" else "mean"
    head = {"type": "sequence_classification", "num_labels": 3, "pooling": pooling}
    model = build(name, head=head)
    release = save_release(tmp_path / "release", model)
    out = export_hf(release, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    inputs = make_inputs()
    with torch.no_grad():
        ours = model(**inputs).logits
    if name == "softmax":
        assert config["architectures"] == ["AlbertForSequenceClassification"]
        hf = transformers.AlbertForSequenceClassification.from_pretrained(out).eval()
        with torch.no_grad():
            theirs = hf(**inputs).logits
    else:
        assert config["architectures"] == ["AlbatrossForSequenceClassification"]
        assert config["classifier_pooling"] == "mean" and len(config["id2label"]) == 3
        imported = import_hf_albert(out)
        assert imported.head_config()["pooling"] == "mean"
        with torch.no_grad():
            theirs = imported(**inputs).logits
    assert max_diff(ours, theirs) <= ATOL


def test_tokenizer_files_and_model_card(tmp_path, tokenizer):
    release = make_release("tisa", tmp_path, tokenizer)
    out = export_hf(release, tmp_path / "hf")
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        [
            "README.md",
            FAMILY_FILE,
            "config.json",
            "configuration_albatross.py",
            "model.safetensors",
            "modeling_albatross.py",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    assert (out / FAMILY_FILE).read_text() == (
        Path(ATTENTION_REGISTRY.get("tisa").hf_export.code).read_text()
    )
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["mask_token"] == "[MASK]" and tok_config["pad_token"] == "<pad>"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "albatross" and config["attention"] == "tisa"
    assert config["auto_map"]["AutoModelForMaskedLM"] == "modeling_albatross.AlbatrossForMaskedLM"
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "transformers" and front["license"] == "apache-2.0"
    assert front["pipeline_tag"] == "fill-mask"
    assert {"albatross", "tisa-attention", "custom_code"} <= set(front["tags"])
    assert "trust_remote_code=True" in card and "| hidden width d | 32 |" in card


def test_remote_code_imports_only_torch_and_transformers():
    """The files an export carries import nothing of this project."""
    sources = [Path(ATTENTION_REGISTRY.get(n).hf_export.code) for n in ("softmax", "tisa")]
    sources += [Path(ATTENTION_REGISTRY.get(n).hf_export.code) for n in ("kernel", "transject")]
    sources += list((TESTS.parent / "model" / "hub" / "hf_remote").glob("*ing_albatross.py"))
    for path in sources:
        for line in path.read_text().splitlines():
            if line.startswith(("import ", "from ")):
                top = line.split()[1].split(".")[0]
                allowed = top in ("", "torch", "transformers") or top in sys.stdlib_module_names
                assert allowed, f"{path}: {line}"  # "" is a relative import (the export's)


def test_a_new_family_exports_through_its_hook(tmp_path):
    """A family registered from outside (the toy of test_toy_family.py) with its own HF-side
    file (tests/toy_family_hf.py): the export carries that file (test_hf_export_fresh.py loads it
    with transformers); one without the hook is a clear error (below)."""
    release = save_release(tmp_path / "release", build("toy"))
    out = export_hf(release, tmp_path / "hf")
    assert (out / FAMILY_FILE).read_text() == (TESTS / "toy_family_hf.py").read_text()
    inputs = make_inputs()
    _assert_same_outputs(
        _forward(load_release(release), inputs), _forward(import_export(out)[0], inputs), inputs
    )


def test_a_family_without_an_hf_mapping_is_a_clear_error(tmp_path, capsys):
    cfg = EncoderConfig.from_dict({**BASE, "attention": "toy-no-hf"})
    release = save_release(tmp_path / "release", build_model(cfg))
    with pytest.raises(ExportError, match=r"'toy-no-hf' has no Hugging Face export.*hf_export"):
        export_hf(release, tmp_path / "hf")
    assert export_main([str(release), "--format", "hf", "--out", str(tmp_path / "cli")]) == 2
    err = capsys.readouterr().err
    assert "'toy-no-hf' has no Hugging Face export" in err and "hf_export" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "cli").exists()


def test_a_directory_that_is_not_a_release_is_a_clear_error(tmp_path, capsys):
    hf_albert = tmp_path / "albert"
    hf_albert.mkdir()
    (hf_albert / "config.json").write_text('{"model_type": "albert"}')
    empty = tmp_path / "empty"
    empty.mkdir()
    for source, says in (
        (empty, "is neither a pretraining run directory (no checkpoints/) nor a release"),
        (hf_albert, "is neither a pretraining run directory (no checkpoints/) nor a release"),
        (tmp_path / "missing", "does not exist"),
    ):
        assert export_main([str(source), "--format", "hf", "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert str(source) in err and says in err, err
    with pytest.raises(ExportError, match="is not a release directory"):
        export_hf(empty, tmp_path / "o")


def test_a_head_without_a_transformers_counterpart_is_a_clear_error(tmp_path):
    cfg = EncoderConfig.from_dict({**BASE, "attention": "tisa"})
    model = build_model(cfg, {"type": "dual_classification", "num_labels": 2})
    release = save_release(tmp_path / "release", model)
    with pytest.raises(ExportError, match="head 'dual_classification' has no `transformers`"):
        export_hf(release, tmp_path / "hf")


def test_an_existing_export_needs_overwrite(tmp_path, capsys):
    release = save_release(tmp_path / "release", build("kernel"))
    export_hf(release, tmp_path / "hf")
    assert export_main([str(release), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    assert "use --overwrite" in capsys.readouterr().err
    args = [str(release), "--format", "hf", "--out", str(tmp_path / "hf"), "--overwrite"]
    assert export_main(args) == 0


def test_the_import_refuses_a_matrix_that_is_no_longer_orthogonal(tmp_path):
    """E.g. an export fine-tuned with the HF Trainer: its TransJect maps are plain weights
    there; their orthogonal parametrisation cannot be restored, and the import says which."""
    release = save_release(tmp_path / "release", build("transject"))
    out = export_hf(release, tmp_path / "hf")
    weights = load_file(str(out / "model.safetensors"))
    key = "encoder.groups.0.0.attention.expert_u"
    weights[key] = weights[key] + 0.01 * torch.randn(weights[key].shape)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{key} is not an orthogonal matrix"):
        import_export(out)


def test_materialised_weights_are_the_maps_values():
    model = build("transject")
    state = materialised_state_dict(model)
    layer = model.encoder.groups[0][0]
    assert torch.equal(state["encoder.groups.0.0.attention.expert_u"], layer.attention.expert_u)
    assert torch.equal(state["encoder.groups.0.0.ffn_in.weight"], layer.ffn_in.weight)
    assert all(v.dtype == torch.float32 for v in state.values())
