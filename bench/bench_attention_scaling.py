"""Attention scaling: forward time and peak memory per family as the sequence grows.

Inference (no grad), batch `--batch` (1), one encoder layer application, CPU fp32 by default.

CPU: each (family, N) point runs in a fresh subprocess so its peak RSS is its own; the figure
reported is the peak RSS minus the RSS just before the first forward (what the forward itself
allocated). Wall-clock time, median of `--repeats` after one warm-up forward.

CUDA (`--device cuda`): all points run in this process (CUDA start-up once). Time: CUDA events
around each forward after `--warmup` forwards (which also absorb torch.compile of TISA's
FlexAttention), median of `--repeats`. Memory: `torch.cuda.max_memory_allocated()` after a
reset, minus what was allocated before the forward. `--dtype bf16` runs the forward under
`torch.autocast(dtype=torch.bfloat16)` (weights stay fp32). An out-of-memory point is recorded
as an error and the next one runs. The batch holds no padding; by default it comes with an
all-ones mask, which on a GPU the model must treat as padded (it cannot read the mask without
a sync: softmax then runs SDPA with a key-padding bias, not flash); `--no-mask` passes none,
as the trainers do for an unpadded batch (`Engine.to_device`), so every family runs its
unpadded path. `--compile` compiles each point's encoder with inductor first, as
`engine.compile` does in training (the ALBERT recipes' `auto`), so the families compare as
they ship; the warm-up forwards absorb the compilation.

    python -m bench.bench_attention_scaling --lengths 256 512 1024 2048 4096 8192 --out bench/results/scaling.json
    python -m bench.bench_attention_scaling --device cuda --dtype bf16 --lengths 256 512 1024 2048 4096 8192 16384 --out scaling_gpu.json
    python -m bench.bench_attention_scaling --device cuda --dtype bf16 --batch 8 --width 768 --heads 12 --no-mask --compile --lengths 2048 4096 8192
    python -m bench.bench_attention_scaling --device cuda --dtype bf16 --batch 8 --width 768 --heads 12 --no-mask --compile --families softmax kernel kernel-triton --lengths 512 4096 8192

`--families kernel-triton`: kernel attention (aoglu) with `kernel.inference_backend: triton`,
its fused inference kernels (not in the default families: off CUDA it is `kernel`).

Prints a markdown table with the speed-up of each family over softmax at every N, beside
TransJect's Table 4 (5.0x to 26.3x inference speed-up, growing with sequence length).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import module_command, subprocess_env, write_result

FAMILY_CONFIGS = {
    "softmax": {},
    "tisa": {"position_embedding": "none"},
    "kernel": {"kernel": {"feature_map": "aoglu", "dropout": 0.0}},
    "kernel-elu": {"attention": "kernel", "kernel": {"feature_map": "elu", "dropout": 0.0}},
    "transject": {"transject": {"num_experts": 4}},
    # kernel attention's fused inference kernels (CUDA; elsewhere the same as `kernel`)
    "kernel-triton": {
        "attention": "kernel",
        "kernel": {"feature_map": "aoglu", "dropout": 0.0, "inference_backend": "triton"},
    },
}
DEFAULT_FAMILIES = [family for family in FAMILY_CONFIGS if family != "kernel-triton"]


def _peak_rss_mb() -> float:
    """High-water mark of this process's resident memory."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def build(family: str, n: int, width: int, heads: int, layers: int):
    from model import Encoder, EncoderConfig

    overrides = dict(FAMILY_CONFIGS[family])
    attention = overrides.pop("attention", family)
    cfg = EncoderConfig.preset(
        "debug",
        vocab_size=1000,
        embedding_size=128,
        hidden_size=width,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        max_position_embeddings=max(n, 512),
        attention=attention,
        **overrides,
    )
    return Encoder(cfg).eval()


def run_point(
    family: str, n: int, width: int, heads: int, layers: int, repeats: int, threads: int
) -> dict:
    import torch

    torch.set_num_threads(threads)
    model = build(family, n, width, heads, layers)
    ids = torch.randint(4, 1000, (1, n))
    mask = torch.ones(1, n, dtype=torch.bool)
    with torch.no_grad():
        base = _current_rss_mb()  # model and inputs built; the forwards' own memory comes next
        model(ids, mask)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids, mask)
            times.append(time.perf_counter() - start)
    return {
        "family": family,
        "N": n,
        "seconds": statistics.median(times),
        "peak_mb": _peak_rss_mb() - base,
    }


def run_point_cuda(family: str, n: int, args: argparse.Namespace) -> dict:
    """One point on the current CUDA device, in this process (see the module docstring)."""
    import torch

    model = build(family, n, args.width, args.heads, args.layers).cuda()
    if args.compile:
        from engine.engine import compile_encoder

        torch._dynamo.reset()  # a fresh cache per point: each point compiles its own graph
        compile_encoder(model)  # as the engine does (the warm-up forwards absorb the compile)
    ids = torch.randint(4, 1000, (args.batch, n), device="cuda")
    mask = None if args.no_mask else torch.ones(args.batch, n, dtype=torch.bool, device="cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    try:
        with torch.no_grad(), autocast:
            for _ in range(args.warmup):
                model(ids, mask)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            model(ids, mask)
            torch.cuda.synchronize()
            peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
            times = []
            for _ in range(args.repeats):
                begin = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                begin.record()
                model(ids, mask)
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end) / 1e3)
    except torch.cuda.OutOfMemoryError as e:
        return {"family": family, "N": n, "error": f"CUDA out of memory: {str(e)[:120]}"}
    finally:
        del model
        torch.cuda.empty_cache()
    return {"family": family, "N": n, "seconds": statistics.median(times), "peak_mb": peak_mb}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192]
    )
    parser.add_argument(
        "--families", nargs="+", default=DEFAULT_FAMILIES, choices=list(FAMILY_CONFIGS)
    )
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="sequences per forward (CUDA)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="CUDA: bf16 "
                        "autocast (fp32 weights); the CPU path is fp32 only")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=3, help="untimed forwards (CUDA)")
    parser.add_argument(
        "--no-mask",
        action="store_true",
        help="CUDA: no attention mask (the unpadded path) instead of an all-ones one",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="CUDA: the encoder compiled with inductor, as `engine.compile` compiles it",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--point", nargs=2, metavar=("FAMILY", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        family, n = args.point[0], int(args.point[1])
        print(
            json.dumps(
                run_point(
                    family, n, args.width, args.heads, args.layers, args.repeats, args.threads
                )
            )
        )
        return
    if args.device == "cpu" and (args.dtype != "fp32" or args.batch != 1 or args.compile):
        parser.error(
            "the CPU path measures eager fp32 at batch 1 (--dtype/--batch/--compile are for CUDA)"
        )
    rows = []
    for n in args.lengths:
        for family in args.families:
            if args.device == "cuda":
                rows.append(run_point_cuda(family, n, args))
                print(rows[-1], file=sys.stderr, flush=True)
                # what is done survives a kill of this process
                write_result(args.out, {"args": vars(args), "complete": False, "rows": rows})
                continue
            cmd = module_command("bench.bench_attention_scaling", "--point", family, str(n))
            cmd += [
                "--width",
                str(args.width),
                "--heads",
                str(args.heads),
                "--layers",
                str(args.layers),
            ]
            cmd += ["--repeats", str(args.repeats), "--threads", str(args.threads)]
            res = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env())
            if res.returncode != 0:
                rows.append(
                    {"family": family, "N": n, "error": res.stderr.strip().splitlines()[-1]}
                )
            else:
                rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(rows[-1], file=sys.stderr, flush=True)
    if args.device == "cuda":
        import torch

        where = f"{torch.cuda.get_device_name()}, {args.dtype}, torch {torch.__version__}"
        where += ", compiled (inductor)" if args.compile else ""
    else:
        where = f"{args.threads} threads"
    write_result(args.out, {"args": vars(args), "where": where, "rows": rows})
    by = {(r["family"], r["N"]): r for r in rows}
    digits = 2 if args.device == "cuda" else 1
    print(
        f"\nd={args.width}, H={args.heads}, {args.layers} layer(s), batch {args.batch}, "
        f"forward, {where}; ms (peak MB)\n"
    )
    print(
        "| N | "
        + " | ".join(f"{f} ms (MB)" for f in args.families)
        + " | "
        + " | ".join(f"{f} speed-up" for f in args.families if f != "softmax")
        + " |"
    )
    print("|---" * (1 + 2 * len(args.families) - 1) + "|")
    for n in args.lengths:
        cells, speed = [], []
        soft = by.get(("softmax", n), {})
        for f in args.families:
            r = by.get((f, n), {})
            cells.append(
                f"{r['seconds'] * 1e3:.{digits}f} ({r['peak_mb']:.0f})"
                if "seconds" in r
                else "error"
            )
            if f != "softmax":
                ok = "seconds" in r and "seconds" in soft
                speed.append(f"{soft['seconds'] / r['seconds']:.2f}x" if ok else "-")
        print(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(speed) + " |")


if __name__ == "__main__":
    main()
