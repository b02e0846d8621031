"""What ``engine.compile_scope: layers`` saves: the compilation of a new process's first
training step when each distinct layer is compiled once instead of the encoder unrolled over
every application of its layers, and what it costs in later steps.

Each point runs ``bench/bench_pretrain_throughput.py`` compiled (``engine.compile=true``) in
new processes, once per scope, each with the compiler's cache in a new empty folder (every run
cold: a warm cache would hide the compilation): the peer is the whole-encoder compilation
(``engine.compile_scope=encoder``, the default) in the same run. Points: the albert-base recipe
of each family (``--families``), and one shared softmax layer at albert-base width applied
``--depth`` times (the throughput benchmark's depth points: activation checkpointing on unless
``--no-checkpointing``). Reported per run: the first step's seconds (compilation included), the
later steps' median, the process's wall time, peak memory; then layers / encoder ratios.

    python bench/bench_compile_scope.py --device cpu --families softmax tisa kernel transject \
        --depth 12 48 96 --seq 128 --batch 2 --out bench/results/compile_scope_cpu.json
    python bench/bench_compile_scope.py --device cuda --families softmax transject --depth 48 \
        --out compile_scope_gpu.json      # the suite's part `compilescope`
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from bench_compile_cache import FAMILIES, family_point, one_run

SCOPES = ("encoder", "layers")


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
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--config", default="albert-base-512", help="a name of the albert preset")
    p.add_argument("--depth", type=int, nargs="*", default=[], help="shared-layer applications")
    p.add_argument("--no-checkpointing", action="store_true", help="depth points without it")
    p.add_argument("--seq", type=int, default=None, help="override the config's length")
    p.add_argument("--batch", type=int, default=None, help="override the micro-batch")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run, the first included")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=None, help="seconds per run")
    p.add_argument("--override", nargs="*", default=[], help="recipe overrides key=value")
    p.add_argument("--root", type=Path, default=None, help="where the cache folders go")
    p.add_argument("--out", type=Path, default=None)
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
            whole, layers = runs["encoder"], runs["layers"]
            row = {"point": name, "encoder": whole, "layers": layers}
            if "error" not in whole and "error" not in layers:
                row["first_step_ratio"] = layers["first_step_s"] / whole["first_step_s"]
                row["process_ratio"] = layers["process_s"] / whole["process_s"]
                if whole["later_step_s"] and layers["later_step_s"]:
                    row["later_step_ratio"] = layers["later_step_s"] / whole["later_step_s"]
            results.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    meta = {"args": {k: str(v) for k, v in vars(args).items()}}
    print_table(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": results}, indent=1) + "\n")


def print_table(results: list[dict]) -> None:
    print("\n| point | first step, encoder s | layers s | encoder / layers | later step, encoder s "
          "| layers s | layers / encoder | process, encoder s | layers s | peak GB encoder / "
          "layers | graphs compiled encoder / layers |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        whole, layers = r["encoder"], r["layers"]
        if "error" in whole or "error" in layers:
            print(f"| {r['point']} | error: {whole.get('error') or layers.get('error')} |")
            continue
        print(
            f"| {r['point']} | {whole['first_step_s']:.1f} | {layers['first_step_s']:.1f} | "
            f"{1 / r['first_step_ratio']:.2f}x | {whole['later_step_s']:.3f} | "
            f"{layers['later_step_s']:.3f} | {r.get('later_step_ratio', float('nan')):.3f} | "
            f"{whole['process_s']:.1f} | {layers['process_s']:.1f} | "
            f"{whole['peak_gb']:.2f} / {layers['peak_gb']:.2f} | "
            f"{whole['compiled']} / {layers['compiled']} |"
        )


if __name__ == "__main__":
    main()
