"""The README's main job, shortened: data_prep on the embedded corpus -> DeepSpeed pretraining
on 2 processes -> export -> summary -> LRA (self-pretraining vs scratch on generated ListOps);
a second run reuses everything."""

from __future__ import annotations

import json

from main_job import pipeline
from model.release import load_release


def test_main_job_end_to_end(tmp_path):
    out = tmp_path / "main"
    args = ["--out", str(out), "--families", "softmax", "transject", "--lra-scale", "tiny"]
    args += ["--", "train.steps=12"]
    assert pipeline.main(args) == 0
    manifest = json.loads((out / "data" / "shards-val5" / "manifest.json").read_text())
    assert manifest["totals"]["examples"] > 1000
    assert manifest["validation"]["totals"]["examples"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["family"] for r in summary] == ["softmax", "transject"]
    for row in summary:
        assert row["state"] == "completed" and row["steps"] == 12
        assert row["mlm_loss_last"] < row["mlm_loss_first"]
        assert 0 < row["validation_mlm_loss"] < row["mlm_loss_first"]  # evaluated at step 12
        assert row["export_matches_run"]
        release = out / "releases" / row["family"]
        assert (release / "tokenizer.json").read_bytes() == (
            out / "data" / "tokenizer" / "tokenizer.json"
        ).read_bytes()
        assert load_release(release).config.attention == row["family"]
        assert (out / "pretrain" / row["family"] / "tensorboard").is_dir()
    # The LRA stage: self-pretrained and from-scratch ListOps runs, side by side.
    lra = json.loads((out / "lra" / "results.json").read_text())["rows"]
    assert sorted(r["init"] for r in lra) == ["scratch", "self-pretrained"]
    for r in lra:
        assert r["task"] == "listops" and r["family"] == "softmax" and r["seeds"] == [0]
        assert 0.0 <= r["median"] <= 1.0
    assert (
        load_release(out / "lra" / "pretrain" / "listops-softmax" / "release").config.vocab_size
        == 19
    )
    # A second run reuses the shards and the finished runs (they resume at their last step).
    before = (out / "data" / "shards-val5" / "shard_00000.tokens.npy").stat().st_mtime_ns
    again = ["--out", str(out), "--families", "softmax", "--lra-scale", "none"]
    assert pipeline.main([*again, "--", "train.steps=12"]) == 0
    assert (out / "data" / "shards-val5" / "shard_00000.tokens.npy").stat().st_mtime_ns == before
