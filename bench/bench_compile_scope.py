"""What ``engine.compile_scope: layers`` saves: the compilation of a new process's first
training step when each distinct layer is compiled once instead of the encoder unrolled over
every application of its layers, and what it costs in later steps.

Each point runs the throughput benchmark (``bench.bench_pretrain_throughput``) compiled
(``engine.compile=true``) in new processes, once per scope, each with the compiler's cache in a new
empty folder (every run cold: a warm cache would hide the compilation): the peer is the
whole-encoder compilation (``engine.compile_scope=encoder``, the default) in the same run. Points:
the albert-base recipe of each family (``--families``), and one shared softmax layer at albert-base
width applied ``--depth`` times (the throughput benchmark's depth points: activation checkpointing
on unless ``--no-checkpointing``). Reported per run: the first step's seconds (compilation
included), the later steps' median, the process's wall time, peak memory; then layers / encoder
ratios.

    python -m bench.bench_compile_scope --device cpu --families softmax tisa kernel transject \
        --depth 12 48 96 --seq 128 --batch 2 --out bench/results/compile_scope_cpu.json
    python -m bench.bench_compile_scope --device cuda --families softmax --depth 48 \
        --out compile_scope_gpu.json      # the suite's part `compilescope`
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from bench.bench_compile_cache import (
    FAMILIES,
    add_run_args,
    family_point,
    one_run,
    paired,
    print_pairs,
    write_results,
)
from engine.config import COMPILE_SCOPES as SCOPES


def points(args) -> list[tuple[str, list[str]]]:
    """(name, the throughput benchmark's arguments) of every point asked for."""
    out = [(f"{args.config} {family}", family_point(args, family)) for family in args.families]
    for layers in args.depth:
        depth = ["--depth", str(layers)]
        if args.no_checkpointing:
            depth.append("--no-checkpointing")
        out.append((f"depth {layers}" + ("" if args.no_checkpointing else " ckpt"), depth))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p, steps=4)
    p.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--depth", type=int, nargs="*", default=[], help="shared-layer applications")
    p.add_argument("--no-checkpointing", action="store_true", help="depth points without it")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="compile_scope_", dir=args.root))
    results = []
    try:
        for i, (name, point) in enumerate(points(args)):
            runs = {}
            for scope in SCOPES:
                cache = root / f"{i}_{scope}"  # empty: every run compiles
                out = root / f"{i}_{scope}.json"
                overrides = (f"engine.compile_scope={scope}",)
                runs[scope] = one_run(args, point, cache, out, overrides)
                print(f"{name} {scope}: {json.dumps(runs[scope])}", flush=True)
            row = paired({"point": name}, "encoder", runs["encoder"], "layers", runs["layers"])
            results.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    meta = {"args": {k: str(v) for k, v in vars(args).items()}}
    print_table(results)
    write_results(args.out, meta, results)


def print_table(results: list[dict]) -> None:
    header = [
        "first step, encoder s", "layers s", "encoder / layers", "later step, encoder s",
        "layers s", "layers / encoder", "process, encoder s", "layers s",
        "peak GB encoder / layers", "graphs compiled encoder / layers",
    ]  # fmt: skip
    print_pairs(
        results, "point", "encoder", "layers", header,
        lambda r, whole, layers: [
            f"{whole['first_step_s']:.1f}", f"{layers['first_step_s']:.1f}",
            f"{1 / r['first_step_ratio']:.2f}x", f"{whole['later_step_s']:.3f}",
            f"{layers['later_step_s']:.3f}", f"{r.get('later_step_ratio', float('nan')):.3f}",
            f"{whole['process_s']:.1f}", f"{layers['process_s']:.1f}",
            f"{whole['peak_gb']:.2f} / {layers['peak_gb']:.2f}",
            f"{whole['compiled']} / {layers['compiled']}",
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
