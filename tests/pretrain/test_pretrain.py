"""Pretraining with the real DeepSpeed engine on CPU: 2 ranks over gloo, launched by torchrun.

ZeRO 0-3 x every attention family, exact resume, SIGTERM mid-run, non-finite losses, corrupt
checkpoints, export, TensorBoard read back, and bad input failing before any work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from background_runs import BackgroundRuns, uses_fixture
from pretrain_support import (
    FAMILY as FAMILY_OVERRIDES,
)
from pretrain_support import (
    REPO,
    base_overrides,
    env,
    free_port,
    make_shards,
    run_pretrain,
    torchrun_cmd,
)
from safetensors.torch import load_file

from engine.metrics import read_image_tags, read_jsonl, read_scalars
from model.hub.release import load_release
from pretrain import export as export_cli
from pretrain.__main__ import main as pretrain_main

pytestmark = pytest.mark.slow

MATRIX = ("0:fp32", "1:bf16", "2:bf16-mixed", "3:bf16", "3:bf16-mixed:ckpt-gas2")
FAMILIES = ("softmax", "tisa", "kernel", "transject")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("data"))


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, f"{what} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"


def _jsonl(run_dir: Path) -> dict[int, dict]:
    return read_jsonl(run_dir / "tensorboard")


# ----------------------------------------------------------------------------- ZeRO x families


RESUME_EXTRA = [
    "engine.zero_stage=2",
    "model.hidden_dropout_prob=0.1",
    "model.attention_probs_dropout_prob=0.1",
    "data.num_workers=1",
    "train.checkpoint_every=5",
    "train.keep_last=5",
]
"""Run A and run B of the resume tests (`resumed`): ZeRO-2, fp32, dropout."""


def _zero_matrix(jobs: BackgroundRuns, shards: Path, out: Path) -> Path:
    cmd = torchrun_cmd(
        2, str(REPO / "tests/multiproc/zero_matrix.py"), str(shards), str(out), *MATRIX
    )
    _check(jobs.run(cmd, cwd=REPO, env=env(), timeout=600), "tests/multiproc/zero_matrix.py")
    return out


def _run_a(shards: Path, a: Path) -> None:
    _check(run_pretrain([*base_overrides(shards, a, 10), *RESUME_EXTRA]), "run A")


def _run_b(shards: Path, b: Path) -> None:
    _check(run_pretrain([*base_overrides(shards, b, 5), *RESUME_EXTRA]), "run B to 5")
    _check(run_pretrain([*base_overrides(shards, b, 10), *RESUME_EXTRA]), "run B resumed to 10")


@pytest.fixture(scope="module")
def resume_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def launches(request, shards, resume_root, tmp_path_factory):
    """The launches behind the module's shared fixtures, `matrix` and `resumed`, started
    together when the first of them is needed, two at a time (`BackgroundRuns`): the matrix's
    tests wait for it while runs A and B go on. Only those of selected tests start."""
    jobs = BackgroundRuns(workers=2)
    if uses_fixture(request, "matrix"):
        jobs.submit("matrix", _zero_matrix, jobs, shards, tmp_path_factory.mktemp("matrix"))
    if uses_fixture(request, "resumed"):
        jobs.submit("b", _run_b, shards, resume_root / "b")
        jobs.submit("a", _run_a, shards, resume_root / "a")
    yield jobs
    jobs.close()


@pytest.fixture(scope="module")
def matrix(launches) -> dict:
    out = launches.result("matrix")
    return {"report": json.loads((out / "report.json").read_text()), "out": out}


@pytest.mark.parametrize("spec", MATRIX)
@pytest.mark.parametrize("family", FAMILIES)
def test_zero_stage_smoke_steps(matrix, spec, family):
    row = matrix["report"][f"{spec}:{family}"]
    assert row["state"] == "completed" and row["step"] == 3
    assert row["finite"], row["last"]
    assert row["last"]["loss/mlm"] > 0
    # The release (consolidated fp32, gathered from ZeRO-3 partitions) equals the live weights
    # (bf16 weights: their rounding of the fp32 master copies).
    assert row["same_keys"]
    assert row["max_diff_vs_live"] == 0.0
    if family == "transject":
        # The orthogonal parameterisation survives ZeRO (incl. ZeRO-3) and bf16.
        assert row["orthogonality_error"] < 1e-5
        assert "loss/aux/transject_reconstruction" in row["tags"]
    if spec == "3:bf16":
        # An independent path: DeepSpeed's own zero_to_fp32 consolidation of the checkpoint.
        assert row["zero_to_fp32_missing"] == []
        assert row["zero_to_fp32_max_diff"] == 0.0


def test_tensorboard_holds_the_scalars_and_diagnostics(matrix):
    row = matrix["report"]["0:fp32:transject"]
    tags = set(row["tags"])
    expected = {
        "loss/mlm",
        "loss/sop",
        "loss/total",
        "accuracy/mlm",
        "accuracy/sop",
        "optim/lr",
        "optim/grad_norm",
        "optim/loss_scale",
        "optim/skipped_steps",
        "throughput/tokens_per_s",
        "throughput/samples_per_s",
        "time/data",
        "time/forward",
        "time/backward",
        "time/step",
        "memory/cpu_max_rss_gb",
        "diagnostics/activation_factor/layer_00",
        "diagnostics/entropy/layer_01",
        "diagnostics/expert_weight/layer_00/expert_1",
        "diagnostics/residual/layer_01",
        "diagnostics/orthogonality_error_max",
        "diagnostics/transject/eigenbasis_error",
        "diagnostics/transject/reconstruction_loss",
    }
    assert expected <= tags, sorted(expected - tags)
    run_dir = matrix["out"] / "zero0-fp32-plain-transject"
    scalars = read_scalars(run_dir / "tensorboard")
    assert [s for s, _ in scalars["loss/mlm"]] == [1, 2, 3]
    jsonl = _jsonl(run_dir)
    assert scalars["loss/mlm"][-1][1] == pytest.approx(jsonl[3]["loss/mlm"], rel=1e-6)
    tisa = matrix["out"] / "zero0-fp32-plain-tisa" / "tensorboard"
    assert "diagnostics/tisa_curves" in read_image_tags(tisa)


def test_transject_eigenbasis_error_falls_over_a_run(shards, tmp_path):
    """The eigen-approximation trains: TransJect's eigenbasis error (the share of M's energy off
    the diagonal of U^T M U), logged to TensorBoard every 10 steps, falls over 60 steps."""
    run_dir = tmp_path / "run"
    overrides = [
        *base_overrides(shards, run_dir, 60),
        *FAMILY_OVERRIDES["transject"],
        "train.log_every=10",
        "train.diagnostics_every=10",
        "model.transject.reconstruction_weight=0.1",  # the authors' LM weight
    ]
    _check(run_pretrain(overrides, nproc=1), "transject pretraining")
    curve = read_scalars(run_dir / "tensorboard")["diagnostics/transject/eigenbasis_error"]
    steps = [s for s, _ in curve]
    values = [v for _, v in curve]
    assert steps[0] == 10 and steps[-1] == 60, steps
    print("eigenbasis error", list(zip(steps, values)))
    assert values[-1] < values[0] - 0.05, values


# ----------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def resumed(launches, resume_root) -> dict:
    """Run A: 10 steps straight. Run B: stopped at 5, resumed to 10. ZeRO-2, fp32, dropout
    (`launches`)."""
    launches.result("a")
    launches.result("b")
    root = resume_root
    return {"a": root / "a", "b": root / "b", "extra": RESUME_EXTRA, "root": root}


def test_resume_is_exact(resumed):
    a, b = _jsonl(resumed["a"]), _jsonl(resumed["b"])
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for step in range(6, 11):
        for key in ("loss/mlm", "loss/sop", "optim/lr", "optim/grad_norm", "accuracy/mlm"):
            assert abs(a[step][key] - b[step][key]) <= 1e-6, (step, key, a[step][key], b[step][key])
    assert a[10]["throughput/tokens_seen"] == b[10]["throughput/tokens_seen"]
    wa = load_file(str(resumed["a"] / "release" / "model.safetensors"))
    wb = load_file(str(resumed["b"] / "release" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    status = json.loads((resumed["b"] / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 10


GOLDEN = Path(__file__).parents[1] / "golden" / "pretrain_debug_zero2.json"


def test_golden_losses(resumed):
    """The debug recipe's losses (2 ranks, ZeRO-2, fp32, dropout) are pinned, so a refactor
    must reproduce them. Regenerate deliberately with ALBATROSS_UPDATE_GOLDEN=1."""
    rows = _jsonl(resumed["a"])
    losses = {str(s): [rows[s]["loss/mlm"], rows[s]["loss/sop"]] for s in sorted(rows)}
    if os.environ.get("ALBATROSS_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(losses, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden, key=int) == sorted(losses, key=int)
    for step, (mlm, sop) in golden.items():
        assert losses[step] == pytest.approx([mlm, sop], abs=1e-4), step


def test_export_cli_from_a_checkpoint(resumed, tmp_path):
    out = tmp_path / "rel"
    assert export_cli.main([str(resumed["a"]), "--step", "5", "--out", str(out)]) == 0
    model = load_release(out)
    assert (out / "tokenizer.json").is_file()
    saved = load_file(
        str(resumed["a"] / "checkpoints" / "step_00000005" / "release" / "model.safetensors")
    )
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    # An existing release is not overwritten without --overwrite.
    assert export_cli.main([str(resumed["a"]), "--out", str(out)]) == 2
    assert export_cli.main([str(resumed["a"]), "--step", "7", "--out", str(tmp_path / "x")]) == 2


def test_corrupt_latest_checkpoint_falls_back(resumed, shards):
    run_dir = resumed["root"] / "corrupt"
    extra = resumed["extra"]
    _check(run_pretrain([*base_overrides(shards, run_dir, 10), *extra]), "run to 10")
    # Same size, unreadable content: passes the size check, fails to load.
    victim = run_dir / "checkpoints" / "step_00000010" / "rank_00001.pt"
    victim.write_bytes(b"\0" * victim.stat().st_size)
    proc = run_pretrain([*base_overrides(shards, run_dir, 12), *extra])
    _check(proc, "resume past a corrupt checkpoint")
    assert "step_00000010" in proc.stderr and "falling back" in proc.stderr
    assert "resumed from" in proc.stderr and "step_00000005" in proc.stderr.split("resumed from")[1]
    assert json.loads((run_dir / "status.json").read_text())["step"] == 12


def test_different_config_in_run_dir_is_refused(resumed, shards, capsys):
    run_dir = resumed["a"]
    before = (run_dir / "config.yaml").read_text()
    args = ["--config", str(REPO / "configs/pretrain/debug.yaml")]
    overrides = [*base_overrides(shards, run_dir, 10), *resumed["extra"], "optimizer.lr=0.1"]
    assert pretrain_main([*args, *overrides]) == 2
    err = capsys.readouterr().err
    assert "different config" in err and "optimizer.lr" in err
    assert (run_dir / "config.yaml").read_text() == before


# ----------------------------------------------------------------------------- faults


def test_sigterm_mid_run_leaves_a_loadable_checkpoint(shards, tmp_path):
    run_dir = tmp_path / "sig"
    cmd = torchrun_cmd(
        2,
        "-m",
        "pretrain",
        "--config",
        str(REPO / "configs/pretrain/debug.yaml"),
        *base_overrides(shards, run_dir, 100_000),
    )
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = run_dir / "tensorboard" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks
    proc.communicate(timeout=120)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped" and status["reason"] == "signal SIGTERM"
    step = status["step"]
    assert 3 <= step < 100_000
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{step:08d}"
    assert load_release(run_dir / "checkpoints" / latest / "release") is not None
    # ... and the run resumes from it and finishes.
    _check(run_pretrain(base_overrides(shards, run_dir, step + 2)), "resume after SIGTERM")
    assert json.loads((run_dir / "status.json").read_text())["step"] == step + 2


def test_nonfinite_losses_are_skipped_then_the_run_stops(shards, tmp_path):
    cmd = torchrun_cmd(2, str(REPO / "tests/multiproc/nonfinite.py"), str(shards), str(tmp_path))
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    _check(proc, "tests/multiproc/nonfinite.py")
    r = json.loads((tmp_path / "report.json").read_text())
    # NaN on rank 1 only at steps 3 and 4: both ranks skipped; weights unchanged; lr held.
    assert r["unchanged"]["3"] and r["unchanged"]["4"]
    assert not r["unchanged"]["5"] and not r["unchanged"]["6"]
    assert r["lrs"]["3"] == r["lrs"]["4"] == r["lrs"]["5"]
    # inf from step 7 on: 3 in a row -> checkpoint of the last good weights, clear error.
    assert r["step"] == 9 and r["skipped"] == 5
    assert r["complete_steps"] == [9]
    assert r["final_digest"] == r["digest_after_6"]
    assert "not finite in 3 steps in a row" in r["error"]


def test_bad_input_fails_before_any_work(shards, tmp_path, capsys):
    args = ["--config", str(REPO / "configs/pretrain/debug.yaml")]
    run_dir = tmp_path / "never"
    base = base_overrides(shards, run_dir, 5)
    assert pretrain_main([*args, *base, "optimizer.lrr=1"]) == 2
    assert "did you mean 'lr'" in capsys.readouterr().err
    assert pretrain_main([*args, *base, f"data.shards={tmp_path / 'nope'}"]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert pretrain_main([*args, *base, "engine.precision=fp16"]) == 2
    assert "CUDA" in capsys.readouterr().err
    assert pretrain_main([*args, *base, "model.vocab_size=123"]) == 2
    assert "model.vocab_size" in capsys.readouterr().err
    # A shard whose bytes no longer match the manifest's sha256.
    bad = tmp_path / "bad_shards"
    bad.mkdir()
    for f in shards.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tokens = bad / "shard_00000.tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[-1] ^= 0xFF
    tokens.write_bytes(bytes(data))
    assert pretrain_main([*args, *base, f"data.shards={bad}"]) == 2
    assert "shard_00000" in capsys.readouterr().err
    assert not run_dir.exists()


def test_deepspeed_launcher(shards, tmp_path):
    """``deepspeed --num_gpus 2 --module pretrain ...`` (it passes --local_rank to each rank)."""
    run_dir = tmp_path / "ds"
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]
    launcher += ["--master_port", str(free_port())]  # its default, 29500, may be taken
    cmd = [*launcher, "--module", "pretrain", "--config", str(REPO / "configs/pretrain/debug.yaml")]
    proc = subprocess.run(
        [*cmd, *base_overrides(shards, run_dir, 3)],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    _check(proc, "deepspeed launcher")
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 3
    assert "2 process(es)" in proc.stdout + proc.stderr


def test_single_process_crash_and_time_budget(shards, tmp_path):
    """``python -m pretrain`` as one plain process: a crash after step 3 leaves the step-2
    checkpoint, the re-run resumes from it; a tiny time budget stops the run with a checkpoint
    (state "stopped"), and the next run finishes."""
    run_dir = tmp_path / "single"
    cmd = [sys.executable, "-m", "pretrain", "--config", str(REPO / "configs/pretrain/debug.yaml")]
    e = {k: v for k, v in env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base = [
        *base_overrides(shards, run_dir, 6),
        "engine.backend=torch",
        "engine.zero_stage=0",
        "train.checkpoint_every=2",
    ]

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*cmd, *base, *extra], cwd=REPO, env=e, capture_output=True, text=True, timeout=300
        )

    crashed = run("train.fail_at_step=3")
    assert crashed.returncode == 1 and "failing on purpose" in crashed.stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "running"  # crashed
    stopped = run("train.time_budget_minutes=0.0001")
    _check(stopped, "time budget")
    assert "resumed from" in stopped.stderr and "step_00000002" in stopped.stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped" and status["reason"].startswith("time budget")
    assert status["step"] == 3
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    _check(run(), "finish")
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 6
    assert os.path.isfile(run_dir / "release" / "model.safetensors")
