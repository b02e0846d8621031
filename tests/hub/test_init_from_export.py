"""Continued pretraining and LRA fine-tuning start from this project's Hugging Face export (a
model downloaded from the Hub, remote code, any family) as they start from a release: the same
encoder config, the same weights, the same outputs, with no conversion step in between."""

from __future__ import annotations

import pytest
import torch
from hf_export_support import ATOL, BASE, FAMILIES, build, make_inputs, max_diff

from finetune.lra.run import LraConfig, build_lra_model
from finetune.lra.tasks import get_task
from model.config import EncoderConfig
from model.heads import EncoderForPretraining, build_model
from model.hub.hf_export import export_hf, import_export
from model.hub.release import load_release, save_release
from pretrain.init import checkpoint_encoder, encoder_config, load_init

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def release_and_export(name, tmp_path, **overrides):
    model = build(name)
    if overrides:
        cfg = EncoderConfig.from_dict({**BASE, **FAMILIES[name], **overrides})
        torch.manual_seed(0)
        model = build_model(cfg, {"type": "pretraining"}).eval()
    release = save_release(tmp_path / f"release_{name}", model)
    return release, export_hf(release, tmp_path / f"export_{name}")


@pytest.mark.parametrize("name", ["tisa", "kernel", "transject"])
def test_continued_pretraining_from_an_export_equals_from_its_release(name, tmp_path):
    release, export = release_and_export(name, tmp_path)
    base, kind = checkpoint_encoder(export)
    assert kind == "export"
    assert base == checkpoint_encoder(release)[0]
    section = {"init_from": str(export)}
    model = EncoderForPretraining(encoder_config(section, BASE["vocab_size"], 0))
    report = load_init(model, section)
    assert report.kind == "export" and not report.initialised, report.summary()
    reference = load_release(release).eval()
    inputs = make_inputs()
    with torch.no_grad():
        ours, theirs = model.eval()(**inputs), reference(**inputs)
    assert max_diff(ours.logits, theirs.logits) <= ATOL
    assert max_diff(ours.sop_logits, theirs.sop_logits) <= ATOL


def test_an_export_fixes_the_architecture_and_the_tokenizer(tmp_path):
    _, export = release_and_export("tisa", tmp_path)
    with pytest.raises(ValueError, match="hidden_size=64"):
        encoder_config({"init_from": str(export), "hidden_size": 64}, BASE["vocab_size"], 0)
    with pytest.raises(ValueError, match="301 tokens"):
        encoder_config({"init_from": str(export)}, 301, 0)


def test_import_export_with_another_head_keeps_the_encoder(tmp_path):
    release, export = release_and_export("kernel", tmp_path)
    head = {"type": "sequence_classification", "num_labels": 3}
    model, report = import_export(export, head=head)
    reference = load_release(release, head=head)
    own, ref = model.state_dict(), reference.state_dict()
    for key in own:
        if key.startswith("encoder."):
            torch.testing.assert_close(own[key], ref[key], rtol=0, atol=1e-6)
    assert any(k.startswith("classifier") for k in report.initialised)


def test_lra_from_an_export_equals_from_its_release(tmp_path):
    task = get_task("listops")
    release, export = release_and_export(
        "transject", tmp_path, vocab_size=task.vocab_size, pad_token_id=0
    )
    cfg = LraConfig(task="listops")
    seq_len = BASE["max_position_embeddings"]
    ours, reference = build_lra_model(cfg, export, seq_len), build_lra_model(cfg, release, seq_len)
    with torch.no_grad():  # the classifier is new on both sides: give them the same one
        for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
            if not name.startswith("encoder."):
                p.copy_(q)
    inputs = make_inputs(vocab_size=task.vocab_size)
    inputs.pop("token_type_ids")
    with torch.no_grad():
        a, b = ours.eval()(**inputs).logits, reference.eval()(**inputs).logits
    assert max_diff(a, b) <= ATOL
    _, other = release_and_export("tisa", tmp_path / "other")  # vocabulary 300, not listops'
    with pytest.raises(ValueError, match="vocab_size"):
        build_lra_model(cfg, other, seq_len)


@pytest.mark.integration
def test_pretrain_cli_continues_from_an_export(tmp_path, monkeypatch):
    """The trainer with `model.init_from` = an export (in process, the tiny test shards made
    with the export's own tokenizer): the start-up report names an export, no tensor is new,
    and the run trains to the end."""
    from pretrain_support import base_overrides, make_shards, one_process_rendezvous

    import pretrain.train as train_module
    from engine.metrics import read_jsonl
    from engine.recipe import load_recipe
    from pretrain.config import pretrain_config

    shards = make_shards(tmp_path / "data")
    tokenizer = tmp_path / "data" / "tokenizer" / "tokenizer.json"
    release = save_release(tmp_path / "release", build("kernel"), tokenizer_file=tokenizer)
    export = export_hf(release, tmp_path / "export")
    one_process_rendezvous(monkeypatch)
    overrides = [
        *base_overrides(shards, tmp_path / "run", 2),
        f"model.init_from={export}",
        "train.export_at_end=false",
    ]
    # the export fixes the architecture: no model sizes from the tiny test recipe
    overrides = [o for o in overrides if not o.startswith("model.") or "init_from" in o]
    trainer = train_module.Trainer(pretrain_config(load_recipe(None, overrides)))
    assert trainer.init_report.kind == "export" and not trainer.init_report.initialised
    assert trainer.run().state == "completed"
    assert read_jsonl(tmp_path / "run" / "tensorboard")[1]["loss/mlm"] > 0
