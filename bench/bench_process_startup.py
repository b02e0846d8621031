"""What a process's start and end cost: DeepSpeed's import, Python's teardown, a short job.

Every rank of a job, and every short command a batch script runs, pays for importing torch
and DeepSpeed and for Python's interpreter teardown at the end. The project imports DeepSpeed
without its autotuner's MLflow import (`engine.extensions.import_deepspeed`) and ends its
commands without the teardown (`engine.process_exit.exit_process`). Three measurements, each
against the plain way in the same run, the two variants alternating (A B A B ...) so that the
ratios are taken pair by pair on a machine whose speed drifts:

1. `import deepspeed` after `import torch`, in a fresh interpreter: plain, against
   `import_deepspeed()` (seconds inside the process);
2. a process that imports torch, TorchDynamo and DeepSpeed and ends: normally (`sys.exit`),
   against `exit_process` (wall seconds of the whole process);
3. a 2-rank DeepSpeed pretraining run of the debug recipe under `torchrun` (ZeRO-2 over gloo,
   `--steps` steps on the tiny shard set of `bench_host_syncs.make_shards`): with MLflow
   imported first and `ALBATROSS_FULL_EXIT=1` (what every rank did before), against the
   project as it is (wall seconds of the whole `torchrun`). Both go through the same small wrapper.

MLflow must be installed for 1 and 3 to differ (the `mlflow` extra; the test environment has
it). Medians over `--repeats` pairs; the JSON has every run.

    python bench/bench_process_startup.py --repeats 5 --out bench/results/process_startup_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

IMPORT_PLAIN = "import torch, time; t = time.perf_counter(); import deepspeed; "
IMPORT_OURS = (
    "import torch, time; from engine.extensions import import_deepspeed; "
    "t = time.perf_counter(); import_deepspeed(); "
)
PRINT_ELAPSED = "print(time.perf_counter() - t)"

EXIT_CHILD = (
    "import sys, torch, torch._dynamo; from engine.extensions import import_deepspeed; "
    "import_deepspeed(); from engine.process_exit import exit_process; "
    "exit_process(0) if sys.argv[1] == 'fast' else sys.exit(0)"
)

RANK_WRAPPER = (
    "import os, runpy, sys\n"
    "if os.environ.get('BENCH_PRELOAD_MLFLOW') == '1':\n"
    "    import mlflow  # noqa: F401\n"
    "sys.argv = ['pretrain', *sys.argv[1:]]\n"
    "runpy.run_module('pretrain', run_name='__main__')\n"
)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ALBATROSS_FULL_EXIT"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(extra)
    return env


def run(cmd: list[str], env: dict[str, str], timeout: float = 600) -> tuple[float, str]:
    """(wall seconds, stdout) of a command that must succeed."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]}... exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def paired(name: str, a, b, repeats: int) -> dict:
    """Runs a() and b() alternately `repeats` times (after one warm-up of each); each returns
    seconds. Medians and the median of the pairwise ratios a / b."""
    a(), b()  # warm-up: page cache, compiled bytecode
    runs_a, runs_b = [], []
    for _ in range(repeats):
        runs_a.append(a())
        runs_b.append(b())
    ratios = [x / y for x, y in zip(runs_a, runs_b, strict=True)]
    out = {
        "name": name,
        "ours_s": statistics.median(runs_a),
        "plain_s": statistics.median(runs_b),
        "ratio": statistics.median(ratios),
        "ours_runs": runs_a,
        "plain_runs": runs_b,
    }
    print(
        f"{name}: ours {out['ours_s']:.3f} s, plain {out['plain_s']:.3f} s, "
        f"ratio {out['ratio']:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})",
        flush=True,
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="training steps of part 3")
    parser.add_argument("--parts", nargs="+", default=["import", "exit", "job"])
    parser.add_argument("--out", type=Path, help="JSON results")
    args = parser.parse_args()
    py = sys.executable
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "repeats": args.repeats,
        "parts": [],
    }
    env = child_env()

    if "import" in args.parts:
        results["parts"].append(
            paired(
                "import deepspeed (s, in the process)",
                lambda: float(run([py, "-c", IMPORT_OURS + PRINT_ELAPSED], env)[1].split()[-1]),
                lambda: float(run([py, "-c", IMPORT_PLAIN + PRINT_ELAPSED], env)[1].split()[-1]),
                args.repeats,
            )
        )
    if "exit" in args.parts:
        results["parts"].append(
            paired(
                "a process with torch, TorchDynamo and DeepSpeed (wall s)",
                lambda: run([py, "-c", EXIT_CHILD, "fast"], env)[0],
                lambda: run([py, "-c", EXIT_CHILD, "normal"], env)[0],
                args.repeats,
            )
        )
    if "job" in args.parts:
        with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
            from bench_host_syncs import make_shards  # bench/ (this script's folder)

            shards = make_shards(Path(tmp) / "data", seq=32)
            run_dir = Path(tmp) / "run"
            overrides = [
                f"data.shards={shards}",
                "data.max_seq_length=32",
                "model.max_position_embeddings=32",
                "data.num_workers=0",
                "engine.backend=deepspeed",
                "engine.device=cpu",
                "engine.precision=fp32",
                "engine.zero_stage=2",
                "engine.micro_batch_size=4",
                "optimizer.name=adamw",
                f"train.run_dir={run_dir}",
                f"train.steps={args.steps}",
                "train.checkpoint_every=0",
                "train.progress=false",
            ]
            torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            cmd = [
                *torchrun,
                "--no-python",
                py,
                "-c",
                RANK_WRAPPER,
                "--config",
                str(REPO / "configs" / "pretrain" / "debug.yaml"),
                *overrides,
            ]
            plain_env = child_env(BENCH_PRELOAD_MLFLOW="1", ALBATROSS_FULL_EXIT="1")

            def job(environ: dict[str, str]) -> float:
                shutil.rmtree(run_dir, ignore_errors=True)
                return run(cmd, environ)[0]

            results["parts"].append(
                paired(
                    f"2-rank DeepSpeed debug run, {args.steps} steps, torchrun (wall s)",
                    lambda: job(env),
                    lambda: job(plain_env),
                    args.repeats,
                )
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
