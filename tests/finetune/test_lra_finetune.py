"""``python -m finetune lra`` end to end on CPU: ListOps generated in the official format,
Retrieval pairs through the dual encoder on a learnable fixture, Image / Pathfinder / Path-X
from their official files with the shipped recipes shrunk (Text: test_lra_selfpretrain.py and
the Slurm sweep below), lra-summary, and the LRA sweep as a Slurm array."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from data_prep.listops import write_splits
from finetune.__main__ import main as finetune_main
from finetune.compare import load_predictions

pytestmark = pytest.mark.integration  # runs the stages end to end

TINY = [
    "model.hidden_size=32",
    "model.embedding_size=32",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "engine.micro_batch_size=16",
    "engine.precision=fp32",
    "engine.backend=torch",
    "train.log_every=10",
]


def test_listops_from_scratch(tmp_path):
    data = tmp_path / "listops"
    write_splits(data, {"train": 200, "val": 48, "test": 48}, min_length=20, max_length=60, seed=0)
    run_dir = tmp_path / "run"
    args = ["lra", "--task", "listops", "--data", str(data), "data.max_length=80"]
    args += [*TINY, "schedule.warmup_steps=2", "schedule.total_steps=20", "train.eval_every=10"]
    args += [f"train.run_dir={run_dir}", "--seeds", "0", "1"]
    assert finetune_main(args) == 0
    runs = json.loads((run_dir / "results.json").read_text())["runs"]
    assert [r["seed"] for r in runs] == [0, 1]
    for row in runs:
        assert 0.0 <= row["test_accuracy"] <= 1.0 and row["best_step"] in (10, 20)
        history = json.loads((Path(row["run_dir"]) / "results.json").read_text())["history"]
        assert [h["step"] for h in history] == [10, 20]
        # the predictions a comparison needs: the reported (best val) step's and the last's
        best, labels = load_predictions(row["run_dir"], "test", "best")
        last, same = load_predictions(row["run_dir"], "test", "last")
        assert len(labels) == 48 and np.array_equal(labels, same)
        assert np.mean(best == labels) == pytest.approx(row["test_accuracy"])
        assert np.mean(last == labels) == pytest.approx(history[-1]["test"]["accuracy"])
        assert len(load_predictions(row["run_dir"], "val")[0]) == 48
    md = (run_dir / "results.md").read_text()
    assert "| listops | scratch | 2 |" in md and "| test acc (mean, 95% interval) |" in md
    mean = sum(r["test_accuracy"] for r in runs) / 2
    assert f"| {100 * mean:.1f} [" in md


def write_aan(root: Path, n: dict[str, int]) -> Path:
    """new_aan_pairs.{train,eval,test}.tsv: label, id1, id2, text1, text2; no header, quoting
    off. Learnable: the pair is related (1) when both texts carry the same marker word."""
    rng = random.Random(0)
    root.mkdir(parents=True)
    for split, count in n.items():
        lines = []
        for i in range(count):
            label = i % 2
            a = rng.choice(["alpha", "omega"])
            b = a if label else ("omega" if a == "alpha" else "alpha")
            filler = " ".join(rng.choice(["x", "y", "z"]) for _ in range(3))
            lines.append(f'{label}\tdoc{i}a\tdoc{i}b\t"{a}" {filler}\t{filler} {b}')
        (root / f"new_aan_pairs.{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


def test_retrieval_dual_encoder_learns_a_fixture(tmp_path):
    data = write_aan(tmp_path / "aan", {"train": 256, "eval": 64, "test": 64})
    run_dir = tmp_path / "run"
    args = ["lra", "--task", "retrieval", "--data", str(data), "data.max_length=64", *TINY]
    args += ["optimizer.lr=0.003", "schedule.warmup_steps=5", "schedule.total_steps=300"]
    args += ["train.eval_every=100", "model.num_hidden_layers=1", f"train.run_dir={run_dir}"]
    assert finetune_main(args) == 0
    (row,) = json.loads((run_dir / "results.json").read_text())["runs"]
    assert row["val_accuracy"] >= 0.8 and row["test_accuracy"] >= 0.8, row  # chance: 0.5


def test_lra_bad_input_exit_2(tmp_path, capsys):
    assert finetune_main(["lra", "--task", "nope", "--data", str(tmp_path)]) == 2
    assert "unknown LRA task" in capsys.readouterr().err
    assert finetune_main(["lra", "--task", "listops", "--data", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


CPU_SMALL = [
    "engine.device=cpu",
    "engine.precision=fp32",
    "engine.micro_batch_size=8",
    "schedule.warmup_steps=0",
    "schedule.total_steps=4",
    "train.eval_every=4",
    "train.log_every=2",
    "seeds=[0]",
]


def test_protocol_recipes_and_lra_summary(tmp_path):
    data = tmp_path / "listops"
    write_splits(data, {"train": 64, "val": 16, "test": 16}, min_length=20, max_length=60, seed=1)
    root = tmp_path / "sweep"
    for family in ("softmax", "kernel"):
        args = ["lra", "--task", "listops", "--data", str(data), "--protocol", "skyformer"]
        args += ["--family", family, "--no-summary", "data.max_length=60", *CPU_SMALL]
        args += [f"train.run_dir={root / f'listops-{family}'}"]
        assert finetune_main(args) == 0
        assert not (root / f"listops-{family}" / "results.md").exists()  # --no-summary
        seed = json.loads((root / f"listops-{family}" / "seed_0" / "results.json").read_text())
        assert seed["summary"]["family"] == family and seed["summary"]["task"] == "listops"
    assert finetune_main(["lra-summary", str(root)]) == 0
    table = (root / "results.md").read_text().splitlines()
    ours = {line.split(" | ")[0][2:]: line for line in table if "ours" in line}
    assert set(ours) == {"kernel (scratch, ours, 1 seeds)", "softmax (scratch, ours, 1 seeds)"}
    for line in ours.values():
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert 0.0 <= float(cells[1]) <= 100.0  # ListOps
        assert cells[2:] == ["–"] * 7  # the other tasks and the averages: not run
    lra_paper = next(line for line in table if line.startswith("| Transformer (LRA paper)"))
    assert lra_paper.endswith("| 71.40 | FAIL | 54.39 | 53.66 |")
    transject = next(line for line in table if line.startswith("| TransJect (TransJect paper)"))
    assert "| 59.56 |" in transject  # the paper's 59.6 over its five tasks
    summary = json.loads((root / "results.json").read_text())
    assert len(summary["runs"]) == 2
    # the intervals: each family's accuracy, and kernel - softmax on the same test examples
    intervals = {r["family"]: r for r in summary["intervals"]}
    assert set(intervals) == {"softmax", "kernel"}
    labels = load_predictions(root / "listops-softmax" / "seed_0", "test")[1]
    accuracy = {}
    for family, r in intervals.items():
        pred = load_predictions(root / f"listops-{family}" / "seed_0", "test")[0]
        accuracy[family] = np.mean(pred == labels)
        assert r["accuracy"]["estimate"] == pytest.approx(accuracy[family])
        assert r["accuracy"]["low"] <= accuracy[family] <= r["accuracy"]["high"]
    difference = intervals["kernel"]["vs_softmax"]
    assert difference["estimate"] == pytest.approx(accuracy["kernel"] - accuracy["softmax"])
    assert "vs_softmax" not in intervals["softmax"]
    md = (root / "results.md").read_text()
    assert "| task | model | init | seeds | test accuracy | − softmax |" in md
    assert "| listops | kernel | scratch | 1 |" in md
    # a run from before predictions were saved is named and left out, not an error
    (root / "listops-kernel" / "seed_0" / "predictions.npz").unlink()
    assert finetune_main(["lra-summary", str(root)]) == 0
    md = (root / "results.md").read_text()
    assert "left out: kernel (scratch) on listops" in md
    assert "| listops | softmax | scratch | 1 |" in md


def test_protocol_errors(tmp_path, capsys):
    args = ["lra", "--task", "listops", "--data", str(tmp_path), "--family", "kernel"]
    assert finetune_main(args) == 2
    assert "--family picks a shipped recipe" in capsys.readouterr().err
    args = ["lra", "--task", "listops", "--data", str(tmp_path), "--protocol", "skyformer"]
    assert finetune_main([*args, "--family", "kernal"]) == 2
    assert "no shipped recipe" in capsys.readouterr().err
    assert finetune_main(["lra-summary", str(tmp_path)]) == 2
    assert "nothing to summarise" in capsys.readouterr().err


def test_lra_sweep_as_a_slurm_array_then_summary(slurm_cluster, tmp_path):
    """slurm/finetune.sbatch: an LRA array over task x family x seed with the shipped
    Skyformer recipes, one element self-pretrained via SWEEP_INIT, then lra-summary."""
    import os
    import sys

    from slurm_support import REPO, submit, wait_for_job

    from finetune.lra.synthetic import write_synthetic_imdb
    from model import EncoderConfig
    from model.heads import build_model
    from model.hub.release import save_release

    data = tmp_path / "lra_release"
    write_splits(data / "listops-1000", {"train": 48, "val": 16, "test": 16}, 20, 60, seed=2)
    write_synthetic_imdb(data, train=32, test=16, min_words=5, max_words=10)
    # "pretrained" releases in the LRA vocabularies (random weights: what matters is the path)
    for task, vocab in (("listops", 19), ("text", 260)):
        cfg = EncoderConfig.from_dict(
            {"preset": "debug", "hidden_size": 32, "embedding_size": 32, "num_hidden_layers": 1}
            | {"num_attention_heads": 2, "intermediate_size": 64, "vocab_size": vocab}
            | {"pad_token_id": 0, "max_position_embeddings": 128}
        )
        save_release(tmp_path / f"pre-{task}", build_model(cfg, {"type": "pretraining"}))
    root = tmp_path / "sweep"
    env = dict(os.environ)
    env.update(
        ALBATROSS_DIR=str(REPO),
        ALBATROSS_SETUP=f"source {sys.prefix}/bin/activate",
        SWEEP_TASKS="listops text",
        SWEEP_FAMILIES="softmax",
        SWEEP_SEEDS="0 1",
        SWEEP_ROOT=str(root),
        SWEEP_INIT=str(tmp_path / "pre-{task}"),
    )
    template = str(REPO / "slurm" / "finetune.sbatch")
    common = ["--gpus-per-node=0", "--cpus-per-task=1", f"--output={tmp_path}/lra-%A_%a.out"]
    lra = ["lra", "--protocol", "skyformer", "--data", str(data), "data.max_length=60"]
    array = submit(["--array=0-3", *common, template, *lra, *CPU_SMALL[:-1]], env=env)
    summary = submit(
        [f"--dependency=afterok:{array}", *common, template, "lra-summary", str(root)], env=env
    )
    wait_for_job(summary)
    wait_for_job(array)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("lra-*.out")))
    seeds = sorted(
        (json.loads(p.read_text())["summary"]["task"], json.loads(p.read_text())["summary"]["seed"])
        for p in root.glob("*/seed_*/results.json")
    )
    assert seeds == [("listops", 0), ("listops", 1), ("text", 0), ("text", 1)], logs
    for p in root.glob("*/seed_*/results.json"):
        row = json.loads(p.read_text())["summary"]
        assert row["init"] == str(tmp_path / f"pre-{row['task']}")
    table = (root / "results.md").read_text()
    assert "| softmax (pretrained, ours, 2 seeds) |" in table, logs


@pytest.mark.parametrize(
    ("task", "family"), [("image", "softmax"), ("pathfinder", "tisa"), ("pathx", "kernel")]
)
def test_image_tasks_end_to_end(tmp_path, task, family):
    """A tiny run per pixel task from its official files, with a shipped recipe shrunk to CPU
    size (Path-X: 16385 tokens per sequence, with linear attention)."""
    from test_lra_data import write_cifar, write_pathfinder

    data = tmp_path / "lra_release"
    if task == "image":
        write_cifar(data / "cifar-10-batches-py", per_batch=8)
    else:
        side = 32 if task == "pathfinder" else 128
        folder = "pathfinder32" if task == "pathfinder" else "pathfinder128"
        write_pathfinder(data / folder, side=side, batches=1, per=20)
    run_dir = tmp_path / "run"
    args = ["lra", "--task", task, "--data", str(data), "--protocol", "skyformer"]
    args += ["--family", family, *CPU_SMALL, "engine.micro_batch_size=4"]
    args += [f"train.run_dir={run_dir}"]
    args += ["schedule.total_steps=2", "train.eval_every=2"]
    assert finetune_main(args) == 0
    row = json.loads((run_dir / "results.json").read_text())["runs"][0]
    assert row["task"] == task and row["family"] == family
    assert 0.0 <= row["test_accuracy"] <= 1.0


def test_an_override_after_seeds_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        finetune_main(["lra", "--task", "listops", "--data", str(tmp_path), "--seeds", "0", "a=1"])
    assert exit_info.value.code == 2
    assert "put key=value overrides before --seeds, or set seeds=[...]" in capsys.readouterr().err
