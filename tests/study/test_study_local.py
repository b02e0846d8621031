"""Studies run end to end with the local executor: ``main`` at scale ``tiny`` from nothing to
report.md (``transject-lra`` runs end to end on Slurm, test_study_slurm.py); a stage that
fails stops what needs it, and ``run`` again completes only the rest; a spec change reruns only
the stages it reaches."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from study_support import STUDIES, TEXT_STAGES, data_args, markers, to_run, two_data_sets

from study.cli import main as study_main

pytestmark = pytest.mark.integration


def test_main_study_tiny_from_nothing_to_report(tmp_path, capsys):
    out = tmp_path / "main"
    args = ["run", str(STUDIES / "main.yaml"), "--scale", "tiny", "--out", str(out)]
    assert study_main(args) == 0
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["title"].endswith(
        "— scale `tiny` (two families, a few steps each, for the tests)"
    )
    assert report["missing"] == [] and report["checks"] == []
    pretraining = {p["variant"]: p for p in report["pretraining"]}
    assert set(pretraining) == {"softmax", "transject"}
    for p in pretraining.values():
        assert p["steps"] == 12 and p["mlm_loss_last"] < p["mlm_loss_first"]
        assert 0 < p["validation_mlm_loss"] < p["mlm_loss_first"]  # evaluated at step 12
    assert report["exports"] == {"softmax": True, "transject": True}
    ours = {(r["variant"], r["task"]): r for r in report["ours"]}
    assert set(ours) == {("lra-scratch", "listops"), ("lra-self-pretrained", "listops")}
    assert all(0 <= r["aggregate"] <= 100 and r["interval"] for r in ours.values())
    (diff,) = report["differences"]  # self-pretrained against scratch, with its interval
    assert diff["variant"] == "lra-self-pretrained" and diff["reference"] == "lra-scratch"
    assert set(report["baselines"]["listops"]) == {"majority", "first_token", "bag_of_tokens"}
    figures = {p.name for p in (out / "report" / "figures").iterdir()}
    assert {"scores-listops.png", "pretraining.png"} <= figures
    # the releases carry the corpus's tokenizer
    (corpus,) = out.glob("nodes/data.corpus-*/run/tokenizer/tokenizer.json")
    for release in out.glob("nodes/*.export-*/run/release"):
        assert (release / "tokenizer.json").read_bytes() == corpus.read_bytes()
    # a second run finds everything done and runs nothing
    before = markers(out)
    capsys.readouterr()
    assert study_main(args) == 0
    assert to_run(capsys.readouterr().out) == 0 and markers(out) == before


def test_failed_stage_then_rerun_completes_only_the_rest_and_a_change_reruns_only_it(
    tmp_path, capsys
):
    spec, data = two_data_sets(tmp_path)
    out = tmp_path / "out"
    base = ["--out", str(out), *data_args(data)]
    hidden = data["tx"] / "hidden"
    (data["tx"] / "aclImdb").rename(hidden)  # Text's files gone: its stages fail at run time
    assert study_main(["run", str(spec), *base]) == 1
    captured = capsys.readouterr()
    assert to_run(captured.out) == 6
    assert "b.lra.text: not run: b.lra-pretrain.text did not finish" in captured.err
    assert study_main(["status", str(spec), *base]) == 0
    status = capsys.readouterr().out
    assert "| a.lra.listops | done |" in status and "| lra-shards.text-128 | failed |" in status
    assert "| b.lra.text | not started |" in status
    assert "lra-shards.text-128 failed (exit status" in status and "whole log: less" in status
    done = markers(out)
    assert len(done) == 2  # a.lra.listops and baselines.listops

    hidden.rename(data["tx"] / "aclImdb")  # the data is back: run again
    assert study_main(["run", str(spec), *base]) == 0
    assert to_run(capsys.readouterr().out) == len(TEXT_STAGES)
    after = markers(out)
    assert {k: v for k, v in after.items() if k in done} == done  # the done stages untouched
    assert {k.split("/")[1].rsplit("-", 1)[0] for k in set(after) - set(done)} == TEXT_STAGES

    # a spec change reaches b's fine-tuning only: its pretraining and everything else is reused
    changed = yaml.safe_load(spec.read_text())
    changed["variants"]["b"]["stages"]["lra"]["overrides"] = ["optimizer.lr=0.002"]
    spec.write_text(yaml.safe_dump(changed))
    old = next(out.glob("nodes/b.lra.text-*"))
    assert study_main(["run", str(spec), *base]) == 0
    assert to_run(capsys.readouterr().out) == 1
    new = set(out.glob("nodes/b.lra.text-*")) - {old}
    assert len(new) == 1 and old.is_dir()  # a new directory; the old run is not overwritten
    assert {k: v for k, v in markers(out).items() if k in after} == after
    shutil.rmtree(out)
