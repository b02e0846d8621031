"""The README's main job, shortened: data_prep on the embedded corpus, a few steps per family,
releases written with the tokenizer and reloaded."""

from __future__ import annotations

import json

from model.release import load_release
from pretrain import smoke


def test_main_job_end_to_end(tmp_path):
    out = tmp_path / "smoke"
    rc = smoke.main(
        ["--out", str(out), "--steps", "8", "--batch", "8", "--families", "softmax", "transject"]
    )
    assert rc == 0
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    assert manifest["totals"]["examples"] > 1000
    summary = json.loads((out / "summary.json").read_text())
    assert [r["family"] for r in summary] == ["softmax", "transject"]
    for row in summary:
        assert row["mlm_loss_last"] < row["mlm_loss_first"]
        release = out / "releases" / row["family"]
        assert (release / "tokenizer.json").read_bytes() == (
            out / "tokenizer" / "tokenizer.json"
        ).read_bytes()
        assert load_release(release).config.attention == row["family"]
    # A second run reuses the tokenizer and the finished shards.
    before = (out / "shards" / "shard_00000.tokens.npy").stat().st_mtime_ns
    assert (
        smoke.main(["--out", str(out), "--steps", "2", "--batch", "8", "--families", "softmax"])
        == 0
    )
    assert (out / "shards" / "shard_00000.tokens.npy").stat().st_mtime_ns == before
