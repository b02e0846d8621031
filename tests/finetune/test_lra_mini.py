"""The mini-LRA driver (finetune/lra/mini.py) without training: its scales, commands, the
last-step accuracy and curves it reads from the runs, its tables; and one tiny end-to-end run
of ListOps (the end-to-end Text run is in test_lra_selfpretrain.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_prep import listops
from finetune.lra import mini


def fake_run(run_dir: Path, seed: int, points: list[tuple[int, float, float]]) -> None:
    """seed_<s>/results.json as Finetuner writes it; best = the best val point (which the
    driver must ignore)."""
    history = [{"step": s, "val": {"accuracy": v}, "test": {"accuracy": t}} for s, v, t in points]
    best = max(history, key=lambda h: h["val"]["accuracy"])
    path = run_dir / f"seed_{seed}" / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"best_step": best["step"], "best": best, "history": history}))


def test_scales():
    table = mini.SCALES["table"]
    assert table == mini.Scale()
    assert (table.listops_max_depth, table.listops_max_args) == (3, 5)
    assert table.listops[2] == 2000 and table.text[1] == 2000  # test sets that resolve ±2 points
    assert mini.SCALES["lra-shape"].text == (2000, 500)  # the previous table, as it was
    assert table.steps("listops") == 3000 and table.steps("text") == 400
    assert table.steps("listops", "pretrain") == 500 and table.steps("text", "pretrain") == 300
    assert mini.eval_steps("listops", table) == list(range(375, 3001, 375))
    assert mini.eval_steps("text", table) == list(range(50, 401, 50))
    gpu = mini.SCALES["gpu"]
    assert gpu.steps("listops") > table.steps("listops") and gpu.listops[0] > table.listops[0]
    assert gpu.listops_length[1] > table.listops_length[1]
    assert "engine.device=cuda" in gpu.overrides
    # the main job's stage and the previous table keep the LRA generator's shape
    for name in ("main", "lra-shape"):
        scale = mini.SCALES[name]
        assert (scale.listops_max_depth, scale.listops_max_args) == (10, 10)
        assert scale.listops_length == (50, 150) and scale.steps("listops") == 400
    assert mini.eval_steps("listops", mini.SCALES["main"]) == [400]
    assert mini.eval_steps("text", mini.Scale(finetune_steps=10, curve_points=3)) == [3, 6, 9, 10]
    assert mini.eval_steps("text", mini.SCALES["tiny"]) == [4, 8]


def test_families():
    assert mini.FAMILIES == ("softmax", "tisa", "kernel", "transject")
    # TISA keeps absolute positions; the TISA-only ablation is a family of its own
    assert not any("position_embedding" in o for o in mini.FAMILY_OVERRIDES["tisa"])
    assert "model.position_embedding=none" in mini.FAMILY_OVERRIDES["tisa-nopos"]
    with pytest.raises(SystemExit):
        mini.main(["--families", "nope"])
    with pytest.raises(ValueError, match="unknown families"):
        mini.run(Path("unused"), ["text"], ["nope"], [0], mini.SCALES["tiny"])


def test_commands(tmp_path):
    scale = mini.SCALES["table"]
    data = mini.listops_data_cmd(tmp_path, scale)
    assert data[data.index("--max-depth") + 1] == "3" and data[data.index("--max-args") + 1] == "5"
    assert (
        data[data.index("--min-length") + 1] == "10"
        and data[data.index("--max-length") + 1] == "40"
    )
    ft = mini.finetune_cmd("listops", "tisa", tmp_path, tmp_path / "r", [0, 1], scale, None)
    assert "train.eval_every=375" in ft and "schedule.total_steps=3000" in ft
    assert "train.save_best=false" in ft and "model.attention=tisa" in ft
    assert "model.position_embedding=none" not in ft
    nopos = mini.finetune_cmd("text", "tisa-nopos", tmp_path, tmp_path, [0], scale, None)
    assert "model.position_embedding=none" in nopos and "train.eval_every=50" in nopos
    # from a release: the release's model, nothing of the family's
    init = mini.finetune_cmd("text", "tisa", tmp_path, tmp_path, [0], scale, tmp_path / "rel")
    assert "--init" in init and not any(o.startswith("model.") for o in init)
    pre = mini.pretrain_cmd("listops", "kernel", tmp_path, tmp_path, scale)
    assert "schedule.total_steps=500" in pre and "data.max_seq_length=41" in pre
    assert "model.attention=kernel" in pre
    assert not any(o.startswith("model.max_position") for o in pre)
    assert "--op-prob" not in data  # the LRA value, left to the generator's default
    gpu_data = mini.listops_data_cmd(tmp_path, mini.SCALES["gpu"])
    assert gpu_data[gpu_data.index("--op-prob") + 1] == "0.4"
    gpu = mini.pretrain_cmd("text", "softmax", tmp_path, tmp_path, mini.SCALES["gpu"])
    assert "engine.device=cuda" in gpu and "model.num_hidden_layers=4" in gpu
    assert any(o.startswith("model.max_position_embeddings=") for o in gpu)  # > 512 tokens


def test_default_generator_flags_keep_the_lra_shape(tmp_path):
    """The driver always passes --max-depth / --max-args; with the LRA values the files are
    those of the generator's defaults."""
    cmd = mini.listops_data_cmd(tmp_path / "a", mini.SCALES["main"])
    assert cmd[cmd.index("--max-depth") + 1] == str(listops.DEFAULT_MAX_DEPTH)
    assert cmd[cmd.index("--max-args") + 1] == str(listops.DEFAULT_MAX_ARGS)


def test_last_step_not_best_val_and_curves(tmp_path):
    steps = [2, 4, 6]
    fake_run(tmp_path, 0, [(2, 0.30, 0.31), (4, 0.60, 0.62), (6, 0.50, 0.51)])
    fake_run(tmp_path, 1, [(2, 0.20, 0.21), (4, 0.40, 0.41), (6, 0.45, 0.47)])
    fake_run(tmp_path, 2, [(2, 0.10, 0.11), (4, 0.30, 0.33), (6, 0.35, 0.39)])
    got = mini.summarise_runs(tmp_path, [0, 1, 2], steps)
    assert got["test_accuracy"] == [0.51, 0.47, 0.39]  # after the last step, not the best val
    assert got["median"] == 0.47 and got["spread"] == pytest.approx(0.12)
    assert got["curve"]["steps"] == steps
    assert got["curve"]["test_median"] == [0.21, 0.41, 0.47]
    assert got["curve"]["val_median"] == [0.20, 0.40, 0.45]
    assert mini._done(tmp_path, [0, 1, 2], steps)
    assert not mini._done(tmp_path, [0, 3], steps)  # seed 3 never ran
    assert not mini._done(tmp_path, [0], [3, 6])  # other evaluation steps: run again
    with pytest.raises(RuntimeError, match="not evaluated"):
        mini.summarise_runs(tmp_path, [0], [6])


def row(task, family, init, median, spread=0.02, steps=(1, 2)):
    curve = {"steps": list(steps), "test_median": [median / 2, median]}
    return {"task": task, "family": family, "init": init, "median": median,
            "spread": spread, "curve": curve}  # fmt: skip


def test_tables():
    found = {
        "listops": {"majority": 0.14, "first_token": 0.274, "bag_of_tokens": 0.356},
        "text": {"majority": 0.5, "bag_of_tokens": 0.70, "bag_of_words": 1.0},
    }
    rows = [
        row("listops", "softmax", "scratch", 0.456),
        row("text", "softmax", "scratch", 0.68),
        row("listops", "softmax", "self-pretrained", 0.40),
        row("text", "softmax", "self-pretrained", 0.72),
        row("listops", "kernel", "scratch", 0.30),
    ]
    md = mini.table(rows, found)
    lines = md.splitlines()
    assert lines[0] == (
        "| model | init | listops | listops − shortcut | listops gain | text | text − shortcut "
        "| text gain | average |"
    )
    assert "| majority class | baseline | 14.0 |  |  | 50.0 |  |  | |" in lines
    assert "| first-operator rule | baseline | 27.4 |  |  | – |  |  | |" in lines
    assert "| bag-of-words (reference) | baseline | – |  |  | 100.0 |  |  | |" in lines
    # the shortcut of Text is bag-of-bytes (70.0), not bag-of-words
    assert "| softmax | scratch | 45.6 ± 1.0 | +10.0 |  | 68.0 ± 1.0 | -2.0 |  | 56.8 |" in lines
    assert (
        "| softmax | self-pretrained | 40.0 ± 1.0 | +4.4 | -5.6 | 72.0 ± 1.0 | +2.0 | +4.0 | 56.0 |"
        in lines
    )
    assert "| kernel | scratch | 30.0 ± 1.0 | -5.6 |  | – | – | – | – |" in lines
    iv = {"accuracy": {"estimate": 0.456, "low": 0.41, "high": 0.50, "level": 0.95},
          "vs_shortcut": {"estimate": 0.10, "low": 0.05, "high": 0.15, "level": 0.95}}  # fmt: skip
    rows[0]["intervals"] = iv
    rows[4]["intervals"] = {"vs_softmax": {"estimate": -0.156, "low": -0.2, "high": 0.01,
                                           "level": 0.95}}  # fmt: skip
    lines = mini.interval_table(rows).splitlines()
    assert lines[0] == ("| task | model | init | test accuracy (mean) | − shortcut | − softmax "
                        "| self-pretraining gain |")  # fmt: skip
    assert (
        "| listops | softmax | scratch | 45.6 [41.0, 50.0] | +10.0 [+5.0, +15.0] * |  |  |" in lines
    )
    assert "| listops | kernel | scratch |  |  | -15.6 [-20.0, +1.0] |  |" in lines
    curves = mini.curve_table(rows)
    assert "| listops: step | 1 | 2 |" in curves and "| softmax, scratch | 22.8 | 45.6 |" in curves
    assert "| text: step | 1 | 2 |" in curves


def test_another_scale_in_the_same_out_is_refused(tmp_path):
    mini.check_scale(tmp_path, mini.SCALES["tiny"])
    mini.check_scale(tmp_path, mini.SCALES["tiny"])  # the same: fine
    with pytest.raises(ValueError, match="another scale"):
        mini.check_scale(tmp_path, mini.SCALES["table"])
    assert mini.main(["--out", str(tmp_path), "--scale", "table", "--tasks", "text"]) == 1


@pytest.mark.slow
def test_mini_lra_tiny_listops(tmp_path):
    rows = mini.run(tmp_path, ["listops"], ["softmax"], [0, 1], mini.SCALES["tiny"], jobs=2)
    assert sorted(r["init"] for r in rows) == ["scratch", "self-pretrained"]
    for r in rows:
        assert r["curve"]["steps"] == [4, 8] and len(r["test_accuracy"]) == 2
        # the table's number is the last step's, whatever step val liked best
        for seed, final in zip(r["seeds"], r["test_accuracy"]):
            history = json.loads((Path(r["run_dir"]) / f"seed_{seed}" / "results.json").read_text())
            assert final == history["history"][-1]["test"]["accuracy"]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["baselines"]["listops"]) == {"majority", "first_token", "bag_of_tokens"}
    assert results["shortcut"]["listops"]["accuracy"] == max(
        results["baselines"]["listops"].values()
    )
    assert results["scale"]["listops_max_depth"] == 3
    md = (tmp_path / "results.md").read_text()
    assert "| first-operator rule | baseline |" in md and "| softmax | self-pretrained |" in md
    assert "| listops: step | 4 | 8 |" in md
    # the intervals: paired with the shortcut baseline's predictions, the gain with scratch's
    assert "| task | model | init | test accuracy (mean) |" in md
    by = {r["init"]: r for r in results["rows"]}
    for r in by.values():
        mean = sum(r["test_accuracy"]) / len(r["test_accuracy"])
        assert r["intervals"]["accuracy"]["estimate"] == pytest.approx(mean)
        shortcut = results["shortcut"]["listops"]["accuracy"]
        assert r["intervals"]["vs_shortcut"]["estimate"] == pytest.approx(mean - shortcut)
    gain = by["self-pretrained"]["intervals"]["gain"]["estimate"]
    means = {k: sum(r["test_accuracy"]) / 2 for k, r in by.items()}
    assert gain == pytest.approx(means["self-pretrained"] - means["scratch"])
    assert "gain" not in by["scratch"]["intervals"]
    # the data: depth <= 3 (at most 2 nested operators), 10 < length < 40
    for src, _ in listops.read_tsv(tmp_path / "data" / "listops" / "basic_train.tsv"):
        assert 10 < listops.source_length(src) < 40
        depth = most = 0
        for tok in src.split():
            depth += tok.startswith("[")
            depth -= tok == "]"
            most = max(most, depth)
        assert most <= 2
    # a second call reuses every run, also one from before runs saved their predictions
    (Path(by["scratch"]["run_dir"]) / "seed_1" / "predictions.npz").unlink()
    again = mini.run(tmp_path, ["listops"], ["softmax"], [0, 1], mini.SCALES["tiny"], jobs=2)
    assert [r["test_accuracy"] for r in again] == [r["test_accuracy"] for r in rows]
    md = (tmp_path / "results.md").read_text()
    assert "No predictions saved (runs from an older version): listops softmax scratch." in md
    assert "gain" not in {r["init"]: r for r in again}["self-pretrained"]["intervals"]
