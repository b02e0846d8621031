"""GLUE fine-tuning end to end on fixtures in the GLUE formats: a learnable SST-2-style task beats
chance clearly and writes results, tables and server files; an imported HF ALBERT with TISA at
zero amplitude starts from exactly the HF model's predictions."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.tokenizer import write_tokenizer
from finetune.__main__ import main as finetune_main
from finetune.batching import collate
from finetune.glue import run as glue_run
from finetune.glue.data import encode, load_glue_tokenizer, load_split
from finetune.glue.metrics import compute_metrics
from finetune.glue.tasks import get_task
from finetune.trainer import FinetuneConfig, FinetuneData, Finetuner
from model.config import EncoderConfig
from model.heads import EncoderForPretraining
from model.hub.release import save_release

pytestmark = pytest.mark.integration  # runs the stages end to end

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "house",
    "tree",
    "river",
    "car",
    "book",
    "music",
    "film",
    "story",
    "day",
    "night",
    "city",
    "road",
]


def sentence(rng: random.Random, positive: bool) -> str:
    words = rng.sample(WORDS, 6)
    words.insert(rng.randrange(7), "wonderful" if positive else "terrible")
    return " ".join(words)


def write_sst2(root: Path, n_train: int = 256, n_dev: int = 64, n_test: int = 16) -> Path:
    """SST-2 in the GLUE layout: train/dev "sentence<TAB>label", test "index<TAB>sentence"."""
    rng = random.Random(0)
    d = root / "SST-2"
    d.mkdir(parents=True)
    for split, n in (("train", n_train), ("dev", n_dev)):
        with open(d / f"{split}.tsv", "w", newline="") as f:
            w = csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, lineterminator="\n")
            w.writerow(["sentence", "label"])
            for i in range(n):
                w.writerow([sentence(rng, i % 2 == 0), (i % 2 == 0 and "1") or "0"])
    with open(d / "test.tsv", "w", newline="") as f:
        w = csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, lineterminator="\n")
        w.writerow(["index", "sentence"])
        for i in range(n_test):
            w.writerow([i, sentence(rng, i % 3 == 0)])
    return root


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.txt"
    rng = random.Random(1)
    corpus.write_text(
        "\n\n".join(
            sentence(rng, i % 2 == 0) + ".\n" + sentence(rng, i % 3 == 0) for i in range(300)
        )
    )
    write_tokenizer(root / "tok", inputs=[str(corpus)], vocab_size=120)
    return root / "tok" / "tokenizer.json"


@pytest.fixture(scope="module")
def release(tmp_path_factory, tokenizer_file) -> Path:
    """A randomly initialised tiny encoder as a release (what pretraining would hand over)."""
    return tiny_release(tmp_path_factory.mktemp("release") / "tiny", tokenizer_file)


def tiny_release(out: Path, tokenizer_file: Path, **overrides) -> Path:
    """A randomly initialised tiny encoder (debug preset, `overrides` on top) saved as a release."""
    vocab = load_glue_tokenizer(tokenizer_file).get_vocab_size()
    torch.manual_seed(0)
    cfg = EncoderConfig.preset(
        "debug",
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        max_position_embeddings=64,
        **overrides,
    )
    return save_release(out, EncoderForPretraining(cfg), tokenizer_file=tokenizer_file)


def test_finetune_glue_beats_chance_and_writes_outputs(tmp_path, release):
    data = write_sst2(tmp_path / "glue")
    run_dir = tmp_path / "runs"
    overrides = [
        "train.eval_every=40",
        "train.log_every=20",
        "schedule.warmup_steps=10",
        "schedule.total_steps=120",
        "engine.micro_batch_size=16",
        "engine.precision=fp32",
        "data.max_length=32",
        f"train.run_dir={run_dir}",
    ]
    args = ["glue", "--task", "sst2", "--data", str(data), "--init", str(release)]
    assert finetune_main([*args, *overrides, "--seeds", "0", "1", "--lrs", "0.002"]) == 0
    results = json.loads((run_dir / "results.json").read_text())
    assert len(results["runs"]) == 2
    for row in results["runs"]:
        assert row["dev"]["dev"]["accuracy"] >= 0.85, row  # chance is 0.5
        per_run = json.loads((Path(row["run_dir"]) / "results.json").read_text())
        assert [h["step"] for h in per_run["history"]] == [40, 80, 120]
        assert (Path(row["run_dir"]) / "best" / "model.safetensors").is_file()
    table = (run_dir / "results.md").read_text()
    assert "| sst2 | 0.002 | 2 | accuracy |" in table
    server = (run_dir / "submission" / "SST-2.tsv").read_text().splitlines()
    assert server[0] == "index\tprediction" and len(server) == 17
    assert {line.split("\t")[1] for line in server[1:]} <= {"0", "1"}
    assert [int(line.split("\t")[0]) for line in server[1:]] == list(range(16))
    # the summary's dev score over the seeds, with its interval
    (interval,) = results["intervals"]
    mean = sum(r["dev"]["dev"]["score"] for r in results["runs"]) / 2
    assert interval["score"]["estimate"] == pytest.approx(mean)
    assert interval["score"]["low"] <= mean <= interval["score"]["high"]
    assert "| sst2 | 0.002 | dev | 2 |" in table
    # the two seeds as two "models": their dev accuracies at the best step and the difference
    seeds = [row["run_dir"] for row in results["runs"]]
    out = tmp_path / "compare.json"
    assert finetune_main(["compare", *seeds, "--split", "dev", "--out", str(out)]) == 0
    models = json.loads(out.read_text())["models"]
    for model, row in zip(models, results["runs"]):
        assert model["accuracy"]["estimate"] == pytest.approx(row["dev"]["dev"]["accuracy"])
    difference = (
        results["runs"][1]["dev"]["dev"]["accuracy"] - results["runs"][0]["dev"]["dev"]["accuracy"]
    )
    assert models[1]["difference"]["estimate"] == pytest.approx(difference)
    assert finetune_main(["compare", *seeds, "--split", "dev", "--out", str(out)]) == 2  # exists
    assert finetune_main(["compare", *seeds, "--split", "test"]) == 2  # unlabelled: no scores


def test_bad_arguments_exit_2(tmp_path, release, capsys):
    data = write_sst2(tmp_path / "glue")
    base = ["glue", "--data", str(data), "--init", str(release)]
    assert finetune_main([*base, "--task", "nope"]) == 2
    assert "unknown GLUE task" in capsys.readouterr().err
    assert finetune_main([*base, "--task", "rte"]) == 2  # no RTE folder in the fixture
    assert "RTE" in capsys.readouterr().err
    assert finetune_main([*base, "--task", "sst2", "optimizer.lrr=1"]) == 2
    assert "did you mean 'lr'" in capsys.readouterr().err


def test_hf_albert_with_tisa_starts_from_the_hf_predictions(tmp_path, tokenizer_file):
    transformers = pytest.importorskip("transformers")
    vocab = load_glue_tokenizer(tokenizer_file).get_vocab_size()
    hf_cfg = transformers.AlbertConfig(
        vocab_size=vocab,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        num_labels=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    hf = transformers.AlbertForSequenceClassification(hf_cfg).eval()
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir)
    (hf_dir / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())

    data = write_sst2(tmp_path / "glue", n_train=32, n_dev=24, n_test=4)
    task = get_task("sst2")
    cfg = glue_run.GlueConfig(task="sst2")
    cfg.model.attention = "tisa"
    cfg.model.classifier_dropout = 0.0
    release = glue_run.prepare_init(hf_dir, cfg, tmp_path / "work")
    model = glue_run.build_classifier(release, task, cfg).eval()
    assert model.config.attention == "tisa"

    dev, _ = load_split(task, data, "dev")
    enc = encode(dev, load_glue_tokenizer(tokenizer_file), 32)
    batch = collate([enc[i] for i in range(len(enc))], pad_id=0)
    inputs = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    with torch.no_grad():
        ours = model(*inputs).logits
        theirs = hf(*inputs).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)

    # The fine-tuning run's evaluation before its first step sees exactly those predictions.
    train, _ = load_split(task, data, "train")
    data = FinetuneData(
        encode(train, load_glue_tokenizer(tokenizer_file), 32),
        {"dev": enc},
        lambda p, y: compute_metrics(task, p, y),
        pad_id=0,
    )
    run = Finetuner(
        model,
        data,
        FinetuneConfig(steps=1, eval_at_start=True, save_best=False),
        tmp_path / "run",
        engine=cfg.engine.__class__(backend="torch", precision="fp32", micro_batch_size=8),
        optimizer=cfg.optimizer,
        schedule=cfg.schedule.__class__(warmup_steps=0, total_steps=1),
    )
    start, _ = run.evaluate()
    expected = compute_metrics(task, theirs.argmax(-1).numpy(), np.array(enc.labels))
    assert start["dev"] == expected


def write_stsb(root: Path, n: int = 48) -> Path:
    """STS-B in the GLUE layout (10 columns with a header; test without the score)."""
    rng = random.Random(2)
    d = root / "STS-B"
    d.mkdir(parents=True)
    head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
    for split in ("train", "dev", "test"):
        lines = [head + ("\tscore" if split != "test" else "")]
        for i in range(n if split != "test" else 8):
            a, b = sentence(rng, i % 2 == 0), sentence(rng, i % 3 == 0)
            row = f"{i}\tmain-captions\tMSRvid\t2012test\t{i:04d}\tnone\tnone\t{a}\t{b}"
            lines.append(
                row
                + (f"\t{(i % 2 == 0) * 2.5 + (i % 3 == 0) * 2.5:.3f}" if split != "test" else "")
            )
        (d / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


def test_stsb_regression_end_to_end(tmp_path, release):
    data = write_stsb(tmp_path / "glue")
    run_dir = tmp_path / "runs"
    overrides = [
        "schedule.warmup_steps=2",
        "schedule.total_steps=20",
        "engine.micro_batch_size=8",
        "data.max_length=40",
        "train.num_workers=2",  # float labels through the workers' packed batches
        f"train.run_dir={run_dir}",
    ]
    args = ["glue", "--task", "stsb", "--data", str(data), "--init", str(release), *overrides]
    assert finetune_main(args) == 0
    row = json.loads((run_dir / "results.json").read_text())["runs"][0]
    assert set(row["dev"]["dev"]) == {"pearson", "spearman", "score"}
    lines = (run_dir / "submission" / "STS-B.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 9
    assert all(0.0 <= float(line.split("\t")[1]) <= 5.0 for line in lines[1:])
    out = tmp_path / "compare.json"
    args = ["compare", row["run_dir"], "--split", "dev", "--metric", "pearson", "--out", str(out)]
    assert finetune_main([*args, "--resamples", "200"]) == 0
    pearson = json.loads(out.read_text())["models"][0]["pearson"]
    assert pearson["estimate"] == pytest.approx(row["dev"]["dev"]["pearson"])
    assert pearson["low"] <= pearson["estimate"] <= pearson["high"]


@pytest.mark.slow
def test_glue_sweep_as_a_slurm_array_then_summary(slurm_cluster, tmp_path, release):
    """slurm/finetune.sbatch: an array over seeds x lrs, then glue-summary after it."""
    import os
    import sys

    from slurm_support import REPO, submit, wait_for_job

    data = write_sst2(tmp_path / "glue", n_train=64, n_dev=32, n_test=4)
    run_dir = tmp_path / "sweep"
    env = dict(os.environ)
    env.update(
        ALBATROSS_DIR=str(REPO),
        ALBATROSS_SETUP=f"source {sys.prefix}/bin/activate",
        SWEEP_TASKS="sst2",
        SWEEP_SEEDS="0 1",
        SWEEP_LRS="0.002 0.001",
    )
    template = str(REPO / "slurm" / "finetune.sbatch")
    common = ["--gpus-per-node=0", "--cpus-per-task=1", f"--output={tmp_path}/ft-%A_%a.out"]
    glue = ["glue", "--data", str(data), "--init", str(release), f"train.run_dir={run_dir}"]
    glue += ["schedule.warmup_steps=2", "schedule.total_steps=10", "engine.micro_batch_size=8"]
    array = submit(["--array=0-3", *common, template, *glue], env=env)
    summary = submit(
        [f"--dependency=afterok:{array}", *common, template, "glue-summary", str(run_dir)], env=env
    )
    wait_for_job(summary)
    wait_for_job(array)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("ft-*.out")))
    runs = json.loads((run_dir / "results.json").read_text())["runs"]
    assert sorted((r["lr"], r["seed"]) for r in runs) == [
        (0.001, 0),
        (0.001, 1),
        (0.002, 0),
        (0.002, 1),
    ], logs
    table = (run_dir / "results.md").read_text()
    assert "| sst2 | 0.001 | 2 | accuracy |" in table and "| sst2 | 0.002 | 2 | accuracy |" in table
    assert (run_dir / "submission" / "SST-2.tsv").is_file()


@pytest.mark.slow
def test_glue_transject_on_two_ranks_with_sharded_maps(tmp_path, tokenizer_file):
    """Fine-tuning a TransJect release on 2 processes with its orthogonal maps shared out over
    the ranks (every size; the release's `model.orthogonal_shard_maps`): the run says so, and
    its fine-tuned weights and dev metrics equal those of the run where every rank maps
    everything."""
    import subprocess

    from pretrain_support import REPO, env, torchrun_cmd

    data = write_sst2(tmp_path / "glue")
    results = {}
    for shard in (False, True):
        release = tiny_release(  # the same weights (seeded), the setting in its config
            tmp_path / f"release-{shard}",
            tokenizer_file,
            attention="transject",
            transject={"num_experts": 2},
            orthogonal_shard_maps=shard,
            orthogonal_shard_min_size=0,
        )
        run_dir = tmp_path / f"runs-{shard}"
        args = ["-m", "finetune", "glue", "--task", "sst2", "--data", str(data)]
        args += ["--init", str(release), "engine.backend=torch", "engine.precision=fp32"]
        args += ["engine.device=cpu", "engine.micro_batch_size=8", "data.max_length=32"]
        args += ["schedule.warmup_steps=2", "schedule.total_steps=12", "train.eval_every=12"]
        args += ["optimizer.lr=0.002", f"train.run_dir={run_dir}"]
        args += ["model.hidden_dropout_prob=0.0"]
        proc = subprocess.run(
            torchrun_cmd(2, *args), cwd=REPO, env=env(), capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ("shared out over 2 ranks" in proc.stdout + proc.stderr) == shard
        (row,) = json.loads((run_dir / "results.json").read_text())["runs"]
        results[shard] = row
    assert results[True]["dev"] == results[False]["dev"], results
    from safetensors.torch import load_file

    tuned = {
        s: load_file(Path(results[s]["run_dir"]) / "best" / "model.safetensors") for s in results
    }
    start = load_file(release / "model.safetensors")
    moved = max(
        (tuned[False][k] - v).abs().max().item() for k, v in start.items() if k in tuned[False]
    )
    assert moved > 1e-3, moved  # the runs trained
    for key, value in tuned[False].items():
        torch.testing.assert_close(tuned[True][key], value, atol=1e-5, rtol=1e-4)
