"""The fused Q/K/V weight made once per encoder forward vs at every layer application.

ALBERT applies one shared layer L times per forward. The fused projection concatenates
[W_q; W_k; W_v] (and the biases); made at every application, that is L concatenations and,
under bf16 autocast, L casts of 3 d^2 weights per forward (autocast caches casts of leaf
parameters only, not of a concatenation), plus their backward. `model.attention.base.
cache_fused_qkv` makes it once per forward. This times a training step (forward + backward of
the MLM logits' mean square) of `EncoderForPretraining` (softmax attention, no padding) both
ways, interleaved in one process (the other way: `cache_fused_qkv` replaced by a no-op), and
reports medians and the ratio once / per application (< 1: the cache is faster).

    python bench/bench_fused_qkv.py --out bench/results/fused_qkv_cpu.json
    python bench/bench_fused_qkv.py --device cuda --points 32x512x768 8x128x768 --out fused_qkv_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import model.encoder as encoder_module  # noqa: E402
from model import EncoderConfig, EncoderForPretraining  # noqa: E402


def timed_step(model, ids, device, autocast: bool) -> float:
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(ids, None).logits.float().square().mean()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument(
        "--points",
        nargs="+",
        default=["2x64x768", "8x128x768", "2x64x128"],
        help="BATCHxSEQxWIDTH (heads of 64, FFN 4 x width)",
    )
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    real = encoder_module.cache_fused_qkv
    ways = {"once": real, "per_application": lambda *a: None}
    rows = []
    for point in args.points:
        B, N, d = (int(x) for x in point.split("x"))
        cfg = EncoderConfig(
            attention="softmax",
            hidden_size=d,
            num_attention_heads=max(1, d // 64),
            intermediate_size=4 * d,
            num_hidden_layers=args.layers,
            vocab_size=1000,
            embedding_size=128,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        torch.manual_seed(0)
        model = EncoderForPretraining(cfg).to(device)
        ids = torch.randint(5, 1000, (B, N), device=device)
        times: dict[str, list[float]] = {w: [] for w in ways}
        try:
            for r in range(args.warmup + args.repeats):
                for way, fn in ways.items():
                    encoder_module.cache_fused_qkv = fn
                    dt = timed_step(model, ids, device, args.dtype == "bf16")
                    if r >= args.warmup:
                        times[way].append(dt)
        finally:
            encoder_module.cache_fused_qkv = real
        ms = {w: statistics.median(t) * 1e3 for w, t in times.items()}
        row = {
            "batch": B,
            "seq": N,
            "width": d,
            "layers": args.layers,
            "dtype": args.dtype,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "once_ms": round(ms["once"], 2),
            "per_application_ms": round(ms["per_application"], 2),
            "ratio": round(ms["once"] / ms["per_application"], 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
