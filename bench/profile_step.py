"""Where a pretraining step's time goes, per operator: the shipped recipe's training step (the
same engine and batches as ``bench_pretrain_throughput.py``: DeepSpeed, the recipe's ZeRO stage,
``bf16-mixed`` on CUDA, its LAMB) under ``torch.profiler``, for each family given, and the
operators' self time per step, largest first, with the share of each kind of work (matrix
products, attention kernels, linear algebra, the optimizer, copies and casts, everything else).

A diagnostic for the GPU suite (part ``profile``), not a benchmark: the profiler adds its own
overhead per operator, so the step time it sees is longer than the benchmark's; the shares are
what it is for. On CUDA the time is the device's (kernels, attributed to the operator that
launched them), and the kernels themselves are listed too, by name (which GEMM, which attention
kernel SDPA chose, which fused kernel); on the CPU the host's. Compiled (``--override
engine.compile=true``, as the recipes run on a GPU), the kernels Inductor fused count under
their graph's range ("fused by the compiler"); its products and attention stay aten operators.

    python -m bench.profile_step --device cuda --families softmax transject --out profile.json
    python -m bench.profile_step --device cuda --families softmax tisa transject --padding none \
        --override engine.compile=true --out profile_compiled.json
    python -m bench.profile_step --device cpu --base debug --seq 64 --batch 4 --families transject
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.bench_pretrain_throughput import (
    Measurement,
    add_single_point_args,
    finish_single_point_args,
)
from bench.common import write_result

# Kinds of work by operator name (without "aten::"): (kind, parts any of which the name
# contains, names it may be), the first that matches; the rest is "other" (elementwise,
# reductions, normalisation, indexing).
KINDS = (
    # A compiled graph's own range: on CUDA the self time of the Triton kernels Inductor fused
    # (its matrix products and attention kernels stay aten operators, counted as such).
    ("fused by the compiler", ("compiledfxgraph", "triton_"), ()),
    # row_lse, diagonal_grad: TISA's split backend (model/attention/tisa_split_kernels.py);
    # key_summary, query_output: kernel attention's inference kernels and its training
    # mixing's forward; query_grad, summary_grad, key_grad: that mixing's backward
    # (kernel_triton_kernels.py)
    ("attention", ("attention", "flash", "cudnn", "flex", "fmha", "row_lse", "diagonal_grad",
                   "key_summary", "query_output", "query_grad", "summary_grad", "key_grad"),
     ()),
    # gauss_jordan_inverse: the Cayley maps' leaves (model/orthogonal_kernels.py)
    ("linear algebra",
     ("linalg", "lu_factor", "lu_solve", "_lu", "solve", "inverse", "gauss_jordan"), ()),
    ("optimizer", ("foreach", "lamb", "optimizer", "multi_tensor"), ()),
    ("matrix products", ("gemm",),
     ("mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "einsum", "_scaled_mm")),
    ("copies and casts", (),
     ("copy_", "_to_copy", "to", "clone", "contiguous", "cat", "stack", "_copy_from")),
)  # fmt: skip


def kind_of(name: str) -> str:
    op = name.lower().removeprefix("aten::")
    return next(
        (kind for kind, parts, names in KINDS if op in names or any(p in op for p in parts)),
        "other",
    )


def _device_us(event, fields: tuple[str, str]) -> float:
    """The first of ``fields`` (today's name, then the older one: it changed across torch
    versions) that an averaged profiler event has, in microseconds; 0 if none."""
    for field in fields:
        value = getattr(event, field, None)
        if value is not None:
            return float(value)
    return 0.0


def self_time_us(event, cuda: bool) -> float:
    """An averaged profiler event's self time in microseconds: the device's on CUDA, the host's
    on the CPU."""
    if not cuda:
        return float(event.self_cpu_time_total)
    return _device_us(event, ("self_device_time_total", "self_cuda_time_total"))


def kernel_time_us(event) -> float:
    """A device kernel's averaged profiler event: its total time in microseconds."""
    return _device_us(event, ("device_time_total", "cuda_time_total"))


def profile_family(family: str, args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    m = Measurement(family, args.base, family, args.seq, args.batch, args.vocab, args, {})
    for i in range(args.warmup):  # compilation (engine.compile), the allocator, lazy inits
        m.step(i)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(args.steps):
            m.step(args.warmup + i)
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / args.steps
    ops, kernels = [], []
    for event in prof.key_averages():
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            # kernels: their time is already the launching operator's self time; listed apart
            # by name (which GEMM, which attention kernel SDPA chose, which fused kernel)
            us = kernel_time_us(event)
            if us > 0:
                kernels.append({"kernel": event.key[:160], "calls": event.count / args.steps,
                                "ms": us / 1e3 / args.steps})  # fmt: skip
            continue
        us = self_time_us(event, cuda)
        if us > 0:
            ops.append({"op": event.key, "calls": event.count / args.steps,
                        "self_ms": us / 1e3 / args.steps, "kind": kind_of(event.key)})  # fmt: skip
    ops.sort(key=lambda o: -o["self_ms"])
    total = sum(o["self_ms"] for o in ops) or 1.0
    kernels.sort(key=lambda k: -k["ms"])
    for k in kernels:
        k["share"] = k["ms"] / total
    kinds: dict[str, float] = {}
    for o in ops:
        o["share"] = o["self_ms"] / total
        kinds[o["kind"]] = kinds.get(o["kind"], 0.0) + o["self_ms"]
    del m
    if cuda:
        torch.cuda.empty_cache()
    return {
        "family": family,
        "recipe_base": args.base,
        "seq": args.seq,
        "batch": args.batch,
        "profiled_step_wall_ms": wall * 1e3,
        "self_ms_per_step": total,
        "time": "device" if cuda else "host",
        "kinds": {
            k: {"ms": v, "share": v / total}
            for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
        },
        "top": ops[: args.top],
        "top_kernels": kernels[: args.top],
    }


def print_report(row: dict) -> None:
    print(f"\n{row['family']} ({row['recipe_base']}, seq {row['seq']}, batch {row['batch']}): "
          f"{row['self_ms_per_step']:.1f} ms of {row['time']} time per step under the profiler "
          f"(wall {row['profiled_step_wall_ms']:.1f} ms)")  # fmt: skip
    print("\n| kind of work | ms per step | share |\n|---|---|---|")
    for kind, v in row["kinds"].items():
        print(f"| {kind} | {v['ms']:.2f} | {v['share']:.1%} |")
    print(
        "\n| operator | calls per step | self ms per step | share | kind |\n|---|---|---|---|---|"
    )
    for o in row["top"]:
        print(
            f"| `{o['op']}` | {o['calls']:g} | {o['self_ms']:.2f} | {o['share']:.1%} | {o['kind']} |"
        )
    if row.get("top_kernels"):
        print("\n| device kernel | calls per step | ms per step | share |\n|---|---|---|---|")
        for k in row["top_kernels"]:
            print(f"| `{k['kernel']}` | {k['calls']:g} | {k['ms']:.2f} | {k['share']:.1%} |")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_single_point_args(p)
    p.add_argument("--families", nargs="+", default=["softmax", "transject"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--top", type=int, default=25, help="operators listed")
    p.add_argument("--override", nargs="*", default=["engine.compile=false"],
                   help="recipe overrides key=value (default: engine.compile=false)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    finish_single_point_args(args)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "families": []}
    for family in args.families:
        try:
            row = profile_family(family, args)
        except Exception as e:  # one family that fails: say so, go on with the others
            row = {"family": family, "error": f"{type(e).__name__}: {e}"[:1000]}
            print(f"{family}: {row['error']}", flush=True)
        else:
            print_report(row)
        report["families"].append(row)
        write_result(args.out, report)  # what is done survives a kill


if __name__ == "__main__":
    main()
