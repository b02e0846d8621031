"""What ``engine.compile_cache_dir`` saves: the first training step of a new process, compiled,
with the compiler's cache folder empty (cold) and then holding the graphs of an earlier process
(warm), as a requeued or resumed job, the next phase or another fine-tuning task on another node
would find it on shared storage.

For each family, the throughput benchmark (``bench.bench_pretrain_throughput``) runs twice in new
processes on the same recipe (``--configs``, e.g. ``albert-base-512``), ``engine.compile=true`` and
``engine.compile_cache_dir`` pointing both at one folder made empty for the family: the first
compiles into it, the second loads from it. Reported per run: the first step's seconds (the
compilation included; the throughput benchmark's ``first_step_s``), the later steps' median (the
same in both, unless the cache changed the code: a check), the graphs loaded from and compiled into
the folder, and the whole process's wall time; then warm / cold ratios. The peer is the same command
without the cache (cold), in the same run. The folders are removed at the end unless ``--keep``.

    python -m bench.bench_compile_cache --device cpu --families softmax tisa kernel transject \
        --seq 128 --batch 2 --out bench/results/compile_cache_cpu.json
    python -m bench.bench_compile_cache --device cuda --families softmax tisa transject \
        --out compile_cache_gpu.json      # the suite's part `compilecache`
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, module_command, subprocess_env, write_result

FAMILIES = ("softmax", "tisa", "kernel", "transject")


def family_point(args, family: str) -> list[str]:
    """The throughput benchmark's arguments for ``family`` on the recipe ``args.config``."""
    return ["--preset", "albert", "--configs", args.config, "--families", family]


def one_run(args, point: list[str], cache: Path, out: Path, overrides: tuple = ()) -> dict:
    """One process of the throughput benchmark on ``point`` (its arguments naming what to
    run, e.g. `family_point`), compiled, with the compiler's cache in ``cache``; its row and
    the process's wall seconds. ``overrides``: recipe overrides before ``args.override``."""
    cmd = [
        *module_command("bench.bench_pretrain_throughput"), "--device", args.device, *point, "--padding", "none", "--warmup", "0",
        "--steps", str(args.steps), "--steady-steps", "0", "--threads", str(args.threads),
        "--out", str(out),
    ]  # fmt: skip
    if args.seq:
        cmd += ["--seq", str(args.seq)]
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    if args.timeout:
        cmd += ["--timeout", str(args.timeout)]
    cmd += ["--override", "engine.compile=true", f"engine.compile_cache_dir={cache}",
            *overrides, *args.override]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True)
    wall = time.perf_counter() - start
    rows = json.loads(out.read_text())["rows"] if out.is_file() else []
    if done.returncode != 0 or not rows or "error" in rows[0]:
        error = rows[0].get("error") if rows else (done.stderr or done.stdout)[-800:]
        return {"error": error, "process_s": wall}
    row = rows[0]
    later = row["step_s_all"][1:]  # the first timed step is the first step
    return {
        "first_step_s": row["first_step_s"],
        "later_step_s": statistics.median(later) if later else None,
        "process_s": wall,
        "encoder_compiled": row["compiled"],
        "peak_gb": row.get("peak_gb", row.get("max_rss_gb")),  # GPU: allocated; CPU: RSS
        **{k: v for k, v in row["compile_cache"].items() if k != "dir"},
    }


def add_run_args(p: argparse.ArgumentParser, steps: int) -> None:
    """The options `one_run` and `family_point` read (``steps``: the default of ``--steps``),
    and ``--root`` and ``--out``; shared with ``bench_compile_scope``."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--config", default="albert-base-512", help="a name of the albert preset")
    p.add_argument("--seq", type=int, default=None, help="override the config's length")
    p.add_argument("--batch", type=int, default=None, help="override the micro-batch")
    p.add_argument(
        "--steps", type=int, default=steps, help="timed steps per run, the first included"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=None, help="seconds per run")
    p.add_argument("--override", nargs="*", default=[], help="recipe overrides key=value")
    p.add_argument("--root", type=Path, default=None, help="where the cache folders go")
    p.add_argument("--out", type=Path, default=None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p, steps=3)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--keep", action="store_true", help="keep the cache folders")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="compile_cache_", dir=args.root))
    results = []
    try:
        for family in args.families:
            cache = root / family
            runs = {}
            for kind in ("cold", "warm"):
                point = family_point(args, family)
                runs[kind] = one_run(args, point, cache, root / f"{family}_{kind}.json")
                print(f"{family} {kind}: {json.dumps(runs[kind])}", flush=True)
            results.append(paired({"family": family}, "cold", runs["cold"], "warm", runs["warm"]))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    meta = {"args": {k: str(v) for k, v in vars(args).items()}, "cache_root": str(root)}
    print_table(results)
    write_results(args.out, meta, results)


def paired(row: dict, a: str, first: dict, b: str, second: dict) -> dict:
    """``row`` with the runs ``first`` (under key ``a``) and ``second`` (``b``), and the
    ratios second / first of their first steps, processes and later steps."""
    row = {**row, a: first, b: second}
    if "error" not in first and "error" not in second:
        row["first_step_ratio"] = second["first_step_s"] / first["first_step_s"]
        row["process_ratio"] = second["process_s"] / first["process_s"]
        if first["later_step_s"] and second["later_step_s"]:
            row["later_step_ratio"] = second["later_step_s"] / first["later_step_s"]
    return row


def write_results(out: Path | None, meta: dict, results: list[dict]) -> None:
    write_result(out, {"meta": meta, "rows": results})


def print_pairs(results: list[dict], name: str, a: str, b: str, header: list[str], cells) -> None:
    """A markdown table of `paired` rows: the row's ``name``, then ``cells(row, first,
    second)``; a row whose runs failed shows the error."""
    print("\n| " + " | ".join([name, *header]) + " |")
    print("|---" * (len(header) + 1) + "|")
    for r in results:
        first, second = r[a], r[b]
        if "error" in first or "error" in second:
            print(f"| {r[name]} | error: {first.get('error') or second.get('error')} |")
            continue
        print("| " + " | ".join([str(r[name]), *cells(r, first, second)]) + " |")


def print_table(results: list[dict]) -> None:
    header = [
        "first step cold s", "warm s", "warm / cold", "process cold s", "warm s",
        "graphs compiled cold / loaded warm", "joint graphs loaded warm", "later steps warm / cold",
    ]  # fmt: skip
    print_pairs(
        results, "family", "cold", "warm", header,
        lambda r, cold, warm: [
            f"{cold['first_step_s']:.1f}", f"{warm['first_step_s']:.1f}",
            f"{r['first_step_ratio']:.2f}", f"{cold['process_s']:.1f}", f"{warm['process_s']:.1f}",
            f"{cold['compiled']} / {warm['loaded']} (warm compiled {warm['compiled']})",
            f"{warm['joint_loaded']} of {warm['joint_loaded'] + warm['joint_traced']}",
            f"{r.get('later_step_ratio', float('nan')):.2f}",
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
