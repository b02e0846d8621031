"""Studies on the real 2-node Slurm cluster (``slurm/cluster.sh``): ``main`` and
``transject-lra`` at scale ``tiny`` from nothing to report.md, one job per stage and an array
per fine-tuning grid, ordered by Slurm's ``afterok`` dependencies (seen in ``sacct`` and in the
sbatch scripts); a failed stage gets its dependents cancelled by Slurm
(``--kill-on-invalid-dep``), and ``run`` again submits only what is missing."""

from __future__ import annotations

import json
import re
import subprocess
from datetime import datetime

import pytest
from study_support import STUDIES, TEXT_STAGES, data_args, two_data_sets

from study.cli import main as study_main
from study.ledger import read_ledger

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

TIMEOUT = "600"


def sacct(job: str) -> dict[str, str]:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State,Start,End"],
                         capture_output=True, text=True).stdout.split("\n")[0]  # fmt: skip
    state, start, end = out.split("|")
    return {"state": state, "start": start, "end": end}


def test_main_and_transject_lra_tiny_on_slurm(tmp_path, capsys):
    """Both studies submitted at once (their jobs share the cluster), then ``run --wait`` again:
    it submits nothing (every stage is done or has a live job) and waits for the reports.
    ``transject-lra`` runs end to end here only: its report sets the paper's 25 numbers beside
    ours, with the differences and a figure per task."""
    studies = {"main": tmp_path / "main", "transject-lra": tmp_path / "tj"}
    args = {name: ["run", str(STUDIES / f"{name}.yaml"), "--scale", "tiny", "--out", str(out),
                   "--executor", "slurm"] for name, out in studies.items()}  # fmt: skip
    for name in studies:
        assert study_main(args[name]) == 0
    submitted = {name: read_ledger(out) for name, out in studies.items()}
    capsys.readouterr()
    for name in studies:
        assert study_main([*args[name], "--wait", "--timeout", TIMEOUT]) == 0
        assert "job(s) submitted" not in capsys.readouterr().out  # nothing submitted twice
        assert read_ledger(studies[name]) == submitted[name]

    out = studies["main"]
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["missing"] == [] and report["checks"] == []
    assert report["exports"] == {"softmax": True, "transject": True}
    ledger = read_ledger(out)
    pretrain = ledger["softmax.pretrain"]["all"]["job"]
    export = ledger["softmax.export"]["all"]["job"]
    script = (out / "slurm" / f"{export}_submission.sh").read_text()
    assert f"--dependency=afterok:{pretrain}" in script and "--kill-on-invalid-dep=yes" in script
    first, then = sacct(pretrain), sacct(export)
    assert first["state"] == then["state"] == "COMPLETED"
    assert datetime.fromisoformat(then["start"]) >= datetime.fromisoformat(first["end"])
    # pretraining ran as 2 tasks (ranks) of one job
    assert "--ntasks-per-node=2" in (out / "slurm" / f"{pretrain}_submission.sh").read_text()

    out = studies["transject-lra"]
    report = json.loads((out / "report" / "report.json").read_text())
    rows = report["rows"]  # the paper's 25 numbers, each beside ours
    assert len(rows) == 25 and all(r["ours"] is not None for r in rows)
    assert {r["verdict"] for r in rows} <= {"consistent", "below the paper", "above the paper"}
    assert len(report["differences"]) == 20  # four variants against the Transformer, 5 tasks
    text = (out / "report" / "report.md").read_text()
    assert "scale `tiny`, NOT the paper's protocol" in text.splitlines()[0]
    assert "| TransJect | listops | accuracy | 42.2 |" in text
    for task in ("listops", "text", "retrieval", "pathfinder", "image"):
        assert (out / "report" / "figures" / f"scores-{task}.png").stat().st_size > 1000
    jobs = {e["job"] for node in read_ledger(out).values() for e in node.values()}
    assert len(jobs) == 28  # the data, 25 fine-tuning stages, ListOps' and Text's baselines
    assert all(sacct(j)["state"] == "COMPLETED" for j in jobs)


def test_failed_stage_cancels_its_dependents_and_rerun_submits_only_the_rest(tmp_path, capsys):
    spec, data = two_data_sets(tmp_path)
    out = tmp_path / "out"
    base = ["--out", str(out), *data_args(data), "--executor", "slurm", "--wait",
            "--timeout", TIMEOUT, "--partition", "debug"]  # fmt: skip
    hidden = data["tx"] / "hidden"
    (data["tx"] / "aclImdb").rename(hidden)
    assert study_main(["run", str(spec), *base]) == 1
    capsys.readouterr()
    ledger = read_ledger(out)
    job = {node: next(iter(entries.values()))["job"] for node, entries in ledger.items()}
    assert sacct(job["lra-shards.text-128"])["state"] == "FAILED"
    assert sacct(job["baselines.text"])["state"] == "FAILED"  # it reads the Text files too
    for dependent in ("b.lra-pretrain.text", "b.lra.text"):  # Slurm cancelled them itself
        assert sacct(job[dependent])["state"] == "CANCELLED"
    assert sacct(job["a.lra.listops"])["state"] == "COMPLETED"
    script = (out / "slurm" / f"{job['a.lra.listops']}_submission.sh").read_text()
    assert "--partition=debug" in script  # the user's partition, from the command line
    assert study_main(["status", str(spec), "--out", str(out), *data_args(data)]) == 0
    status = capsys.readouterr().out
    assert re.search(r"\| b\.lra\.text \| failed \|", status) and "CANCELLED" in status
    assert f"sacct -j {job['lra-shards.text-128']}" in status

    hidden.rename(data["tx"] / "aclImdb")
    assert study_main(["run", str(spec), *base]) == 0
    again = read_ledger(out)
    resubmitted = {n for n, e in again.items() if next(iter(e.values()))["job"] != job[n]}
    assert resubmitted == TEXT_STAGES  # the failed, the cancelled; nothing done before
