"""Hugging Face exports load with `transformers` alone: every family's export is loaded in a
fresh Python process where this project is not importable (tests/hf_fresh_load.py, run with
``python -I -S`` from another directory), and its hidden states, pooled output and MLM logits
equal the project's own forward (fp32, 1e-5). The same process runs the fill-mask pipeline, a
sequence-classification head and a few HF Trainer steps. Also: the export CLI on a real
pretraining run (model card with its validation metrics), and fine-tuning with this project
from an export gives the same dev metric as from the release (the round trip).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml
from hf_export_support import (
    ATOL,
    BASE,
    FAMILIES,
    assert_non_trivial,
    make_inputs,
    make_release,
    max_diff,
    save_inputs,
)
from safetensors.torch import load_file

from data_prep.tokenizer import write_tokenizer
from model.config import EncoderConfig
from model.heads import build_model
from model.hub.hf_export import export_hf, materialised_state_dict
from model.hub.release import load_release, save_release

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
REMOTE = {name: name != "softmax" for name in FAMILIES}
"""Which exports need the remote code: all but the native ALBERT."""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    write_tokenizer(root / "tok", inputs=["embedded:40"], vocab_size=300)
    return root / "tok" / "tokenizer.json"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, tokenizer):
    """Every family's release, its export, and what a fresh process made of the export."""
    root = tmp_path_factory.mktemp("hf")
    releases, exports = {}, {}
    for name in FAMILIES:
        releases[name] = make_release(name, root, tokenizer)
        assert_non_trivial(load_release(releases[name]))
        exports[name] = export_hf(releases[name], root / f"hf_{name}")
    job = {
        "repo": str(REPO),
        "inputs": str(save_inputs(root / "inputs.safetensors")),
        "out": str(root / "out"),
        "exports": {
            name: {
                "path": str(path),
                "remote": REMOTE[name],
                "pipeline": True,
                "trainer": name == "transject",
            }
            for name, path in exports.items()
        },
    }
    (root / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(root / "hf_home"),  # remote code is copied under HF_HOME/modules
        OMP_NUM_THREADS="1",
    )
    site = sysconfig.get_paths()["purelib"]  # torch, transformers
    script = REPO / "tests" / "hf_fresh_load.py"
    run = subprocess.run(
        [sys.executable, "-I", "-S", str(script), site, str(root / "job.json")],
        cwd=root,  # not the repository
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads((root / "out.json").read_text())
    return releases, exports, report, root


def test_the_fresh_process_could_not_import_the_project(loaded):
    _, _, report, _ = loaded
    assert report["modules"] == []
    assert not any(p.startswith(str(REPO)) and "site-packages" not in p for p in report["sys_path"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_transformers_computes_the_projects_forward(loaded, name):
    releases, _, report, root = loaded
    ours = load_release(releases[name]).eval()
    inputs = make_inputs()
    with torch.no_grad():
        out = ours(**inputs, output_hidden_states=True)
    theirs = load_file(str(root / f"out.{name}.safetensors"))
    m = inputs["attention_mask"].bool()
    cfg = ours.config
    states = [k for k in theirs if k.startswith("hidden_state_")]
    if len(states) == 1 + cfg.num_hidden_layers * cfg.inner_group_num:  # HF ALBERT: per layer
        their_states = [
            theirs[f"hidden_state_{i}"] for i in range(0, len(states), cfg.inner_group_num)
        ]
    else:
        their_states = [theirs[f"hidden_state_{i}"] for i in range(len(states))]
    assert len(their_states) == len(out.encoder.hidden_states) == cfg.num_hidden_layers + 1
    for i, (a, b) in enumerate(zip(out.encoder.hidden_states, their_states)):
        assert max_diff(a[m], b[m]) <= ATOL, f"hidden state {i}"
    assert max_diff(out.encoder.last_hidden_state[m], theirs["last_hidden_state"][m]) <= ATOL
    assert max_diff(out.encoder.pooled_output, theirs["pooler_output"]) <= ATOL
    assert max_diff(out.logits[m], theirs["mlm_logits"][m]) <= ATOL
    assert out.logits[m].std() > 0.5  # logits that say something, not a near-constant
    assert theirs["classifier_logits"].shape == (3, 3)
    assert torch.isfinite(theirs["classifier_logits"]).all()
    row = report["exports"][name]
    native = ["AlbertModel", "AlbertForMaskedLM", "AlbertForSequenceClassification"]
    remote = ["AlbatrossModel", "AlbatrossForMaskedLM", "AlbatrossForSequenceClassification"]
    assert row["classes"] == (remote if REMOTE[name] else native)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tokenizer_and_fill_mask(loaded, name):
    _, _, report, _ = loaded
    row = report["exports"][name]
    tok = row["tokenizer"]
    assert tok["is_fast"] is True
    assert (tok["cls_token"], tok["sep_token"], tok["mask_token"]) == ("[CLS]", "[SEP]", "[MASK]")
    assert (tok["pad_token"], tok["unk_token"]) == ("<pad>", "<unk>")
    ids = tok["encoded"]  # [CLS] a [SEP] b [SEP]
    assert ids[0] == 2 and ids.count(3) == 2 and ids[-1] == 3
    fills = row["fill_mask"]
    assert len(fills) == 5 and all(f["token_str"] and 0 < f["score"] < 1 for f in fills)
    assert [f["score"] for f in fills] == sorted((f["score"] for f in fills), reverse=True)


def test_hf_trainer_fine_tunes_an_export(loaded):
    _, _, report, _ = loaded
    trained = report["exports"]["transject"]["trainer"]
    assert trained["steps"] == 3 and len(trained["losses"]) == 3
    assert trained["tensors_changed"] > 10 and trained["reloaded_equal"]


def test_export_cli_on_a_pretraining_run(tmp_path):
    """A few steps of TISA pretraining, then ``--format hf`` of the run: the model card holds
    the run's recipe and its last validation metrics; the weights are the checkpoint's."""
    from pretrain_support import base_overrides

    from data_prep.shards import ShardConfig, build_shards
    from engine.recipe import load_recipe
    from pretrain.config import pretrain_config
    from pretrain.export import main as export_main
    from pretrain.train import Trainer

    write_tokenizer(tmp_path / "tok", inputs=["embedded:60"], vocab_size=300)
    shards = tmp_path / "shards"
    shard_cfg = ShardConfig(
        inputs=("embedded:60",), num_shards=2, max_seq_length=32, seed=0, validation_fraction=0.1
    )
    build_shards(shard_cfg, tmp_path / "tok" / "tokenizer.json", shards, workers=1)
    run_dir = tmp_path / "run"
    overrides = [
        *base_overrides(shards, run_dir, 6),
        "model.attention=tisa",
        "engine.backend=torch",
        "engine.zero_stage=0",
        "train.eval_every=3",
    ]
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    cfg = pretrain_config(load_recipe(str(REPO / "configs/pretrain/debug.yaml"), overrides))
    assert Trainer(cfg).run().state == "completed"
    out = tmp_path / "hf"
    assert export_main([str(run_dir), "--format", "hf", "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "transformers" and front["license"] == "apache-2.0"
    assert front["pipeline_tag"] == "fill-mask" and "custom_code" in front["tags"]
    metrics = front["model-index"][0]["results"][0]["metrics"]
    status = json.loads((run_dir / "status.json").read_text())["validation"]
    assert {m["type"]: m["value"] for m in metrics}["mlm_loss"] == pytest.approx(
        status["eval/loss/mlm"], rel=1e-5
    )
    for text in ("| optimizer.lr | 0.003 |", "| train.steps | 6 |", "At step 6", "tisa"):
        assert text in card, text
    exported = load_file(str(out / "model.safetensors"))
    release = load_file(str(run_dir / "release" / "model.safetensors"))
    assert exported.keys() == release.keys()  # TISA has no parameterised tensor
    assert all(torch.equal(exported[k], release[k]) for k in release)


@pytest.mark.parametrize("name", ["transject", "softmax"])
def test_fine_tuning_from_an_export_gives_the_releases_dev_metric(tmp_path, name):
    """GLUE fine-tuning (SST-2 style) from the release and from its export: the same dev
    accuracy. The export goes through the import (native ALBERT for softmax; the Cayley
    inverse of TransJect's orthogonal maps)."""
    from test_glue_finetune import sentence, write_sst2

    from finetune.__main__ import main as finetune_main
    from finetune.glue.data import load_glue_tokenizer

    root = tmp_path
    corpus = root / "corpus.txt"
    rng = random.Random(1)
    corpus.write_text(
        "\n\n".join(
            sentence(rng, i % 2 == 0) + ".\n" + sentence(rng, i % 3 == 0) for i in range(300)
        )
    )
    write_tokenizer(root / "tok", inputs=[str(corpus)], vocab_size=120)
    tok = root / "tok" / "tokenizer.json"
    vocab = load_glue_tokenizer(tok).get_vocab_size()
    torch.manual_seed(0)
    cfg = EncoderConfig.from_dict({**BASE, **FAMILIES[name], "vocab_size": vocab})
    release = save_release(root / "release", build_model(cfg), tokenizer_file=tok)
    export = export_hf(release, root / "hf")
    data = write_sst2(root / "glue", n_train=128, n_dev=32, n_test=8)
    results, best = {}, {}
    for label, init in (("release", release), ("export", export)):
        run_dir = root / f"runs_{label}"
        args = ["glue", "--task", "sst2", "--data", str(data), "--init", str(init)]
        overrides_cli = [
            "train.eval_every=30",
            "train.log_every=30",
            "schedule.warmup_steps=4",
            "schedule.total_steps=30",
            "engine.micro_batch_size=16",
            "engine.precision=fp32",
            "data.max_length=24",
            "model.pooling=mean",
            f"train.run_dir={run_dir}",
        ]
        assert finetune_main([*args, *overrides_cli, "--seeds", "0", "--lrs", "0.002"]) == 0
        rows = json.loads((run_dir / "results.json").read_text())["runs"]
        results[label] = rows[0]["dev"]["dev"]
        best[label] = materialised_state_dict(load_release(Path(rows[0]["run_dir"]) / "best"))
    assert results["release"]["accuracy"] > 0.7, results  # it learned (chance: 0.5)
    assert results["export"] == pytest.approx(results["release"], abs=1e-6), results
    # ... and the fine-tuned weights agree (TransJect's orthogonal maps start from their
    # Cayley inverse: the same matrices to about 1e-7, other free parameters where the map
    # ignores them, hence the comparison of the matrices)
    assert best["export"].keys() == best["release"].keys()
    diff = max(max_diff(best["export"][k], best["release"][k]) for k in best["release"])
    assert diff <= 1e-4, diff
