"""The fast paths, each timed against its peer in the same process.

TISA's step against softmax's, the compiled encoder against eager, length-grouped fine-tuning
batches against shuffled ones, TISA's backends per length, TransJect's orthogonal maps and
eigen-state, kernel attention's training mixing, the loss terms compiled, the LayerNorms'
output dtype.

Every timing is the median of `--repeats` interleaved forward + backward steps after `--warmup`
untimed ones (CUDA: synchronised; `bench.common.time_interleaved`). Ratios compare two paths in
the same process. Run from the repository root:

    python -m bench.bench_fast_paths tisa --seq 128 512 --out tisa_cpu.json
    python -m bench.bench_fast_paths compile --families softmax kernel --out compile_cpu.json
    python -m bench.bench_fast_paths grouping --out grouping_cpu.json
    python -m bench.bench_fast_paths orthogonal-cache --seq 256 1024 4096 --batch 1
    python -m bench.bench_fast_paths orthogonal-step --seq 128 --batch 4 --accumulation 4
    python -m bench.bench_fast_paths orthogonal-shard --ranks 2 --seq 128 --batch 4 --accumulation 1
    python -m bench.bench_fast_paths cayley --hidden 768 --maps 121 --layers 2 --seq 128 --batch 4
    python -m bench.bench_fast_paths tisa-backends --device cuda --dtype bf16 --seq 256 512 1024 2048 4096
    python -m bench.bench_fast_paths objective --batch 16 --vocab 30000   # the loss terms compiled
    python -m bench.bench_fast_paths eigen-products --hidden 768 --heads 12 --batch 4 --seq 512
    python -m bench.bench_fast_paths norm-output --families softmax --seq 128 --compiled  # LN's dtype
    python -m bench.bench_fast_paths kernel-mixing --device cuda --dtype bf16 --hidden 768 --heads 12 --seq 512 4096

The GPU's correctness checks of these paths are tests: ``pytest -m gpu`` (tests/test_gpu_*.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import write_result
from bench.fast_paths.kernel import bench_kernel_mixing
from bench.fast_paths.tisa import bench_tisa, bench_tisa_backends
from bench.fast_paths.training import (
    bench_compile,
    bench_grouping,
    bench_norm_output,
    bench_objective,
)
from bench.fast_paths.transject import (
    bench_cayley,
    bench_eigen_products,
    bench_orthogonal_cache,
    bench_orthogonal_shard,
    bench_orthogonal_step,
)

RUN = {
    "tisa": bench_tisa,
    "compile": bench_compile,
    "grouping": bench_grouping,
    "orthogonal-cache": bench_orthogonal_cache,
    "tisa-backends": bench_tisa_backends,
    "orthogonal-step": bench_orthogonal_step,
    "orthogonal-shard": bench_orthogonal_shard,
    "cayley": bench_cayley,
    "objective": bench_objective,
    "eigen-products": bench_eigen_products,
    "norm-output": bench_norm_output,
    "kernel-mixing": bench_kernel_mixing,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=list(RUN))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--families", nargs="+", default=["softmax", "tisa", "kernel", "transject"])
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="orthogonal-step / orthogonal-shard: both engines with engine.compile; "
        "norm-output: the encoder compiled as the engine does",
    )
    p.add_argument(
        "--slots", type=int, default=77, help="objective: the MLM head's slots per row (K)"
    )
    p.add_argument(
        "--anisotropy",
        type=float,
        default=0.0,
        help="eigen-products: add to every embedding one shared direction of this many times "
        "the tokens' mean norm (a wide spectrum, as trained embeddings tend to have)",
    )
    p.add_argument("--examples", type=int, default=1024, help="grouping: training examples")
    p.add_argument("--max-seq-length", type=int, default=512)
    p.add_argument(
        "--accumulation", type=int, default=4, help="orthogonal-step: micro-batches per step"
    )
    p.add_argument("--ranks", type=int, default=2, help="orthogonal-shard: data-parallel ranks")
    p.add_argument(
        "--maps",
        type=int,
        default=121,
        help="cayley: matrices in the batch (TransJect albert-base: 121)",
    )
    p.add_argument(
        "--shard-min-size", type=int, default=256, help="model.orthogonal_shard_min_size"
    )
    p.add_argument(
        "--no-flex",
        action="store_true",
        help="tisa-backends: without the FlexAttention variants (no compile: split, sdpa, softmax)",
    )
    p.add_argument(
        "--split-options",
        nargs="*",
        default=[],
        metavar="BLOCK:WARPS:STAGES",
        help="tisa-backends: the split backend with these kernel options too (e.g. 128:8:2)",
    )
    p.add_argument(
        "--mixing-options",
        nargs="*",
        default=[],
        metavar="BLOCK:WARPS:STAGES",
        help="kernel-mixing: the training mixing's backward kernels with these options too",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.threads and args.what == "cayley" and args.device == "cpu":
        # torch's parametrization solves the maps in one batched call, which oneMKL (torch
        # 2.13's CPU build) leaves hanging once set_num_threads has been called
        p.error("cayley on the CPU: leave out --threads (a batched solve hangs after it)")
    if args.threads:
        torch.set_num_threads(args.threads)
    run = RUN[args.what]
    result = {"what": args.what, "args": {k: str(v) for k, v in vars(args).items()}}
    result.update(run(args))
    write_result(args.out, result)
    if args.out:
        print("wrote", args.out)


if __name__ == "__main__":
    main()
