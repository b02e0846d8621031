"""What resuming on another number of processes costs: DeepSpeed's universal-checkpoint
conversion (``engine.reshard.to_universal``) and the load from it, per model size.

For each model: 2 processes (torchrun, DeepSpeed ZeRO ``--stage``, fp32, CPU/gloo) train one
step and save a checkpoint through ``engine.checkpoint.CheckpointStore``. Then, in this
process, ``to_universal`` converts it with 1 worker (in process, as ``Engine.load`` does on
rank 0) and with ``--workers`` worker processes (as ``python -m engine.reshard`` does), each
from scratch. Then ``Engine.load`` is timed on 1 process from the cached universal checkpoint
(the load proper), on 1 process with no cache (conversion + load, what a resume on another
world size pays the first time), and on 2 processes (the ordinary same-world-size load, the
reference). ``seconds`` are wall-clock, one run each (the conversion is I/O- and
pickle-bound: expect +-20% between runs on a shared machine).

    python -m bench.bench_reshard --models tiny albert-base albert-large xlarge xxlarge \
        --out bench/results/reshard_cpu.json

Models: ``tiny`` is the engine test's (tests/multiproc/elastic_engine.py), the others ALBERT
presets (vocabulary 30000; ``xlarge``/``xxlarge``: hidden 2048/4096, ALBERT's xlarge/xxlarge
widths with 12 shared layers).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT as REPO
from bench.common import subprocess_env, write_result

MODELS = {
    "tiny": (
        "debug",
        dict(
            vocab_size=97,
            hidden_size=24,
            embedding_size=12,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=40,
            max_position_embeddings=16,
        ),
    ),
    "albert-base": ("albert-base", {}),
    "albert-large": ("albert-large", {}),
    "xlarge": (
        "albert-base",
        dict(hidden_size=2048, num_attention_heads=16, intermediate_size=8192),
    ),
    "xxlarge": (
        "albert-base",
        dict(hidden_size=4096, num_attention_heads=64, intermediate_size=16384),
    ),
}
SEQ, MICRO, GLOBAL = 16, 1, 2


def _engine(model_name: str, stage: int):
    import torch

    from engine.distributed import detect
    from engine.engine import Engine, EngineConfig
    from engine.optim import OptimizerConfig, ScheduleConfig
    from model.config import EncoderConfig
    from model.heads import EncoderForPretraining

    dist = detect()
    preset, overrides = MODELS[model_name]
    torch.manual_seed(0)
    model = EncoderForPretraining(EncoderConfig.preset(preset, **overrides))
    cfg = EngineConfig(
        backend="deepspeed",
        zero_stage=stage,
        precision="fp32",
        micro_batch_size=MICRO,
        gradient_accumulation_steps=GLOBAL // (MICRO * dist.world_size),
        device="cpu",
    )
    return Engine(model, cfg, OptimizerConfig(name="adamw"), ScheduleConfig(), dist)


def worker(mode: str, directory: Path, model_name: str, stage: int) -> None:
    """Under torchrun. save: one step, then a checkpoint of step 1; load: time Engine.load."""
    import torch

    from engine import checkpoint as ckpt
    from engine.engine import shutdown
    from pretrain.objective import model_inputs, pretraining_loss

    engine = _engine(model_name, stage)
    vocab = engine.module.config.vocab_size
    store = ckpt.CheckpointStore(
        directory / "checkpoints",
        rank=engine.rank,
        world_size=engine.world_size,
        barrier=engine.barrier,
        checksum=None,
    )
    report: dict = {"world_size": engine.world_size}
    if mode == "save":
        g = torch.Generator().manual_seed(engine.rank)
        for _ in range(engine.cfg.gradient_accumulation_steps):
            ids = torch.randint(5, vocab, (MICRO, SEQ), generator=g)
            labels = torch.full_like(ids, -100)
            labels[:, 1:4] = ids[:, 1:4]
            batch = {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "token_type_ids": torch.zeros_like(ids),
                "mlm_labels": labels,
                "sop_labels": torch.zeros(MICRO, dtype=torch.long),
            }
            engine.backward(pretraining_loss(engine.forward(**model_inputs(batch)), batch).total)
        engine.step()
        t0 = time.perf_counter()
        staging = store.begin(1)
        engine.save(staging)
        store.commit(1, {})
        report["save_seconds"] = time.perf_counter() - t0
        report["parameters"] = sum(p.numel() for p in engine.module.parameters())
    else:
        engine.barrier()
        t0 = time.perf_counter()
        engine.load(directory / "checkpoints" / ckpt.tag_for(1))
        engine.barrier()
        report["load_seconds"] = time.perf_counter() - t0
    if engine.rank == 0:
        (directory / f"{mode}_w{engine.world_size}.json").write_text(json.dumps(report))
    shutdown()


def _torchrun(nproc: int, *args: str) -> None:
    env = subprocess_env(OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "bench.bench_reshard",
        "--worker",
        *args,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def _bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def measure(model_name: str, stage: int, workers: int, workdir: Path) -> dict:
    from engine import reshard

    directory = workdir / model_name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    _torchrun(2, "save", str(directory), model_name, str(stage))
    saved = json.loads((directory / "save_w2.json").read_text())
    checkpoint = directory / "checkpoints" / "step_00000001"
    row = {
        "parameters": saved["parameters"],
        "save_seconds_2_processes": round(saved["save_seconds"], 3),
        "checkpoint_mb": round(_bytes(checkpoint.iterdir()) / 1e6, 2),
    }
    universal = reshard.universal_path(checkpoint)
    for count in sorted({1, workers}):
        shutil.rmtree(universal, ignore_errors=True)
        t0 = time.perf_counter()
        reshard.to_universal(checkpoint, workers=count)
        row[f"convert_seconds_{count}_worker{'s' if count > 1 else ''}"] = round(
            time.perf_counter() - t0, 3
        )
    row["universal_mb"] = round(_bytes(universal.rglob("*")) / 1e6, 2)
    row["universal_files"] = sum(1 for p in universal.rglob("*") if p.is_file())
    _torchrun(1, "load", str(directory), model_name, str(stage))  # from the cache
    row["load_seconds_1_process_cached"] = round(
        json.loads((directory / "load_w1.json").read_text())["load_seconds"], 3
    )
    shutil.rmtree(universal)
    _torchrun(1, "load", str(directory), model_name, str(stage))  # converts, then loads
    row["load_seconds_1_process_with_conversion"] = round(
        json.loads((directory / "load_w1.json").read_text())["load_seconds"], 3
    )
    _torchrun(2, "load", str(directory), model_name, str(stage))  # same world size
    row["load_seconds_2_processes_same_world"] = round(
        json.loads((directory / "load_w2.json").read_text())["load_seconds"], 3
    )
    shutil.rmtree(directory)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "albert-base"], choices=MODELS)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", nargs=4, metavar=("MODE", "DIR", "MODEL", "STAGE"))
    args = parser.parse_args()
    if args.worker:
        mode, directory, model_name, stage = args.worker
        worker(mode, Path(directory), model_name, int(stage))
        return
    import deepspeed

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_reshard_"))
    results = {
        "deepspeed": deepspeed.__version__,
        "zero_stage": args.stage,
        "precision": "fp32",
        "models": {},
    }
    for name in args.models:
        row = measure(name, args.stage, args.workers, workdir)
        results["models"][name] = row
        print(name, json.dumps(row), flush=True)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    write_result(args.out, results)


if __name__ == "__main__":
    main()
