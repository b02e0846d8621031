"""Continued pretraining from a local HF ALBERT checkpoint (made here with `transformers`), with
TISA added at zero amplitude: step 0's MLM loss is the HF model's on the same batch, the
release at the end fine-tunes, a foreign tokenizer or a conflicting architecture is refused at
start-up, and switching to another family names the new tensors."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pretrain_support import REPO, SEQ, env, make_shards, torchrun_cmd

from data_prep.loader import PretrainingData, PretrainingLoader
from engine.metrics import read_jsonl
from engine.recipe import load_recipe
from model.hub.release import load_release
from pretrain.__main__ import main as pretrain_main
from pretrain.config import pretrain_config
from pretrain.train import SetupError, run

transformers = pytest.importorskip("transformers")

CONFIG = str(REPO / "configs" / "pretrain" / "debug-continue-tisa.yaml")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("data"))


def _hf_albert(root: Path, shards: Path, **changes) -> tuple[Path, torch.nn.Module]:
    """A tiny random AlbertForPreTraining with the shards' tokenizer, saved as HF does."""
    manifest = json.loads((shards / "manifest.json").read_text())
    settings = dict(
        vocab_size=manifest["vocab_size"],
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=manifest["special_tokens"]["pad"],
    )
    config = transformers.AlbertConfig(**{**settings, **changes})
    torch.manual_seed(0)
    hf = transformers.AlbertForPreTraining(config).eval()
    hf.save_pretrained(str(root))
    shutil.copy(shards / "tokenizer.json", root / "tokenizer.json")
    return root, hf


def _cfg(shards: Path, run_dir: Path, init: Path, *extra: str):
    overrides = [
        f"data.shards={shards}",
        f"train.run_dir={run_dir}",
        f"model.init_from={init}",
        *extra,
    ]
    return pretrain_config(load_recipe(CONFIG, overrides))


@pytest.fixture
def no_rendezvous(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_continue_with_tisa_starts_at_the_hf_models_loss(shards, tmp_path, no_rendezvous):
    init, hf = _hf_albert(tmp_path / "hf", shards)
    cfg = _cfg(shards, tmp_path / "run", init)
    result = run(cfg)
    assert result.state == "completed"
    first = read_jsonl(tmp_path / "run" / "tensorboard")[1]

    # The same first batch, as the loader made it for rank 0, through the HF model.
    data = PretrainingData(
        shards, max_seq_length=cfg.data.max_seq_length, masking=cfg.data.masking, seed=0
    )
    batch = next(iter(PretrainingLoader(data, cfg.engine.micro_batch_size)))
    assert first["loss/mlm"] == pytest.approx(_hf_mlm_loss(hf, batch), abs=1e-5)

    # The release is TISA (new scorer tensors) and loads for fine-tuning.
    classifier = load_release(
        tmp_path / "run" / "release", head={"type": "sequence_classification", "num_labels": 2}
    )
    assert classifier.encoder.config.attention == "tisa"
    ids = batch["input_ids"][:2]
    assert classifier(ids, batch["attention_mask"][:2]).logits.shape == (2, 2)


def test_a_foreign_tokenizer_is_refused_naming_both_sizes(shards, tmp_path, capsys):
    init, _ = _hf_albert(tmp_path / "hf", shards, vocab_size=120)
    argv = ["--config", CONFIG, f"data.shards={shards}", f"train.run_dir={tmp_path / 'run'}"]
    assert pretrain_main([*argv, "--init", str(init)]) == 2
    err = capsys.readouterr().err
    assert "tokens, the checkpoint" in err and "120" in err
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_conflicting_architecture_is_refused(shards, tmp_path, no_rendezvous):
    init, _ = _hf_albert(tmp_path / "hf", shards)
    cfg = _cfg(shards, tmp_path / "run", init, "model.hidden_size=64")
    with pytest.raises(SetupError, match=r"model.hidden_size=64 \(the checkpoint has 32\)"):
        run(cfg)


def test_switching_to_kernel_names_the_new_tensors(shards, tmp_path, no_rendezvous, capsys):
    init, _ = _hf_albert(tmp_path / "hf", shards)
    cfg = _cfg(
        shards, tmp_path / "run", init, "model.attention=kernel", "train.steps=1",
        "model.kernel.feature_map=ffn",
    )  # fmt: skip
    assert run(cfg).state == "completed"
    err = capsys.readouterr().err
    assert "initialised from" in err and "new (initialised):" in err
    assert "kernel" in err.split("new (initialised):")[1]


def _hf_mlm_loss(hf, batch) -> float:
    with torch.no_grad():
        out = hf(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            token_type_ids=batch["token_type_ids"],
        )
    labels = batch["mlm_labels"]
    return float(F.cross_entropy(out.prediction_logits[labels != -100], labels[labels != -100]))


@pytest.mark.slow
def test_continue_on_deepspeed_with_two_processes(shards, tmp_path):
    """The same on the real DeepSpeed engine (ZeRO-2, 2 processes over gloo): the logged step-0
    loss is the mean over both ranks of the HF model's loss on each rank's first batch."""
    init, hf = _hf_albert(tmp_path / "hf", shards)
    run_dir = tmp_path / "run"
    overrides = [
        f"data.shards={shards}", f"train.run_dir={run_dir}", "engine.backend=deepspeed",
        "engine.zero_stage=2", "train.steps=3",
    ]  # fmt: skip
    cmd = torchrun_cmd(2, "-m", "pretrain", "--config", CONFIG, "--init", str(init), *overrides)
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised from" in proc.stderr
    cfg = _cfg(shards, run_dir, init)
    data = PretrainingData(
        shards, max_seq_length=cfg.data.max_seq_length, masking=cfg.data.masking, seed=0
    )
    losses = [
        _hf_mlm_loss(hf, next(iter(PretrainingLoader(data, 4, rank=r, world_size=2))))
        for r in (0, 1)
    ]
    first = read_jsonl(run_dir / "tensorboard")[1]
    assert first["loss/mlm"] == pytest.approx(sum(losses) / 2, abs=1e-5)
    assert load_release(run_dir / "release").encoder.config.attention == "tisa"
